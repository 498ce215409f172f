//! [`ReplicaHost`] holds the (possibly closed) replica of one directory and serves it to the data-protocol server
//! (as a [`BlockBackend`]) and to the gRPC services (`crate::service::grpc`); below both the services and the
//! rebuild job, which each run over a host.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use data_protocol::{BackendError, BlockBackend, VolumeInfo};

use crate::error::ReplicaError;
#[cfg(feature = "fault-injection")]
use crate::fault::{FaultInjector, FaultOp};
use crate::jobs::JobTable;
use crate::locks::{read_lock, write_lock};
use crate::model::{ReplicaStatus, generation_unreadable, wire_error};
use crate::replica::{Replica, ReplicaOptions};

/// One replica directory as served by a daemon: the open replica (or none while closed) and its jobs.
#[derive(Debug)]
pub struct ReplicaHost {
    dir: PathBuf,
    volume: String,
    opts: RwLock<ReplicaOptions>,
    current: RwLock<Option<Arc<Replica>>>,
    /// Long-running jobs (purge, hash), kept across close/open.
    pub jobs: JobTable,
    /// Backups reading a snapshot now: a purge would punch or overwrite the files they read, so it is refused.
    pub backups_running: std::sync::atomic::AtomicUsize,
    /// The engine generation record ([`crate::generation`]) once read; `None` until then or while unreadable.
    generation: std::sync::Mutex<Option<u64>>,
    /// Rules consulted before every data-protocol operation.
    #[cfg(feature = "fault-injection")]
    faults: Arc<FaultInjector>,
}

impl ReplicaHost {
    /// A host for `dir`, with `replica` already open (or `None`).
    pub fn new(dir: PathBuf, volume: String, opts: ReplicaOptions, replica: Option<Replica>) -> Self {
        Self {
            dir,
            volume,
            opts: RwLock::new(opts),
            current: RwLock::new(replica.map(Arc::new)),
            jobs: JobTable::default(),
            backups_running: std::sync::atomic::AtomicUsize::new(0),
            generation: std::sync::Mutex::new(None),
            #[cfg(feature = "fault-injection")]
            faults: Arc::default(),
        }
    }

    /// The fault rules this host's data path obeys.
    #[cfg(feature = "fault-injection")]
    pub fn faults(&self) -> &Arc<FaultInjector> {
        &self.faults
    }

    /// The open replica.
    pub fn replica(&self) -> Result<Arc<Replica>, ReplicaError> {
        read_lock(&self.current)
            .clone()
            .filter(|r| !r.is_closed())
            .ok_or_else(|| {
                ReplicaError::FailedPrecondition(format!("replica {} is not open", self.dir.display()))
            })
    }

    /// Creates the replica (the directory must hold none) and opens it.
    pub fn create(&self, size: u64, disable_revision_counter: bool) -> Result<Arc<Replica>, ReplicaError> {
        let mut cur = write_lock(&self.current);
        let mut opts = read_lock(&self.opts).clone();
        opts.disable_revision_counter = Some(disable_revision_counter);
        let r = Arc::new(Replica::create(&self.dir, size, &opts)?);
        *cur = Some(r.clone());
        Ok(r)
    }

    /// Opens the replica if it is not open.
    pub fn open(&self) -> Result<Arc<Replica>, ReplicaError> {
        let mut cur = write_lock(&self.current);
        if let Some(r) = cur.as_ref().filter(|r| !r.is_closed()) {
            return Ok(r.clone());
        }
        let r = Arc::new(Replica::open(&self.dir, &read_lock(&self.opts))?);
        *cur = Some(r.clone());
        Ok(r)
    }

    /// Closes the replica cleanly (no-op when closed).
    pub fn close(&self) -> Result<(), ReplicaError> {
        let r = write_lock(&self.current).take();
        match r {
            Some(r) => r.close(),
            None => Ok(()),
        }
    }

    /// Closes the replica and deletes its directory contents.
    pub fn delete(&self) -> Result<(), ReplicaError> {
        self.close()?;
        std::fs::remove_dir_all(&self.dir).map_err(|e| ReplicaError::io("remove", &self.dir, e))?;
        std::fs::create_dir_all(&self.dir).map_err(|e| ReplicaError::io("create directory", &self.dir, e))?;
        // A stale engine must stay fenced from whatever is created here next.
        let known = *self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match known {
            Some(g) if g > 0 => crate::generation::store(&self.dir, g),
            _ => Ok(()),
        }
    }

    /// Status of the open replica, or the directory's offline status.
    pub fn status(&self) -> Result<ReplicaStatus, ReplicaError> {
        match read_lock(&self.current).clone() {
            Some(r) if !r.is_closed() => r.status(),
            _ => {
                let mut s = crate::replica::inspect(&self.dir)?;
                if s.state != "initial" {
                    s.state = "closed".into();
                }
                Ok(s)
            }
        }
    }

    /// Volume name given at start (may be empty).
    pub fn volume(&self) -> &str {
        &self.volume
    }
}

/// `ReplicaHost::replica` on the IO path: the host's current-replica lock, then the chain lock `is_closed` reads.
fn count_replica_lookup() {
    data_protocol::io_counters::lock();
    data_protocol::io_counters::lock();
}

impl BlockBackend for ReplicaHost {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        let r = self.replica().map_err(|e| wire_error(&e))?;
        Ok(VolumeInfo {
            size: r.size(),
            sector_size: u32::try_from(crate::model::SECTOR_SIZE).unwrap_or(512),
            name: self.volume.clone(),
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::Read)?;
        count_replica_lookup();
        self.replica()
            .and_then(|r| r.read_at(offset, buf))
            .map_err(|e| wire_error(&e))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::Write)?;
        count_replica_lookup();
        self.replica()
            .and_then(|r| r.write_at(offset, buf))
            .map_err(|e| wire_error(&e))
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::Unmap)?;
        self.replica()
            .and_then(|r| r.unmap(offset, len))
            .map_err(|e| wire_error(&e))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::WriteZeroes)?;
        self.replica()
            .and_then(|r| r.write_zeroes(offset, len))
            .map_err(|e| wire_error(&e))
    }

    fn flush(&self) -> Result<(), BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::Flush)?;
        self.replica().and_then(|r| r.flush()).map_err(|e| wire_error(&e))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>, BackendError> {
        #[cfg(feature = "fault-injection")]
        self.faults.check(FaultOp::BlockStatus)?;
        self.replica()
            .and_then(|r| r.allocated_ranges(offset, len))
            .map_err(|e| wire_error(&e))
    }

    fn generation(&self) -> Result<u64, BackendError> {
        let mut known = self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(g) = *known {
            return Ok(g);
        }
        // Read once; an unreadable record is read again at the next Hello (after the operator repaired it).
        match crate::generation::load(&self.dir) {
            Ok(g) => {
                *known = Some(g);
                Ok(g)
            }
            Err(e) => Err(generation_unreadable(&e)),
        }
    }

    fn record_generation(&self, generation: u64) -> Result<(), BackendError> {
        let mut known = self
            .generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        crate::generation::store(&self.dir, generation).map_err(|e| wire_error(&e))?;
        *known = Some(generation);
        Ok(())
    }
}
