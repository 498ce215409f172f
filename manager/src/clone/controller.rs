//! Cluster-wide (leader only): drives each [`VolumeClone`] from initiated to completed or failed. Steps, each
//! recorded before the next so a new leader goes on where the last one stopped:
//!
//! 1. the source's engine runs: a detached source is attached without a frontend on this node (and detached
//!    again at the end);
//! 2. `vol://`: a snapshot `clone-<target>-<8 hex>` (unique per clone) is taken on the source (`snap://` names one that must exist);
//! 3. the target is attached without a frontend (maintenance mode: nobody can reach it for IO) with all its
//!    replicas RW;
//! 4. the target's engine clones the snapshot from one of the source's RW replicas into every RW replica of the
//!    target (`ControllerService.SnapshotClone`), progress polled into the record;
//! 5. completed: the target grows to the size asked for when that is larger than the source; failed: the error is
//!    kept and the target is never served (delete it and create it again);
//! 6. either way: the target is detached, the snapshot taken in 2 removed, an auto-attached source detached.
//!
//! The copy runs in the target's replicas, so a target engine restarted mid-copy answers with their outcome (the
//! clone completes when they did); a target replica that restarted has lost its job, and the clone fails rather
//! than serve a target that may hold part of the data. A manager restarted mid-copy goes on polling (the daemons
//! keep running). The test `manager/tests/clone.rs` SIGKILLs each of these during a copy.

use std::sync::Arc;
use std::time::Duration;

use corral_proto::v1;
use tokio_util::sync::CancellationToken;

use super::model::{CloneState, VolumeClone};
use crate::context::Ctx;
use crate::model::{Engine, ProcessState, Robustness, Volume, VolumeState};
use crate::runtime::Stop;
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::store::{Object, StoreError};
use crate::volume_engine::{EngineCallError, VolumeEngine};

/// How often a running step is looked at again.
const POLL: Duration = Duration::from_millis(500);

/// How long a clone waits for the source or the target to be attached before it fails.
const WAIT_LIMIT: Duration = Duration::from_secs(300);

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<VolumeClone>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(5),
        |ev| Some(ev.name().to_owned()),
        |o| (!o.data.cleaned_up).then(|| o.name.clone()),
    );
    // Target volumes: attach and detach progress.
    feed::<Volume>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3600),
        |ev| Some(ev.name().to_owned()),
        |_| None,
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("clone", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let Some(mut c) = ctx.db.get::<VolumeClone>(&name).await? else {
        return Ok(None);
    };
    if c.data.cleaned_up {
        return Ok(None);
    }
    let target = ctx.db.get::<Volume>(&name).await?;
    if target.is_none() && c.data.state.active() {
        c.data.state = CloneState::Failed;
        c.data.message = "the target volume was deleted".into();
    }
    if c.data.state.active() && c.data.copied {
        // The copy is done: undo the attachments and the snapshot, and call it completed once both volumes are
        // detached as they should be.
        undo(&ctx, &name, &mut c.data, true).await?;
        let detached = |v: Option<Object<Volume>>| {
            v.is_none_or(|v| v.data.spec.node_id.is_some() || v.data.status.state == VolumeState::Detached)
        };
        let target_detached = ctx
            .db
            .get::<Volume>(&name)
            .await?
            .is_some_and(|v| v.data.status.state == VolumeState::Detached);
        let source_settled = detached(ctx.db.get::<Volume>(&c.data.source_volume).await?);
        if target_detached && source_settled {
            tracing::info!(volume = %name, source = %c.data.data_source, "clone completed");
            c.data.state = CloneState::Completed;
            c.data.message = String::new();
            c.data.cleaned_up = true;
            ctx.db.update(&mut c).await?;
            return Ok(None);
        }
        c.data.message = "detaching after the copy".into();
        ctx.db.update(&mut c).await?;
        return Ok(Some(POLL));
    }
    if c.data.state.active() {
        let before = c.data.clone();
        let outcome = match &target {
            Some(t) => step(&ctx, &name, &mut c.data, t).await,
            None => Err(Stop::Fail("the target volume was deleted".into())),
        };
        match outcome {
            Ok(requeue) => {
                if c.data != before {
                    ctx.db.update(&mut c).await?;
                }
                return Ok(requeue);
            }
            Err(Stop::Retry(e)) => {
                if c.data != before {
                    ctx.db.update(&mut c).await?;
                }
                return Err(e);
            }
            Err(Stop::Fail(reason)) => {
                tracing::warn!(volume = %name, source = %c.data.data_source, %reason, "clone failed");
                c.data.state = CloneState::Failed;
                c.data.message = reason;
                ctx.db.update(&mut c).await?;
            }
        }
    }
    undo(&ctx, &name, &mut c.data, target.is_some()).await?;
    c.data.cleaned_up = true;
    if target.is_some() {
        ctx.db.update(&mut c).await?;
    } else {
        ctx.db.delete_any::<VolumeClone>(&name).await?;
    }
    Ok(None)
}

