//! One v2 replica: a chain of lvols in the disk's shared [`LvStore`] — the head lvol `NAME` (writable) over its
//! snapshots `NAME.snap.SNAP` (read-only) — with the operations of the v1 [`crate::Replica`] the engine uses
//! (IO, snapshot, revert, expand, mark removed, purge, revision counter, rebuilding flag, status), so the v2
//! daemon answers the same gRPC and data-protocol requests as a v1 replica.
//!
//! Metadata lives in xattrs (`docs/formats.md`, "v2 replica"): on the head `corral.volume` (revision counter on or
//! off, rebuilding, listener ports, head index) and `corral.salvage` (last-modified time, allocated bytes and the
//! revision counter, rewritten at each flush that follows a write, after the data is durable); on a snapshot
//! `corral.snapshot` (created, user-created, removed, labels). Every change is one journaled lvstore operation.
//!
//! Revert is crash-ordered: the new head is cloned as `NAME.revert` (with the old head's `corral.volume`), the old
//! head deleted, then `NAME.revert` renamed to `NAME`. Opening finishes it: `NAME.revert` beside `NAME` means the
//! revert had not begun deleting (the clone is deleted); `NAME.revert` alone means the old head is gone (renamed).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use lvstore::{BlobId, BlobKind, LvStore, LvolInfo};
use serde::{Deserialize, Serialize};

use crate::error::{ReplicaError, Result};
use crate::jobs::JobControl;
use crate::locks::{read_lock, write_lock};
use crate::model::{DiskStatus, ReplicaStatus, SECTOR_SIZE, SnapshotRequest};
use crate::names;

/// Head xattr: the replica's settings.
pub const XATTR_VOLUME: &str = "corral.volume";
/// Head xattr: salvage fields, rewritten at a flush after a write (when, see [`LvolReplica::flush`]).
pub const XATTR_SALVAGE: &str = "corral.salvage";

/// How old (ns) the recorded `lastModifyTime` may get while flushed writes go on with the revision counter off:
/// 5 s, ext4's default journal commit interval, which bounds how stale a v1 head file's persisted mtime can be.
pub const SALVAGE_TIME_LAG_NS: i64 = 5_000_000_000;
/// Snapshot xattr: the snapshot's metadata.
pub const XATTR_SNAPSHOT: &str = "corral.snapshot";
/// Head xattr: the backup last restored completely into the replica (`crate::backup::RestoreState`, JSON;
/// `super::backup`).
pub const XATTR_RESTORE_STATE: &str = "corral.backup-restore";
/// Head xattr: the replica's backup chain was ended (`crate::backup::ChainEnd`, JSON); cleared by the next full
/// backup, kept across a revert.
pub const XATTR_CHAIN_END: &str = "corral.backup-chain-end";
/// Head xattr: the highest engine generation the replica accepted (decimal ASCII u64; absent: none), set in one
/// journaled transaction before the data-protocol Hello that raised it is answered (`docs/formats.md`, "Engine
/// generation"); kept across a revert.
pub const XATTR_ENGINE_GENERATION: &str = "corral.engine-generation";
/// Separator between a replica's name and its snapshot's in lvol names.
const SNAP_INFIX: &str = ".snap.";
/// Suffix of the head being put in place by a revert.
const REVERT_SUFFIX: &str = ".revert";
/// Infix of a snapshot received by a rebuild, not yet in place (`NAME.rcv.SNAP`).
const RCV_INFIX: &str = ".rcv.";
/// Infix of a received snapshot still being written (`NAME.rcvw.SNAP`).
const RCVW_INFIX: &str = ".rcvw.";
const BLOCK: u64 = 4096;

/// `corral.volume` of a head lvol.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeXattr {
    pub revision_counter_disabled: bool,
    #[serde(default)]
    pub rebuilding: bool,
    /// Ports the replica's control, data and sync listeners were bound to (0: none yet).
    #[serde(default)]
    pub ports: [u16; 3],
    /// Index shown in the head's v1-style name (`volume-head-NNN.img`), bumped by snapshot and revert.
    #[serde(default)]
    pub head_index: u32,
}

/// `corral.salvage` of a head lvol (seed 003: what salvage compares when the counter is off).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SalvageXattr {
    /// Nanoseconds since the epoch of the last flush that followed a write.
    pub last_modify_time: i64,
    /// Bytes the head lvol holds itself.
    pub allocated_bytes: u64,
    /// Revision counter (0 when disabled).
    pub revision_counter: u64,
}

/// `corral.snapshot` of a snapshot lvol.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotXattr {
    pub created: String,
    pub user_created: bool,
    #[serde(default)]
    pub removed: bool,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Checks a replica name: it becomes an lvol name and the prefix of its snapshots', so letters, digits, `_`, `-`
/// only (no `.`, which would let `a.snap.b` be both a replica and a snapshot of `a`), 1–100 bytes.
pub fn check_replica_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ReplicaError::InvalidArgument(format!(
            "invalid replica name {name:?}: 1-100 ASCII letters, digits, '_' or '-', not starting with '-'"
        )))
    }
}

