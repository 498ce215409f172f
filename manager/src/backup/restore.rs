//! Restores (leader only), like clones: a volume created with `fromBackup`, or a detached volume restored in
//! place, gets a [`VolumeRestore`] record named after it, and its spec names the backup (`fromBackup`, written
//! with the volume itself, so no attach can slip in before the record exists). Steps, each recorded before the
//! next:
//!
//! 1. the volume is attached without a frontend on this node (maintenance mode: nobody can reach it for IO) and
//!    waits until every replica is RW;
//! 2. every RW replica restores the backup into its head (`ReplicaBackupService.BackupRestore`), progress polled;
//! 3. a replica that restarted (its job is gone, or it reports another backup), or a change of the RW set, starts
//!    the restore again on every replica (a full restore overwrites everything it covers and zeroes the rest), up
//!    to [`MAX_ATTEMPTS`] times; an error reported by a replica fails the restore;
//! 4. once every replica reports the backup restored, the volume is detached and the record `completed`.
//!
//! Attach is refused until then (`check_attach`); a failed restore is never served: restore again or delete.

use std::sync::Arc;
use std::time::Duration;

use corral_proto::v1;
use tokio_util::sync::CancellationToken;

use super::model::{Backup, BackupState, RestoreState, VolumeRestore, key};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{Robustness, Volume, VolumeSpec, VolumeState};
use crate::runtime::Stop;
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::store::{Object, StoreError};

const POLL: Duration = Duration::from_millis(500);
/// How often a standby volume looks for a newer backup (the target poller lists the target meanwhile).
const STANDBY_POLL: Duration = Duration::from_secs(2);

/// The newest completed backup of the record's backup volume when it is newer than the one restored.
async fn newest_backup(ctx: &Ctx, r: &VolumeRestore) -> Result<Option<String>, StoreError> {
    let newest = ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .filter(|b| {
            b.data.target == r.target
                && b.data.volume == r.backup_volume
                && b.data.state == BackupState::Completed
        })
        .max_by(|a, b| (&a.data.completed, &a.data.name).cmp(&(&b.data.completed, &b.data.name)));
    let current = ctx.db.get::<Backup>(&key(&r.target, &r.backup)).await?;
    Ok(newest
        .filter(|n| {
            current
                .as_ref()
                .is_none_or(|c| n.data.completed > c.data.completed)
        })
        .map(|n| n.data.name))
}
/// Restarts of one restore (replicas or engine restarted mid-way) before it fails.
pub const MAX_ATTEMPTS: u32 = 5;

/// `[TARGET:]BACKUP` → (target, backup).
pub fn parse_ref(r: &str) -> (String, String) {
    match r.split_once(':') {
        Some((t, b)) => (t.to_owned(), b.to_owned()),
        None => (super::model::DEFAULT_TARGET.to_owned(), r.to_owned()),
    }
}

/// The completed backup `[TARGET:]BACKUP` names, as listed in the store.
pub async fn completed_backup(ctx: &Ctx, r: &str) -> Result<Object<Backup>, ApiError> {
    let (target, backup) = parse_ref(r);
    crate::api::openapi::check_name("backup target", &target)?;
    backupstore::validate_name("backup", &backup).map_err(|e| ApiError::Invalid(e.to_string()))?;
    let b = ctx
        .db
        .get::<Backup>(&key(&target, &backup))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup {backup:?} not found on target {target}")))?;
    if b.data.state != BackupState::Completed {
        return Err(ApiError::Conflict(format!(
            "backup {backup} is {}: only a completed backup can be restored",
            b.data.state.as_str()
        )));
    }
    Ok(b)
}

/// The record a restore of `b` starts with.
pub fn record_for(b: &Backup) -> VolumeRestore {
    VolumeRestore {
        target: b.target.clone(),
        backup_volume: b.volume.clone(),
        backup: b.name.clone(),
        ..Default::default()
    }
}

/// `fromBackup` as the volume's spec keeps it.
pub fn spec_ref(b: &Backup) -> String {
    key(&b.target, &b.name)
}

/// Refuses to serve a volume whose restore has not completed.
pub async fn check_attach(ctx: &Ctx, name: &str, spec: &VolumeSpec) -> Result<(), ApiError> {
    let r = ctx.db.get::<VolumeRestore>(name).await?;
    // A record of an earlier restore (in place) does not vouch for the one the spec names now.
    let r = r.filter(|r| {
        spec.from_backup
            .as_ref()
            .is_none_or(|b| *b == key(&r.data.target, &r.data.backup))
    });
    match (&spec.from_backup, r) {
        (Some(b), None) => Err(ApiError::Conflict(format!(
            "volume {name} is restored from backup {b} whose restore has not started: it can be attached once the restore completed"
        ))),
        (_, Some(r)) => match r.data.state {
            RestoreState::Completed => Ok(()),
            RestoreState::Failed => Err(ApiError::Conflict(format!(
                "the restore of backup {} into {name} failed ({}): its data is incomplete; restore it again or delete the volume",
                r.data.backup, r.data.message
            ))),
            RestoreState::Initiated | RestoreState::Restoring => Err(ApiError::Conflict(format!(
                "volume {name} is being restored from backup {} ({}%): it can be attached once the restore completed",
                r.data.backup, r.data.progress
            ))),
        },
        (None, None) => Ok(()),
    }
}