/// The engine of `volume` when it runs with a replica in RW.
async fn running_engine(ctx: &Ctx, volume: &str) -> Result<Option<Object<Engine>>, StoreError> {
    Ok(ctx.db.get::<Engine>(volume).await?.filter(|e| {
        e.data.status.state == ProcessState::Running
            && e.data.status.replica_modes.values().any(|m| m == "RW")
    }))
}

async fn engine_client(e: &Object<Engine>) -> Result<VolumeEngine, Stop> {
    VolumeEngine::connect(e)
        .await
        .map_err(|err| Stop::Retry(anyhow::anyhow!(err)))
}

/// Attaches `volume` without a frontend on this node unless someone attached it meanwhile; true when this call
/// attached it.
async fn attach_for_clone(ctx: &Ctx, volume: &str) -> Result<bool, StoreError> {
    let node = ctx.cfg.node_id.clone();
    let mut attached = false;
    ctx.db
        .modify::<Volume>(volume, |v| {
            attached = v.spec.node_id.is_none() && v.status.state == VolumeState::Detached;
            if attached {
                v.spec.node_id = Some(node.clone());
                v.spec.disable_frontend = true;
            }
            attached
        })
        .await?;
    Ok(attached)
}

async fn step(ctx: &Ctx, name: &str, c: &mut VolumeClone, target: &Object<Volume>) -> Result<Requeue, Stop> {
    // 1. The source's engine.
    let Some(source) = ctx.db.get::<Volume>(&c.source_volume).await? else {
        return Err(Stop::Fail(format!(
            "the source volume {} was deleted",
            c.source_volume
        )));
    };
    if source.data.spec.node_id.is_none() {
        if c.auto_attached_source && source.data.status.state == VolumeState::Detached {
            return Err(Stop::Fail(format!(
                "the source volume {} was detached during the clone",
                c.source_volume
            )));
        }
        if !c.auto_attached_source && attach_for_clone(ctx, &c.source_volume).await? {
            tracing::info!(volume = %name, source = %c.source_volume, "source attached for the clone (no frontend)");
            c.auto_attached_source = true;
        }
        return wait_or_fail(
            c,
            format!("attaching the source volume {}", c.source_volume),
            unix_now(),
        );
    }
    let Some(src_engine) = running_engine(ctx, &c.source_volume).await? else {
        let why = source.data.status.message.clone();
        return wait_or_fail(
            c,
            format!(
                "waiting for the engine of the source volume {}{}",
                c.source_volume,
                reason(&why)
            ),
            unix_now(),
        );
    };

    // 2. The snapshot.
    if !c.started {
        let mut src = engine_client(&src_engine).await?;
        if !src.has_snapshot(ctx, &c.snapshot).await? {
            if c.snapshot_taken || !c.data_source.starts_with("vol://") {
                return Err(Stop::Fail(format!(
                    "the source volume {} has no snapshot {}",
                    c.source_volume, c.snapshot
                )));
            }
            let labels = [("corral.io/clone-target".to_owned(), name.to_owned())].into();
            src.snapshot_create(ctx, c.snapshot.clone(), labels)
                .await
                .map_err(|e| match e {
                    EngineCallError::Engine { status, .. } => {
                        refused_unless_unreachable(status, "the source's engine refused the snapshot")
                    }
                    e @ EngineCallError::Store(_) => Stop::Retry(e.into()),
                })?;
            tracing::info!(volume = %name, source = %c.source_volume, snapshot = %c.snapshot, "snapshot taken for the clone");
        }
        if c.data_source.starts_with("vol://") {
            c.snapshot_taken = true;
        }
    }

    // 3. The target, in maintenance mode with every replica RW.
    if target.data.spec.node_id.is_none() {
        if c.started {
            return Err(Stop::Fail("the target was detached during the clone".into()));
        }
        attach_for_clone(ctx, name).await?;
        return wait_or_fail(c, "attaching the target without a frontend".into(), unix_now());
    }
    let t = &target.data;
    let ready = t.status.state == VolumeState::Attached && t.status.robustness == Robustness::Healthy;
    let Some(tgt_engine) = running_engine(ctx, name).await?.filter(|_| ready || c.started) else {
        return wait_or_fail(
            c,
            format!("waiting for the target's replicas{}", reason(&t.status.message)),
            unix_now(),
        );
    };
    c.waiting_since = None;
    let mut tgt = engine_client(&tgt_engine).await?;

    // 4. The copy.
    if !c.started {
        let req = v1::VolumeCloneRequest {
            from_engine_address: src_engine.data.status.address.clone(),
            snapshot_name: c.snapshot.clone(),
            export_backing_image_if_exist: false,
            max_bytes_per_second: ctx.setting_u64("clone-max-bytes-per-second").await,
        };
        if let Err(e) = tgt.clone_from(req).await {
            return Err(refused_unless_unreachable(
                e,
                "the target's engine refused the clone",
            ));
        }
        tracing::info!(volume = %name, source = %c.data_source, snapshot = %c.snapshot, "clone started");
        c.started = true;
        c.state = CloneState::Copying;
        c.progress = 0;
        c.message = String::new();
        return Ok(Some(POLL));
    }
    let st = tgt.clone_status().await?;
    match st.state.as_str() {
        "in-progress" => {
            c.progress = st.progress.min(99);
            Ok(Some(POLL))
        }
        "complete" => {
            // 5. Grow to the size asked for (the extra space reads zeros).
            if c.size > t.spec.size {
                tgt.expand(ctx, c.size).await.map_err(|e| match e {
                    EngineCallError::Engine { status, .. } => Stop::Fail(format!(
                        "the clone completed but growing it to {} bytes failed: {}",
                        c.size,
                        status.message()
                    )),
                    e @ EngineCallError::Store(_) => Stop::Retry(e.into()),
                })?;
            }
            tracing::info!(volume = %name, source = %c.data_source, "copy completed");
            c.copied = true;
            c.progress = 100;
            Ok(Some(Duration::ZERO))
        }
        "error" => Err(Stop::Fail(if st.error.is_empty() {
            "the copy failed".into()
        } else {
            st.error
        })),
        _ => Err(Stop::Fail(
            "the copy was interrupted: the target's engine or replicas restarted during the clone".into(),
        )),
    }
}

