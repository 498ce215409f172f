//! Volume clone (seed 002): a volume created with `dataSource` `vol://NAME` or `snap://NAME/SNAPSHOT` is filled
//! from that source by its engine (`ControllerService.SnapshotClone`, one RW replica of the source exporting the
//! snapshot over sparse-sync into every replica of the target), then detached and usable. The record of a clone
//! is its own resource ([`model::VolumeClone`], named after the target), driven by the leader's
//! [`controller`]; the API refuses to attach a target before its clone completed and to delete a source a clone
//! still reads.

pub mod controller;
pub mod model;
pub mod openapi;
pub mod views;

use crate::context::Ctx;
use crate::store::StoreError;
use model::VolumeClone;

/// The clone that still reads `volume` as its source, if any (its target's name).
pub async fn reading_from(ctx: &Ctx, volume: &str) -> Result<Option<String>, StoreError> {
    Ok(ctx
        .db
        .list::<VolumeClone>()
        .await?
        .into_iter()
        .find(|c| c.data.source_volume == volume && c.data.state.active())
        .map(|c| c.name))
}

/// The clone that attached `volume` (a detached source) for its copy and still runs, if any (its target's name).
pub async fn attached_for(ctx: &Ctx, volume: &str) -> Result<Option<String>, StoreError> {
    Ok(ctx
        .db
        .list::<VolumeClone>()
        .await?
        .into_iter()
        .find(|c| c.data.source_volume == volume && c.data.auto_attached_source && c.data.state.active())
        .map(|c| c.name))
}

/// The snapshot a `vol://` clone takes on its source: `clone-<target>-<8 hex>`, unique per clone so that a target
/// deleted and created again never meets the snapshot of its earlier attempt (a removed snapshot keeps its name in
/// the chain until a purge), or `clone-<uuid>` when the target's name would make it too long.
pub fn snapshot_name_for(target: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("clone-{target}-{}", &id[..8]);
    if name.len() <= 200 {
        name
    } else {
        format!("clone-{id}")
    }
}