/// Refuses to detach or delete a volume a restore works on, and to detach one a backup reads.
pub async fn check_detach(ctx: &Ctx, name: &str) -> Result<(), ApiError> {
    if let Some(r) = ctx.db.get::<VolumeRestore>(name).await?
        && r.data.state.active()
    {
        return Err(ApiError::Conflict(format!(
            "volume {name} is being restored from backup {} ({}%): it is detached when the restore ends",
            r.data.backup, r.data.progress
        )));
    }
    if let Some((backup, snap)) = super::running_on(ctx, name).await? {
        return Err(ApiError::Conflict(format!(
            "backup {backup} is reading snapshot {snap} of volume {name}: detach once it completed"
        )));
    }
    Ok(())
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<VolumeRestore>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(5),
        |ev| Some(ev.name().to_owned()),
        |o| o.data.state.active().then(|| o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("restore", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

/// Detaches a volume this restore attached (without a frontend); true once it is detached.
async fn release(ctx: &Ctx, name: &str) -> Result<bool, StoreError> {
    let v = match ctx
        .db
        .modify::<Volume>(name, |v| {
            let ours = v.spec.disable_frontend && v.spec.node_id.is_some();
            if ours {
                v.spec.node_id = None;
                v.spec.disable_frontend = false;
            }
            ours
        })
        .await
    {
        Ok(v) => v,
        Err(StoreError::NotFound { .. }) => return Ok(true),
        Err(e) => return Err(e),
    };
    Ok(v.data.spec.node_id.is_none() && v.data.status.state == VolumeState::Detached)
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let Some(mut r) = ctx.db.get::<VolumeRestore>(&name).await? else {
        return Ok(None);
    };
    if !r.data.state.active() {
        return Ok(None);
    }
    let Some(vol) = ctx.db.get::<Volume>(&name).await? else {
        ctx.db.delete_any::<VolumeRestore>(&name).await?;
        return Ok(None);
    };
    let before = r.data.clone();
    if r.data.restored
        && r.data.standby
        && let Some(newer) = newest_backup(&ctx, &r.data).await?
    {
        // A DR volume follows: the newer backup, only the changed blocks.
        tracing::info!(volume = %name, from = %r.data.backup, to = %newer, "standby: restoring a newer backup incrementally");
        // The spec names the backup the volume's data will be (attach compares the two).
        let from = key(&r.data.target, &newer);
        ctx.db
            .modify::<Volume>(&name, |v| {
                v.spec.from_backup = Some(from.clone());
                true
            })
            .await?;
        r.data.backup = newer;
        r.data.replicas.clear();
        r.data.restored = false;
        r.data.incremental = true;
        r.data.progress = 0;
    } else if r.data.restored && r.data.standby && r.data.activate {
        tracing::info!(volume = %name, backup = %r.data.backup, "standby volume activated");
        r.data.standby = false;
    }
    let requeue = if r.data.restored && r.data.standby {
        r.data.message = format!(
            "standby: restored {}, following {}",
            r.data.backup, r.data.backup_volume
        );
        Ok(Some(STANDBY_POLL))
    } else if r.data.restored {
        if release(&ctx, &name).await? {
            tracing::info!(volume = %name, backup = %r.data.backup, "restore completed");
            r.data.state = RestoreState::Completed;
            r.data.message.clear();
            Ok(None)
        } else {
            r.data.message = "detaching after the restore".into();
            Ok(Some(POLL))
        }
    } else {
        match step(&ctx, &name, &mut r.data, &vol).await {
            Ok(q) => Ok(q),
            Err(Stop::Retry(e)) => Err(e),
            Err(Stop::Fail(reason)) => {
                tracing::warn!(volume = %name, backup = %r.data.backup, %reason, "restore failed");
                r.data.state = RestoreState::Failed;
                r.data.message = reason;
                release(&ctx, &name).await?;
                Ok(None)
            }
        }
    };
    if r.data != before {
        match ctx.db.update(&mut r).await {
            Ok(()) | Err(StoreError::NotFound { .. }) => {}
            Err(StoreError::Conflict { .. }) => return Ok(Some(Duration::ZERO)),
            Err(e) => return Err(e.into()),
        }
    }
    requeue
}

async fn step(ctx: &Ctx, name: &str, r: &mut VolumeRestore, vol: &Object<Volume>) -> Result<Requeue, Stop> {
    // 1. Attached without a frontend, every replica RW.
    if vol.data.spec.node_id.is_none() {
        let node = ctx.cfg.node_id.clone();
        ctx.db
            .modify::<Volume>(name, |v| {
                let free = v.spec.node_id.is_none() && v.status.state == VolumeState::Detached;
                if free {
                    v.spec.node_id = Some(node.clone());
                    v.spec.disable_frontend = true;
                }
                free
            })
            .await?;
        r.message = "attaching the volume without a frontend".into();
        return Ok(Some(POLL));
    }
    if !vol.data.spec.disable_frontend {
        return Err(Stop::Fail(
            "the volume was attached with a frontend during the restore".into(),
        ));
    }
    let healthy =
        vol.data.status.state == VolumeState::Attached && vol.data.status.robustness == Robustness::Healthy;
    let rw = super::controller::rw_replicas(ctx, name).await?;
    let Some((_, rw)) = rw.filter(|_| healthy || !r.replicas.is_empty()) else {
        r.message = "waiting for the volume's replicas".into();
        return Ok(Some(POLL));
    };
    let t = super::target::open(ctx, &r.target).await.map_err(|e| match e {
        super::target::TargetError::Store(e) => Stop::Retry(e.into()),
        e => Stop::Retry(e.into()),
    })?;
    let url = t.backup_url(&r.backup_volume, &r.backup);

    // 2. Start on every RW replica (again, when the set changed).
    if r.replicas != rw {
        if !r.replicas.is_empty() {
            r.attempts += 1;
            if r.attempts > MAX_ATTEMPTS {
                return Err(Stop::Fail(format!(
                    "the volume's replicas changed {MAX_ATTEMPTS} times during the restore"
                )));
            }
            tracing::warn!(volume = %name, before = ?r.replicas, now = ?rw, "replicas changed: restoring again on every replica");
        }
        for a in &rw {
            ask(ctx, name, a, &url, &t, r.incremental).await?;
        }
        r.replicas = rw;
        r.state = RestoreState::Restoring;
        r.progress = 0;
        r.message.clear();
        tracing::info!(volume = %name, backup = %r.backup, replicas = ?r.replicas, "restore started");
        return Ok(Some(POLL));
    }

    // 3. Poll.
    let mut min = 100;
    let mut all_done = true;
    let mut written = None;
    for a in r.replicas.clone() {
        let mut c = super::controller::replica_client(&a, 0).await?;
        let s = c.restore_status(v1::RestoreStatusRequest {}).await?.into_inner();
        match s.state.as_str() {
            "in-progress" => {
                all_done = false;
                min = min.min(s.progress);
            }
            "error" => {
                return Err(Stop::Fail(format!("replica {a}: {}", s.error)));
            }
            // Done (`none`: the replica restarted after it finished; the name is saved once the data is flushed).
            "complete" | "none" | "" if s.last_restored == r.backup => {
                if written.is_none() {
                    written = Some(s.bytes_written);
                }
            }
            _ => {
                // The replica restarted (no job, or the job of an earlier restore): ask it again.
                r.attempts += 1;
                if r.attempts > MAX_ATTEMPTS {
                    return Err(Stop::Fail(format!(
                        "replica {a} lost the restore {MAX_ATTEMPTS} times"
                    )));
                }
                tracing::warn!(volume = %name, replica = %a, state = %s.state, "the replica has no running restore: asking again");
                // Started again: a full restore (the replica forgot what it held when it lost the job).
                r.incremental = false;
                ask(ctx, name, &a, &url, &t, false).await?;
                all_done = false;
                min = 0;
            }
        }
    }
    r.progress = if all_done { 100 } else { min.min(99) };
    if all_done {
        r.bytes_written = written.unwrap_or(0);
        r.restored = true;
        return Ok(Some(Duration::ZERO));
    }
    Ok(Some(POLL))
}

async fn ask(
    ctx: &Ctx,
    volume: &str,
    replica: &str,
    url: &str,
    t: &super::target::OpenTarget,
    incremental: bool,
) -> Result<(), Stop> {
    let generation = crate::engine_generation::current(&ctx.db, volume).await?;
    let mut c = super::controller::replica_client(replica, generation).await?;
    match c
        .backup_restore(v1::BackupRestoreRequest {
            url: url.to_owned(),
            credentials: t.credentials.clone().into_iter().collect(),
            concurrency: 0,
            incremental,
        })
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
            Err(Stop::Retry(s.into()))
        }
        Err(s) if s.message().contains("in progress") => Ok(()),
        Err(s) => Err(Stop::Fail(format!(
            "replica {replica} refused the restore: {}",
            s.message()
        ))),
    }
}
