//! The engine of one volume as the manager's REST handlers and the clone controller call it. Every
//! `ControllerService` call they make goes through [`VolumeEngine`], so what a call means for the manager (which
//! engine answers, what is recorded after it — the snapshot list — and which calls must stay paired, like taking
//! the frontend down and up around a revert) is written once. The controllers that supervise engine processes use
//! [`client`] directly: they talk to an engine about its replicas, not on a user's behalf.

use corral_proto::v1::{self, controller_service_client::ControllerServiceClient};
use tonic::transport::Channel;

use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::Snapshot;
use crate::model::{Engine, ProcessState, Replica, Volume};
use crate::store::{Object, StoreError};

/// A call that failed: the engine refused or could not be reached, or recording its answer failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineCallError {
    #[error("engine of {volume}: {status}")]
    Engine { volume: String, status: tonic::Status },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<EngineCallError> for ApiError {
    fn from(e: EngineCallError) -> Self {
        match e {
            EngineCallError::Engine { status, .. } => status.into(),
            EngineCallError::Store(e) => e.into(),
        }
    }
}

/// A client of an engine's ControllerService: the one the volume engine, the engine controller and maintenance
/// use.
pub async fn client(
    address: &str,
) -> Result<ControllerServiceClient<Channel>, corral_proto::grpc::ConnectError> {
    let ch = corral_proto::grpc::connect(address, corral_proto::grpc::GrpcTimeouts::CONTROL).await?;
    Ok(ControllerServiceClient::new(ch))
}

/// A connected client of one volume's engine.
pub struct VolumeEngine {
    volume: String,
    c: ControllerServiceClient<Channel>,
}

impl VolumeEngine {
    /// Wraps a client already connected to `volume`'s engine (e.g. one borrowed in maintenance mode).
    pub fn new(volume: &str, c: ControllerServiceClient<Channel>) -> Self {
        Self {
            volume: volume.to_owned(),
            c,
        }
    }

    /// Connects to the engine `e` (the running engine of the volume of the same name); the error names its address.
    pub async fn connect(e: &Object<Engine>) -> Result<Self, String> {
        client(&e.data.status.address)
            .await
            .map(|c| Self::new(&e.name, c))
            .map_err(|err| format!("engine of {} at {}: {err}", e.name, e.data.status.address))
    }

