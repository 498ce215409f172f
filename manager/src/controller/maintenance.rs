//! Maintenance mode: a volume attached without its NBD frontend. The engine runs over the replicas, so snapshot
//! operations, revert, restore and clone work, but nothing listens for IO. Attaching with `disableFrontend` is the
//! controller path (the volume controller puts the flag into the engine spec, the engine controller starts the
//! engine without `--nbd-listen`); [`with_volume_in_maintenance`] is the one way an operation on a *detached* volume
//! borrows it: attach without a frontend on this node, run the operation against the engine, detach again.

use std::future::Future;
use std::time::{Duration, Instant};

use corral_proto::v1::controller_service_client::ControllerServiceClient;
use tonic::transport::Channel;

use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{Engine, ProcessState, Volume, VolumeState};
use crate::store::StoreError;

/// How long attaching (replicas and engine started) or detaching may take.
pub const MAINTENANCE_TIMEOUT: Duration = Duration::from_secs(120);

/// How often the store is read while waiting for the controllers.
const POLL: Duration = Duration::from_millis(200);

/// Attaches the detached `volume` without a frontend on this node, waits until its engine runs with no replica
/// rebuilding, runs `op` against the engine, then detaches and waits until the volume is detached again (also when
/// `op` failed). A volume that is attached, or attached meanwhile by someone else, is a conflict.
pub async fn with_volume_in_maintenance<T, F, Fut>(ctx: &Ctx, volume: &str, op: F) -> Result<T, ApiError>
where
    F: FnOnce(ControllerServiceClient<Channel>) -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let mut v = ctx
        .db
        .get::<Volume>(volume)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("volume {volume:?} not found")))?;
    if v.data.spec.node_id.is_some() || v.data.status.state != VolumeState::Detached {
        return Err(ApiError::Conflict(format!(
            "volume {volume} is not detached: it cannot be attached for maintenance"
        )));
    }
    v.data.spec.node_id = Some(ctx.cfg.node_id.clone());
    v.data.spec.disable_frontend = true;
    // The version read above makes a concurrent attach and this one exclusive.
    match ctx.db.update(&mut v).await {
        Err(StoreError::Conflict { .. }) => {
            return Err(ApiError::Conflict(format!(
                "volume {volume} changed meanwhile: try again"
            )));
        }
        r => r?,
    }
    tracing::info!(volume, "attached for maintenance (no frontend)");
    let result = match engine_in_maintenance(ctx, volume).await {
        Ok(c) => op(c).await,
        Err(e) => Err(e),
    };
    let detached = detach_and_wait(ctx, volume).await;
    tracing::info!(volume, ok = result.is_ok(), "maintenance done; detached");
    let out = result?;
    detached?;
    Ok(out)
}

/// Waits until the volume's engine runs without a frontend and no replica rebuilds (revert refuses then).
async fn engine_in_maintenance(
    ctx: &Ctx,
    volume: &str,
) -> Result<ControllerServiceClient<Channel>, ApiError> {
    let end = Instant::now() + MAINTENANCE_TIMEOUT;
    loop {
        let v = ctx.db.get::<Volume>(volume).await?;
        let e = ctx.db.get::<Engine>(volume).await?;
        if let (Some(v), Some(e)) = (v, e)
            && v.data.status.state == VolumeState::Attached
            && v.data.status.frontend_disabled
            && e.data.status.state == ProcessState::Running
            && !e.data.status.replica_modes.values().any(|m| m == "WO")
        {
            return crate::volume_engine::client(&e.data.status.address)
                .await
                .map_err(|err| {
                    ApiError::Unavailable(format!("engine of {volume} at {}: {err}", e.data.status.address))
                });
        }
        if Instant::now() > end {
            let msg = ctx
                .db
                .get::<Volume>(volume)
                .await?
                .map(|v| v.data.status.message)
                .unwrap_or_default();
            return Err(ApiError::Unavailable(format!(
                "volume {volume} did not attach for maintenance within {MAINTENANCE_TIMEOUT:?}: {msg}"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn detach_and_wait(ctx: &Ctx, volume: &str) -> Result<(), ApiError> {
    ctx.db
        .modify::<Volume>(volume, |v| {
            let changed = v.spec.node_id.is_some() || v.spec.disable_frontend;
            v.spec.node_id = None;
            v.spec.disable_frontend = false;
            changed
        })
        .await?;
    let end = Instant::now() + MAINTENANCE_TIMEOUT;
    loop {
        match ctx.db.get::<Volume>(volume).await? {
            Some(v) if v.data.status.state != VolumeState::Detached => {}
            _ => return Ok(()),
        }
        if Instant::now() > end {
            return Err(ApiError::Unavailable(format!(
                "volume {volume} did not detach within {MAINTENANCE_TIMEOUT:?} after maintenance"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}
