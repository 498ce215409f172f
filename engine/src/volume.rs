//! The volume's data path: every write goes to all RW and WO replicas and is acknowledged when all answered;
//! reads rotate over RW replicas; a replica that fails goes ERR and IO continues while one RW replica remains.
//!
//! The replica list is an immutable [`ReplicaSet`] (an epoch, `epoch.rs`): IO enters the gate and reads it
//! without a lock; operations that must see no IO in flight (snapshot, expand, adding or removing a replica)
//! freeze the gate, wait for IO to drain, install a new set if they change it, and resume. Mode changes are
//! per-replica atomics and never wait for IO.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use data_protocol::{ClientError, DataClient};

use corral_disk::{BLOCK_BYTES, BLOCK_SIZE};

use crate::epoch::{Epochs, ReplicaSet};
use crate::error::EngineError;
use crate::metrics::VolumeMetrics;
use crate::replica_client::{Mode, ReplicaEntry};

/// Zeros for write-zeroes during a rebuild.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];
/// Replicas handled by the allocation-free fan-out; more fall back to a heap-allocated join.
const INLINE_FANOUT: usize = 4;

/// One volume served by this engine.
#[derive(Debug)]
pub struct Volume {
    /// Volume name.
    pub name: String,
    size: AtomicU64,
    /// Sector size reported by the replicas.
    pub sector_size: u32,
    pub(crate) epochs: Epochs,
    next_reader: AtomicUsize,
    /// Revision counter disabled for this volume.
    pub revision_counter_disabled: bool,
    /// Frontend up (revert needs it down).
    pub frontend_up: AtomicBool,
    /// IO counters and latencies.
    pub metrics: VolumeMetrics,
    /// Set, once and for good, when a replica refused this engine as stale: every IO fails from then on.
    fenced: std::sync::OnceLock<Fencing>,
}

/// Why this engine no longer serves its volume: a replica accepted a newer engine generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fencing {
    /// The generation the replica accepted.
    pub replica_generation: u64,
    /// This engine's generation (0: none).
    pub generation: u64,
    /// The replica that refused this engine.
    pub replica: String,
}

impl std::fmt::Display for Fencing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fenced by generation {} > {} (replica {})",
            self.replica_generation, self.generation, self.replica
        )
    }
}

fn is_no_space(e: &ClientError) -> bool {
    matches!(e, ClientError::NoSpace)
        || matches!(
            e,
            ClientError::Remote {
                kind: data_protocol::ErrorKind::NoSpace,
                ..
            }
        )
}

fn to_u32(len: u64) -> Result<u32, EngineError> {
    u32::try_from(len).map_err(|_| EngineError::InvalidArgument(format!("length {len} exceeds 4 GiB")))
}

impl Volume {
    /// A volume over already-checked replicas.
    pub fn new(
        name: String,
        size: u64,
        sector_size: u32,
        replicas: Vec<Arc<ReplicaEntry>>,
        rc_disabled: bool,
    ) -> Self {
        Self {
            name,
            size: AtomicU64::new(size),
            sector_size,
            epochs: Epochs::new(replicas),
            next_reader: AtomicUsize::new(0),
            revision_counter_disabled: rc_disabled,
            frontend_up: AtomicBool::new(false),
            metrics: VolumeMetrics::default(),
            fenced: std::sync::OnceLock::new(),
        }
    }

    /// Why this engine is fenced, once a replica refused it as stale.
    pub fn fenced(&self) -> Option<&Fencing> {
        self.fenced.get()
    }

    /// Fences this engine for good when `e` is a replica's refusal of a stale engine.
    pub(crate) fn note_fenced(&self, replica: &impl std::fmt::Display, e: &ClientError) {
        if let ClientError::Fenced {
            replica: replica_generation,
            generation,
            ..
        } = e
        {
            let fencing = Fencing {
                replica_generation: *replica_generation,
                generation: *generation,
                replica: replica.to_string(),
            };
            if self.fenced.set(fencing.clone()).is_ok() {
                tracing::error!(volume = %self.name, "{fencing}: this engine no longer serves IO");
            }
        }
    }

