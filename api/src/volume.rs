//! The JSON shapes of the volume routes (requests and responses: volumes, their snapshots and replicas).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::clone::CloneStatusView;
use crate::model::{Robustness, VolumeState};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct VolumeCreate {
    pub name: String,
    pub size: u64,
    #[serde(default = "three")]
    pub number_of_replicas: u32,
    #[serde(default)]
    pub disable_revision_counter: Option<bool>,
    /// Only `nbd`.
    #[serde(default)]
    pub frontend: Option<String>,
    /// A backing image (its virtual size must fit in `size`).
    #[serde(default)]
    pub backing_image: Option<String>,
    /// Fill the new volume from `vol://NAME` (as it is now) or `snap://NAME/SNAPSHOT`: a clone. `size` may be
    /// larger than the source's, never smaller; the clone uses the source's backing image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_source: Option<String>,
    /// Restore this completed backup (`[TARGET:]BACKUP`) into the new volume; `size` may be larger than the
    /// backup's, never smaller. The volume is attachable once the restore completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_backup: Option<String>,
    /// With `fromBackup`: a standby (DR) volume that restores each newer backup of that backup volume
    /// incrementally and cannot be attached until activated (`POST /v1/volumes/{name}/activate`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby: bool,
    /// v1 or v2; the `default-data-engine` setting when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_engine: Option<crate::model::DataEngine>,
}

fn three() -> u32 {
    3
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    /// Defaults to the node whose manager answers.
    #[serde(default)]
    pub node_id: Option<String>,
    /// Maintenance mode: run the engine without its NBD frontend, so nobody can reach the volume for IO (revert,
    /// restore and clone targets use it). Changing it needs a detach first.
    #[serde(default)]
    pub disable_frontend: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeRequest {
    pub size: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreate {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaView {
    pub name: String,
    pub volume: String,
    pub node_id: String,
    pub disk: String,
    pub data_path: String,
    pub data_engine: crate::model::DataEngine,
    pub state: crate::model::ProcessState,
    pub desire_state: crate::model::DesireState,
    /// RW | WO | ERR in the volume's engine, empty when not in one.
    pub mode: String,
    /// 0–100 while the replica is rebuilt.
    pub rebuild_progress: Option<u32>,
    pub address: String,
    pub pid: Option<i32>,
    pub failed: bool,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineView {
    pub node_id: String,
    pub state: crate::model::ProcessState,
    pub address: String,
    pub pid: Option<i32>,
    pub restarts: u32,
    /// The generation the running engine was started with (0: not started yet).
    #[serde(default)]
    pub generation: u64,
    /// The last time an engine of the volume was found fenced by a newer generation and stopped (empty: never).
    #[serde(default)]
    pub last_fenced: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeView {
    pub name: String,
    pub size: u64,
    pub number_of_replicas: u32,
    pub frontend: crate::model::Frontend,
    pub data_engine: crate::model::DataEngine,
    pub disable_revision_counter: Option<bool>,
    pub revision_counter_disabled: bool,
    pub node_id: Option<String>,
    pub current_node_id: Option<String>,
    pub state: VolumeState,
    pub robustness: Robustness,
    pub endpoints: Vec<String>,
    /// Asked for: attach without a frontend (maintenance mode).
    pub disable_frontend: bool,
    /// The running engine serves no frontend: attached for maintenance, unreachable for IO.
    pub frontend_disabled: bool,
    pub salvage_requested: bool,
    pub message: String,
    /// The backing image the volume's replicas sit on.
    #[serde(default)]
    pub backing_image: Option<String>,
    pub engine: Option<EngineView>,
    pub replicas: Vec<ReplicaView>,
    /// `vol://NAME` or `snap://NAME/SNAPSHOT` when the volume is a clone.
    #[serde(default)]
    pub data_source: Option<String>,
    /// The clone's progress; attachable for IO once `completed`.
    #[serde(default)]
    pub clone_status: Option<CloneStatusView>,
    /// The last engine generation the manager handed out for the volume (0: none yet); kept while detached.
    #[serde(default)]
    pub engine_generation: u64,
}

impl VolumeView {
    /// The view with the last engine generation handed out for the volume.
    #[must_use]
    pub fn with_engine_generation(mut self, generation: u64) -> Self {
        self.engine_generation = generation;
        self
    }
}

/// A snapshot as the API shows it: the observed document.
pub type SnapshotView = crate::model::Snapshot;
