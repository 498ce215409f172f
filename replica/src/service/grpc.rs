//! gRPC `ReplicaService` (the control listener) and `SyncAgentService` (the sync listener) over any
//! [`ServedReplica`], v1 or v2. Blocking replica work runs on the blocking pool; long jobs (purge, hash) run in the
//! background and report through their status RPCs.

use std::sync::Arc;

use corral_proto::v1::{
    self, replica_service_server::ReplicaService, sync_agent_service_server::SyncAgentService,
};
use tonic::{Request, Response, Status};
use tracing::error;

use super::{LocalFilesStream, ReplicaChain, ServedReplica, blocking};
use crate::clone::CloneRequest;
use crate::error::ReplicaError;
use crate::export::ExportRequest;
use crate::jobs::{JobState, JobStatus};
use crate::model::{ServedEndpoints, SnapshotRequest, job_outcome, purge_status, to_proto};

/// Job key of the purge.
pub(crate) const PURGE: &str = "purge";

/// Implements both services over one served replica.
#[derive(Debug)]
pub struct ReplicaGrpc<H> {
    host: Arc<H>,
    /// The data-protocol and sync-agent listeners, reported in every `ReplicaResponse`.
    served: ServedEndpoints,
}

impl<H> Clone for ReplicaGrpc<H> {
    fn clone(&self) -> Self {
        Self {
            host: self.host.clone(),
            served: self.served.clone(),
        }
    }
}

impl<H: ServedReplica> ReplicaGrpc<H> {
    /// Services for `host`, whose other listeners are `served`.
    pub fn new(host: Arc<H>, served: ServedEndpoints) -> Self {
        Self { host, served }
    }

    async fn reply(&self) -> Result<Response<v1::ReplicaResponse>, Status> {
        let host = self.host.clone();
        let s = blocking(move || host.status()).await?;
        Ok(Response::new(
            self.served.response(to_proto(&s, self.host.volume())),
        ))
    }

    /// Runs `f` on the blocking pool, then answers with the status.
    async fn with_host(
        &self,
        f: impl FnOnce(&H) -> Result<(), ReplicaError> + Send + 'static,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let host = self.host.clone();
        blocking(move || f(&host)).await?;
        self.reply().await
    }

    /// Runs `f` on the open replica on the blocking pool, then answers with the status.
    async fn with_chain(
        &self,
        f: impl FnOnce(&H::Chain) -> Result<(), ReplicaError> + Send + 'static,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_host(move |h| f(&*h.chain()?)).await
    }
}

#[tonic::async_trait]
impl<H: ServedReplica> ReplicaService for ReplicaGrpc<H> {
    async fn replica_create(
        &self,
        req: Request<v1::ReplicaCreateRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let req = req.into_inner();
        self.with_host(move |h| h.create(req.size, req.disable_revision_counter))
            .await
    }

