//! Node-local: runs the [`BackingImageBackup`]s recorded for this node (it holds a ready copy of the image: a v1
//! file, or a v2 copy received through its disk daemon into a staging file first,
//! [`crate::backing_image::v2_source`]), pending → in-progress (progress written every [`PROGRESS_EVERY`]) → completed | failed with the backup store's
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
use crate::backing_image::model::{BackingImage, BackingImageManager};
use crate::backing_image::strategy::CopyStrategy as _;
use crate::backing_image::v2_source::{ready_v2_copies, receive_copy, remove_staging, staging_path};
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::runtime::{Requeue, WorkQueue, feed_node_local, run_worker};
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
        remove_leftover_staging(&ctx, &b.data).await;
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

/// The staging file an interrupted v2 backup may have left on one of this node's v2 disks.
async fn remove_leftover_staging(ctx: &Ctx, b: &BackingImageBackup) {
    let Ok(all) = crate::backing_image::disks::disks(ctx).await else {
        return;
    };
    for d in all
        .iter()
        .filter(|d| d.node_id == b.node_id && d.engine.in_lvstore())
    {
        remove_staging(&staging_path(&d.path, &b.image, &b.backup));
    }
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
    let image = match ctx.db.get::<BackingImage>(&b.image).await {
        Ok(o) => o.filter(|o| o.data.spec.uuid == b.image_uuid),
        Err(e) => return Some(Err(format!("cannot read backing image {}: {e}", b.image))),
    };
    if let Some(bi) = image.filter(|o| o.data.spec.data_engine.copies_are_lvols()) {
        return run_v2(ctx, key, b, &bi.data, cancel).await;
    }
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
    backup_file(ctx, key, b, std::path::Path::new(&path), (0, 99), cancel).await
}

/// A v2 image's backup: its ready copy on this node received through its disk daemon into a staging file
/// (progress 0–49 %), the file backed up (50–99 %), the file removed whatever the outcome.
async fn run_v2(
    ctx: &Ctx,
    key: &str,
    b: &BackingImageBackup,
    bi: &BackingImage,
    cancel: &CancellationToken,
) -> Option<Result<backupstore::BackupConfig, String>> {
    let copy = match ready_v2_copies(ctx, bi).await {
        Ok(c) => c.into_iter().find(|c| c.node_id == b.node_id),
        Err(e) => return Some(Err(format!("{e:#}"))),
    };
    let Some(copy) = copy else {
        return Some(Err(format!(
            "node {} holds no ready v2 copy of backing image {} any more",
            b.node_id, b.image
        )));
    };
    let ip: std::net::IpAddr = match ctx.cfg.host.parse() {
        Ok(ip) => ip,
        Err(e) => return Some(Err(format!("this node's address {:?}: {e}", ctx.cfg.host))),
    };
    let staging = staging_path(&copy.disk_path, &b.image, &b.backup);
    tracing::info!(key, image = %b.image, disk = %copy.disk_name, staging = %staging.display(),
        "receiving the v2 copy to back it up");
    let received = std::sync::atomic::AtomicU64::new(0);
    let stop = CancellationToken::new();
    let size = copy.size.max(1);
    let receiving = receive_copy(&copy, &b.image, &staging, ip, &stop, |n| {
        received.store(n, std::sync::atomic::Ordering::Relaxed);
    });
    let percent = || {
        let n = received.load(std::sync::atomic::Ordering::Relaxed).min(size);
        u32::try_from(n * 49 / size).unwrap_or(49)
    };
    let outcome = match tracked(ctx, key, receiving, cancel, percent, || stop.cancel()).await {
        None => {
            remove_staging(&staging);
            return None;
        }
        Some(Err(e)) => Some(Err(format!("{e:#}"))),
        Some(Ok(_)) => backup_file(ctx, key, b, &staging, (50, 99), cancel).await,
    };
    remove_staging(&staging);
    outcome
}

/// Backs the file at `path` up as the backup `b` describes, its progress mapped to `span` of the record's.
async fn backup_file(
    ctx: &Ctx,
    key: &str,
    b: &BackingImageBackup,
    path: &std::path::Path,
    (from, to): (u32, u32),
    cancel: &CancellationToken,
) -> Option<Result<backupstore::BackupConfig, String>> {
    let t = match super::target::open(ctx, &b.target).await {
        Ok(t) => t,
        Err(e) => return Some(Err(e.to_string())),
    };
    tracing::info!(key, image = %b.image, target = %b.target, path = %path.display(), "backing image backup started");
    let progress = backupstore::Progress::default();
    let backup = t.store.backup_backing_image(
        &b.image,
        path,
        &b.checksum,
        &b.backup,
        b.max_upload_rate,
        &progress,
    );
    let percent = || from + (to - from) * progress.percent().min(100) / 100;
    tracked(ctx, key, backup, cancel, percent, || progress.cancel())
        .await
        .map(|r| r.map_err(|e| e.to_string()))
}

/// Runs `work` to its end, writing `percent()` (below 100 until the record says completed) every
/// [`PROGRESS_EVERY`]; each tick reads the record, which carries a cancel asked for through any manager: then
/// `stop()` asks `work` to end at its next step. `None` when this manager stops (after `stop()`; the record stays
/// in-progress and is failed at the next start).
async fn tracked<T>(
    ctx: &Ctx,
    key: &str,
    work: impl std::future::Future<Output = T>,
    cancel: &CancellationToken,
    percent: impl Fn() -> u32,
    stop: impl Fn(),
) -> Option<T> {
    tokio::pin!(work);
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    loop {
        tokio::select! {
            r = &mut work => return Some(r),
            () = cancel.cancelled() => {
                stop();
                return None;
            }
            _ = tick.tick() => {
                let p = percent().min(99);
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
                            stop();
                        }
                    }
                    // Deleted meanwhile (cannot be while active, but then nothing is waiting for it).
                    Err(StoreError::NotFound { .. }) => stop(),
                    Err(e) => tracing::debug!(key, error = %e, "progress not written"),
                }
            }
        }
    }
}
