//! Backups in the control plane (issue 18): backup targets (a `file://` directory or an S3 bucket, with their
//! credentials kept as a separate secret document), the backup volumes and backups found on them, backups of
//! this cluster's volumes, and restores into new or detached volumes. The data path is the replicas'
//! `ReplicaBackupService` (one RW replica backs a snapshot up; every RW replica restores itself); this module
//! decides what runs where and records it:
//!
//! - [`model`]: the resources; [`target`]: opening a target, and the leader's poller that mirrors each target
//!   into the store (backups made elsewhere appear);
//! - [`controller`]: the leader's backup jobs (request → replica job → record), [`restore`]: the leader's
//!   restores, guarded like clones (a volume whose restore has not completed is never attached for IO);
//! - [`backing`]: the backing image a restore takes, checked against the SHA-512 the backup recorded;
//!   [`image_backup`]: backups of backing images, tracked like volume backups and run by
//!   [`image_backup_runner`] on a node holding a ready copy;
//! - [`service`]: what other features call (request or remove a backup, check and start a restore);
//! - [`routes`]: REST (`/v1/backuptargets`, `/v1/backupvolumes`, `/v1/backups`, `/v1/volumes/{v}/restore`) and
//!   its OpenAPI shapes; [`cli`]: `corral backup ...`.

pub mod backing;
pub mod cli;
pub mod controller;
mod errors;
pub mod image_backup;
pub mod image_backup_runner;
pub mod model;
pub mod openapi;
pub mod restore;
pub mod routes;
pub mod service;
pub mod target;

use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::store::StoreError;
use model::Backup;

/// Starts the cluster-wide backup controllers (leader only).
pub fn start_leader(ctx: &Ctx, cancel: &CancellationToken) {
    target::start(ctx, cancel);
    controller::start(ctx, cancel);
    restore::start(ctx, cancel);
}

/// Starts the node-local backup controllers (every manager): this node's backing-image backups.
pub fn start_node(ctx: &Ctx, cancel: &CancellationToken) {
    image_backup_runner::start(ctx, cancel);
}

/// The backup of this cluster that still reads a snapshot of `volume`, if any: (backup, snapshot).
pub async fn running_on(ctx: &Ctx, volume: &str) -> Result<Option<(String, String)>, StoreError> {
    Ok(ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .find(|b| b.data.source_volume == volume && b.data.state.active())
        .map(|b| (b.data.name, b.data.snapshot)))
}