    async fn replica_delete(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        let host = self.host.clone();
        blocking(move || host.delete()).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn replica_get(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.reply().await
    }

    async fn replica_open(
        &self,
        _: Request<v1::ReplicaOpenRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_host(H::open).await
    }

    async fn replica_close(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_host(H::close).await
    }

    async fn replica_reload(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_chain(H::Chain::reload).await
    }

    async fn replica_revert(
        &self,
        req: Request<v1::ReplicaRevertRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let req = req.into_inner();
        self.with_chain(move |r| r.revert(&req.name, &req.created)).await
    }

    async fn replica_snapshot(
        &self,
        req: Request<v1::ReplicaSnapshotRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let snap = SnapshotRequest::from_proto(req.into_inner());
        self.with_chain(move |r| r.snapshot(&snap)).await
    }

    async fn replica_expand(
        &self,
        req: Request<v1::ReplicaExpandRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let size = req.into_inner().size;
        self.with_chain(move |r| r.expand(size)).await
    }

    async fn disk_mark_as_removed(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let name = req.into_inner().name;
        self.with_chain(move |r| r.mark_removed(&name)).await
    }

    async fn rebuilding_set(
        &self,
        req: Request<v1::RebuildingSetRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let v = req.into_inner().rebuilding;
        self.with_chain(move |r| r.set_rebuilding(v)).await
    }

    async fn revision_counter_set(
        &self,
        req: Request<v1::RevisionCounterSetRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let v = req.into_inner().counter;
        self.with_chain(move |r| r.set_revision_counter(v)).await
    }
}

#[tonic::async_trait]
impl<H: ServedReplica> SyncAgentService for ReplicaGrpc<H> {
    async fn snapshot_purge(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        let replica = self.host.chain()?;
        self.host.purge_check()?;
        let Some(ctl) = self.host.jobs().start(PURGE) else {
            return Err(Status::failed_precondition("a purge is already running"));
        };
        if let Some(msg) = self.host.purge_refusal() {
            let refused = JobStatus {
                state: JobState::Error,
                error: msg.into(),
                ..Default::default()
            };
            self.host.jobs().finish(PURGE, refused);
            return Err(Status::failed_precondition(msg));
        }
        let host = self.host.clone();
        tokio::task::spawn_blocking(move || {
            let result = replica.purge(&ctl);
            if let Err(e) = &result
                && !matches!(e, ReplicaError::Cancelled)
            {
                error!(volume = host.volume(), error = %e, "purge failed");
            }
            host.jobs().finish(PURGE, job_outcome(&result));
        });
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_purge_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::SnapshotPurgeStatusResponse>, Status> {
        Ok(Response::new(purge_status(self.host.jobs().status(PURGE))))
    }

    async fn snapshot_hash(
        &self,
        req: Request<v1::SnapshotHashRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let req = req.into_inner();
        let replica = self.host.chain()?;
        crate::hash::start_job(
            self.host.clone(),
            H::jobs,
            &req.snapshot_name,
            move |file, ctl| replica.hash_snapshot(file, req.rehash, ctl),
        )?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_hash_status(
        &self,
        req: Request<v1::SnapshotHashStatusRequest>,
    ) -> Result<Response<v1::SnapshotHashStatusResponse>, Status> {
        let name = req.into_inner().snapshot_name;
        Ok(Response::new(crate::hash::job_status(self.host.jobs(), &name)?))
    }

    async fn snapshot_hash_cancel(
        &self,
        req: Request<v1::SnapshotHashStatusRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        crate::hash::cancel_job(self.host.jobs(), &req.into_inner().snapshot_name)?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn files_sync(&self, req: Request<v1::FilesSyncRequest>) -> Result<Response<v1::Empty>, Status> {
        if self.host.clones().is_running() {
            return Err(Status::failed_precondition(
                "a clone is running on this replica; rebuild after it finishes",
            ));
        }
        // The engine's generation goes on to the sources: one that accepted a newer engine refuses to serve it.
        let generation = corral_proto::engine_generation::of_request(req.metadata())?.unwrap_or(0);
        self.host.start_rebuild(req.into_inner(), generation).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn replica_rebuild_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.host.rebuild().to_proto()))
    }

    async fn file_send(
        &self,
        req: Request<v1::FileSendRequest>,
    ) -> Result<Response<v1::FileSendResponse>, Status> {
        Ok(Response::new(self.host.file_send(req.into_inner()).await?))
    }

    async fn volume_export(
        &self,
        req: Request<v1::VolumeExportRequest>,
    ) -> Result<Response<v1::VolumeExportResponse>, Status> {
        let export = ExportRequest::from_proto(req.into_inner())?;
        let s = self.host.volume_export(export).await?;
        Ok(Response::new(v1::VolumeExportResponse {
            bytes_sent: s.bytes_sent,
            data_bytes: s.data_bytes,
            size: s.size,
        }))
    }

    type LocalFilesStream = LocalFilesStream;

    async fn local_files(
        &self,
        req: Request<v1::LocalFilesRequest>,
    ) -> Result<Response<Self::LocalFilesStream>, Status> {
        Ok(Response::new(self.host.local_files(req.into_inner()).await?))
    }

    async fn snapshot_clone(
        &self,
        req: Request<v1::SnapshotCloneRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let req = CloneRequest::from_proto(req.into_inner())?;
        self.host.start_clone(req).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_clone_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.host.clones().status().to_proto()))
    }
}