    /// The running engine of an attached volume, for a REST handler: 404 without the volume, 409 when it is not
    /// attached, 503 when its engine does not answer.
    pub async fn of_attached(ctx: &Ctx, volume: &str) -> Result<Self, ApiError> {
        ctx.db
            .get::<Volume>(volume)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("volume {volume:?} not found")))?;
        let e = ctx
            .db
            .get::<Engine>(volume)
            .await?
            .filter(|e| e.data.status.state == ProcessState::Running)
            .ok_or_else(|| ApiError::Conflict(format!("volume {volume} is not attached")))?;
        Self::connect(&e).await.map_err(ApiError::Unavailable)
    }

    fn err(&self, status: tonic::Status) -> EngineCallError {
        EngineCallError::Engine {
            volume: self.volume.clone(),
            status,
        }
    }

    /// The volume's size as its engine serves it.
    pub async fn size(&mut self) -> Result<u64, EngineCallError> {
        let v = self.c.volume_get(v1::Empty {}).await.map_err(|s| self.err(s))?;
        Ok(v.into_inner().size)
    }

    /// Grows the volume to `size` (nothing when the engine already serves that size: an expansion whose size was
    /// not recorded is not done twice), then records the size on the volume and its replicas.
    pub async fn expand(&mut self, ctx: &Ctx, size: u64) -> Result<(), EngineCallError> {
        if self.size().await? < size {
            self.c
                .volume_expand(v1::ExpandRequest { size })
                .await
                .map_err(|s| self.err(s))?;
        }
        record_size(ctx, &self.volume, size).await?;
        Ok(())
    }

    /// The engine's snapshots, recorded so that a detach right after a change still lists them.
    pub async fn snapshots(&mut self, ctx: &Ctx) -> Result<Vec<Snapshot>, EngineCallError> {
        let l = self
            .c
            .snapshot_list(v1::Empty {})
            .await
            .map_err(|s| self.err(s))?;
        let snaps = crate::snapshot::from_engine(&self.volume, &l.into_inner());
        crate::snapshot::record(&ctx.db, &self.volume, &snaps).await?;
        Ok(snaps)
    }

    /// Whether the volume has `snapshot`, not removed.
    pub async fn has_snapshot(&mut self, ctx: &Ctx, snapshot: &str) -> Result<bool, EngineCallError> {
        Ok(self
            .snapshots(ctx)
            .await?
            .iter()
            .any(|s| s.name == snapshot && !s.removed))
    }

    /// Takes a snapshot (the engine names it when `name` is empty); returns its name.
    pub async fn snapshot_create(
        &mut self,
        ctx: &Ctx,
        name: String,
        labels: std::collections::HashMap<String, String>,
    ) -> Result<String, EngineCallError> {
        let r = self
            .c
            .snapshot_create(v1::SnapshotCreateRequest { name, labels })
            .await
            .map_err(|s| self.err(s))?;
        self.snapshots(ctx).await?;
        Ok(r.into_inner().name)
    }

    /// Marks a snapshot removed.
    pub async fn snapshot_remove(&mut self, ctx: &Ctx, name: String) -> Result<(), EngineCallError> {
        self.c
            .snapshot_remove(v1::SnapshotName { name })
            .await
            .map_err(|s| self.err(s))?;
        self.snapshots(ctx).await?;
        Ok(())
    }

    /// Starts a purge of removed snapshots on every RW replica (refused while a replica rebuilds).
    pub async fn snapshot_purge(&mut self) -> Result<(), EngineCallError> {
        self.c
            .snapshot_purge(v1::Empty {})
            .await
            .map_err(|s| self.err(s))?;
        Ok(())
    }

    /// Reverts to a snapshot; with `frontend`, the frontend is taken down for it and brought back whether or not the
    /// revert worked.
    pub async fn snapshot_revert(
        &mut self,
        ctx: &Ctx,
        name: String,
        frontend: bool,
    ) -> Result<(), EngineCallError> {
        if frontend {
            self.c
                .frontend_shutdown(v1::Empty {})
                .await
                .map_err(|s| self.err(s))?;
        }
        let reverted = self.c.snapshot_revert(v1::SnapshotName { name }).await;
        if frontend {
            self.c
                .frontend_start(v1::Empty {})
                .await
                .map_err(|s| self.err(s))?;
        }
        reverted.map_err(|s| self.err(s))?;
        self.snapshots(ctx).await?;
        Ok(())
    }

    /// Starts cloning a snapshot of another volume's engine into this volume.
    pub async fn clone_from(&mut self, req: v1::VolumeCloneRequest) -> Result<(), tonic::Status> {
        self.c.snapshot_clone(req).await.map(|_| ())
    }

    /// The state of the clone into this volume.
    pub async fn clone_status(&mut self) -> Result<v1::VolumeCloneStatusResponse, EngineCallError> {
        let r = self
            .c
            .snapshot_clone_status(v1::Empty {})
            .await
            .map_err(|s| self.err(s))?;
        Ok(r.into_inner())
    }
}

/// Records that the engine of `volume` grew it to `size`: the volume's and its replicas' specs (so a restart
/// opens them at that size). The API's expand and a clone grown past its source's size both end here.
pub async fn record_size(ctx: &Ctx, volume: &str, size: u64) -> Result<(), StoreError> {
    ctx.db
        .modify::<Volume>(volume, |v| {
            let grow = v.spec.size < size;
            v.spec.size = v.spec.size.max(size);
            grow
        })
        .await?;
    for r in ctx
        .db
        .list::<Replica>()
        .await?
        .iter()
        .filter(|r| r.data.spec.volume == volume)
    {
        ctx.db
            .modify::<Replica>(&r.name, |r| {
                let grow = r.spec.size < size;
                r.spec.size = r.spec.size.max(size);
                grow
            })
            .await?;
    }
    Ok(())
}