/// The replica names the store holds (head lvols and unfinished reverts).
pub fn replicas_in(store: &LvStore) -> Vec<String> {
    let mut out: Vec<String> = store
        .list()
        .into_iter()
        .filter(|l| l.kind == BlobKind::Lvol && !super::backing_image::is_backing_image_lvol(&l.name))
        .filter_map(|l| {
            let n = l.name.strip_suffix(REVERT_SUFFIX).unwrap_or(&l.name).to_owned();
            check_replica_name(&n).is_ok().then_some(n)
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

pub(crate) use crate::error::lv_err;

#[derive(Debug, Clone)]
struct Open {
    head: BlobId,
    size: u64,
    volume: VolumeXattr,
}

/// One replica hosted in an lvstore. Created empty ("initial") until [`LvolReplica::create`] or found in the
/// store at [`LvolReplica::load`].
pub struct LvolReplica {
    store: Arc<LvStore>,
    name: String,
    /// `None`: initial (no head lvol) or closed.
    open: RwLock<Option<Open>>,
    /// A head lvol exists (open or closed).
    exists: AtomicBool,
    /// Serialises shape changes (snapshot, revert, expand, purge steps).
    shape: Mutex<()>,
    counter: AtomicU64,
    /// Writes since the salvage fields were last recorded (they are rewritten only at a flush).
    written: AtomicBool,
    /// `lastModifyTime` as last recorded in `corral.salvage` (ns since the epoch).
    salvage_recorded: AtomicI64,
    /// The time of a flush after writes whose salvage fields are not recorded yet (0: none).
    salvage_unrecorded: AtomicI64,
    pub(crate) purging: AtomicBool,
    /// Snapshots being sent to a rebuilding replica or read by a backup (a purge waits for none).
    pub(super) sending: AtomicUsize,
    /// The v2 backing image's snapshot lvol a [`LvolReplica::create`] clones the head from (issue 21); once
    /// created, the chain's root names it ([`LvolReplica::backing_image`]).
    create_over: Mutex<Option<String>>,
}

/// Holds off purges while a snapshot lvol is being sent.
pub struct Sending<'a>(&'a AtomicUsize);

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for LvolReplica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LvolReplica")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl LvolReplica {
    /// Replica `name` of `store`: finishes an interrupted revert and opens the head when there is one.
    pub fn load(store: Arc<LvStore>, name: &str) -> Result<Self> {
        check_replica_name(name)?;
        let r = Self {
            store,
            name: name.to_owned(),
            open: RwLock::new(None),
            exists: AtomicBool::new(false),
            shape: Mutex::new(()),
            counter: AtomicU64::new(0),
            written: AtomicBool::new(false),
            salvage_recorded: AtomicI64::new(0),
            salvage_unrecorded: AtomicI64::new(0),
            purging: AtomicBool::new(false),
            sending: AtomicUsize::new(0),
            create_over: Mutex::new(None),
        };
        r.finish_revert()?;
        r.finish_rebuild()?;
        if r.store.lookup(name).is_ok() {
            r.exists.store(true, Ordering::SeqCst);
            r.open()?;
        }
        Ok(r)
    }

    fn err(&self, e: lvstore::Error) -> ReplicaError {
        lv_err(&self.store, e)
    }

    fn revert_name(&self) -> String {
        format!("{}{REVERT_SUFFIX}", self.name)
    }

    /// The lvol of snapshot `file` (`volume-snap-X.img` or `X`): `NAME.snap.X`.
    pub(crate) fn snap_lvol(&self, file: &str) -> String {
        format!(
            "{}{SNAP_INFIX}{}",
            self.name,
            names::snapshot_name(file).unwrap_or(file)
        )
    }

    /// The v1 file name of a snapshot lvol of this replica, if it is one.
    pub(super) fn snap_file(&self, lvol: &str) -> Option<String> {
        lvol.strip_prefix(&self.name)?
            .strip_prefix(SNAP_INFIX)
            .map(names::snapshot_file)
    }

    fn finish_revert(&self) -> Result<()> {
        let tmp = self.revert_name();
        if self.store.lookup(&tmp).is_err() {
            return Ok(());
        }
        if self.store.lookup(&self.name).is_ok() {
            self.store.delete(&tmp).map_err(|e| self.err(e))
        } else {
            self.store.rename(&tmp, &self.name).map_err(|e| self.err(e))
        }
    }

    /// Replica name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The store.
    pub fn store(&self) -> &Arc<LvStore> {
        &self.store
    }

    fn read_volume_xattr(&self) -> Result<VolumeXattr> {
        match self
            .store
            .xattr(&self.name, XATTR_VOLUME)
            .map_err(|e| self.err(e))?
        {
            None => Ok(VolumeXattr::default()),
            Some(v) => serde_json::from_slice(&v).map_err(|e| ReplicaError::CorruptMeta {
                path: self.store.path().join(&self.name),
                reason: format!("xattr {XATTR_VOLUME}: {e}"),
            }),
        }
    }

    /// The highest engine generation recorded on the head (0: none). A value that is not a decimal u64 is
    /// corrupt: an error naming the lvol and the xattr.
    pub fn engine_generation(&self) -> Result<u64> {
        if !self.exists.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let Some(v) = self
            .store
            .xattr(&self.name, XATTR_ENGINE_GENERATION)
            .map_err(|e| self.err(e))?
        else {
            return Ok(0);
        };
        std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| ReplicaError::CorruptMeta {
                path: self.store.path().join(&self.name),
                reason: format!(
                    "xattr {XATTR_ENGINE_GENERATION}: {:?} is not a generation number",
                    String::from_utf8_lossy(&v)
                ),
            })
    }

    /// Records `generation` on the head, in one journaled transaction (durable when this returns).
    pub fn set_engine_generation(&self, generation: u64) -> Result<()> {
        self.store
            .set_xattr(
                &self.name,
                XATTR_ENGINE_GENERATION,
                generation.to_string().as_bytes(),
            )
            .map_err(|e| self.err(e))
    }

    /// The salvage fields as last flushed (default when never flushed).
    pub fn salvage(&self) -> Result<SalvageXattr> {
        match self
            .store
            .xattr(&self.name, XATTR_SALVAGE)
            .map_err(|e| self.err(e))?
        {
            None => Ok(SalvageXattr::default()),
            Some(v) => serde_json::from_slice(&v).map_err(|e| ReplicaError::CorruptMeta {
                path: self.store.path().join(&self.name),
                reason: format!("xattr {XATTR_SALVAGE}: {e}"),
            }),
        }
    }

    fn write_volume_xattr(&self, v: &VolumeXattr) -> Result<()> {
        let bytes = volume_xattr_bytes(v)?;
        self.store
            .set_xattr(&self.name, XATTR_VOLUME, &bytes)
            .map_err(|e| self.err(e))
    }

    /// Creates the head lvol (the replica must not exist) and opens it.
    pub fn create(&self, size: u64, disable_revision_counter: bool, ports: [u16; 3]) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        if self.exists.load(Ordering::SeqCst) {
            return Err(ReplicaError::AlreadyExists(format!("replica {}", self.name)));
        }
        if size == 0 || !size.is_multiple_of(BLOCK) {
            return Err(ReplicaError::InvalidArgument(format!(
                "size {size} is not a positive multiple of {BLOCK}"
            )));
        }
        let v = VolumeXattr {
            revision_counter_disabled: disable_revision_counter,
            ports,
            ..Default::default()
        };
        match crate::locks::lock(&self.create_over).clone() {
            None => {
                // The head and its record in one commit: a crash leaves both or neither.
                let bytes = volume_xattr_bytes(&v)?;
                self.store
                    .create_lvol_with_xattrs(&self.name, size, &[(XATTR_VOLUME, &bytes)])
                    .map_err(|e| self.err(e))?;
            }
            Some(bi) => self.clone_backing_image(&bi, size, &v)?,
        }
        self.exists.store(true, Ordering::SeqCst);
        self.open_locked()
    }

    /// Makes the next [`LvolReplica::create`] clone the head from the v2 backing image whose snapshot lvol is
    /// `lvol` (`None`: an empty head).
    pub fn create_over_backing_image(&self, lvol: Option<String>) {
        *crate::locks::lock(&self.create_over) = lvol;
    }

    /// The head as a clone of backing image snapshot `bi`, grown to `size` (seed 001: the image is the chain's
    /// first layer; unwritten ranges read its data), with its record `v`, in one commit. Refused unless the copy is
    /// ready and fits in `size`.
    fn clone_backing_image(&self, bi: &str, size: u64, v: &VolumeXattr) -> Result<()> {
        let info = self.store.info(bi).map_err(|e| self.err(e))?;
        let ready = info
            .xattrs
            .get(super::backing_image::XATTR_STATE)
            .map(String::as_str)
            == Some(corral_proto::backing_image::FileState::Ready.as_str());
        if info.kind != BlobKind::Snapshot || !ready {
            return Err(ReplicaError::FailedPrecondition(format!(
                "v2 backing image {bi} is not a ready copy"
            )));
        }
        if info.size > size {
            return Err(ReplicaError::InvalidArgument(format!(
                "volume size {size} is smaller than its backing image {bi} ({} bytes)",
                info.size
            )));
        }
        let bytes = volume_xattr_bytes(v)?;
        self.store
            .clone_snapshot_with(bi, &self.name, Some(size), &[(XATTR_VOLUME, &bytes)])
            .map(drop)
            .map_err(|e| self.err(e))
    }

    /// The v2 backing image's snapshot lvol under the chain (the parent of its root), if any.
    pub fn backing_image(&self) -> Option<String> {
        let all = self.store.list();
        let by_name: BTreeMap<&str, &LvolInfo> = all.iter().map(|l| (l.name.as_str(), l)).collect();
        let mut cur = by_name.get(self.name.as_str())?.parent.clone();
        while let Some(p) = cur {
            if super::backing_image::is_backing_image_lvol(&p) {
                return Some(p);
            }
            cur = by_name.get(p.as_str()).and_then(|l| l.parent.clone());
        }
        None
    }

    /// Opens the head (no-op when open).
    pub fn open(&self) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        self.open_locked()
    }

    fn open_locked(&self) -> Result<()> {
        if read_lock(&self.open).is_some() {
            return Ok(());
        }
        let head = self.store.lookup(&self.name).map_err(|e| self.err(e))?;
        let size = self.store.size_of(head).map_err(|e| self.err(e))?;
        let volume = self.read_volume_xattr()?;
        let salvage = self.salvage()?;
        self.counter.store(salvage.revision_counter, Ordering::SeqCst);
        self.salvage_recorded
            .store(salvage.last_modify_time, Ordering::SeqCst);
        *write_lock(&self.open) = Some(Open { head, size, volume });
        Ok(())
    }

    /// Flushes and closes (IO then fails until [`open`](Self::open)).
    pub fn close(&self) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        if read_lock(&self.open).is_none() {
            return Ok(());
        }
        self.flush_recording_salvage(true)?;
        *write_lock(&self.open) = None;
        Ok(())
    }

    /// Closes and deletes every lvol of the replica (snapshots from the newest down).
    pub fn delete(&self) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        *write_lock(&self.open) = None;
        let mine: Vec<LvolInfo> = self
            .store
            .list()
            .into_iter()
            .filter(|l| {
                l.name == self.name
                    || l.name == self.revert_name()
                    || self.snap_file(&l.name).is_some()
                    || self.is_received(&l.name)
            })
            .collect();
        self.delete_leaves_first(mine.into_iter().map(|l| l.name).collect())?;
        self.exists.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Deletes the lvols `names`, leaves first: a blob is deleted once none of `names` reads through to it.
    fn delete_leaves_first(&self, mut left: Vec<String>) -> Result<()> {
        while !left.is_empty() {
            let before = left.len();
            let mut next = Vec::new();
            for n in &left {
                let info = self.store.info(n).map_err(|e| self.err(e))?;
                if info.children.iter().any(|c| left.contains(c)) {
                    next.push(n.clone());
                } else {
                    self.store.delete(n).map_err(|e| self.err(e))?;
                }
            }
            if next.len() == before {
                return Err(ReplicaError::FailedPrecondition(format!(
                    "replica {}: lvols {next:?} have clones outside the replica",
                    self.name
                )));
            }
            left = next;
        }
        Ok(())
    }

    fn current(&self) -> Result<Open> {
        read_lock(&self.open)
            .clone()
            .ok_or_else(|| ReplicaError::FailedPrecondition(format!("replica {} is not open", self.name)))
    }

    /// Is the head open?
    pub fn is_open(&self) -> bool {
        read_lock(&self.open).is_some()
    }

    /// Volume size (0 when not open).
    pub fn size(&self) -> u64 {
        read_lock(&self.open).as_ref().map_or(0, |o| o.size)
    }

    fn check_range(o: &Open, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > o.size) {
            return Err(ReplicaError::OutOfRange {
                offset,
                len,
                size: o.size,
            });
        }
        Ok(())
    }

    fn bump(&self, o: &Open) {
        if !o.volume.revision_counter_disabled {
            self.counter.fetch_add(1, Ordering::SeqCst);
        }
        self.written.store(true, Ordering::SeqCst);
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, buf.len() as u64)?;
        self.store.read_at(o.head, offset, buf).map_err(|e| self.err(e))
    }

    /// [`LvStore::read_at_nowait`] on the head: `Ok(false)` when the read would wait for the device.
    pub fn read_at_nowait(&self, offset: u64, buf: &mut [u8]) -> Result<bool> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, buf.len() as u64)?;
        self.store
            .read_at_nowait(o.head, offset, buf)
            .map_err(|e| self.err(e))
    }

    /// [`LvStore::write_at_nowait`] on the head: `Ok(false)` (nothing written) when the write would wait for
    /// the device.
    pub fn write_at_nowait(&self, offset: u64, data: &[u8]) -> Result<bool> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, data.len() as u64)?;
        let done = self
            .store
            .write_at_nowait(o.head, offset, data)
            .map_err(|e| self.err(e))?;
        if done {
            self.bump(o);
        }
        Ok(done)
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, data.len() as u64)?;
        self.bump(o);
        self.store.write_at(o.head, offset, data).map_err(|e| self.err(e))
    }

    pub fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, len)?;
        self.bump(o);
        // Whole blocks only, as v1 (a partial block keeps its data).
        let (s, e) = (offset.next_multiple_of(BLOCK), (offset + len) / BLOCK * BLOCK);
        if s < e {
            self.store.unmap(o.head, s, e - s).map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, len)?;
        self.bump(o);
        self.store
            .write_zeroes(o.head, offset, len)
            .map_err(|e| self.err(e))
    }

    pub fn allocated_ranges(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>> {
        let g = read_lock(&self.open);
        let o = g.as_ref().ok_or_else(|| self.not_open())?;
        Self::check_range(o, offset, len)?;
        self.store
            .allocated_ranges(o.head, offset, len)
            .map_err(|e| self.err(e))
    }

    fn not_open(&self) -> ReplicaError {
        ReplicaError::FailedPrecondition(format!("replica {} is not open", self.name))
    }

    /// Makes every acknowledged write durable (the store's flush) and, when something was written since they were
    /// last recorded, records the salvage fields in the head's `corral.salvage` in the flush's own journal record:
    /// at every such flush while the revision counter is on (it must be durable at each flush, as v1's); with it
    /// off, only when the flush journals a record anyway (it allocated) or the recorded `lastModifyTime` is
    /// [`SALVAGE_TIME_LAG_NS`] old — as v1's head-file mtime, which `fdatasync` does not persist either and the
    /// file system commits within seconds. A rewrite of allocated blocks then flushes with one `fdatasync`.
    pub fn flush(&self) -> Result<()> {
        self.flush_recording_salvage(false)
    }

    /// [`flush`](Self::flush); `force` records pending salvage fields whatever the lag (close, snapshot).
    fn flush_recording_salvage(&self, force: bool) -> Result<()> {
        let o = self.current()?;
        let wrote = self.written.swap(false, Ordering::SeqCst);
        let unrecorded = self.salvage_unrecorded.load(Ordering::SeqCst);
        if !wrote && unrecorded == 0 {
            return self.store.flush().map_err(|e| self.err(e));
        }
        let now = now_ns();
        // The time of the last flush that followed a write: this one, or an earlier one not recorded yet.
        let time = if wrote { now } else { unrecorded };
        let recorded = self.salvage_recorded.load(Ordering::SeqCst);
        // A clock that went back counts as due: the recorded time must not stay ahead of the writes.
        let due = force
            || !o.volume.revision_counter_disabled
            || now < recorded
            || now - recorded >= SALVAGE_TIME_LAG_NS;
        let allocated = self.store.allocated_bytes(&self.name).map_err(|e| self.err(e))?;
        let s = SalvageXattr {
            last_modify_time: time,
            allocated_bytes: allocated,
            revision_counter: if o.volume.revision_counter_disabled {
                0
            } else {
                self.counter.load(Ordering::SeqCst)
            },
        };
        let bytes = serde_json::to_vec(&s).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?;
        let res = if due {
            self.store
                .flush_with_xattr(&self.name, XATTR_SALVAGE, &bytes)
                .map(|()| true)
        } else {
            self.store
                .flush_with_xattr_if_journaling(&self.name, XATTR_SALVAGE, &bytes)
        };
        match res {
            Ok(true) => {
                self.salvage_recorded.store(time, Ordering::SeqCst);
                let _ = self.salvage_unrecorded.compare_exchange(
                    unrecorded,
                    0,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                Ok(())
            }
            // Still to record: at a later flush (or close, or snapshot); `status` reports it meanwhile.
            Ok(false) => {
                self.salvage_unrecorded.store(time, Ordering::SeqCst);
                Ok(())
            }
            Err(e) => {
                if wrote {
                    self.written.store(true, Ordering::SeqCst);
                }
                Err(self.err(e))
            }
        }
    }

    /// Whether a flush now would journal a record rather than only sync: the store has map changes to journal,
    /// or the revision counter is on and something was written (its salvage xattr goes in a record). A hint for
    /// the data server ([`data_protocol::BlockBackend::flush_at_pool`]).
    pub fn flush_would_journal(&self) -> bool {
        let counter_on = read_lock(&self.open)
            .as_ref()
            .is_some_and(|o| !o.volume.revision_counter_disabled);
        self.store.flush_would_journal() || (counter_on && self.written.load(Ordering::SeqCst))
    }

    /// The revision counter (0 when disabled).
    pub fn revision_counter(&self) -> u64 {
        self.counter.load(Ordering::SeqCst)
    }

    /// Sets the revision counter (after a rebuild) and makes it durable.
    pub fn set_revision_counter(&self, v: u64) -> Result<()> {
        self.counter.store(v, Ordering::SeqCst);
        self.written.store(true, Ordering::SeqCst);
        self.flush()
    }

    fn update_volume(&self, f: impl FnOnce(&mut VolumeXattr)) -> Result<()> {
        let mut g = write_lock(&self.open);
        let o = g.as_mut().ok_or_else(|| self.not_open())?;
        let mut v = o.volume.clone();
        f(&mut v);
        if v != o.volume {
            self.write_volume_xattr(&v)?;
            o.volume = v;
        }
        Ok(())
    }

    pub fn set_rebuilding(&self, rebuilding: bool) -> Result<()> {
        self.update_volume(|v| v.rebuilding = rebuilding)
    }

    /// Records the listeners' ports (so a restarted daemon binds the same).
    pub fn set_ports(&self, ports: [u16; 3]) -> Result<()> {
        self.update_volume(|v| v.ports = ports)
    }

    /// The recorded ports, read from the store (also when closed).
    pub fn recorded_ports(&self) -> [u16; 3] {
        if let Some(o) = read_lock(&self.open).as_ref() {
            return o.volume.ports;
        }
        self.read_volume_xattr().map_or([0; 3], |v| v.ports)
    }

    /// Takes a snapshot in O(1): the head's data becomes `NAME.snap.SNAP`, the head reads through to it.
    pub fn snapshot(&self, req: &SnapshotRequest) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        self.snapshot_locked(req)
    }

    fn snapshot_locked(&self, req: &SnapshotRequest) -> Result<()> {
        let file = names::resolve_snapshot(&req.name)?;
        let lvol = self.snap_lvol(&file);
        if self.store.lookup(&lvol).is_ok() {
            return Err(ReplicaError::AlreadyExists(format!(
                "snapshot {} ({file})",
                req.name
            )));
        }
        // IO stops for the snapshot (the store's exclusive gate); flush first so the salvage fields are current.
        self.flush_recording_salvage(true)?;
        let meta = SnapshotXattr {
            created: if req.created.is_empty() {
                crate::meta::now_rfc3339()
            } else {
                req.created.clone()
            },
            user_created: req.user_created,
            removed: false,
            labels: req.labels.clone(),
        };
        let snap_bytes =
            serde_json::to_vec(&meta).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?;
        let mut g = write_lock(&self.open);
        let o = g.as_mut().ok_or_else(|| self.not_open())?;
        let mut volume = o.volume.clone();
        volume.head_index += 1;
        let volume_bytes =
            serde_json::to_vec(&volume).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?;
        // The snapshot, its record and the head's new index in one commit (one journal record, one sync).
        self.store
            .snapshot_with_xattrs(
                &self.name,
                &lvol,
                &[(XATTR_SNAPSHOT, &snap_bytes)],
                &[(XATTR_VOLUME, &volume_bytes)],
            )
            .map_err(|e| self.err(e))?;
        o.volume = volume;
        Ok(())
    }

    fn write_snapshot_xattr(&self, lvol: &str, m: &SnapshotXattr) -> Result<()> {
        let bytes = serde_json::to_vec(m).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?;
        self.store
            .set_xattr(lvol, XATTR_SNAPSHOT, &bytes)
            .map_err(|e| self.err(e))
    }

    pub(super) fn snapshot_xattr(&self, lvol: &str) -> Result<SnapshotXattr> {
        match self.store.xattr(lvol, XATTR_SNAPSHOT).map_err(|e| self.err(e))? {
            None => Ok(SnapshotXattr::default()),
            Some(v) => serde_json::from_slice(&v).map_err(|e| ReplicaError::CorruptMeta {
                path: self.store.path().join(lvol),
                reason: format!("xattr {XATTR_SNAPSHOT}: {e}"),
            }),
        }
    }

    /// Grows the volume: a system snapshot `expand-SIZE` (as v1), then the head is resized.
    pub fn expand(&self, size: u64) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        let cur = self.current()?.size;
        if size == cur {
            return Ok(());
        }
        if size < cur || !size.is_multiple_of(BLOCK) {
            return Err(ReplicaError::InvalidArgument(format!(
                "cannot expand from {cur} to {size}: the new size must be larger and a multiple of {BLOCK}"
            )));
        }
        self.snapshot_locked(&SnapshotRequest {
            name: format!("expand-{size}"),
            user_created: false,
            created: String::new(),
            labels: BTreeMap::from([("replica-expansion".to_owned(), size.to_string())]),
        })?;
        let mut g = write_lock(&self.open);
        self.store.resize(&self.name, size).map_err(|e| self.err(e))?;
        if let Some(o) = g.as_mut() {
            o.size = size;
        }
        Ok(())
    }

    /// Reverts to a snapshot: a new empty head over it; the old head's data is discarded, newer snapshots stay.
    pub fn revert(&self, name: &str, _created: &str) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        if self.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "cannot revert while a purge runs".into(),
            ));
        }
        let file = names::resolve_snapshot(name)?;
        let lvol = self.snap_lvol(&file);
        if self.store.lookup(&lvol).is_err() {
            return Err(ReplicaError::NotFound(format!("snapshot {file}")));
        }
        if self.snapshot_xattr(&lvol)?.removed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "snapshot {file} is marked removed"
            )));
        }
        self.put_head_over(&lvol)
    }

    /// A new empty head over snapshot lvol `lvol`, keeping the head's xattrs and size: cloned as `NAME.revert`,
    /// the old head deleted (the commit point), the clone renamed `NAME` (see the module doc).
    fn put_head_over(&self, lvol: &str) -> Result<()> {
        let mut g = write_lock(&self.open);
        let o = g.as_mut().ok_or_else(|| self.not_open())?;
        let mut volume = o.volume.clone();
        volume.head_index += 1;
        let tmp = self.revert_name();
        let bytes = volume_xattr_bytes(&volume)?;
        // The head's own records move to the new head; a backup chain-end marker must outlive a revert too.
        let kept: Vec<(&str, Vec<u8>)> = [XATTR_SALVAGE, XATTR_CHAIN_END, XATTR_ENGINE_GENERATION]
            .into_iter()
            .filter_map(|k| Some((k, self.store.xattr(&self.name, k).ok().flatten()?)))
            .collect();
        let mut xattrs: Vec<(&str, &[u8])> = vec![(XATTR_VOLUME, &bytes)];
        xattrs.extend(kept.iter().map(|(k, v)| (*k, v.as_slice())));
        // The clone, at the volume's size (after an expand, larger than the snapshot) and with the records, in one
        // commit.
        self.store
            .clone_snapshot_with(lvol, &tmp, Some(o.size), &xattrs)
            .map_err(|e| self.err(e))?;
        self.store.delete(&self.name).map_err(|e| self.err(e))?; // commit point
        self.store.rename(&tmp, &self.name).map_err(|e| self.err(e))?;
        o.head = self.store.lookup(&self.name).map_err(|e| self.err(e))?;
        o.volume = volume;
        self.written.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Marks a snapshot removed; the next purge deletes it.
    pub fn mark_removed(&self, name: &str) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        let file = names::resolve_snapshot(name)?;
        let lvol = self.snap_lvol(&file);
        if self.store.lookup(&lvol).is_err() {
            return Err(ReplicaError::NotFound(format!("snapshot {file}")));
        }
        let mut m = self.snapshot_xattr(&lvol)?;
        if !m.removed {
            m.removed = true;
            self.write_snapshot_xattr(&lvol, &m)?;
        }
        Ok(())
    }

    /// Deletes every removed snapshot with at most one child (the store merges it into its child: the clusters
    /// move, only blocks both hold are copied). A removed snapshot with several children (a revert's side branch)
    /// stays, as in v1.
    pub fn purge(&self, ctl: &JobControl) -> Result<()> {
        self.purging.store(true, Ordering::Release);
        let res = self.purge_inner(ctl);
        self.purging.store(false, Ordering::Release);
        res
    }

    fn purge_inner(&self, ctl: &JobControl) -> Result<()> {
        if self.sending.load(Ordering::Acquire) > 0 {
            return Err(ReplicaError::FailedPrecondition(
                "a backup is running or snapshots are being sent to a rebuilding replica; purge after it finishes"
                    .into(),
            ));
        }
        let removed: Vec<String> = self
            .store
            .list()
            .into_iter()
            .filter(|l| self.snap_file(&l.name).is_some())
            .filter(|l| self.snapshot_xattr(&l.name).is_ok_and(|m| m.removed))
            .map(|l| l.name)
            .collect();
        let total = removed.len().max(1);
        for (i, lvol) in removed.iter().enumerate() {
            if ctl.is_cancelled() {
                return Err(ReplicaError::Cancelled);
            }
            let _shape = crate::locks::lock(&self.shape);
            let info = self.store.info(lvol).map_err(|e| self.err(e))?;
            if info.children.len() <= 1 {
                self.store.delete(lvol).map_err(|e| self.err(e))?;
            }
            ctl.set_progress(u32::try_from((i + 1) * 100 / total).unwrap_or(100));
        }
        Ok(())
    }

    /// State and metadata, in the v1 replica's form (head `volume-head-NNN.img`, snapshots
    /// `volume-snap-NAME.img`).
    pub fn status(&self) -> Result<ReplicaStatus> {
        let dir = format!("{}#{}", self.store.path().display(), self.name);
        let Some(o) = read_lock(&self.open).clone() else {
            let state = if self.exists.load(Ordering::SeqCst) {
                "closed"
            } else {
                "initial"
            };
            return Ok(ReplicaStatus {
                state: state.into(),
                dir,
                size: 0,
                sector_size: SECTOR_SIZE,
                head: String::new(),
                parent: String::new(),
                dirty: false,
                rebuilding: false,
                error: String::new(),
                backing_file: String::new(),
                chain: vec![],
                disks: BTreeMap::new(),
                revision_counter: 0,
                revision_counter_disabled: false,
                last_modify_time: 0,
                head_file_size: 0,
                extent_map_runs: 0,
            });
        };
        let head_file = names::head_file(o.volume.head_index);
        // Only this replica's lvols (a store holds every replica of the disk).
        let all = self
            .store
            .list_where(|n| n == self.name || self.snap_file(n).is_some());
        let by_name: BTreeMap<&str, &LvolInfo> = all.iter().map(|l| (l.name.as_str(), l)).collect();
        let file_of = |lvol: &str| -> String {
            if lvol == self.name {
                head_file.clone()
            } else {
                self.snap_file(lvol).unwrap_or_default()
            }
        };
        let mut disks = BTreeMap::new();
        for l in &all {
            let file = file_of(&l.name);
            let meta = if l.name == self.name {
                SnapshotXattr::default()
            } else {
                self.snapshot_xattr(&l.name)?
            };
            disks.insert(
                file.clone(),
                DiskStatus {
                    name: file,
                    parent: l.parent.as_deref().map(&file_of).unwrap_or_default(),
                    children: l
                        .children
                        .iter()
                        .map(|c| file_of(c))
                        .filter(|c| !c.is_empty())
                        .collect(),
                    removed: meta.removed,
                    user_created: meta.user_created,
                    created: meta.created,
                    size: l.allocated_bytes,
                    labels: meta.labels,
                },
            );
        }
        let mut chain = Vec::new();
        let mut cur = Some(self.name.clone());
        let mut backing_file = String::new();
        while let Some(n) = cur {
            if super::backing_image::is_backing_image_lvol(&n) {
                // The backing image is below the chain, as a v1 replica's backing file.
                backing_file = n;
                break;
            }
            chain.push(file_of(&n));
            cur = by_name.get(n.as_str()).and_then(|l| l.parent.clone());
        }
        let head = by_name.get(self.name.as_str());
        let salvage = self.salvage()?;
        Ok(ReplicaStatus {
            state: if o.volume.rebuilding { "rebuilding" } else { "open" }.into(),
            dir,
            size: o.size,
            sector_size: SECTOR_SIZE,
            head: head_file,
            parent: chain.get(1).cloned().unwrap_or_default(),
            dirty: false,
            rebuilding: o.volume.rebuilding,
            error: String::new(),
            backing_file,
            chain,
            disks,
            revision_counter: if o.volume.revision_counter_disabled {
                0
            } else {
                self.revision_counter()
            },
            revision_counter_disabled: o.volume.revision_counter_disabled,
            // Flushed but not recorded yet (at most SALVAGE_TIME_LAG_NS old): what salvage compares while this
            // daemon runs, as a v1 head file's mtime is current in memory before the file system persists it.
            last_modify_time: salvage
                .last_modify_time
                .max(self.salvage_unrecorded.load(Ordering::SeqCst)),
            head_file_size: head.map_or(0, |h| h.allocated_bytes),
            extent_map_runs: 0,
        })
    }
}

