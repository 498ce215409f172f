//! gRPC `ReplicaService` (the control listener) and `SyncAgentService` (the sync listener). Blocking replica work runs on the blocking
//! pool; long jobs (purge, hash) run in the background and report through their status RPCs.

use std::sync::Arc;

use corral_proto::v1::{
    self, replica_service_server::ReplicaService, sync_agent_service_server::SyncAgentService,
};
use tonic::{Request, Response, Status};
use tracing::error;

use crate::clone::CloneRequest;
use crate::error::ReplicaError;
use crate::export::ExportRequest;
use crate::host::ReplicaHost;
use crate::jobs::{JobState, JobStatus};
use crate::model::{ServedEndpoints, SnapshotRequest, job_outcome, purge_status, to_proto};

/// Job key of the purge.
pub(crate) const PURGE: &str = "purge";

/// Runs blocking replica work off the reactor.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ReplicaError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("task failed: {e}")))?
        .map_err(Status::from)
}

/// Implements both services over one [`ReplicaHost`].
#[derive(Debug, Clone)]
pub struct ReplicaGrpc {
    host: Arc<ReplicaHost>,
    rebuild: Arc<crate::rebuild::RebuildTracker>,
    clone: Arc<crate::clone::CloneTracker>,
    exports: Arc<crate::export::ExportTracker>,
    /// Address sparse-sync receivers bind to (the daemon's listen IP).
    listen_ip: std::net::IpAddr,
    /// Clone and rebuild copy a source's files directly when it is on this host ([`crate::local_copy`]).
    local_copy: bool,
    /// The data protocol's counters: a rebuild's local copy backs off while this replica serves foreground IO.
    foreground: Option<Arc<data_protocol::ServerMetrics>>,
    /// The data-protocol and sync-agent listeners, reported in every `ReplicaResponse`.
    served: ServedEndpoints,
    cancel: tokio_util::sync::CancellationToken,
}

impl ReplicaGrpc {
    /// Services for `host`; rebuild receivers bind on `listen_ip`; jobs stop on `cancel`.
    pub fn new(
        host: Arc<ReplicaHost>,
        listen_ip: std::net::IpAddr,
        served: ServedEndpoints,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Self {
        Self {
            host,
            rebuild: Arc::default(),
            clone: Arc::default(),
            exports: Arc::default(),
            listen_ip,
            local_copy: true,
            foreground: None,
            served,
            cancel,
        }
    }

    /// Whether clone and rebuild may copy a source's files directly when it is on this host (default: yes).
    #[must_use]
    pub fn with_local_copy(mut self, enabled: bool) -> Self {
        self.local_copy = enabled;
        self
    }

    /// The data-protocol server whose requests count as foreground IO for a rebuild's `busy_bytes_per_second`.
    #[must_use]
    pub fn with_foreground_io(mut self, metrics: Arc<data_protocol::ServerMetrics>) -> Self {
        self.foreground = Some(metrics);
        self
    }

    async fn reply(&self) -> Result<Response<v1::ReplicaResponse>, Status> {
        let host = self.host.clone();
        let s = blocking(move || host.status()).await?;
        Ok(Response::new(
            self.served.response(to_proto(&s, self.host.volume())),
        ))
    }

    async fn with_replica(
        &self,
        f: impl FnOnce(&crate::Replica) -> Result<(), ReplicaError> + Send + 'static,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let host = self.host.clone();
        blocking(move || f(&*host.replica()?)).await?;
        self.reply().await
    }
}

#[tonic::async_trait]
impl ReplicaService for ReplicaGrpc {
    async fn replica_create(
        &self,
        req: Request<v1::ReplicaCreateRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let req = req.into_inner();
        let host = self.host.clone();
        blocking(move || host.create(req.size, req.disable_revision_counter).map(drop)).await?;
        self.reply().await
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
        let host = self.host.clone();
        blocking(move || host.open().map(drop)).await?;
        self.reply().await
    }

    async fn replica_close(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        let host = self.host.clone();
        blocking(move || host.close()).await?;
        self.reply().await
    }

    async fn replica_reload(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_replica(crate::Replica::reload).await
    }

    async fn replica_revert(
        &self,
        req: Request<v1::ReplicaRevertRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let req = req.into_inner();
        self.with_replica(move |r| r.revert(&req.name, &req.created))
            .await
    }

    async fn replica_snapshot(
        &self,
        req: Request<v1::ReplicaSnapshotRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let snap = SnapshotRequest::from_proto(req.into_inner());
        self.with_replica(move |r| r.snapshot(&snap)).await
    }

    async fn replica_expand(
        &self,
        req: Request<v1::ReplicaExpandRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let size = req.into_inner().size;
        self.with_replica(move |r| r.expand(size)).await
    }

    async fn disk_mark_as_removed(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let name = req.into_inner().name;
        self.with_replica(move |r| r.mark_removed(&name)).await
    }

    async fn rebuilding_set(
        &self,
        req: Request<v1::RebuildingSetRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let v = req.into_inner().rebuilding;
        self.with_replica(move |r| r.set_rebuilding(v)).await
    }