    /// Fails an IO of a fenced engine (one atomic load while it is not).
    fn check_fenced(&self) -> Result<(), EngineError> {
        match self.fenced.get() {
            None => Ok(()),
            Some(f) => Err(EngineError::Fenced(format!("volume {}: {f}", self.name))),
        }
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub(crate) fn set_size(&self, size: u64) {
        self.size.store(size, Ordering::Release);
    }

    /// A snapshot of the replicas and their modes.
    pub async fn replicas(&self) -> Vec<Arc<ReplicaEntry>> {
        self.epochs.load().to_vec()
    }

    /// The current replica set (its epoch and replicas), without waiting for a freeze.
    pub fn replica_set(&self) -> Arc<ReplicaSet> {
        self.epochs.load()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        self.check_fenced()?;
        let size = self.size();
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(EngineError::InvalidArgument(format!(
                "IO at {offset}+{len} is past the end of volume {} ({size} bytes)",
                self.name
            )));
        }
        Ok(())
    }

    fn no_healthy(&self, reps: &[Arc<ReplicaEntry>]) -> EngineError {
        let detail = reps
            .iter()
            .map(|r| format!("{} {} {}", r.address, r.mode().as_str(), r.error()))
            .collect::<Vec<_>>()
            .join("; ");
        EngineError::NoHealthyReplica {
            volume: self.name.clone(),
            detail,
        }
    }

