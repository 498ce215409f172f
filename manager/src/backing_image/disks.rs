//! The cluster's disks as the backing-image controllers see them: a leaf module, so that the image controller and
//! the modules it calls ([`super::v2_source`]) share it without depending on each other.

use super::model::BackingImage;
use crate::context::Ctx;
use crate::model::{DataEngine, Node};
use crate::scheduler::node_is_up;

/// A disk of the cluster, by UUID.
#[derive(Debug, Clone)]
pub struct DiskRef {
    pub node_id: String,
    pub disk_name: String,
    pub disk_uuid: String,
    pub path: String,
    /// Node up, disk reporting no error, scheduling allowed: the disk may receive new copies.
    pub ready: bool,
    /// Node up, disk reporting no error: what the disk holds can be read, even while it or its node is cordoned
    /// (a cordon stops new work from landing there, not reads of what is there).
    pub readable: bool,
    pub engine: DataEngine,
}

pub async fn disks(ctx: &Ctx) -> anyhow::Result<Vec<DiskRef>> {
    let mut out = Vec::new();
    for n in ctx.db.list::<Node>().await? {
        let up = node_is_up(ctx, &n.data).await;
        for (disk, d) in &n.data.spec.disks {
            let ok = n.data.status.disks.get(disk).is_some_and(|s| s.error.is_empty());
            let readable = up && ok;
            out.push(DiskRef {
                node_id: n.name.clone(),
                disk_name: disk.clone(),
                disk_uuid: d.disk_uuid.clone(),
                path: d.path.clone(),
                ready: readable && d.allow_scheduling && n.data.spec.allow_scheduling,
                readable,
                engine: d.engine,
            });
        }
    }
    Ok(out)
}

pub(crate) fn selected(bi: &BackingImage, d: &DiskRef) -> bool {
    (bi.spec.disk_selector.is_empty() || bi.spec.disk_selector.contains(&d.disk_name))
        && (bi.spec.node_selector.is_empty() || bi.spec.node_selector.contains(&d.node_id))
}