/// Rebuild (`super::rebuild`): sending snapshot lvols, receiving them as `NAME.rcv.SNAP`, and the crash-ordered
/// commit that puts the head over them.
impl LvolReplica {
    fn is_received(&self, lvol: &str) -> bool {
        lvol.strip_prefix(&self.name)
            .is_some_and(|r| r.starts_with(RCV_INFIX) || r.starts_with(RCVW_INFIX))
    }

    fn rcv_lvol(&self, file: &str) -> String {
        format!(
            "{}{RCV_INFIX}{}",
            self.name,
            names::snapshot_name(file).unwrap_or(file)
        )
    }

    fn rcvw_lvol(&self, file: &str) -> String {
        format!(
            "{}{RCVW_INFIX}{}",
            self.name,
            names::snapshot_name(file).unwrap_or(file)
        )
    }

    /// Snapshot `file` (`volume-snap-X.img`) as read-only sparse content for a rebuild; purges wait until the
    /// guard is dropped.
    pub fn snapshot_for_sending(
        &self,
        file: &str,
    ) -> Result<(super::snapshot_view::LvolSnapshot, Sending<'_>)> {
        self.sending.fetch_add(1, Ordering::AcqRel);
        let guard = Sending(&self.sending);
        if self.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "a purge is running; rebuild after it".into(),
            ));
        }
        let lvol = self.snap_lvol(file);
        let id = self
            .store
            .lookup(&lvol)
            .map_err(|_| ReplicaError::NotFound(format!("snapshot {file}")))?;
        let size = self.store.size_of(id).map_err(|e| self.err(e))?;
        Ok((
            super::snapshot_view::LvolSnapshot::new(self.store.clone(), id, size),
            guard,
        ))
    }

    /// Deletes every lvol a rebuild received and has not put in place.
    pub fn abandon_received(&self) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        let received: Vec<String> = self
            .store
            .list()
            .into_iter()
            .filter(|l| self.is_received(&l.name))
            .map(|l| l.name)
            .collect();
        self.delete_leaves_first(received)
    }

    /// Writes the staged file of snapshot `disk` into the store as `NAME.rcv.SNAP` (see the module doc of
    /// `super::rebuild`) and removes the staged file. Its parent must have been received before it; a root
    /// (no parent) is a clone of `backing_image` (this store's copy of the source's image) when given, as the
    /// source's root is a clone of its store's copy — the staged file holds only the blocks the root holds itself.
    pub fn import_received(
        &self,
        staged: &std::path::Path,
        disk: &corral_proto::v1::DiskInfo,
        backing_image: Option<&str>,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::open(staged).map_err(|e| ReplicaError::io("open", staged, e))?;
        let size = file
            .metadata()
            .map_err(|e| ReplicaError::io("stat", staged, e))?
            .len();
        if size == 0 || !size.is_multiple_of(BLOCK) {
            return Err(ReplicaError::InvalidArgument(format!(
                "received snapshot {} has size {size}, not a positive multiple of {BLOCK}",
                disk.name
            )));
        }
        let (w, s) = (self.rcvw_lvol(&disk.name), self.rcv_lvol(&disk.name));
        for n in [&w, &s] {
            if self.store.lookup(n).is_ok() {
                self.store.delete(n).map_err(|e| self.err(e))?;
            }
        }
        let parent = match (disk.parent.is_empty(), backing_image) {
            (true, None) => None,
            (true, Some(bi)) => Some(bi.to_owned()),
            (false, _) => {
                let p = self.rcv_lvol(&disk.parent);
                if self.store.lookup(&p).is_err() {
                    return Err(ReplicaError::FailedPrecondition(format!(
                        "snapshot {} arrived before its parent {}",
                        disk.name, disk.parent
                    )));
                }
                Some(p)
            }
        };
        let id = if let Some(p) = parent {
            self.store
                .clone_snapshot_with(&p, &w, Some(size), &[])
                .map_err(|e| self.err(e))?
        } else {
            self.store.create_lvol(&w, size).map_err(|e| self.err(e))?
        };
        let mut buf = vec![0u8; 1 << 20];
        for r in corral_disk::sparse::data_extents(&file, 0..size) {
            let r = r.map_err(|e| ReplicaError::io("seek data in", staged, e))?;
            let mut off = r.start;
            while off < r.end {
                let n = usize::try_from((r.end - off).min(buf.len() as u64)).unwrap_or(buf.len());
                file.read_exact_at(&mut buf[..n], off)
                    .map_err(|e| ReplicaError::io("read", staged, e))?;
                self.store.write_at(id, off, &buf[..n]).map_err(|e| self.err(e))?;
                off += n as u64;
            }
        }
        self.store.flush().map_err(|e| self.err(e))?;
        self.store.snapshot(&w, &s).map_err(|e| self.err(e))?;
        self.store.delete(&w).map_err(|e| self.err(e))?;
        self.write_snapshot_xattr(
            &s,
            &SnapshotXattr {
                created: disk.created.clone(),
                user_created: disk.user_created,
                removed: disk.removed,
                labels: disk.labels.clone().into_iter().collect(),
            },
        )?;
        std::fs::remove_file(staged).map_err(|e| ReplicaError::io("remove", staged, e))
    }

    /// Puts the head over the received snapshots: the head's parent (the engine's rebuild snapshot, taken here
    /// too) is replaced by its received copy in one journaled `reparent` — the commit point — then the old
    /// snapshots are deleted and the received ones renamed `NAME.snap.SNAP`.
    pub fn commit_received(&self, files: &[corral_proto::v1::DiskInfo]) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        let _open = write_lock(&self.open);
        let parent = self.store.info(&self.name).map_err(|e| self.err(e))?.parent;
        let Some(file) = parent.as_deref().and_then(|p| self.snap_file(p)) else {
            return Err(ReplicaError::FailedPrecondition(format!(
                "replica {}: the head has no snapshot under it (the engine takes one before a rebuild)",
                self.name
            )));
        };
        if !files.iter().any(|f| f.name == file) {
            return Err(ReplicaError::FailedPrecondition(format!(
                "the source has no snapshot {file}, the rebuilt head's parent"
            )));
        }
        self.store
            .reparent(&self.name, &self.rcv_lvol(&file))
            .map_err(|e| self.err(e))?;
        self.finish_received()
    }

    /// Makes received snapshot `file` the replica's data, as a clone (`super::clone`): a new empty head over
    /// `NAME.rcv.SNAP` (`put_head_over`, whose delete of the old head is the commit point),
    /// then, as after a rebuild, the replica's older snapshots are deleted and the received one renamed
    /// `NAME.snap.SNAP`. Loading finishes or undoes an interrupted one as it does a rebuild.
    pub fn commit_clone(&self, file: &str) -> Result<()> {
        let _shape = crate::locks::lock(&self.shape);
        if self.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "cannot commit a clone while a purge runs".into(),
            ));
        }
        self.put_head_over(&self.rcv_lvol(file))?;
        self.finish_received()
    }

    /// The names of the lvols in the head's tree (its root snapshot and everything under it; a backing image
    /// under the root is not part of it).
    fn head_tree(&self) -> std::collections::BTreeSet<String> {
        let all = self.store.list();
        let by_name: BTreeMap<&str, &LvolInfo> = all.iter().map(|l| (l.name.as_str(), l)).collect();
        let mut root = self.name.clone();
        // A backing image is shared by every replica on it: the tree starts above it.
        while let Some(p) = by_name
            .get(root.as_str())
            .and_then(|l| l.parent.clone())
            .filter(|p| !super::backing_image::is_backing_image_lvol(p))
        {
            root = p;
        }
        let mut tree = std::collections::BTreeSet::new();
        let mut todo = vec![root];
        while let Some(n) = todo.pop() {
            if let Some(l) = by_name.get(n.as_str()) {
                todo.extend(l.children.iter().cloned());
            }
            tree.insert(n);
        }
        tree
    }

    /// After the commit: deletes what is not in the head's tree (the old snapshots) and what is half written,
    /// then renames the received snapshots into place. Idempotent (load runs it again after a crash).
    fn finish_received(&self) -> Result<()> {
        let half: Vec<String> = self
            .store
            .list()
            .into_iter()
            .filter(|l| {
                l.name
                    .strip_prefix(&self.name)
                    .is_some_and(|r| r.starts_with(RCVW_INFIX))
            })
            .map(|l| l.name)
            .collect();
        self.delete_leaves_first(half)?;
        let tree = self.head_tree();
        let old: Vec<String> = self
            .store
            .list()
            .into_iter()
            .filter(|l| self.snap_file(&l.name).is_some() && !tree.contains(&l.name))
            .map(|l| l.name)
            .collect();
        self.delete_leaves_first(old)?;
        for l in self.store.list() {
            if let Some(snap) = l
                .name
                .strip_prefix(&self.name)
                .and_then(|r| r.strip_prefix(RCV_INFIX))
            {
                let to = format!("{}{SNAP_INFIX}{snap}", self.name);
                self.store.rename(&l.name, &to).map_err(|e| self.err(e))?;
            }
        }
        Ok(())
    }

    /// At load: a rebuild that crashed before its commit is undone, one after it is finished.
    fn finish_rebuild(&self) -> Result<()> {
        let all = self.store.list();
        if !all.iter().any(|l| self.is_received(&l.name)) {
            return Ok(());
        }
        let by_name: BTreeMap<&str, &LvolInfo> = all.iter().map(|l| (l.name.as_str(), l)).collect();
        let mut committed = false;
        let mut cur = by_name.get(self.name.as_str()).and_then(|l| l.parent.clone());
        while let Some(p) = cur {
            committed |= self.is_received(&p);
            cur = by_name.get(p.as_str()).and_then(|l| l.parent.clone());
        }
        if committed {
            tracing::info!(replica = %self.name, "finishing a committed rebuild");
            self.finish_received()
        } else {
            tracing::info!(replica = %self.name, "deleting the snapshots of an unfinished rebuild");
            let received = all
                .into_iter()
                .filter(|l| self.is_received(&l.name))
                .map(|l| l.name)
                .collect();
            self.delete_leaves_first(received)
        }
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// The head's `corral.volume` record as stored.
fn volume_xattr_bytes(v: &VolumeXattr) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lvstore::FormatOptions;

    fn store(dir: &std::path::Path) -> Arc<LvStore> {
        let p = dir.join("disk.img");
        std::fs::File::create(&p).unwrap().set_len(64 << 20).unwrap();
        Arc::new(
            LvStore::format(
                &p,
                &FormatOptions {
                    cluster_size: 64 << 10,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    }

    fn snap(r: &LvolReplica, name: &str) {
        r.snapshot(&SnapshotRequest {
            name: name.into(),
            user_created: true,
            ..Default::default()
        })
        .unwrap();
    }

    fn read(r: &LvolReplica, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        r.read_at(off, &mut b).unwrap();
        b
    }

    #[test]
    fn snapshot_revert_expand_and_purge_keep_each_snapshots_data() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        assert_eq!(r.status().unwrap().state, "initial");
        r.create(1 << 20, false, [1, 2, 3]).unwrap();
        r.write_at(0, &[1u8; 8192]).unwrap();
        snap(&r, "s1");
        r.write_at(4096, &[2u8; 4096]).unwrap();
        snap(&r, "s2");
        r.write_at(0, &[3u8; 512]).unwrap();
        let st = r.status().unwrap();
        assert_eq!(
            st.chain,
            ["volume-head-002.img", "volume-snap-s2.img", "volume-snap-s1.img"]
        );
        assert_eq!(st.revision_counter, 3);
        // Remove and purge the middle snapshot: the data reads the same.
        let before = read(&r, 0, 16384);
        r.mark_removed("s1").unwrap();
        r.purge(&JobControl::default()).unwrap();
        assert_eq!(read(&r, 0, 16384), before);
        assert_eq!(
            r.status().unwrap().chain,
            ["volume-head-002.img", "volume-snap-s2.img"]
        );
        // Revert to s2: the head's writes are gone, s2's data is back.
        r.revert("s2", "").unwrap();
        assert_eq!(read(&r, 0, 8192), [[1u8; 4096], [2u8; 4096]].concat());
        // Expand: the new range reads zeros and takes writes; the volume settings survive a reload.
        r.expand(2 << 20).unwrap();
        assert_eq!(read(&r, (2 << 20) - 4096, 4096), vec![0u8; 4096]);
        r.write_at((2 << 20) - 4096, &[9u8; 4096]).unwrap();
        r.flush().unwrap();
        let salvage = r.salvage().unwrap();
        assert!(salvage.last_modify_time > 0 && salvage.allocated_bytes >= 4096);
        assert_eq!(salvage.revision_counter, r.revision_counter());
        drop(r);
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        assert_eq!(r.size(), 2 << 20);
        assert_eq!(r.recorded_ports(), [1, 2, 3]);
        assert_eq!(read(&r, (2 << 20) - 4096, 4096), vec![9u8; 4096]);
        assert_eq!(r.revision_counter(), salvage.revision_counter);
        s.check().unwrap();
        // Deleting the replica deletes every lvol of it.
        r.delete().unwrap();
        assert!(s.list().is_empty(), "{:?}", s.list());
    }

    #[test]
    fn with_the_counter_off_a_flush_that_allocated_nothing_journals_nothing_and_close_records_the_salvage_time()
     {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let commits = || s.space().journal_commits;
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        r.create(1 << 20, true, [1, 2, 3]).unwrap();
        // A write that allocates: the flush journals the map change, and the salvage fields ride along.
        r.write_at(0, &[1u8; 4096]).unwrap();
        let c0 = commits();
        r.flush().unwrap();
        assert_eq!(commits(), c0 + 1);
        let first = r.salvage().unwrap();
        assert!(
            first.last_modify_time > 0 && first.allocated_bytes >= 4096,
            "{first:?}"
        );
        // A rewrite of the allocated block: one fdatasync, no journal record, the salvage fields as they were.
        r.write_at(0, &[2u8; 4096]).unwrap();
        r.flush().unwrap();
        assert_eq!(commits(), c0 + 1, "a rewrite's flush journaled a record");
        assert_eq!(r.salvage().unwrap(), first);
        // Once the recorded time is SALVAGE_TIME_LAG_NS old, the next flush records it even without allocating.
        r.salvage_recorded
            .store(first.last_modify_time - SALVAGE_TIME_LAG_NS, Ordering::SeqCst);
        r.flush().unwrap();
        assert_eq!(commits(), c0 + 2);
        let second = r.salvage().unwrap();
        assert!(second.last_modify_time > first.last_modify_time);
        // Close records what a rewrite left pending, whatever its age.
        r.write_at(0, &[3u8; 4096]).unwrap();
        r.flush().unwrap();
        assert_eq!(r.salvage().unwrap(), second);
        // Not recorded, but reported while the daemon runs (what salvage compares after an engine crash).
        let reported = r.status().unwrap().last_modify_time;
        assert!(reported > second.last_modify_time);
        r.close().unwrap();
        assert_eq!(r.salvage().unwrap().last_modify_time, reported);
        assert_eq!(read_back(&s, 4096), vec![3u8; 4096]);
        s.check().unwrap();
    }

    #[test]
    fn with_the_counter_on_every_flush_after_a_write_records_the_counter() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        r.create(1 << 20, false, [1, 2, 3]).unwrap();
        r.write_at(0, &[1u8; 4096]).unwrap();
        r.flush().unwrap();
        let c0 = s.space().journal_commits;
        r.write_at(0, &[2u8; 4096]).unwrap();
        r.flush().unwrap();
        assert_eq!(s.space().journal_commits, c0 + 1);
        assert_eq!(r.salvage().unwrap().revision_counter, r.revision_counter());
        assert_eq!(r.revision_counter(), 2);
    }

    fn read_back(s: &Arc<LvStore>, len: usize) -> Vec<u8> {
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        read(&r, 0, len)
    }

    #[test]
    fn an_interrupted_revert_is_finished_or_undone_at_load() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        r.create(1 << 20, false, [0; 3]).unwrap();
        r.write_at(0, &[1u8; 4096]).unwrap();
        snap(&r, "s1");
        r.write_at(0, &[2u8; 4096]).unwrap();
        r.flush().unwrap();
        drop(r);
        // Crashed after the clone, before the old head's delete: undone (the head keeps its writes).
        s.clone_snapshot("r.snap.s1", "r.revert").unwrap();
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        assert_eq!(read(&r, 0, 4096), vec![2u8; 4096]);
        assert!(s.lookup("r.revert").is_err());
        drop(r);
        // Crashed after the delete, before the rename: finished (the reverted head is in place).
        s.clone_snapshot("r.snap.s1", "r.revert").unwrap();
        let v = s.xattr("r", XATTR_VOLUME).unwrap().unwrap();
        s.set_xattr("r.revert", XATTR_VOLUME, &v).unwrap();
        s.delete("r").unwrap();
        assert_eq!(replicas_in(&s), ["r"]);
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        assert_eq!(read(&r, 0, 4096), vec![1u8; 4096]);
        s.check().unwrap();
    }

    /// Stages snapshot `name` (parent `parent`) with `fill` at block 0 and writes it into the store as received.
    fn receive(r: &LvolReplica, dir: &std::path::Path, name: &str, parent: &str, fill: u8) {
        use std::os::unix::fs::FileExt;
        let staged = dir.join(names::snapshot_file(name));
        let f = std::fs::File::create(&staged).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&[fill; 4096], 0).unwrap();
        let disk = corral_proto::v1::DiskInfo {
            name: names::snapshot_file(name),
            parent: if parent.is_empty() {
                String::new()
            } else {
                names::snapshot_file(parent)
            },
            created: "2026-01-01T00:00:00Z".into(),
            user_created: true,
            ..Default::default()
        };
        r.import_received(&staged, &disk, None).unwrap();
        assert!(!staged.exists(), "the staging file is removed");
    }

    fn received_files() -> Vec<corral_proto::v1::DiskInfo> {
        ["s1", "rebuild-x"]
            .iter()
            .map(|n| corral_proto::v1::DiskInfo {
                name: names::snapshot_file(n),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // an expected range list of one range
    fn a_rebuild_is_undone_before_its_commit_and_finished_after_it_at_load() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        r.create(1 << 20, false, [0; 3]).unwrap();
        r.write_at(0, &[9u8; 4096]).unwrap();
        snap(&r, "old"); // a former life's snapshot
        snap(&r, "rebuild-x"); // the engine's rebuild snapshot
        r.write_at(4096, &[7u8; 4096]).unwrap(); // written during the rebuild
        // Crash before the commit: the received lvols go, the replica is as it was.
        receive(&r, t.path(), "s1", "", 1);
        receive(&r, t.path(), "rebuild-x", "s1", 2);
        s.clone_snapshot("r.rcv.rebuild-x", "r.rcvw.next").unwrap(); // a half-written one
        drop(r);
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        assert!(
            s.list().iter().all(|l| !l.name.contains(".rcv")),
            "{:?}",
            s.list()
        );
        assert_eq!(read(&r, 0, 8192), [[9u8; 4096], [7u8; 4096]].concat());
        // A rebuild that fails is cleaned up at once.
        receive(&r, t.path(), "s1", "", 1);
        r.abandon_received().unwrap();
        assert!(s.list().iter().all(|l| !l.name.contains(".rcv")));
        // Receiving a child before its parent is refused.
        let staged = t.path().join("volume-snap-x.img");
        std::fs::File::create(&staged).unwrap().set_len(1 << 20).unwrap();
        let orphan = corral_proto::v1::DiskInfo {
            name: "volume-snap-x.img".into(),
            parent: "volume-snap-nope.img".into(),
            ..Default::default()
        };
        assert!(r.import_received(&staged, &orphan, None).is_err());
        r.abandon_received().unwrap();
        // Crash right after the commit (the reparent): finished at load.
        receive(&r, t.path(), "s1", "", 1);
        receive(&r, t.path(), "rebuild-x", "s1", 2);
        s.reparent("r", "r.rcv.rebuild-x").unwrap();
        drop(r);
        let r = LvolReplica::load(s.clone(), "r").unwrap();
        let st = r.status().unwrap();
        assert_eq!(
            st.chain,
            [
                "volume-head-002.img",
                "volume-snap-rebuild-x.img",
                "volume-snap-s1.img"
            ]
        );
        assert!(st.disks["volume-snap-s1.img"].user_created);
        assert_eq!(read(&r, 0, 8192), [[2u8; 4096], [7u8; 4096]].concat());
        // A full commit through the API gives the same, and the store checks clean.
        receive(&r, t.path(), "s1", "", 3);
        receive(&r, t.path(), "rebuild-x", "s1", 4);
        r.commit_received(&received_files()).unwrap();
        assert_eq!(read(&r, 0, 8192), [[4u8; 4096], [7u8; 4096]].concat());
        assert_eq!(r.status().unwrap().disks.len(), 3);
        assert_eq!(s.check().unwrap().leaked_clusters, 0);
        // The sent view of a snapshot is its own blocks only.
        let (view, _g) = r.snapshot_for_sending("volume-snap-rebuild-x.img").unwrap();
        use corral_disk::sparse::SparseRead;
        let ranges: Vec<_> = view.data_ranges(0..1 << 20).map(Result::unwrap).collect();
        assert_eq!(ranges, [0..4096]);
        assert!(r.purge(&JobControl::default()).is_err(), "no purge while sending");
    }

    #[test]
    fn io_past_the_end_and_on_a_closed_replica_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let s = store(t.path());
        let r = LvolReplica::load(s, "r").unwrap();
        assert!(r.write_at(0, &[1u8; 512]).is_err(), "IO before create");
        r.create(1 << 20, true, [0; 3]).unwrap();
        assert!(matches!(
            r.write_at((1 << 20) - 512, &[0u8; 1024]),
            Err(ReplicaError::OutOfRange { .. })
        ));
        r.write_at(0, &[1u8; 512]).unwrap();
        assert_eq!(r.status().unwrap().revision_counter, 0, "counter disabled");
        r.close().unwrap();
        assert_eq!(r.status().unwrap().state, "closed");
        assert!(r.read_at(0, &mut [0u8; 512]).is_err());
        r.open().unwrap();
        assert_eq!(read(&r, 0, 512), vec![1u8; 512]);
        assert!(r.create(1 << 20, true, [0; 3]).is_err(), "created twice");
        for bad in ["", "a.b", "../x", "a/b", "-x"] {
            assert!(check_replica_name(bad).is_err(), "{bad:?}");
        }
    }
}