    /// Runs `op` on every writable replica at once and applies the error policy: a failed replica goes ERR,
    /// unless every RW replica failed with "no space" (then the volume answers ENOSPC and keeps them). Succeeds
    /// while at least one RW replica succeeded.
    async fn fan_out<'a, F, Fut>(
        &self,
        reps: &'a [Arc<ReplicaEntry>],
        what: &str,
        op: F,
    ) -> Result<(), EngineError>
    where
        F: Fn(&'a DataClient) -> Fut,
        Fut: Future<Output = Result<(), ClientError>>,
    {
        let one = |i: usize| {
            let target = reps.get(i).and_then(|r| r.writer().map(|d| (r.mode(), d)));
            let fut = target.map(|(m, d)| (m, op(d)));
            async move {
                match fut {
                    Some((m, f)) => Some((m, f.await)),
                    None => None,
                }
            }
        };
        if reps.len() <= INLINE_FANOUT {
            // No allocation for the common case of up to 4 replicas.
            let (a, b, c, d) = tokio::join!(one(0), one(1), one(2), one(3));
            let results = [a, b, c, d];
            self.apply_policy(
                reps,
                what,
                results.iter().enumerate().map(|(i, r)| (i, r.as_ref())),
            )
        } else {
            let all = futures::future::join_all((0..reps.len()).map(one)).await;
            self.apply_policy(reps, what, all.iter().enumerate().map(|(i, r)| (i, r.as_ref())))
        }
    }

    fn apply_policy<'r>(
        &self,
        reps: &[Arc<ReplicaEntry>],
        what: &str,
        results: impl Iterator<Item = (usize, Option<&'r (Mode, Result<(), ClientError>)>)> + Clone,
    ) -> Result<(), EngineError> {
        let mut rw_ok = 0;
        let mut rw_failed = 0;
        let mut rw_no_space = 0;
        for (_, r) in results.clone() {
            if let Some((Mode::Rw, res)) = r {
                match res {
                    Ok(()) => rw_ok += 1,
                    Err(e) => {
                        rw_failed += 1;
                        if is_no_space(e) {
                            rw_no_space += 1;
                        }
                    }
                }
            }
        }
        let all_rw_full = rw_ok == 0 && rw_failed > 0 && rw_no_space == rw_failed;
        for (i, r) in results {
            if let Some((mode, Err(e))) = r {
                if all_rw_full && *mode == Mode::Rw {
                    continue;
                }
                reps[i].set_err(&format!("{what} failed: {e}"));
                self.metrics.replica_errors.fetch_add(1, Ordering::Relaxed);
                self.note_fenced(&reps[i].address, e);
            }
        }
        self.check_fenced()?;
        if all_rw_full {
            return Err(EngineError::NoSpace(self.name.clone()));
        }
        if rw_ok == 0 {
            return Err(self.no_healthy(reps));
        }
        Ok(())
    }

    /// Reads into `buf` from one RW replica, trying the next one on failure.
    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), EngineError> {
        self.check_range(offset, buf.len() as u64)?;
        let start = Instant::now();
        let io = self.epochs.enter().await;
        let r = self.read_locked(io.set(), offset, buf).await;
        self.metrics.record_read(buf.len() as u64, start, r.is_ok());
        r
    }

    async fn read_locked(
        &self,
        reps: &[Arc<ReplicaEntry>],
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), EngineError> {
        let n = reps.len();
        if n == 0 {
            return Err(self.no_healthy(reps));
        }
        // A replica on this node first: no network hop, and reads keep one copy's page cache hot and batch on one
        // connection (the other replicas on this node, if any, hold the same data). Otherwise, or when it fails,
        // round-robin over the RW replicas.
        let local = reps.iter().position(|r| r.is_local() && r.reader().is_some());
        if let Some(i) = local
            && self.read_one(&reps[i], offset, buf).await
        {
            return Ok(());
        }
        let first = self.next_reader.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let i = (first + k) % n;
            if Some(i) != local && self.read_one(&reps[i], offset, buf).await {
                return Ok(());
            }
        }
        Err(self.no_healthy(reps))
    }

    /// Reads from `r` when it is RW; a failed read puts it in ERR. Whether `buf` holds the data.
    async fn read_one(&self, r: &ReplicaEntry, offset: u64, buf: &mut [u8]) -> bool {
        let Some(d) = r.reader() else { return false };
        match d.read(offset, buf).await {
            Ok(()) => true,
            Err(e) => {
                r.set_err(&format!("read failed: {e}"));
                self.metrics.replica_errors.fetch_add(1, Ordering::Relaxed);
                self.note_fenced(&r.address, &e);
                false
            }
        }
    }

    /// Writes to every RW and WO replica. With `fua`, the write is flushed before it is acknowledged.
    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), EngineError> {
        self.write_bytes(offset, Bytes::copy_from_slice(data), fua).await
    }

    /// [`write`](Self::write) of an owned buffer: every replica is sent this one buffer, none copies it.
    pub async fn write_bytes(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), EngineError> {
        self.check_range(offset, data.len() as u64)?;
        let start = Instant::now();
        let io = self.epochs.enter().await;
        let reps = io.set();
        let rebuilding = reps.iter().any(|r| r.mode() == Mode::Wo);
        let aligned = offset.is_multiple_of(BLOCK_SIZE) && (data.len() as u64).is_multiple_of(BLOCK_SIZE);
        let r = if rebuilding && !aligned {
            self.write_widened(reps, offset, &data).await
        } else {
            self.fan_out(reps, "write", |d| d.write_bytes(offset, data.clone()))
                .await
        };
        let r = match r {
            Ok(()) if fua => self.fan_out(reps, "flush", DataClient::flush).await,
            other => other,
        };
        self.metrics.record_write(data.len() as u64, start, r.is_ok());
        r
    }

    /// A rebuilding (WO) replica's lower layers are incomplete, so it cannot read-modify-write a partial block:
    /// the engine reads the surrounding blocks from RW replicas and writes whole blocks to everyone.
    async fn write_widened(
        &self,
        reps: &[Arc<ReplicaEntry>],
        offset: u64,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let start = offset - offset % BLOCK_SIZE;
        let end = (offset + data.len() as u64).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let len = usize::try_from(end - start)
            .map_err(|_| EngineError::InvalidArgument("write too large".into()))?;
        let block = BLOCK_BYTES;
        let mut buf = vec![0u8; len];
        // Only the partial first and last blocks need their current contents.
        let need_head = !offset.is_multiple_of(BLOCK_SIZE);
        // The last block needs reading unless the write ends aligned or it is the first block, already read.
        let ends_aligned = (offset + data.len() as u64).is_multiple_of(BLOCK_SIZE);
        let tail_is_head_block = need_head && end - BLOCK_SIZE == start;
        let need_tail = !(ends_aligned || tail_is_head_block);
        if need_head {
            self.read_locked(reps, start, &mut buf[..block]).await?;
        }
        if need_tail {
            self.read_locked(reps, end - BLOCK_SIZE, &mut buf[len - block..])
                .await?;
        }
        let head = usize::try_from(offset - start).unwrap_or(0);
        buf[head..head + data.len()].copy_from_slice(data);
        let buf = Bytes::from(buf);
        self.fan_out(reps, "write", |d| d.write_bytes(start, buf.clone()))
            .await
    }

    /// Flushes every RW and WO replica (`fdatasync` of each head, then its revision counter).
    pub async fn flush(&self) -> Result<(), EngineError> {
        self.check_fenced()?;
        let io = self.epochs.enter().await;
        self.metrics.flushes.fetch_add(1, Ordering::Relaxed);
        self.fan_out(io.set(), "flush", DataClient::flush).await
    }

    /// Discards a range. A no-op while a replica rebuilds (its lower layers would disagree).
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        self.check_range(offset, len)?;
        let io = self.epochs.enter().await;
        let reps = io.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Ok(());
        }
        let len = to_u32(len)?;
        self.fan_out(reps, "unmap", |d| d.unmap(offset, len)).await
    }

    /// Makes a range read as zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        self.check_range(offset, len)?;
        let io = self.epochs.enter().await;
        let reps = io.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            // A rebuilding replica's lower layers are still arriving: a hole punched in its head now would let
            // them show through later. Write real zeros instead.
            let end = offset + len;
            let mut pos = offset;
            while pos < end {
                let n = (end - pos).min(ZEROS.len() as u64);
                let chunk = &ZEROS[..usize::try_from(n).unwrap_or(ZEROS.len())];
                if pos.is_multiple_of(BLOCK_SIZE) && n.is_multiple_of(BLOCK_SIZE) {
                    self.fan_out(reps, "write", |d| d.write(pos, chunk)).await?;
                } else {
                    self.write_widened(reps, pos, chunk).await?;
                }
                pos += n;
            }
            return Ok(());
        }
        let len = to_u32(len)?;
        self.fan_out(reps, "write-zeroes", |d| d.write_zeroes(offset, len))
            .await
    }

    /// Robustness: healthy (all RW), degraded (some RW), faulted (none).
    pub async fn robustness(&self) -> &'static str {
        let reps = self.epochs.load();
        let rw = reps.iter().filter(|r| r.mode() == Mode::Rw).count();
        if rw == 0 {
            "faulted"
        } else if rw == reps.len() {
            "healthy"
        } else {
            "degraded"
        }
    }

    /// Marks ERR every replica whose data connection failed (called periodically: finds dead replicas while idle).
    pub async fn check_connections(&self) {
        let reps = self.epochs.load();
        for r in reps.iter() {
            if r.mode() != Mode::Err
                && let Some(c) = &r.conn
                && let Some(e) = c.data.failure()
            {
                r.set_err(&format!("data connection failed: {e}"));
                self.note_fenced(&r.address, &e);
            }
        }
    }
}

