//! One hosted v2 replica as a network service: the data protocol ([`BlockBackend`]), and the [`ServedReplica`]
//! that `crate::service::grpc` serves as gRPC `ReplicaService` and `SyncAgentService` for v1 and v2 alike, so the
//! engine's code paths are the same for both.
//! Purge, rebuild (both ends, [`super::rebuild`]), snapshot hashing ([`super::hash`]), export and clone (both
//! ends, [`super::clone`]) work; `LocalFiles` answers `UNIMPLEMENTED` (a clone or rebuild then takes the network
//! path).

use std::ops::Range;
use std::sync::Arc;

use corral_proto::v1;
use data_protocol::{BackendError, BlockBackend, ErrorKind as WireKind, VolumeInfo};
use tonic::Status;

use super::lvol::LvolReplica;
use crate::Result;
use crate::clone::{CloneRequest, CloneTracker};
use crate::export::{ExportRequest, ExportSummary};
use crate::hash::HashOutcome;
use crate::jobs::{JobControl, JobTable};
use crate::model::{ReplicaStatus, SECTOR_SIZE, SnapshotRequest, generation_unreadable, wire_error};
use crate::rebuild::RebuildTracker;
use crate::service::{LocalFilesStream, ReplicaChain, ServedReplica};

/// What a hosted replica is served with.
#[derive(Debug)]
pub struct V2Replica {
    pub replica: Arc<LvolReplica>,
    pub jobs: JobTable,
    /// Ports of the control, data and sync listeners (recorded in the head at create).
    pub ports: [u16; 3],
    /// The rebuild into this replica.
    pub rebuild: Arc<RebuildTracker>,
    /// The clone into this replica.
    pub clone: Arc<CloneTracker>,
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

fn not_yet(what: &str) -> Status {
    Status::unimplemented(format!(
        "{what} is not built for v2 (lvstore) replicas yet (issue 20); use a v1 replica for it"
    ))
}

impl ServedReplica for V2Replica {
    type Chain = LvolReplica;

    fn volume(&self) -> &str {
        self.replica.name()
    }

    fn status(&self) -> Result<ReplicaStatus> {
        self.replica.status()
    }

    fn create(&self, size: u64, disable_revision_counter: bool) -> Result<()> {
        self.replica.create(size, disable_revision_counter, self.ports)
    }

    fn open(&self) -> Result<()> {
        self.replica.open()
    }

    fn close(&self) -> Result<()> {
        self.replica.close()
    }

    fn delete(&self) -> Result<()> {
        self.replica.delete()
    }

    /// The lvol replica itself: each of its operations checks that it is open.
    fn chain(&self) -> Result<Arc<LvolReplica>> {
        Ok(self.replica.clone())
    }

    fn jobs(&self) -> &JobTable {
        &self.jobs
    }

    fn rebuild(&self) -> &RebuildTracker {
        &self.rebuild
    }

    fn clones(&self) -> &CloneTracker {
        &self.clone
    }

    fn purge_check(&self) -> Result<(), Status> {
        if self.replica.is_open() {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "replica {} is not open",
                self.replica.name()
            )))
        }
    }

    async fn start_rebuild(
        self: &Arc<Self>,
        req: v1::FilesSyncRequest,
        generation: u64,
    ) -> Result<(), Status> {
        super::rebuild::start(
            self.replica.clone(),
            self.rebuild.clone(),
            (self.listen_ip, self.scratch.clone()),
            (req, generation),
            self.cancel.child_token(),
        )
        .await
        .map_err(Status::from)
    }

    async fn file_send(self: &Arc<Self>, req: v1::FileSendRequest) -> Result<v1::FileSendResponse, Status> {
        Ok(super::rebuild::file_send(self.replica.clone(), &req).await?)
    }

    async fn volume_export(self: &Arc<Self>, req: ExportRequest) -> Result<ExportSummary, Status> {
        Ok(super::clone::volume_export(self.replica.clone(), &req).await?)
    }

    /// A v2 replica's snapshots are lvols inside the lvstore, not files a receiver could open: the receiver falls
    /// back to the network path.
    async fn local_files(self: &Arc<Self>, _: v1::LocalFilesRequest) -> Result<LocalFilesStream, Status> {
        Err(not_yet("local snapshot files"))
    }

    async fn start_clone(self: &Arc<Self>, req: CloneRequest) -> Result<(), Status> {
        let target = super::clone::CloneTarget {
            replica: self.replica.clone(),
            clone: self.clone.clone(),
            rebuild_running: self.rebuild.to_proto().is_running,
            listen_ip: self.listen_ip,
            scratch: self.scratch.clone(),
            cancel: self.cancel.clone(),
        };
        Ok(super::clone::start(target, req).await?)
    }
}

impl ReplicaChain for LvolReplica {
    fn snapshot(&self, req: &SnapshotRequest) -> Result<()> {
        LvolReplica::snapshot(self, req)
    }

    fn revert(&self, name: &str, created: &str) -> Result<()> {
        LvolReplica::revert(self, name, created)
    }

    fn expand(&self, size: u64) -> Result<()> {
        LvolReplica::expand(self, size)
    }

    fn mark_removed(&self, name: &str) -> Result<()> {
        LvolReplica::mark_removed(self, name)
    }

    fn set_rebuilding(&self, rebuilding: bool) -> Result<()> {
        LvolReplica::set_rebuilding(self, rebuilding)
    }

    fn set_revision_counter(&self, counter: u64) -> Result<()> {
        LvolReplica::set_revision_counter(self, counter)
    }

    /// Nothing is cached beyond the head id, which every shape change keeps current.
    fn reload(&self) -> Result<()> {
        Ok(())
    }

    fn purge(&self, ctl: &JobControl) -> Result<()> {
        LvolReplica::purge(self, ctl)
    }

    fn hash_snapshot(&self, file: &str, rehash: bool, ctl: &JobControl) -> Result<HashOutcome> {
        super::hash::hash_snapshot(self, file, rehash, ctl)
    }
}
