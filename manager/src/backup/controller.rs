//! Cluster-wide (leader only): drives each [`Backup`] this cluster asked for, pending → in-progress → completed
//! or failed. The job itself runs on one RW replica of the volume (`ReplicaBackupService.BackupCreate`, the
//! credentials in the request, never on a command line); this controller picks the replica, records it before
//! anything else, polls the job and copies the result from the target's record. A manager that restarts finds
//! the replica's job still running and goes on polling it; a request that may have reached the replica before
//! the restart is sent again and the replica's "already in progress" taken as the answer. A replica that lost
//! the job (it restarted, the volume was detached) fails the backup: the target still calls it in-progress and
//! it is never listed completed; create another.

use std::sync::Arc;
use std::time::Duration;

use corral_proto::engine_generation::EngineGeneration;
use corral_proto::v1::{self, replica_backup_service_client::ReplicaBackupServiceClient};
use tokio_util::sync::CancellationToken;

use super::model::{Backup, BackupMode, BackupState};
use super::target::{OpenTarget, TargetError};
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::{Engine, ProcessState, Replica};
use crate::runtime::Stop;
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::store::{Object, StoreError};

/// How often a running backup is looked at.
const POLL: Duration = Duration::from_millis(500);

/// Settings of the chain policy passed to the replica.
pub const DELTA_MAX_SETTING: &str = "backup-delta-max";
pub const INCREMENTAL_SETTING: &str = "backup-incremental";
pub const MAX_COUNT_SETTING: &str = "backup-max-count";

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<Backup>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(10),
        |ev| match ev {
            crate::store::Event::Put(o) => ours_active(&o.data).then(|| o.name.clone()),
            crate::store::Event::Delete { .. } => None,
        },
        |o| ours_active(&o.data).then(|| o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backup", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

fn ours_active(b: &Backup) -> bool {
    !b.source_volume.is_empty() && b.state.active()
}

/// A replica's backup service, every call presenting `generation`.
pub type ReplicaBackupClient = ReplicaBackupServiceClient<
    tonic::codegen::InterceptedService<tonic::transport::Channel, EngineGeneration>,
>;

/// The gRPC client of a replica's backup service (its sync endpoint). Calls that change the replica (create,
/// restore) present the volume's current engine generation (`crate::engine_generation::current`): a replica
/// that accepted one refuses them without it; status polls pass 0.
pub async fn replica_client(address: &str, generation: u64) -> anyhow::Result<ReplicaBackupClient> {
    let a: corral_proto::ReplicaAddress = address.parse()?;
    let ch = corral_proto::grpc::connect_endpoint(&a.sync, corral_proto::grpc::GrpcTimeouts::CONTROL).await?;
    Ok(ReplicaBackupServiceClient::with_interceptor(
        ch,
        EngineGeneration(generation),
    ))
}

/// The RW replica addresses of the volume's running engine, sorted (the first one backs up).
pub async fn rw_replicas(
    ctx: &Ctx,
    volume: &str,
) -> Result<Option<(Object<Engine>, Vec<String>)>, StoreError> {
    let Some(e) = ctx
        .db
        .get::<Engine>(volume)
        .await?
        .filter(|e| e.data.status.state == ProcessState::Running)
    else {
        return Ok(None);
    };
    let rw: Vec<String> = e
        .data
        .status
        .replica_modes
        .iter()
        .filter(|(_, m)| *m == "RW")
        .map(|(a, _)| a.clone())
        .collect();
    Ok((!rw.is_empty()).then_some((e, rw)))
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let Some(mut b) = ctx.db.get::<Backup>(&name).await? else {
        return Ok(None);
    };
    if !ours_active(&b.data) {
        return Ok(None);
    }
    let before = b.data.clone();
    let outcome = step(&ctx, &mut b.data).await;
    let requeue = match outcome {
        Ok(r) => Ok(r),
        Err(Stop::Retry(e)) => Err(e),
        Err(Stop::Fail(reason)) => {
            tracing::warn!(backup = %b.data.name, volume = %b.data.source_volume, %reason, "backup failed");
            b.data.state = BackupState::Failed;
            b.data.error = reason;
            Ok(None)
        }
    };
    if b.data != before {
        match ctx.db.update(&mut b).await {
            // Deleted or changed meanwhile: the next reconcile reads it again.
            Ok(()) | Err(StoreError::NotFound { .. }) => {}
            Err(StoreError::Conflict { .. }) => return Ok(Some(Duration::ZERO)),
            Err(e) => return Err(e.into()),
        }
    }
    requeue
}

fn target_stop(e: TargetError) -> Stop {
    match e {
        TargetError::Store(e) => Stop::Retry(e.into()),
        e => Stop::Fail(e.to_string()),
    }
}

async fn step(ctx: &Ctx, b: &mut Backup) -> Result<Requeue, Stop> {
    let t = super::target::open(ctx, &b.target).await.map_err(target_stop)?;
    if b.replica.is_empty() {
        return start_job(ctx, &t, b).await;
    }
    let mut c = match replica_client(&b.replica, 0).await {
        Ok(c) => c,
        Err(e) => return Err(lost_or_retry(ctx, b, e).await),
    };
    let st = match c
        .backup_status(v1::BackupJobRef {
            backup_name: b.name.clone(),
        })
        .await
    {
        Ok(s) => s.into_inner(),
        Err(s) if s.code() == tonic::Code::NotFound => {
            return Err(Stop::Fail(format!(
                "the replica running the backup ({}) lost the job: it restarted or the volume was detached",
                b.replica
            )));
        }
        Err(s) => return Err(lost_or_retry(ctx, b, s.into()).await),
    };
    match st.state.as_str() {
        "in-progress" => {
            b.state = BackupState::InProgress;
            b.progress = st.progress.min(99);
            Ok(Some(POLL))
        }
        "complete" => {
            // The target's record is the truth (and what the poller shows later); the job's status otherwise.
            match t.store.backup_config(&b.volume, &b.name).await {
                Ok(cfg) => super::target::fill_from_config(b, &cfg),
                Err(e) => {
                    tracing::warn!(backup = %b.name, error = %e, "completed backup's record unreadable; using the job status");
                    b.is_incremental = st.is_incremental;
                    b.chain_position = st.chain_position;
                    b.full_reason = st.full_reason.clone();
                    b.read_bytes = st.read_bytes;
                    b.new_bytes = st.new_bytes;
                }
            }
            b.state = BackupState::Completed;
            b.progress = 100;
            b.error.clear();
            if let Err(e) = super::target::record_volume(ctx, &t, &b.volume).await {
                tracing::warn!(backup = %b.name, error = %e, "backup volume not recorded; the next listing will");
            }
            tracing::info!(backup = %b.name, volume = %b.source_volume, snapshot = %b.snapshot,
                incremental = b.is_incremental, chain_position = b.chain_position, "backup completed");
            Ok(None)
        }
        other => Err(Stop::Fail(if st.error.is_empty() {
            format!("the backup ended {other}")
        } else {
            st.error
        })),
    }
}

/// A replica that cannot be reached: failed when it is not a replica of the volume any more, retried otherwise.
async fn lost_or_retry(ctx: &Ctx, b: &Backup, e: anyhow::Error) -> Stop {
    match replica_exists(ctx, &b.replica).await {
        Ok(false) => Stop::Fail(format!(
            "the replica running the backup ({}) is gone: {e:#}",
            b.replica
        )),
        _ => Stop::Retry(anyhow::anyhow!(
            "replica {} running backup {}: {e:#}",
            b.replica,
            b.name
        )),
    }
}

async fn start_job(ctx: &Ctx, t: &OpenTarget, b: &mut Backup) -> Result<Requeue, Stop> {
    let Some((_, rw)) = rw_replicas(ctx, &b.source_volume).await? else {
        if ctx
            .db
            .get::<crate::model::Volume>(&b.source_volume)
            .await?
            .is_none()
        {
            return Err(Stop::Fail(format!("volume {} was deleted", b.source_volume)));
        }
        b.error = format!(
            "waiting for volume {} to be attached with a RW replica",
            b.source_volume
        );
        return Ok(Some(POLL));
    };
    let replica = rw[0].clone();
    let incremental = ctx.setting_bool(INCREMENTAL_SETTING).await;
    // With incrementals off the backup store makes a full and records why (incremental-disabled).
    let mode = if b.mode == BackupMode::Full {
        "full"
    } else {
        "auto"
    };
    // The backup's own delta-max (a recurring job's), else the volume's, else the setting.
    let source = ctx.db.get::<crate::model::Volume>(&b.source_volume).await?;
    let volume_delta_max = source.as_ref().and_then(|v| v.data.spec.backup_delta_max);
    // A v1 replica records the backing image it was started with (`--backing-image-name/-checksum`); a v2
    // replica is hosted by its disk daemon, which knows only the copy's lvol: the manager names the image.
    let (backing_image_name, backing_image_checksum) = match source.as_ref().map(|v| &v.data.spec) {
        Some(spec) if spec.data_engine.in_lvstore() => match &spec.backing_image {
            Some(image) => {
                let bi = ctx
                    .db
                    .get::<crate::backing_image::model::BackingImage>(image)
                    .await?;
                match bi
                    .map(|o| o.data.status.current_checksum)
                    .filter(|c| !c.is_empty())
                {
                    Some(sum) => (image.clone(), sum),
                    None => {
                        return Err(Stop::Retry(anyhow::anyhow!(
                            "backing image {image} of volume {} has no checksum yet",
                            b.source_volume
                        )));
                    }
                }
            }
            None => (String::new(), String::new()),
        },
        _ => (String::new(), String::new()),
    };
    let delta_max = match b.delta_max.or(volume_delta_max) {
        Some(n) => n,
        None => u32::try_from(ctx.setting_u64(DELTA_MAX_SETTING).await).unwrap_or(u32::MAX),
    };
    let generation = crate::engine_generation::current(&ctx.db, &b.source_volume).await?;
    let mut c = replica_client(&replica, generation).await?;
    // Asked before a manager restart (the answer was lost): the job is known to the replica.
    if c.backup_status(v1::BackupJobRef {
        backup_name: b.name.clone(),
    })
    .await
    .is_ok()
    {
        b.replica = replica;
        b.state = BackupState::InProgress;
        return Ok(Some(Duration::ZERO));
    }
    let req = v1::BackupCreateRequest {
        snapshot: b.snapshot.clone(),
        target: t.spec.store_url(),
        volume: b.volume.clone(),
        backup_name: b.name.clone(),
        labels: b.labels.clone().into_iter().collect(),
        mode: mode.into(),
        delta_max,
        retain: 0,
        concurrency: 0,
        // Taken by the store only for the backup volume's first backup (0: the store's default).
        block_size: b.block_size,
        compression: String::new(),
        credentials: t.credentials.clone().into_iter().collect(),
        max_upload_rate: 0,
        gc_margin_seconds: 0,
        incremental_disabled: !incremental,
        // The manager checks backup-max-count itself, before it creates the Backup.
        max_count: 0,
        backing_image_name,
        backing_image_checksum,
    };
    match c.backup_create(req).await {
        Ok(_) => {}
        // Asked before a manager restart: the job runs.
        Err(s) if s.code() == tonic::Code::AlreadyExists => {}
        Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
            return Err(Stop::Retry(s.into()));
        }
        Err(s) => {
            return Err(Stop::Fail(format!(
                "the replica refused the backup: {}",
                s.message()
            )));
        }
    }
    tracing::info!(backup = %b.name, volume = %b.source_volume, snapshot = %b.snapshot, %replica, mode, delta_max, "backup started");
    b.replica = replica;
    b.state = BackupState::InProgress;
    b.error.clear();
    Ok(Some(POLL))
}

/// Whether a replica address still belongs to a replica of the cluster.
pub async fn replica_exists(ctx: &Ctx, address: &str) -> Result<bool, StoreError> {
    Ok(ctx
        .db
        .list::<Replica>()
        .await?
        .iter()
        .any(|r| r.data.status.address == address))
}