/// A refusal ends the clone; an engine that does not answer is asked again.
fn refused_unless_unreachable(e: tonic::Status, what: &str) -> Stop {
    match e.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => {
            Stop::Retry(e.into())
        }
        _ => Stop::Fail(format!("{what}: {}", e.message())),
    }
}

/// Fails the clone once it waited [`WAIT_LIMIT`] for one step (the source or the target cannot be attached, e.g. a
/// target whose replicas cannot be placed); `waiting` says for what, and is kept as the message meanwhile.
fn wait_or_fail(c: &mut VolumeClone, waiting: String, now: u64) -> Result<Requeue, Stop> {
    let since = *c.waiting_since.get_or_insert(now);
    if now.saturating_sub(since) > WAIT_LIMIT.as_secs() {
        return Err(Stop::Fail(format!(
            "gave up after {} s {waiting}",
            WAIT_LIMIT.as_secs()
        )));
    }
    c.message = waiting;
    Ok(Some(POLL))
}

/// `: WHY` when there is a why.
fn reason(why: &str) -> String {
    if why.is_empty() {
        String::new()
    } else {
        format!(": {why}")
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Undoes what the clone did, each step once (the flags say what is left): detach the target, remove the snapshot
/// taken on the source, detach an auto-attached source. The caller saves the record.
async fn undo(ctx: &Ctx, name: &str, c: &mut VolumeClone, target_exists: bool) -> anyhow::Result<()> {
    if target_exists {
        ctx.db
            .modify::<Volume>(name, |v| {
                let ours = v.spec.disable_frontend && v.spec.node_id.is_some();
                if ours {
                    v.spec.node_id = None;
                    v.spec.disable_frontend = false;
                }
                ours
            })
            .await?;
    }
    let source = c.source_volume.clone();
    if c.snapshot_taken {
        match running_engine(ctx, &source).await? {
            Some(e) => {
                let mut src = VolumeEngine::connect(&e).await.map_err(anyhow::Error::msg)?;
                if src.has_snapshot(ctx, &c.snapshot).await? {
                    src.snapshot_remove(ctx, c.snapshot.clone()).await?;
                    tracing::info!(volume = %name, %source, snapshot = %c.snapshot, "snapshot taken for the clone removed");
                }
            }
            None => tracing::warn!(
                volume = %name, %source, snapshot = %c.snapshot,
                "the source is not running: the snapshot taken for the clone stays"
            ),
        }
        c.snapshot_taken = false;
    }
    if c.auto_attached_source {
        match ctx
            .db
            .modify::<Volume>(&source, |v| {
                let ours = v.spec.disable_frontend && v.spec.node_id.is_some();
                if ours {
                    v.spec.node_id = None;
                    v.spec.disable_frontend = false;
                }
                ours
            })
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        c.auto_attached_source = false;
    }
    Ok(())
}