    async fn revision_counter_set(
        &self,
        req: Request<v1::RevisionCounterSetRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let v = req.into_inner().counter;
        self.with_replica(move |r| r.set_revision_counter(v)).await
    }
}

#[tonic::async_trait]
impl SyncAgentService for ReplicaGrpc {
    async fn snapshot_purge(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        let replica = self.host.replica()?;
        let host = self.host.clone();
        if self.exports.running() > 0 {
            return Err(Status::failed_precondition(
                "a snapshot export is running; purge after it finishes",
            ));
        }
        let Some(ctl) = host.jobs.start(PURGE) else {
            return Err(Status::failed_precondition("a purge is already running"));
        };
        // Checked after the purge is registered: a backup starting now sees it (and a running one is seen here).
        if host.backups_running.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            let msg = "a backup is running; purge after it finishes";
            host.jobs.finish(
                PURGE,
                JobStatus {
                    state: JobState::Error,
                    error: msg.into(),
                    ..Default::default()
                },
            );
            return Err(Status::failed_precondition(msg));
        }
        tokio::task::spawn_blocking(move || {
            let result = replica.purge(&ctl);
            if let Err(e) = &result
                && !matches!(e, ReplicaError::Cancelled)
            {
                error!(dir = %replica.dir().display(), error = %e, "purge failed");
            }
            host.jobs.finish(PURGE, job_outcome(&result));
        });
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_purge_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::SnapshotPurgeStatusResponse>, Status> {
        Ok(Response::new(purge_status(self.host.jobs.status(PURGE))))
    }

    async fn snapshot_hash(
        &self,
        req: Request<v1::SnapshotHashRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let req = req.into_inner();
        let replica = self.host.replica()?;
        crate::hash::start_job(
            self.host.clone(),
            |h| &h.jobs,
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
        Ok(Response::new(crate::hash::job_status(&self.host.jobs, &name)?))
    }

    async fn snapshot_hash_cancel(
        &self,
        req: Request<v1::SnapshotHashStatusRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        crate::hash::cancel_job(&self.host.jobs, &req.into_inner().snapshot_name)?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn files_sync(&self, req: Request<v1::FilesSyncRequest>) -> Result<Response<v1::Empty>, Status> {
        if self.clone.is_running() {
            return Err(Status::failed_precondition(
                "a clone is running on this replica; rebuild after it finishes",
            ));
        }
        crate::rebuild::start(
            self.host.clone(),
            self.rebuild.clone(),
            self.listen_ip,
            (self.local_copy, self.foreground.clone()),
            req.into_inner(),
            self.cancel.child_token(),
        )
        .await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn replica_rebuild_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.rebuild.to_proto()))
    }

    async fn file_send(
        &self,
        req: Request<v1::FileSendRequest>,
    ) -> Result<Response<v1::FileSendResponse>, Status> {
        Ok(Response::new(
            crate::rebuild::file_send(&self.host, &req.into_inner()).await?,
        ))
    }

    async fn volume_export(
        &self,
        req: Request<v1::VolumeExportRequest>,
    ) -> Result<Response<v1::VolumeExportResponse>, Status> {
        let export = ExportRequest::from_proto(req.into_inner())?;
        let host = &self.host;
        let purging = || host.jobs.status(PURGE).state == JobState::InProgress;
        let s = crate::export::volume_export(host.replica()?, &self.exports, purging, &export).await?;
        Ok(Response::new(v1::VolumeExportResponse {
            bytes_sent: s.bytes_sent,
            data_bytes: s.data_bytes,
            size: s.size,
        }))
    }

    type LocalFilesStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<v1::LocalFilesResponse, Status>> + Send + 'static>,
    >;

    async fn local_files(
        &self,
        req: Request<v1::LocalFilesRequest>,
    ) -> Result<Response<Self::LocalFilesStream>, Status> {
        use futures::StreamExt;
        let req = req.into_inner();
        let purging = self.host.jobs.status(PURGE).state == JobState::InProgress;
        // Held until the receiver closes the stream (or this daemon stops): no purge changes the listed files.
        let lease = self.exports.lease(purging)?;
        let replica = self.host.replica()?;
        let listing = blocking(move || crate::local_copy::list(&replica, &req)).await?;
        let cancel = self.cancel.clone();
        let held = futures::stream::once(async move {
            cancel.cancelled().await;
            drop(lease);
            Err(Status::unavailable("the source replica is stopping"))
        });
        Ok(Response::new(
            futures::stream::once(async move { Ok(listing) })
                .chain(held)
                .boxed(),
        ))
    }

    async fn snapshot_clone(
        &self,
        req: Request<v1::SnapshotCloneRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let req = CloneRequest::from_proto(req.into_inner())?;
        crate::clone::start(
            self.host.replica()?,
            self.clone.clone(),
            self.rebuild.to_proto().is_running,
            self.listen_ip,
            self.local_copy,
            req,
            self.cancel.child_token(),
        )
        .await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn snapshot_clone_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.clone.status().to_proto()))
    }
}
