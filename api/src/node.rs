//! The JSON shapes of the node routes (nodes and their disks, a node's drain).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct DiskCreate {
    pub name: String,
    pub path: String,
    #[serde(default = "yes")]
    pub allow_scheduling: bool,
    #[serde(default)]
    pub storage_reserved: u64,
    /// The engine whose replicas the disk takes (default v1). A v2 disk keeps its store in `PATH/lvstore.img`.
    #[serde(default)]
    pub disk_engine: crate::model::DataEngine,
    /// v2: bytes of the store file created on first use (default 10 GiB); a whole number of MiB, at least 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvstore_size: Option<u64>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskView {
    pub name: String,
    pub path: String,
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    pub allow_scheduling: bool,
    pub storage_reserved: u64,
    pub disk_engine: crate::model::DataEngine,
    /// v2: the store size the disk asks for (0: the default).
    #[serde(default)]
    pub lvstore_size: u64,
    pub storage_maximum: u64,
    pub storage_available: u64,
    pub storage_scheduled: u64,
    pub error: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub name: String,
    pub address: String,
    pub host: String,
    pub ready: bool,
    pub allow_scheduling: bool,
    pub heartbeat: i64,
    pub disks: Vec<DiskView>,
    /// Replicas scheduled on the node (a drain ends when none is left).
    #[serde(default)]
    pub replicas: u32,
    #[serde(default)]
    pub drain_state: DrainState,
    /// While draining: why replicas left on the node cannot move now, one line per volume (a volume detached
    /// mid-drain has no engine to rebuild a replacement through).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drain_blocked: Vec<String>,
    /// Stale daemons and data the node's manager removed (the manager's orphan controller), newest last.
    #[serde(default)]
    pub orphans_removed: Vec<crate::model::OrphanRemoved>,
    /// The node's manager version (last heartbeat).
    pub manager_version: String,
    /// URL of the node's instance manager; empty when the manager runs the daemons itself.
    pub instance_manager: String,
    pub instance_manager_version: String,
    /// The build version of the node's data plane (its instance manager's, or its manager's own).
    #[serde(default)]
    pub data_plane_version: String,
    /// What the node's data plane can do (`corral_proto::data_plane`); empty: not reported (everything).
    #[serde(default)]
    pub data_plane_features: Vec<String>,
}

/// Where a node is in a drain, as the API shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainState {
    /// No drain asked for.
    #[default]
    None,
    /// Replicas are still on the node.
    Draining,
    /// Asked for, and no replica is left.
    Drained,
}

impl DrainState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Draining => "draining",
            Self::Drained => "drained",
        }
    }
}
