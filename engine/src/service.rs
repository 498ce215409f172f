//! gRPC `ControllerService` over a running volume.

use std::sync::Arc;

use corral_proto::v1::{self, controller_service_server::ControllerService};
use data_protocol::ClientConfig;
use tonic::{Request, Response, Status};

use crate::frontend::Frontend;
use crate::rebuild::RebuildTracker;
use crate::replica_client::Mode;
use crate::volume::Volume;

/// The service state.
#[derive(Clone)]
pub struct EngineGrpc {
    /// The volume.
    pub volume: Arc<Volume>,
    /// Its frontend.
    pub frontend: Arc<Frontend>,
    /// Data-protocol settings for replicas added later.
    pub client: ClientConfig,
    /// Rebuild jobs.
    pub rebuilds: Arc<RebuildTracker>,
}

impl EngineGrpc {
    async fn volume_info(&self) -> v1::Volume {
        let reps = self.volume.replicas().await;
        v1::Volume {
            name: self.volume.name.clone(),
            size: self.volume.size(),
            sector_size: self.volume.sector_size,
            frontend_state: if self.frontend.is_up().await {
                "attached"
            } else {
                "detached"
            }
            .into(),
            endpoints: self.frontend.endpoints(),
            replica_count: u32::try_from(reps.len()).unwrap_or(u32::MAX),
            robustness: self.volume.robustness().await.into(),
            revision_counter_disabled: self.volume.revision_counter_disabled,
            is_expanding: false,
            last_expansion_error: String::new(),
            fenced: self.volume.fenced().map(ToString::to_string).unwrap_or_default(),
            generation: self.client.generation,
        }
    }
}

#[tonic::async_trait]
impl ControllerService for EngineGrpc {
    async fn volume_get(&self, _: Request<v1::Empty>) -> Result<Response<v1::Volume>, Status> {
        Ok(Response::new(self.volume_info().await))
    }

    async fn volume_expand(&self, req: Request<v1::ExpandRequest>) -> Result<Response<v1::Volume>, Status> {
        self.volume.expand(req.into_inner().size).await?;
        Ok(Response::new(self.volume_info().await))
    }

    async fn replica_list(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaListResponse>, Status> {
        let mut out = Vec::new();
        for r in self.volume.replicas().await {
            let mut rc = 0;
            if r.mode() != Mode::Err
                && let Some(c) = &r.conn
                && let Ok(resp) = c.control.clone().replica_get(v1::Empty {}).await
            {
                rc = resp.into_inner().replica.map_or(0, |x| x.revision_counter);
            }
            out.push(v1::ControllerReplica {
                address: r.address.to_string(),
                mode: r.mode().as_str().into(),
                error: r.error(),
                revision_counter: rc,
            });
        }
        Ok(Response::new(v1::ReplicaListResponse { replicas: out }))
    }

    async fn replica_add(
        &self,
        req: Request<v1::ReplicaAddRequest>,
    ) -> Result<Response<v1::ControllerReplica>, Status> {
        let req = req.into_inner();
        let e = if req.rebuild {
            let rate = crate::rebuild::RebuildRate {
                max_bytes_per_second: req.max_bytes_per_second,
                busy_bytes_per_second: req.busy_bytes_per_second,
            };
            self.rebuilds
                .start(self.volume.clone(), &req.address, &self.client, rate)
                .await?
        } else {
            self.volume.replica_add_empty(&req.address, &self.client).await?
        };
        Ok(Response::new(v1::ControllerReplica {
            address: e.address.to_string(),
            mode: e.mode().as_str().into(),
            error: e.error(),
            revision_counter: 0,
        }))
    }

    async fn replica_remove(&self, req: Request<v1::ReplicaAddress>) -> Result<Response<v1::Empty>, Status> {
        self.volume.replica_remove(&req.into_inner().address).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn rebuild_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::RebuildStatusResponse>, Status> {
        Ok(Response::new(v1::RebuildStatusResponse {
            replicas: self.rebuilds.status().await,
        }))
    }

    async fn snapshot_create(
        &self,
        req: Request<v1::SnapshotCreateRequest>,
    ) -> Result<Response<v1::SnapshotCreateResponse>, Status> {
        let req = req.into_inner();
        let name = self.volume.snapshot(&req.name, req.labels, true).await?;
        Ok(Response::new(v1::SnapshotCreateResponse { name }))
    }

    async fn snapshot_list(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::SnapshotListResponse>, Status> {
        let r = self.volume.snapshot_list().await?;
        Ok(Response::new(v1::SnapshotListResponse {
            disks: r.disks,
            chain: r.chain,
        }))
    }

    async fn snapshot_remove(&self, req: Request<v1::SnapshotName>) -> Result<Response<v1::Empty>, Status> {
        self.volume.snapshot_remove(&req.into_inner().name).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_revert(&self, req: Request<v1::SnapshotName>) -> Result<Response<v1::Empty>, Status> {
        self.volume.revert(&req.into_inner().name).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_purge(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        self.volume.snapshot_purge().await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_purge_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::PurgeStatusResponse>, Status> {
        Ok(Response::new(self.volume.purge_status().await?))
    }

    async fn frontend_start(&self, _: Request<v1::Empty>) -> Result<Response<v1::Volume>, Status> {
        self.frontend.start().await?;
        Ok(Response::new(self.volume_info().await))
    }

    async fn frontend_shutdown(&self, _: Request<v1::Empty>) -> Result<Response<v1::Volume>, Status> {
        self.frontend.stop().await;
        Ok(Response::new(self.volume_info().await))
    }

    async fn metrics_get(&self, _: Request<v1::Empty>) -> Result<Response<v1::MetricsResponse>, Status> {
        use std::sync::atomic::Ordering::Relaxed;
        let m = &self.volume.metrics;
        Ok(Response::new(v1::MetricsResponse {
            read_ops: m.reads.load(Relaxed),
            write_ops: m.writes.load(Relaxed),
            read_bytes: m.read_bytes.load(Relaxed),
            write_bytes: m.write_bytes.load(Relaxed),
            flush_ops: m.flushes.load(Relaxed),
            errors: m.errors.load(Relaxed),
        }))
    }

    async fn snapshot_clone(
        &self,
        req: Request<v1::VolumeCloneRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        self.volume.snapshot_clone(&req.into_inner()).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_clone_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::VolumeCloneStatusResponse>, Status> {
        Ok(Response::new(self.volume.clone_status().await?))
    }
}
