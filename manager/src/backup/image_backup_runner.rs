//! Node-local: runs the [`BackingImageBackup`]s recorded for this node (it holds a ready copy of the image),
//! pending → in-progress (progress written every [`PROGRESS_EVERY`]) → completed | failed with the backup store's
//! error. The backup runs in a task this manager owns, not in the HTTP request that asked for it: a client that
//! goes away changes nothing. Each progress tick reads the record: a cancel asked for through any manager
//! (`cancelRequested`) stops the upload at the next block and the backup is recorded `failed`, "cancelled". A manager that stops cancels its runs; one that finds a run of its own still
//! `in-progress` after a restart fails it with that reason (a new backup of the image uploads only what the
//! interrupted one did not: blocks are deduplicated).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::model::{BackingImageBackup, BackupState};
use crate::backing_image::model::BackingImageManager;
use crate::context::Ctx;
use crate::controller::{Requeue, WorkQueue, feed_node_local, run_worker};
use crate::store::StoreError;

/// How often a running backup's progress is written.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Runs under way on this manager, by store key.
type Running = Arc<Mutex<HashSet<String>>>;

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed_node_local::<BackingImageBackup>(ctx, q.clone(), cancel.clone(), Duration::from_secs(10), |b| {
        &b.node_id
    });
    let ctx = ctx.clone();
    let c = cancel.clone();
    let running = Running::default();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backing-image-backup", q, c.clone(), m, |name| {
            reconcile(ctx.clone(), running.clone(), c.clone(), name)
        })
        .await;
    });
}

async fn reconcile(
    ctx: Ctx,
    running: Running,
    cancel: CancellationToken,
    key: String,
) -> anyhow::Result<Requeue> {
    let Some(mut b) = ctx.db.get::<BackingImageBackup>(&key).await? else {
        return Ok(None);
    };
    if b.data.node_id != ctx.cfg.node_id || !b.data.state.active() {
        return Ok(None);
    }
    if running.lock().is_ok_and(|r| r.contains(&key)) {
        return Ok(None);
    }
    if b.data.state == BackupState::InProgress {
        // Ours, in progress, and no task runs it: this manager restarted meanwhile.
        b.data.state = BackupState::Failed;
        b.data.error = if b.data.cancel_requested {
            super::image_backup::CANCELLED.to_owned()
        } else {
            format!(
                "the manager of node {} stopped while the backup ran ({}%): back the image up again",
                b.data.node_id, b.data.progress
            )
        };
        tracing::warn!(key, error = %b.data.error, "backing image backup failed");
        return update(&ctx, &mut b).await;
    }
    b.data.state = BackupState::InProgress;
    // Claimed in the store before the run starts; a conflict means it changed: read it again.
    if let Err(e) = ctx.db.update(&mut b).await {
        return match e {
            StoreError::Conflict { .. } => Ok(Some(Duration::ZERO)),
            StoreError::NotFound { .. } => Ok(None),
            e => Err(e.into()),
        };
    }
    if let Ok(mut r) = running.lock() {
        r.insert(key.clone());
    }
    tokio::spawn(async move {
        let outcome = run(&ctx, &key, &b.data, &cancel).await;
        if let Some(outcome) = outcome {
            let written = ctx
                .db
                .modify::<BackingImageBackup>(&key, |x| {
                    if !x.state.active() {
                        return false;
                    }
                    match &outcome {
                        Ok(cfg) => {
                            x.state = BackupState::Completed;
                            x.progress = 100;
                            x.size = cfg.size;
                            x.new_bytes = cfg.stats.new_bytes;
                            x.deduplicated_blocks = cfg.stats.deduplicated_blocks;
                            x.completed.clone_from(&cfg.completed);
                            x.error.clear();
                        }
                        Err(e) => {
                            x.state = BackupState::Failed;
                            if x.cancel_requested {
                                super::image_backup::CANCELLED.clone_into(&mut x.error);
                            } else {
                                x.error.clone_from(e);
                            }
                        }
                    }
                    true
                })
                .await;
            match (&outcome, written) {
                (_, Err(e)) => {
                    tracing::warn!(key, error = %e, "cannot record the backing image backup's end");
                }
                (Ok(cfg), Ok(_)) => {
                    tracing::info!(
                        key,
                        new_bytes = cfg.stats.new_bytes,
                        "backing image backup completed"
                    );
                }
                (Err(e), Ok(_)) => tracing::warn!(key, error = %e, "backing image backup failed"),
            }
        }
        if let Ok(mut r) = running.lock() {
            r.remove(&key);
        }
    });
    Ok(None)
}

async fn update(ctx: &Ctx, b: &mut crate::store::Object<BackingImageBackup>) -> anyhow::Result<Requeue> {
    match ctx.db.update(b).await {
        Ok(()) | Err(StoreError::NotFound { .. }) => Ok(None),
        Err(StoreError::Conflict { .. }) => Ok(Some(Duration::ZERO)),
        Err(e) => Err(e.into()),
    }
}

/// One run: the backup's record, or why it failed; `None` when this manager is stopping (the record stays
/// in-progress and is failed at the next start).
async fn run(
    ctx: &Ctx,
    key: &str,
    b: &BackingImageBackup,
    cancel: &CancellationToken,
) -> Option<Result<backupstore::BackupConfig, String>> {
    let managers = match ctx.db.list::<BackingImageManager>().await {
        Ok(m) => m,
        Err(e) => return Some(Err(format!("cannot read this node's disk managers: {e}"))),
    };
    let Some(path) = super::image_backup::ready_copy(&managers, &b.node_id, &b.image, &b.image_uuid) else {
        return Some(Err(format!(
            "node {} holds no ready copy of backing image {} any more",
            b.node_id, b.image
        )));
    };
    let t = match super::target::open(ctx, &b.target).await {
        Ok(t) => t,
        Err(e) => return Some(Err(e.to_string())),
    };
    tracing::info!(key, image = %b.image, target = %b.target, path, "backing image backup started");
    let progress = backupstore::Progress::default();
    let backup = t.store.backup_backing_image(
        &b.image,
        std::path::Path::new(&path),
        &b.checksum,
        &b.backup,
        b.max_upload_rate,
        &progress,
    );
    tokio::pin!(backup);
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    loop {
        tokio::select! {
            r = &mut backup => return Some(r.map_err(|e| e.to_string())),
            () = cancel.cancelled() => {
                progress.cancel();
                return None;
            }
            _ = tick.tick() => {
                // Below 100 until the record says completed. Read every tick (written only when changed): it
                // carries a cancel asked for through any manager.
                let p = progress.percent().min(99);
                let written = ctx.db.modify::<BackingImageBackup>(key, |x| {
                    let changed = x.state.active() && x.progress != p;
                    if changed {
                        x.progress = p;
                    }
                    changed
                }).await;
                match written {
                    Ok(x) => {
                        if x.data.cancel_requested {
                            tracing::info!(key, progress = p, "backing image backup cancelled");
                            progress.cancel();
                        }
                    }
                    // Deleted meanwhile (cannot be while active, but then nothing is waiting for it).
                    Err(StoreError::NotFound { .. }) => progress.cancel(),
                    Err(e) => tracing::debug!(key, error = %e, "progress not written"),
                }
            }
        }
    }
}
