//! The JSON shapes of the node routes (nodes and their disks), shared by the server and the CLI.

use serde::{Deserialize, Serialize};

use crate::model::Node;
use crate::store::Object;

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
    pub drain_state: super::drain::DrainState,
    /// While draining: why replicas left on the node cannot move now, one line per volume (a volume detached
    /// mid-drain has no engine to rebuild a replacement through).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drain_blocked: Vec<String>,
    /// Stale daemons and data the node's manager removed (`crate::controller::orphans`), newest last.
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

impl NodeView {
    pub fn new(n: &Object<Node>, ready: bool) -> Self {
        let d = &n.data;
        Self {
            name: n.name.clone(),
            address: d.spec.address.clone(),
            host: d.spec.host.clone(),
            ready,
            allow_scheduling: d.spec.allow_scheduling,
            heartbeat: d.status.heartbeat,
            replicas: 0,
            drain_state: Default::default(),
            drain_blocked: Vec::new(),
            orphans_removed: d.status.orphans_removed.clone(),
            manager_version: d.status.manager_version.clone(),
            instance_manager: d.status.instance_manager.clone(),
            instance_manager_version: d.status.instance_manager_version.clone(),
            data_plane_version: d.status.data_plane_version.clone(),
            data_plane_features: d.status.data_plane_features.clone(),
            disks: d
                .spec
                .disks
                .iter()
                .map(|(name, s)| {
                    let st = d.status.disks.get(name).cloned().unwrap_or_default();
                    DiskView {
                        name: name.clone(),
                        path: s.path.clone(),
                        disk_uuid: s.disk_uuid.clone(),
                        allow_scheduling: s.allow_scheduling,
                        storage_reserved: s.storage_reserved,
                        disk_engine: s.engine,
                        lvstore_size: s.lvstore_size,
                        storage_maximum: st.storage_maximum,
                        storage_available: st.storage_available,
                        storage_scheduled: st.storage_scheduled,
                        error: st.error,
                    }
                })
                .collect(),
        }
    }
}