impl Volume {
    /// Allocation of `[offset, offset+len)` as consecutive pieces, from one RW replica (the layout of every
    /// replica's chain is the same). Reporting data where there is a hole is always safe, reporting a hole where
    /// there is data is not: a replica that cannot answer makes the whole range "data".
    pub async fn block_status(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, crate::nbd::Allocation)>, EngineError> {
        use crate::nbd::Allocation;
        self.check_range(offset, len)?;
        let io = self.epochs.enter().await;
        let reps = io.set();
        let Some(reader) = reps.iter().find_map(|r| r.reader()) else {
            return Err(self.no_healthy(reps));
        };
        let ask = u32::try_from(len).unwrap_or(u32::MAX);
        let Ok(st) = reader.block_status(offset, ask).await else {
            return Ok(vec![(len, Allocation::Data)]);
        };
        let end = offset + st.covered.min(len);
        let mut out = Vec::with_capacity(st.allocated.len() * 2 + 1);
        let mut pos = offset;
        for r in st.allocated {
            let (s, e) = (r.start.max(pos), r.end.min(end));
            if s >= e {
                continue;
            }
            if s > pos {
                out.push((s - pos, Allocation::Hole));
            }
            out.push((e - s, Allocation::Data));
            pos = e;
        }
        if pos < end {
            out.push((end - pos, Allocation::Hole));
        }
        Ok(out)
    }
}
