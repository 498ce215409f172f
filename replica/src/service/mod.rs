//! The replica as a network service, written once for both replica kinds: [`grpc::ReplicaGrpc`] serves gRPC
//! `ReplicaService` and `SyncAgentService` over any [`ServedReplica`] — the file-chain replica
//! ([`file_chain::FileChainReplica`], over a [`crate::host::ReplicaHost`]) or the lvol replica
//! ([`crate::v2::service::V2Replica`]). Both kinds share the vocabulary of [`crate::model`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use corral_proto::v1;
use tonic::Status;

use crate::Result;
use crate::clone::{CloneRequest, CloneTracker};
use crate::export::{ExportRequest, ExportSummary};
use crate::hash::HashOutcome;
use crate::jobs::{JobControl, JobTable};
use crate::model::{ReplicaStatus, SnapshotRequest};
use crate::rebuild::RebuildTracker;

pub mod file_chain;
pub mod grpc;

/// Runs blocking replica work off the reactor.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("task failed: {e}")))?
        .map_err(Status::from)
}

/// The stream `LocalFiles` answers with.
pub type LocalFilesStream =
    Pin<Box<dyn futures::Stream<Item = Result<v1::LocalFilesResponse, Status>> + Send + 'static>>;

/// What the services call on an open replica: the operations the file-chain replica ([`crate::Replica`]) and the
/// lvol replica ([`crate::v2::lvol::LvolReplica`]) both offer, with one meaning.
pub trait ReplicaChain: Send + Sync + 'static {
    /// Takes a snapshot of the head (the head becomes its child).
    fn snapshot(&self, req: &SnapshotRequest) -> Result<()>;
    /// Makes a new empty head over snapshot `name`.
    fn revert(&self, name: &str, created: &str) -> Result<()>;
    /// Grows the volume to `size` bytes.
    fn expand(&self, size: u64) -> Result<()>;
    /// Marks snapshot `name` removed (a purge deletes it).
    fn mark_removed(&self, name: &str) -> Result<()>;
    /// Sets the rebuilding flag.
    fn set_rebuilding(&self, rebuilding: bool) -> Result<()>;
    /// Sets the revision counter.
    fn set_revision_counter(&self, counter: u64) -> Result<()>;
    /// Re-reads what a rebuild changed underneath (a no-op where nothing is cached).
    fn reload(&self) -> Result<()>;
    /// Deletes or merges the snapshots marked removed.
    fn purge(&self, ctl: &JobControl) -> Result<()>;
    /// Checksums snapshot `file` (reusing a recorded checksum unless `rehash`).
    fn hash_snapshot(&self, file: &str, rehash: bool, ctl: &JobControl) -> Result<HashOutcome>;
}

/// One replica as its daemon serves it: its lifecycle and jobs, and the entry points of the jobs whose work
/// differs by kind (rebuild, clone, export, local files). Generic, not `dyn`: each daemon serves one kind.
pub trait ServedReplica: Send + Sync + Sized + 'static {
    /// The open replica.
    type Chain: ReplicaChain;

    /// The volume name reported with the status.
    fn volume(&self) -> &str;
    /// Status of the replica, open or not.
    fn status(&self) -> Result<ReplicaStatus>;
    /// Creates the replica (none may exist) and opens it.
    fn create(&self, size: u64, disable_revision_counter: bool) -> Result<()>;
    /// Opens the replica (a no-op when open).
    fn open(&self) -> Result<()>;
    /// Closes the replica cleanly (a no-op when closed).
    fn close(&self) -> Result<()>;
    /// Closes and deletes the replica.
    fn delete(&self) -> Result<()>;
    /// The replica the shape operations act on.
    fn chain(&self) -> Result<Arc<Self::Chain>>;
    /// Long-running jobs: purge and hashes.
    fn jobs(&self) -> &JobTable;
    /// The rebuild into this replica.
    fn rebuild(&self) -> &RebuildTracker;
    /// The clone into this replica.
    fn clones(&self) -> &CloneTracker;
    /// Refuses a purge before it is registered (e.g. a replica not open, an export running).
    fn purge_check(&self) -> Result<(), Status>;
    /// Refuses a purge after it is registered, so that a job starting meanwhile sees the purge: the reason.
    fn purge_refusal(&self) -> Option<&'static str> {
        None
    }
    /// Starts the rebuild into this replica (`FilesSync`), presenting the calling engine's `generation` (0: none) to
    /// its sources.
    fn start_rebuild(
        self: &Arc<Self>,
        req: v1::FilesSyncRequest,
        generation: u64,
    ) -> impl Future<Output = Result<(), Status>> + Send;
    /// Sends one snapshot to a rebuilding replica (`FileSend`).
    fn file_send(
        self: &Arc<Self>,
        req: v1::FileSendRequest,
    ) -> impl Future<Output = Result<v1::FileSendResponse, Status>> + Send;
    /// Sends a snapshot to a receiver (`VolumeExport`).
    fn volume_export(
        self: &Arc<Self>,
        req: ExportRequest,
    ) -> impl Future<Output = Result<ExportSummary, Status>> + Send;
    /// Lists the snapshot files a receiver on this host may copy directly (`LocalFiles`).
    fn local_files(
        self: &Arc<Self>,
        req: v1::LocalFilesRequest,
    ) -> impl Future<Output = Result<LocalFilesStream, Status>> + Send;
    /// Starts the clone into this replica (`SnapshotClone`).
    fn start_clone(self: &Arc<Self>, req: CloneRequest) -> impl Future<Output = Result<(), Status>> + Send;
}
