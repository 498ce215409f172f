//! One hosted v2 replica as a network service: the data protocol ([`BlockBackend`]), gRPC `ReplicaService` and
//! gRPC `SyncAgentService`, answering as a v1 replica does, so the engine's code paths are the same for both.
//! Purge, rebuild (both ends, [`super::rebuild`]), snapshot hashing ([`super::hash`]), export and clone (both
//! ends, [`super::clone`]) work; `LocalFiles` answers `UNIMPLEMENTED` (a clone or rebuild then takes the network
//! path).

use std::ops::Range;
use std::sync::Arc;

use corral_proto::v1::{
    self, replica_service_server::ReplicaService, sync_agent_service_server::SyncAgentService,
};
use data_protocol::{BackendError, BlockBackend, ErrorKind as WireKind, VolumeInfo};
use tonic::{Request, Response, Status};

use super::lvol::LvolReplica;
use crate::error::ReplicaError;
use crate::jobs::JobTable;
use crate::model::{
    SECTOR_SIZE, ServedEndpoints, SnapshotRequest, generation_unreadable, job_outcome, purge_status,
    to_proto, wire_error,
};

const PURGE: &str = "purge";

/// What a hosted replica is served with.
#[derive(Debug)]
pub struct V2Replica {
    pub replica: Arc<LvolReplica>,
    pub jobs: JobTable,
    /// Ports of the control, data and sync listeners (recorded in the head at create).
    pub ports: [u16; 3],
    /// The rebuild into this replica.
    pub rebuild: Arc<crate::rebuild::RebuildTracker>,
    /// The clone into this replica.
    pub clone: Arc<crate::clone::CloneTracker>,
    /// Address rebuild receivers bind to (the daemon's IP).
    pub listen_ip: std::net::IpAddr,
    /// Directory for a rebuild's staging files.
    pub scratch: std::path::PathBuf,
    /// Cancelled when the replica stops being served.
    pub cancel: tokio_util::sync::CancellationToken,
}

