//! The node routes' views built from the store's documents. The JSON shapes themselves (nodes and their disks)
//! live in `corral_api::node`, re-exported here.

pub use corral_api::node::{DiskCreate, DiskView, NodeView};

use crate::model::Node;
use crate::store::Object;

/// The view of a node from its document (`ready`: its heartbeat is recent); replicas and drain left empty.
pub fn node_view(n: &Object<Node>, ready: bool) -> NodeView {
    let d = &n.data;
    NodeView {
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
