//! The file-chain (v1) replica as a [`ServedReplica`]: a [`ReplicaHost`] and what its jobs need (rebuild and
//! clone trackers, the running exports, the listen address, the local-copy switch, the data server's counters).

use std::sync::Arc;

use corral_proto::v1;
use futures::StreamExt;
use tonic::Status;

use super::grpc::PURGE;
use super::{LocalFilesStream, ReplicaChain, ServedReplica, blocking};
use crate::Result;
use crate::clone::{CloneRequest, CloneTracker};
use crate::export::{ExportRequest, ExportSummary, ExportTracker};
use crate::hash::HashOutcome;
use crate::host::ReplicaHost;
use crate::jobs::{JobControl, JobState, JobTable};
use crate::model::{ReplicaStatus, SnapshotRequest};
use crate::rebuild::RebuildTracker;
use crate::replica::Replica;

/// A v1 replica directory as its daemon serves it.
#[derive(Debug)]
pub struct FileChainReplica {
    host: Arc<ReplicaHost>,
    rebuild: Arc<RebuildTracker>,
    clone: Arc<CloneTracker>,
    exports: Arc<ExportTracker>,
    /// Address sparse-sync receivers bind to (the daemon's listen IP).
    listen_ip: std::net::IpAddr,
    /// Clone and rebuild copy a source's files directly when it is on this host ([`crate::local_copy`]).
    local_copy: bool,
    /// The data protocol's counters: a rebuild's local copy backs off while this replica serves foreground IO.
    foreground: Option<Arc<data_protocol::ServerMetrics>>,
    cancel: tokio_util::sync::CancellationToken,
}

impl FileChainReplica {
    /// Serves `host`; rebuild receivers bind on `listen_ip`; jobs stop on `cancel`.
    pub fn new(
        host: Arc<ReplicaHost>,
        listen_ip: std::net::IpAddr,
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

    fn purging(&self) -> bool {
        self.host.jobs.status(PURGE).state == JobState::InProgress
    }
}

impl ServedReplica for FileChainReplica {
    type Chain = Replica;

    fn volume(&self) -> &str {
        self.host.volume()
    }

    fn status(&self) -> Result<ReplicaStatus> {
        self.host.status()
    }

    fn create(&self, size: u64, disable_revision_counter: bool) -> Result<()> {
        self.host.create(size, disable_revision_counter).map(drop)
    }

    fn open(&self) -> Result<()> {
        self.host.open().map(drop)
    }

    fn close(&self) -> Result<()> {
        self.host.close()
    }

    fn delete(&self) -> Result<()> {
        self.host.delete()
    }

    fn chain(&self) -> Result<Arc<Replica>> {
        self.host.replica()
    }

    fn jobs(&self) -> &JobTable {
        &self.host.jobs
    }

    fn rebuild(&self) -> &RebuildTracker {
        &self.rebuild
    }

    fn clones(&self) -> &CloneTracker {
        &self.clone
    }

    fn purge_check(&self) -> Result<(), Status> {
        if self.exports.running() > 0 {
            return Err(Status::failed_precondition(
                "a snapshot export is running; purge after it finishes",
            ));
        }
        Ok(())
    }

    /// Checked after the purge is registered: a backup starting now sees it (and a running one is seen here).
    fn purge_refusal(&self) -> Option<&'static str> {
        (self
            .host
            .backups_running
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0)
        .then_some("a backup is running; purge after it finishes")
    }

    async fn start_rebuild(
        self: &Arc<Self>,
        req: v1::FilesSyncRequest,
        generation: u64,
    ) -> Result<(), Status> {
        crate::rebuild::start(
            self.host.clone(),
            self.rebuild.clone(),
            self.listen_ip,
            (self.local_copy, self.foreground.clone()),
            (req, generation),
            self.cancel.child_token(),
        )
        .await
        .map_err(Status::from)
    }

    async fn file_send(self: &Arc<Self>, req: v1::FileSendRequest) -> Result<v1::FileSendResponse, Status> {
        Ok(crate::rebuild::file_send(&self.host, &req).await?)
    }

    async fn volume_export(self: &Arc<Self>, req: ExportRequest) -> Result<ExportSummary, Status> {
        let purging = || self.purging();
        Ok(crate::export::volume_export(self.host.replica()?, &self.exports, purging, &req).await?)
    }

    async fn local_files(self: &Arc<Self>, req: v1::LocalFilesRequest) -> Result<LocalFilesStream, Status> {
        // Held until the receiver closes the stream (or this daemon stops): no purge changes the listed files.
        let lease = self.exports.lease(self.purging())?;
        let replica = self.host.replica()?;
        let listing = blocking(move || crate::local_copy::list(&replica, &req)).await?;
        let cancel = self.cancel.clone();
        let held = futures::stream::once(async move {
            cancel.cancelled().await;
            drop(lease);
            Err(Status::unavailable("the source replica is stopping"))
        });
        Ok(futures::stream::once(async move { Ok(listing) })
            .chain(held)
            .boxed())
    }

    async fn start_clone(self: &Arc<Self>, req: CloneRequest) -> Result<(), Status> {
        crate::clone::start(
            self.host.replica()?,
            self.clone.clone(),
            self.rebuild.to_proto().is_running,
            self.listen_ip,
            self.local_copy,
            req,
            self.cancel.child_token(),
        )
        .await
        .map_err(Status::from)
    }
}

impl ReplicaChain for Replica {
    fn snapshot(&self, req: &SnapshotRequest) -> Result<()> {
        Replica::snapshot(self, req)
    }

    fn revert(&self, name: &str, created: &str) -> Result<()> {
        Replica::revert(self, name, created)
    }

    fn expand(&self, size: u64) -> Result<()> {
        Replica::expand(self, size)
    }

    fn mark_removed(&self, name: &str) -> Result<()> {
        Replica::mark_removed(self, name)
    }

    fn set_rebuilding(&self, rebuilding: bool) -> Result<()> {
        Replica::set_rebuilding(self, rebuilding)
    }

    fn set_revision_counter(&self, counter: u64) -> Result<()> {
        Replica::set_revision_counter(self, counter)
    }

    fn reload(&self) -> Result<()> {
        Replica::reload(self)
    }

    fn purge(&self, ctl: &JobControl) -> Result<()> {
        Replica::purge(self, ctl)
    }

    fn hash_snapshot(&self, file: &str, rehash: bool, ctl: &JobControl) -> Result<HashOutcome> {
        Replica::hash_snapshot(self, file, rehash, ctl)
    }
}