impl BlockBackend for V2Replica {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        if !self.replica.is_open() {
            return Err(BackendError::new(
                WireKind::Unavailable,
                format!("replica {} is not open", self.replica.name()),
            ));
        }
        Ok(VolumeInfo {
            size: self.replica.size(),
            sector_size: u32::try_from(SECTOR_SIZE).unwrap_or(512),
            name: self.replica.name().to_owned(),
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.replica.read_at(offset, buf).map_err(|e| wire_error(&e))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError> {
        self.replica.write_at(offset, buf).map_err(|e| wire_error(&e))
    }

    fn read_at_nowait(&self, offset: u64, buf: &mut [u8]) -> Result<bool, BackendError> {
        self.replica
            .read_at_nowait(offset, buf)
            .map_err(|e| wire_error(&e))
    }

    fn write_at_nowait(&self, offset: u64, buf: &[u8]) -> Result<bool, BackendError> {
        self.replica
            .write_at_nowait(offset, buf)
            .map_err(|e| wire_error(&e))
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.replica.unmap(offset, len).map_err(|e| wire_error(&e))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.replica.write_zeroes(offset, len).map_err(|e| wire_error(&e))
    }

    fn flush(&self) -> Result<(), BackendError> {
        self.replica.flush().map_err(|e| wire_error(&e))
    }

    fn flush_at_pool(&self) -> bool {
        self.replica.flush_would_journal()
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>, BackendError> {
        self.replica
            .allocated_ranges(offset, len)
            .map_err(|e| wire_error(&e))
    }

    fn generation(&self) -> Result<u64, BackendError> {
        self.replica
            .engine_generation()
            .map_err(|e| generation_unreadable(&e))
    }

    fn record_generation(&self, generation: u64) -> Result<(), BackendError> {
        self.replica
            .set_engine_generation(generation)
            .map_err(|e| wire_error(&e))
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ReplicaError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("task failed: {e}")))?
        .map_err(Status::from)
}

fn not_yet(what: &str) -> Status {
    Status::unimplemented(format!(
        "{what} is not built for v2 (lvstore) replicas yet (issue 20); use a v1 replica for it"
    ))
}

/// `ReplicaService` and `SyncAgentService` of one hosted replica.
#[derive(Debug, Clone)]
pub struct V2Grpc {
    host: Arc<V2Replica>,
    served: ServedEndpoints,
}

impl V2Grpc {
    pub fn new(host: Arc<V2Replica>, served: ServedEndpoints) -> Self {
        Self { host, served }
    }

    async fn reply(&self) -> Result<Response<v1::ReplicaResponse>, Status> {
        let r = self.host.replica.clone();
        let s = blocking(move || r.status()).await?;
        Ok(Response::new(
            self.served.response(to_proto(&s, self.host.replica.name())),
        ))
    }

    async fn with_replica(
        &self,
        f: impl FnOnce(&LvolReplica) -> Result<(), ReplicaError> + Send + 'static,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let r = self.host.replica.clone();
        blocking(move || f(&r)).await?;
        self.reply().await
    }
}

#[tonic::async_trait]
impl ReplicaService for V2Grpc {
    async fn replica_create(
        &self,
        req: Request<v1::ReplicaCreateRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        let req = req.into_inner();
        let ports = self.host.ports;
        self.with_replica(move |r| r.create(req.size, req.disable_revision_counter, ports))
            .await
    }

    async fn replica_delete(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        let r = self.host.replica.clone();
        blocking(move || r.delete()).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn replica_get(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.reply().await
    }

    async fn replica_open(
        &self,
        _: Request<v1::ReplicaOpenRequest>,
    ) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_replica(LvolReplica::open).await
    }

    async fn replica_close(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        self.with_replica(LvolReplica::close).await
    }

    async fn replica_reload(&self, _: Request<v1::Empty>) -> Result<Response<v1::ReplicaResponse>, Status> {
        // Nothing is cached beyond the head id, which every shape change keeps current.
        self.reply().await
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
impl SyncAgentService for V2Grpc {
    async fn snapshot_purge(&self, _: Request<v1::Empty>) -> Result<Response<v1::Empty>, Status> {
        let r = self.host.replica.clone();
        if !r.is_open() {
            return Err(Status::failed_precondition(format!(
                "replica {} is not open",
                r.name()
            )));
        }
        let Some(ctl) = self.host.jobs.start(PURGE) else {
            return Err(Status::failed_precondition("a purge is already running"));
        };
        let host = self.host.clone();
        tokio::task::spawn_blocking(move || {
            host.jobs.finish(PURGE, job_outcome(&r.purge(&ctl)));
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
        let r = self.host.replica.clone();
        crate::hash::start_job(
            self.host.clone(),
            |h| &h.jobs,
            &req.snapshot_name,
            move |file, ctl| super::hash::hash_snapshot(&r, file, req.rehash, ctl),
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
        let h = &self.host;
        if h.clone.is_running() {
            return Err(Status::failed_precondition(
                "a clone is running on this replica; rebuild after it finishes",
            ));
        }
        super::rebuild::start(
            h.replica.clone(),
            h.rebuild.clone(),
            (h.listen_ip, h.scratch.clone()),
            req.into_inner(),
            h.cancel.child_token(),
        )
        .await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn replica_rebuild_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.host.rebuild.to_proto()))
    }

    async fn file_send(
        &self,
        req: Request<v1::FileSendRequest>,
    ) -> Result<Response<v1::FileSendResponse>, Status> {
        Ok(Response::new(
            super::rebuild::file_send(self.host.replica.clone(), &req.into_inner()).await?,
        ))
    }

    async fn volume_export(
        &self,
        req: Request<v1::VolumeExportRequest>,
    ) -> Result<Response<v1::VolumeExportResponse>, Status> {
        let req = req.into_inner();
        let export = crate::export::ExportRequest::from_proto(req)?;
        let s = super::clone::volume_export(self.host.replica.clone(), &export).await?;
        Ok(Response::new(v1::VolumeExportResponse {
            bytes_sent: s.bytes_sent,
            data_bytes: s.data_bytes,
            size: s.size,
        }))
    }

    async fn snapshot_clone(
        &self,
        req: Request<v1::SnapshotCloneRequest>,
    ) -> Result<Response<v1::Empty>, Status> {
        let req = crate::clone::CloneRequest::from_proto(req.into_inner())?;
        let h = &self.host;
        let target = super::clone::CloneTarget {
            replica: h.replica.clone(),
            clone: h.clone.clone(),
            rebuild_running: h.rebuild.to_proto().is_running,
            listen_ip: h.listen_ip,
            scratch: h.scratch.clone(),
            cancel: h.cancel.clone(),
        };
        super::clone::start(target, req).await?;
        Ok(Response::new(v1::Empty {}))
    }

    type LocalFilesStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<v1::LocalFilesResponse, Status>> + Send + 'static>,
    >;

    /// A v2 replica's snapshots are lvols inside the lvstore, not files a receiver could open: the receiver falls
    /// back to the network path.
    async fn local_files(
        &self,
        _: Request<v1::LocalFilesRequest>,
    ) -> Result<Response<Self::LocalFilesStream>, Status> {
        Err(not_yet("local snapshot files"))
    }

    async fn snapshot_clone_status(
        &self,
        _: Request<v1::Empty>,
    ) -> Result<Response<v1::JobStatusResponse>, Status> {
        Ok(Response::new(self.host.clone.status().to_proto()))
    }
}
