//! [`LvStore`]: an open store. Metadata lives in memory ([`Meta`]) and changes through journaled ops; data IO
//! goes straight to the device at positions the cluster maps give.
//!
//! Concurrency: data IO holds the `gate` shared for its duration; everything that changes the shape of a chain
//! (snapshot, clone, delete, resize, decouple) and every checkpoint holds it exclusively, so no IO is in flight
//! while a cluster changes owner or a freed cluster becomes reusable. A flush journals under the shared gate (IO
//! goes on) and takes it exclusively only to release the clusters unmaps emptied. Journal appends are serialised
//! by `commit_lock`, always taken before the gate. The metadata lock (`inner`) is never held across data IO, except
//! by a one-sync flush reading back the (at most [`MAX_SUMMED_BLOCKS`]) blocks it checksums, with IO stopped.
//!
//! Crash order of a commit (`docs/formats.md`, "lvstore"): `fdatasync` the data; append one journal record (the
//! ops plus the current state of every cluster changed by IO since the last commit); `fdatasync`; only then apply
//! the ops in memory and let freed clusters be reused. When the journal is full, a checkpoint instead: write the
//! whole metadata image to the image area not in use, `fdatasync`, write the next superblock slot naming it
//! (generation + 1, which also retires every journal record), `fdatasync`.
//!
//! Through the page cache, a flush that newly mapped few blocks syncs once: with IO stopped it reads those blocks
//! back and puts their checksums in its record (op 12), then writes the record and `fdatasync`s data and record
//! together. Replay keeps the journal's last record only if its checksummed blocks match (else the crash came
//! inside that sync, before the flush was acknowledged). So those blocks must not change while the record is the
//! last one: a write to one first appends an empty record and syncs it (`seal`). Concurrent flushes share syncs
//! (group commit: a flush that began after another was asked for and completed covers it). One flush leads a
//! round at a time; the others wait for the round that covers them and are woken together when it ends, one
//! of the next round's waiters with them to lead it (`Rounds`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock};

use corral_disk::BLOCK_SIZE;

use crate::alloc::Allocator;
use crate::codec::checksum;
use crate::device::{DataIo, Device};
use crate::error::{Error, FormatError, Result};
use crate::format::{
    self, AREAS_OFF, MAX_CLUSTER, META_ALIGN, MIN_CLUSTER, SB_SLOT, SB_SLOT_BYTES, Superblock,
    SuperblockError,
};
use crate::meta::{Blob, BlobId, BlobKind, ClusterEntry, Meta, Op};

const BS: usize = corral_disk::BLOCK_BYTES;
/// Most blocks a flush checksums into its record to make data and record durable with one `fdatasync` (more: the
/// data is synced first, as with `O_DIRECT`): they are read back with IO stopped.
const MAX_SUMMED_BLOCKS: usize = 256;
/// Bytes of zeros written at a time when format clears the journal.
const JOURNAL_ZERO_CHUNK: usize = 1 << 20;

/// How to lay out a new store.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    /// Bytes per cluster: a power of two in 32 KiB..=64 MiB (default 1 MiB).
    pub cluster_size: u64,
    /// Bytes of each of the two metadata image areas (default: 4 MiB plus one cluster-map entry per cluster).
    pub meta_area: Option<u64>,
    /// Bytes of the journal (default 4 MiB).
    pub journal_len: u64,
    /// Format over an existing lvstore (refused otherwise, so a typo cannot wipe a disk).
    pub force: bool,
}

impl Default for FormatOptions {
    fn default() -> Self {
        Self {
            cluster_size: 1 << 20,
            meta_area: None,
            journal_len: 4 << 20,
            force: false,
        }
    }
}

/// Read-write or read-only (`check`, `info`: nothing on the device changes, not even journal recovery).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    ReadWrite,
    ReadOnly,
}

/// Whether a flush given an xattr journals it when IO left nothing else to journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum XattrAtFlush {
    Always,
    IfJournaling,
}

/// Whether a journal append must `fdatasync` the data before writing its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataFirst {
    /// The record maps blocks IO wrote: their data must be durable before the record that maps them.
    Sync,
    /// The record maps no unsynced data (no cluster changed, or the record checksums what it maps and replay
    /// drops it if one did not land): one `fdatasync` after it covers everything.
    Covered,
}

/// The data-IO gate as held by a write: shared for aligned writes, exclusive for read-modify-write (held for
/// its drop only).
#[expect(dead_code, reason = "the guards are held, never read")]
enum Gate<'a> {
    Read(std::sync::RwLockReadGuard<'a, ()>),
    Write(std::sync::RwLockWriteGuard<'a, ()>),
}

/// Device runs a read resolves at a time (on the stack).
pub const MAX_RUNS: usize = 16;
/// A run: byte offset in the caller's buffer, length, device offset (`None`: a hole).
type Runs = [(usize, usize, Option<u64>); MAX_RUNS];

struct Inner {
    sb: Superblock,
    meta: Meta,
    alloc: Allocator,
    /// Bytes of the journal used in this generation, and the next record's sequence number.
    journal_tail: u64,
    seq: u64,
    /// Clusters whose state changed through IO since the last commit.
    dirty: BTreeSet<(BlobId, u64)>,
    /// Blocks (lvol, logical cluster, block) that IO newly mapped since the last commit: what a one-sync flush
    /// checksums into its record. Kept only up to one more than [`MAX_SUMMED_BLOCKS`]: past that the flush syncs
    /// data before its record and needs none of them, so memory stays bounded however much is written between
    /// two flushes (a 64 GiB fill without one would otherwise keep 16 M entries, ~400 MB).
    fresh: Vec<(BlobId, u64, u64)>,
    /// Physical blocks whose checksums are in the journal's last record (or the one being written): no write may
    /// reach them until a later record is durable ([`LvStore::seal`]), or replay could take the changed block for
    /// data that never landed and drop a flushed record.
    unconfirmed: HashSet<u64>,
    /// Blocks each lvol holds itself, counted once on demand ([`LvStore::allocated_bytes`], which a v2 flush asks
    /// for each time) and kept by the write and unmap paths; dropped whenever an op changes the metadata.
    allocated: HashMap<BlobId, u64>,
    poisoned: bool,
    /// A flush took `dirty` (and `fresh`) and has neither made its record durable nor put them back: while it
    /// is set, an empty `dirty` does not mean that every completed write's allocation is durable.
    committing: bool,
    /// Journal records replayed at open (reported by `info`).
    replayed: u64,
    /// Journal records appended and checkpoints written since open (the daemon's metrics).
    journal_commits: u64,
    checkpoints: u64,
    /// Journal records of flushes made durable with their data by one `fdatasync` (block checksums).
    one_sync_flushes: u64,
}

/// An open logical-volume store.
pub struct LvStore {
    dev: Device,
    mode: OpenMode,
    cluster_size: u64,
    data_off: u64,
    inner: Mutex<Inner>,
    gate: RwLock<()>,
    /// Serialises journal appends and checkpoints; taken before `gate` (never the other way round).
    commit_lock: Mutex<()>,
    /// Group commit of flushes ([`LvStore::lead_or_wait`]): the rounds, and the flushes waiting for one, by the
    /// parity of the round they wait for; and how many flushes returned because a round that began after they
    /// arrived had completed.
    rounds: Mutex<Rounds>,
    round_cv: [Condvar; 2],
    shared_flushes: AtomicU64,
    plain_syncs: AtomicU64,
}

/// Flush rounds: one flush leads a round at a time (it journals and syncs for itself and for every flush that
/// arrived before the round began). A flush arriving during round `T` waits for round `T + 1` (on
/// `round_cv[(T + 1) % 2]`); when round `T` ends its waiters are all woken (they are covered) and one waiter of
/// round `T + 1` is woken to lead it. So a round's end wakes the flushes it covers together, and the next round
/// starts after one wake-up, where queueing on a mutex would wake the waiters one after another (on a VM each
/// wake-up of an idle vCPU costs tens of µs) and a waker for the next round only once those before it had gone.
#[derive(Default)]
struct Rounds {
    leading: bool,
    /// Rounds begun, and the last that completed successfully (a failed one wakes every waiter to retry).
    begun: u64,
    done: u64,
    /// Flushes waiting on each of `round_cv` (a round's end wakes none when none waits: no futex call).
    waiting: [u32; 2],
}

/// Held by the flush leading round `round`; dropping it ends the round.
struct Lead<'a> {
    store: &'a LvStore,
    round: u64,
    ok: bool,
}

impl Lead<'_> {
    /// Marks the round complete: every flush that arrived before it began is durable.
    fn completed(&mut self) {
        self.ok = true;
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let s = self.store;
        let mut r = s.rounds.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        r.leading = false;
        let this = usize::from(self.round % 2 == 1);
        if self.ok {
            r.done = self.round;
        }
        // A flush that starts waiting after this unlock sees the round ended (it leads, or returns).
        let waiting = r.waiting;
        drop(r);
        if waiting[this] > 0 {
            s.round_cv[this].notify_all();
        }
        if waiting[1 - this] > 0 {
            if self.ok {
                s.round_cv[1 - this].notify_one();
            } else {
                s.round_cv[1 - this].notify_all();
            }
        }
    }
}

/// One lvol or snapshot, as listed.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LvolInfo {
    pub id: BlobId,
    pub uuid: String,
    pub name: String,
    pub kind: BlobKind,
    /// The snapshot this one reads through to.
    pub parent: Option<String>,
    /// Lvols and snapshots whose parent this is.
    pub children: Vec<String>,
    pub size: u64,
    /// Bytes of 4 KiB blocks written in this blob itself.
    pub allocated_bytes: u64,
    /// Clusters owned.
    pub clusters: u64,
    pub created: u64,
    /// Values that are UTF-8 as text, others as `hex:…`.
    pub xattrs: std::collections::BTreeMap<String, String>,
}

/// Space of the store.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SpaceReport {
    pub device_bytes: u64,
    pub cluster_size: u64,
    pub total_clusters: u64,
    pub used_clusters: u64,
    pub free_clusters: u64,
    /// Bytes before the first cluster: superblocks, image areas, journal.
    pub metadata_bytes: u64,
    pub metadata_image_bytes: u64,
    pub metadata_area_bytes: u64,
    pub journal_used_bytes: u64,
    pub journal_bytes: u64,
    /// Sum of the lvols' sizes (thin: may exceed the device).
    pub provisioned_bytes: u64,
    /// Writable lvols (heads and clones) and read-only snapshots.
    pub lvols: u64,
    pub snapshots: u64,
    /// Journal records appended and metadata checkpoints written since the store was opened.
    pub journal_commits: u64,
    pub checkpoints: u64,
    /// Flush records since open made durable with their data by one `fdatasync` (they carry block checksums).
    pub one_sync_flushes: u64,
    /// Flushes since open that needed no sync of their own: one that began after them completed meanwhile (group
    /// commit of concurrent flushes).
    pub shared_flushes: u64,
    /// Flushes since open that had nothing to journal and no journaling flush to wait for: one `fdatasync` each,
    /// run beside any other flush's (no round).
    pub plain_syncs: u64,
}

/// What `check` found.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckReport {
    pub generation: u64,
    pub journal_records_replayed: u64,
    pub blobs: u64,
    pub owned_clusters: u64,
    /// Clusters marked used that no blob owns and no commit will free (always 0 unless a bug breaks the
    /// invariant).
    pub leaked_clusters: u64,
    pub direct_io: bool,
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn check_name(name: &str) -> Result<()> {
    corral_disk::identity::check_path_component("lvol name", name).map_err(Error::Invalid)
}

/// An lvol's size: a positive multiple of 4 KiB.
fn check_size(size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(BLOCK_SIZE) {
        return Err(Error::Invalid(format!(
            "size {size} is not a positive multiple of 4096"
        )));
    }
    Ok(())
}

impl LvStore {
    fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error + '_ {
        let what = what.into();
        move |source| Error::Io {
            path: self.dev.path().to_owned(),
            what,
            source,
        }
    }

    fn corrupt(path: &Path, source: FormatError) -> Error {
        Error::Corrupt {
            path: path.to_owned(),
            source,
        }
    }

    /// Creates a store on `path` (a block device or a preallocated file; its whole length is used).
    pub fn format(path: &Path, opts: &FormatOptions) -> Result<LvStore> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| Error::Io {
                path: path.to_owned(),
                what,
                source,
            }
        };
        let cs = opts.cluster_size;
        if !cs.is_power_of_two() || !(MIN_CLUSTER..=MAX_CLUSTER).contains(&cs) {
            return Err(Error::Invalid(format!(
                "cluster size {cs} is not a power of two from 32 KiB to 64 MiB"
            )));
        }
        if opts.journal_len < 2 * META_ALIGN || !opts.journal_len.is_multiple_of(META_ALIGN) {
            return Err(Error::Invalid(
                "journal length must be a multiple of 4 KiB, at least 8 KiB".into(),
            ));
        }
        let dev = Device::open(path, true).map_err(io("open"))?;
        if !opts.force {
            let mut head = vec![0u8; 2 * SB_SLOT_BYTES];
            if dev.len() >= 2 * SB_SLOT {
                dev.read_at(&mut head, 0).map_err(io("read the superblocks"))?;
                if head[..8] == format::MAGIC || head[SB_SLOT_BYTES..][..8] == format::MAGIC {
                    return Err(Error::Invalid(format!(
                        "{}: already holds an lvstore; format with force to replace it",
                        path.display()
                    )));
                }
            }
        }
        let len = dev.len();
        let meta_area = opts
            .meta_area
            .unwrap_or_else(|| format::default_meta_area(len / cs, cs))
            .next_multiple_of(META_ALIGN);
        let journal_off = AREAS_OFF + 2 * meta_area;
        let data_off = (journal_off + opts.journal_len).next_multiple_of(cs);
        let cluster_count = len.saturating_sub(data_off) / cs;
        if cluster_count == 0 {
            return Err(Error::Invalid(format!(
                "{}: {len} bytes cannot hold the metadata ({data_off} bytes) and one {cs}-byte cluster",
                path.display()
            )));
        }
        let least = cluster_count * format::entry_bytes(cs) + (64 << 10);
        if meta_area < least {
            return Err(Error::Invalid(format!(
                "a metadata area of {meta_area} bytes cannot map {cluster_count} clusters: it needs at least {least}"
            )));
        }
        let meta = Meta {
            next_id: 1,
            blobs: Default::default(),
        };
        let image = meta.encode();
        let sb = Superblock {
            version: format::VERSION,
            store_uuid: *uuid::Uuid::new_v4().as_bytes(),
            cluster_size: cs,
            device_len: len,
            meta_area_len: meta_area,
            journal_off,
            journal_len: opts.journal_len,
            data_off,
            cluster_count,
            generation: 1,
            image_len: image.len() as u64,
            image_sum: checksum(&image),
        };
        // Old superblocks (a forced format) and the journal's first block go first, so nothing of a previous
        // store can be mistaken for this one's.
        let zero = vec![0u8; 2 * SB_SLOT_BYTES];
        dev.write_at(&zero, 0).map_err(io("clear the superblocks"))?;
        // The whole journal, not only its first block: on a preallocated file its blocks are then written
        // extents, so a record append is a plain overwrite and a flush's last `fdatasync` carries no file-system
        // metadata (an unwritten extent converted per record otherwise, until the journal first wraps).
        let chunk = vec![0u8; JOURNAL_ZERO_CHUNK];
        let mut off = 0;
        while off < opts.journal_len {
            let n = usize::try_from((opts.journal_len - off).min(JOURNAL_ZERO_CHUNK as u64))
                .unwrap_or(JOURNAL_ZERO_CHUNK);
            dev.write_at(&chunk[..n], journal_off + off)
                .map_err(io("clear the journal"))?;
            off += n as u64;
        }
        // Generations 0 and 1 both hold the empty store, so both slots carry the magic from the start (a
        // device cut short inside the superblocks is then recognised as a truncated lvstore).
        let mut sb = sb;
        for generation in [0, 1] {
            sb.generation = generation;
            dev.write_at(&pad(image.clone()), sb.image_off())
                .map_err(io("write the metadata image"))?;
            dev.sync().map_err(io("fdatasync"))?;
            dev.write_at(&sb.encode(), sb.slot_off())
                .map_err(io("write the superblock"))?;
            dev.sync().map_err(io("fdatasync"))?;
        }
        drop(dev);
        Self::open(path, OpenMode::ReadWrite)
    }

    /// Opens the store on `path`: picks the newest valid superblock, loads its checkpoint, replays the journal,
    /// checks the result. Read-write opens that replayed records write a fresh checkpoint at once, so a torn
    /// journal tail is never appended to.
    pub fn open(path: &Path, mode: OpenMode) -> Result<LvStore> {
        Self::open_with(path, mode, DataIo::Direct)
    }

    /// As [`LvStore::open`], with data IO as `io` says (`O_DIRECT` or the page cache; see [`DataIo`]).
    pub fn open_with(path: &Path, mode: OpenMode, io: DataIo) -> Result<LvStore> {
        let dev = Device::open_with(path, mode == OpenMode::ReadWrite, io).map_err(|source| Error::Io {
            path: path.to_owned(),
            what: "open".into(),
            source,
        })?;
        let ioe = |what: &str| {
            let what = what.to_owned();
            move |source| Error::Io {
                path: path.to_owned(),
                what,
                source,
            }
        };
        let sb = read_superblock(&dev, path)?;
        if dev.len() < sb.device_len {
            return Err(Self::corrupt(
                path,
                FormatError::Invalid(format!(
                    "the device has {} bytes, the store was made on {} (truncated)",
                    dev.len(),
                    sb.device_len
                )),
            ));
        }
        let image =
            read_padded(&dev, sb.image_off(), sb.image_len).map_err(ioe("read the metadata image"))?;
        if checksum(&image) != sb.image_sum {
            return Err(Self::corrupt(
                path,
                FormatError::Invalid("metadata image checksum mismatch".into()),
            ));
        }
        let mut meta = Meta::decode(&image, sb.cluster_size).map_err(|e| Self::corrupt(path, e))?;
        let journal = read_padded(&dev, sb.journal_off, sb.journal_len).map_err(ioe("read the journal"))?;
        let (mut tail, mut seq) = (0usize, 0u64);
        let mut records = Vec::new();
        while let Some((payload, n)) =
            format::decode_record(&journal[tail..], &sb.store_uuid, sb.generation, seq)
        {
            let ops =
                crate::meta::decode_ops(payload, sb.cluster_size).map_err(|e| Self::corrupt(path, e))?;
            records.push((ops, n));
            tail += n;
            seq += 1;
        }
        // The last record may have been made durable with its data by one `fdatasync`: it stands only if every
        // block it checksums holds that data (a crash inside that sync may have kept the record and not the data;
        // that flush was never acknowledged, so the state before it is the right one).
        let mut dropped = false;
        if let Some((ops, n)) = records.last()
            && !Self::sums_hold(&dev, &sb, ops).map_err(ioe("read back checksummed blocks"))?
        {
            tail -= n;
            seq -= 1;
            records.pop();
            dropped = true;
        }
        for (i, (ops, _)) in records.into_iter().enumerate() {
            for op in ops {
                meta.apply(op, sb.cluster_size).map_err(|e| {
                    Self::corrupt(path, FormatError::Invalid(format!("journal record {i}: {e}")))
                })?;
            }
        }
        let owners = meta
            .check(sb.cluster_size, sb.cluster_count)
            .map_err(|e| Self::corrupt(path, e))?;
        let alloc = Allocator::new(sb.cluster_count, owners.keys().copied());
        let store = LvStore {
            mode,
            cluster_size: sb.cluster_size,
            data_off: sb.data_off,
            inner: Mutex::new(Inner {
                sb,
                meta,
                alloc,
                journal_tail: tail as u64,
                seq,
                dirty: BTreeSet::new(),
                fresh: Vec::new(),
                unconfirmed: HashSet::new(),
                allocated: HashMap::new(),
                poisoned: false,
                committing: false,
                replayed: seq,
                journal_commits: 0,
                checkpoints: 0,
                one_sync_flushes: 0,
            }),
            gate: RwLock::new(()),
            commit_lock: Mutex::new(()),
            rounds: Mutex::new(Rounds::default()),
            round_cv: [Condvar::new(), Condvar::new()],
            shared_flushes: AtomicU64::new(0),
            plain_syncs: AtomicU64::new(0),
            dev,
        };
        if mode == OpenMode::ReadWrite && (seq > 0 || dropped) {
            let _g = store.gate_write();
            let mut inner = store.lock();
            store.checkpoint(&mut inner, None)?;
        }
        Ok(store)
    }

    /// Whether every block checksummed by `ops` (a journal record's) holds the data the checksum was taken of.
    fn sums_hold(dev: &Device, sb: &Superblock, ops: &[Op]) -> std::io::Result<bool> {
        let blocks = sb.cluster_count * (sb.cluster_size / BLOCK_SIZE);
        let mut buf = vec![0u8; BS];
        for op in ops {
            if let Op::BlockSums { sums } = op {
                for &(block, sum) in sums {
                    if block >= blocks {
                        return Ok(false);
                    }
                    dev.read_at(&mut buf, sb.data_off + block * BLOCK_SIZE)?;
                    if checksum(&buf) != sum {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn gate_read(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.gate
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn gate_write(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.gate
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The device path.
    pub fn path(&self) -> &Path {
        self.dev.path()
    }

    /// Whether data IO uses `O_DIRECT`.
    pub fn direct_io(&self) -> bool {
        self.dev.direct()
    }

    pub fn cluster_size(&self) -> u64 {
        self.cluster_size
    }

    /// The store's UUID, set at format (what names a disk's copy of a v2 backing image, `bi-NAME-disk-UUID`).
    pub fn uuid(&self) -> String {
        uuid::Uuid::from_bytes(self.lock().sb.store_uuid).to_string()
    }

    fn writable(&self) -> Result<()> {
        if self.mode == OpenMode::ReadOnly {
            return Err(Error::Invalid(format!(
                "{}: opened read-only",
                self.path().display()
            )));
        }
        Ok(())
    }

    // ---- commits ----

    /// Journals the dirty cluster states and `ops`, then applies `ops` (see the module doc for the order).
    fn commit(&self, inner: &mut Inner, ops: Vec<Op>) -> Result<()> {
        if inner.poisoned {
            return Err(Error::Poisoned {
                path: self.path().to_owned(),
            });
        }
        inner
            .meta
            .validate_all(&ops, self.cluster_size)
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let mut all: Vec<Op> = inner
            .dirty
            .iter()
            .filter_map(|&(id, l)| {
                let b = inner.meta.blobs.get(&id)?;
                Some(Op::Cluster {
                    id,
                    lcluster: l,
                    entry: b.clusters.get(&l).cloned(),
                })
            })
            .collect();
        let n_dirty = all.len();
        all.extend(ops);
        let record = format::encode_record(
            &inner.sb.store_uuid,
            inner.sb.generation,
            inner.seq,
            &crate::meta::encode_ops(&all),
        );
        if inner.journal_tail + record.len() as u64 > inner.sb.journal_len {
            return self.checkpoint(inner, Some(all.split_off(n_dirty)));
        }
        self.append_record(inner, &record, DataFirst::Sync)?;
        inner.allocated.clear();
        for op in all.split_off(n_dirty) {
            let freed = inner
                .meta
                .apply(op, self.cluster_size)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            for c in freed {
                inner.alloc.release(c);
            }
        }
        inner.dirty.clear();
        inner.fresh.clear();
        inner.unconfirmed.clear();
        inner.alloc.committed();
        Ok(())
    }

    /// Appends `record` at the journal's tail and makes it durable ([`LvStore::write_record`] under the metadata
    /// lock, then [`LvStore::record_written`]); the caller holds `commit_lock`.
    fn append_record(&self, inner: &mut Inner, record: &[u8], data_first: DataFirst) -> Result<()> {
        let at = inner.sb.journal_off + inner.journal_tail;
        let res = self.write_record(record, at, data_first);
        self.record_written(inner, record.len(), res)
    }

    /// The IO of every journal append: `fdatasync` the data first when the record maps blocks whose data must
    /// land before it ([`DataFirst::Sync`]), write the record at device offset `at`, `fdatasync`. Takes no lock:
    /// a flush writes its record with IO going on; the caller holds `commit_lock`, so the tail cannot move.
    fn write_record(&self, record: &[u8], at: u64, data_first: DataFirst) -> std::io::Result<()> {
        if data_first == DataFirst::Sync {
            self.dev.sync()?;
        }
        self.dev.write_at(record, at)?;
        self.dev.sync()
    }

    /// Accounts a record of `len` bytes written by [`LvStore::write_record`] with result `res`: on success the
    /// tail, sequence number and commit count move past it; on failure the store is poisoned (the record may
    /// or may not be on the device, so nothing more may be appended after it).
    fn record_written(&self, inner: &mut Inner, len: usize, res: std::io::Result<()>) -> Result<()> {
        if let Err(e) = res {
            inner.poisoned = true;
            return Err(self.io("append to the journal")(e));
        }
        inner.journal_tail += len as u64;
        inner.seq += 1;
        inner.journal_commits += 1;
        Ok(())
    }

    /// Writes the whole metadata (with `ops` applied) as the next generation's checkpoint.
    fn checkpoint(&self, inner: &mut Inner, ops: Option<Vec<Op>>) -> Result<()> {
        if inner.poisoned {
            return Err(Error::Poisoned {
                path: self.path().to_owned(),
            });
        }
        let mut meta = inner.meta.clone();
        let mut freed = Vec::new();
        for op in ops.unwrap_or_default() {
            freed.extend(
                meta.apply(op, self.cluster_size)
                    .map_err(|e| Error::Invalid(e.to_string()))?,
            );
        }
        let image = meta.encode();
        if image.len() as u64 > inner.sb.meta_area_len {
            return Err(Error::MetadataFull {
                path: self.path().to_owned(),
                area: inner.sb.meta_area_len,
                need: image.len() as u64,
            });
        }
        let mut sb = inner.sb.clone();
        sb.generation += 1;
        sb.image_len = image.len() as u64;
        sb.image_sum = checksum(&image);
        let res = self
            .dev
            .sync()
            .and_then(|()| self.dev.write_at(&pad(image), sb.image_off()))
            .and_then(|()| self.dev.sync())
            .and_then(|()| self.dev.write_at(&sb.encode(), sb.slot_off()))
            .and_then(|()| self.dev.sync());
        if let Err(e) = res {
            inner.poisoned = true;
            return Err(self.io("write a metadata checkpoint")(e));
        }
        inner.sb = sb;
        inner.meta = meta;
        inner.allocated.clear();
        inner.journal_tail = 0;
        inner.seq = 0;
        inner.checkpoints += 1;
        for c in freed {
            inner.alloc.release(c);
        }
        inner.dirty.clear();
        inner.fresh.clear();
        inner.unconfirmed.clear();
        inner.alloc.committed();
        Ok(())
    }

    /// Appends a record with no ops and syncs it, so the journal's last record no longer carries block checksums
    /// (`unconfirmed` empties); the caller holds `commit_lock`. The record before it was synced already, so one
    /// `fdatasync` makes it durable; no data needs to be. `Ok(false)`: the journal is full, nothing written (a
    /// checkpoint, which retires every record, is the way out).
    fn seal_locked(&self, inner: &mut Inner) -> Result<bool> {
        if inner.unconfirmed.is_empty() {
            return Ok(true);
        }
        if inner.poisoned {
            return Err(Error::Poisoned {
                path: self.path().to_owned(),
            });
        }
        let record = format::encode_record(
            &inner.sb.store_uuid,
            inner.sb.generation,
            inner.seq,
            &crate::meta::encode_ops(&[]),
        );
        if inner.journal_tail + record.len() as u64 > inner.sb.journal_len {
            return Ok(false);
        }
        self.append_record(inner, &record, DataFirst::Covered)?;
        inner.unconfirmed.clear();
        Ok(true)
    }

    /// [`LvStore::seal_locked`] for a caller holding `commit_lock` and the gate exclusively (a delete or decouple
    /// about to copy blocks), checkpointing when the journal is full.
    fn seal_exclusive(&self, inner: &mut Inner) -> Result<()> {
        if self.seal_locked(inner)? {
            return Ok(());
        }
        self.commit(inner, Vec::new())
    }

    /// Makes a later record durable than the one whose checksums cover a block in lvol `id`'s `[offset, offset +
    /// len)`, if any (a write there must wait for it); waits for a flush in progress first (`commit_lock`).
    fn seal(&self, id: BlobId, offset: u64, len: u64) -> Result<()> {
        let _c = self.commit_guard();
        let mut inner = self.lock();
        if !self.must_seal(&inner, id, offset, len) {
            return Ok(());
        }
        if self.seal_locked(&mut inner)? {
            return Ok(());
        }
        // The journal is full: a checkpoint retires every record (IO stops for it).
        drop(inner);
        let _g = self.gate_write();
        let mut inner = self.lock();
        self.seal_exclusive(&mut inner)
    }

    /// Whether a write to lvol `id`'s `[offset, offset + len)` touches a block of `unconfirmed`.
    fn must_seal(&self, inner: &Inner, id: BlobId, offset: u64, len: u64) -> bool {
        if inner.unconfirmed.is_empty() {
            return false;
        }
        let Some(b) = inner.meta.blobs.get(&id) else {
            return false;
        };
        let bpc = self.cluster_size / BLOCK_SIZE;
        let mut block = offset / BLOCK_SIZE;
        while block * BLOCK_SIZE < offset + len {
            let (lc, blk) = (block / bpc, block % bpc);
            if let Some(e) = b.clusters.get(&lc)
                && inner.unconfirmed.contains(&(e.phys * bpc + blk))
            {
                return true;
            }
            block += 1;
        }
        false
    }

    /// Waits for a flush round ([`Rounds`]): `None` when one that began after this call has completed (only
    /// if `may_share`: the flush has nothing of its own to journal), else `Some` once this flush leads a round.
    fn lead_or_wait(&self, may_share: bool) -> Option<Lead<'_>> {
        let mut r = self
            .rounds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let arrived = r.begun;
        loop {
            if may_share && r.done > arrived {
                return None;
            }
            if !r.leading {
                r.leading = true;
                r.begun += 1;
                return Some(Lead {
                    store: self,
                    round: r.begun,
                    ok: false,
                });
            }
            // Covered by round `arrived + 1` (the one in progress, or the next); a flush that must lead
            // waits for the next round whichever it is.
            let want = if may_share { arrived + 1 } else { r.begun + 1 };
            let cv = usize::from(want % 2 == 1);
            r.waiting[cv] += 1;
            r = self.round_cv[cv]
                .wait(r)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            r.waiting[cv] -= 1;
        }
    }

    fn commit_guard(&self) -> MutexGuard<'_, ()> {
        self.commit_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes every completed write and its allocation durable, without stopping IO: the states of the changed
    /// clusters are taken under the metadata lock, then synced and journaled while IO goes on (a write that
    /// changes a cluster meanwhile marks it changed again, for the next flush). Only releasing the clusters
    /// unmapped before the flush waits for in-flight IO (a read that resolved to one must finish before it can be
    /// reused). A journal too full for the record falls back to an exclusive checkpoint.
    pub fn flush(&self) -> Result<()> {
        self.flush_and(None, XattrAtFlush::Always).map(drop)
    }

    /// Whether a flush now would journal a record (IO changed the map since the last commit) rather than only
    /// `fdatasync`: a hint for where to run it (journaling flushes share their work when several run at once).
    pub fn flush_would_journal(&self) -> bool {
        !self.lock().dirty.is_empty()
    }

    /// [`LvStore::flush`], setting xattr `key` of lvol `name` to `value` in the same journal record (one
    /// append and its two `fdatasync`s for both, and IO goes on meanwhile, where a separate
    /// [`LvStore::set_xattr`] would stop IO and sync twice more).
    pub fn flush_with_xattr(&self, name: &str, key: &str, value: &[u8]) -> Result<()> {
        self.writable()?;
        self.flush_and(Some((name, key, value)), XattrAtFlush::Always)
            .map(drop)
    }

    /// [`LvStore::flush`], setting xattr `key` of lvol `name` to `value` only when the flush journals a record
    /// anyway (IO changed the map since the last commit): a flush with nothing to journal stays one `fdatasync`
    /// and leaves the xattr as it was. Returns whether the xattr was set.
    pub fn flush_with_xattr_if_journaling(&self, name: &str, key: &str, value: &[u8]) -> Result<bool> {
        self.writable()?;
        self.flush_and(Some((name, key, value)), XattrAtFlush::IfJournaling)
    }

    /// A flush's fast path: nothing to journal and no journaling flush in progress means every write completed
    /// before this call changed only data, which one `fdatasync` makes durable. It runs beside any other flush's
    /// sync (as two v1 flushes of one file do), where a round would have it wait for the one in progress to end
    /// first (the engine's two connections to a replica each send flushes). Returns whether it synced.
    fn sync_if_nothing_to_journal(&self) -> Result<bool> {
        let inner = self.lock();
        if inner.poisoned {
            return Err(Error::Poisoned {
                path: self.path().to_owned(),
            });
        }
        if !inner.dirty.is_empty() || inner.committing {
            return Ok(false);
        }
        drop(inner);
        self.dev.sync().map_err(self.io("fdatasync"))?;
        self.plain_syncs.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    /// The journal op setting `xattr` (lvol, key, value), validated, refused when the metadata area could not
    /// hold it.
    fn xattr_op(&self, inner: &Inner, xattr: Option<(&str, &str, &[u8])>) -> Result<Option<Op>> {
        let Some((name, key, value)) = xattr else {
            return Ok(None);
        };
        let b = Self::find(&inner.meta, name)?;
        let op = Op::SetXattr {
            id: b.id,
            key: key.to_owned(),
            value: value.to_vec(),
        };
        inner
            .meta
            .validate(&op, self.cluster_size)
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let need = inner.meta.fixed_bytes()
            + Meta::growth(&op)
            + inner.sb.cluster_count * format::entry_bytes(self.cluster_size);
        if need > inner.sb.meta_area_len {
            return Err(Error::MetadataFull {
                path: self.path().to_owned(),
                area: inner.sb.meta_area_len,
                need,
            });
        }
        Ok(Some(op))
    }

    /// The physical blocks of `fresh` (blocks newly mapped) that are still mapped, sorted, and the op carrying
    /// their checksums. No IO may run (the caller holds the gate exclusively), so what is read back is what the
    /// next `fdatasync` makes durable.
    fn sum_fresh(&self, inner: &Inner, fresh: &[(BlobId, u64, u64)]) -> std::io::Result<(Vec<u64>, Op)> {
        let bpc = self.cluster_size / BLOCK_SIZE;
        let mut blocks = fresh
            .iter()
            .filter_map(|&(id, lc, blk)| {
                let e = inner.meta.blobs.get(&id)?.clusters.get(&lc)?;
                e.has(blk).then_some(e.phys * bpc + blk)
            })
            .collect::<Vec<u64>>();
        blocks.sort_unstable();
        blocks.dedup();
        let mut sums = Vec::with_capacity(blocks.len());
        let mut buf = vec![0u8; BS];
        for &block in &blocks {
            self.dev.read_at(&mut buf, self.data_off + block * BLOCK_SIZE)?;
            sums.push((block, checksum(&buf)));
        }
        Ok((blocks, Op::BlockSums { sums }))
    }

    fn flush_and(&self, xattr: Option<(&str, &str, &[u8])>, when: XattrAtFlush) -> Result<bool> {
        if self.mode == OpenMode::ReadOnly {
            return Ok(false);
        }
        // Group commit: a round that began after this flush was asked for and has completed made every write
        // completed before this call durable, with its map: nothing left to do, unless this flush must journal
        // an xattr of its own.
        let may_share = xattr.is_none() || when == XattrAtFlush::IfJournaling;
        if may_share && self.sync_if_nothing_to_journal()? {
            return Ok(false);
        }
        let Some(mut lead) = self.lead_or_wait(may_share) else {
            self.shared_flushes.fetch_add(1, Ordering::SeqCst);
            return Ok(false);
        };
        let _c = self.commit_guard();
        // One `fdatasync` for data and record when the blocks newly mapped are few and in the page cache: the
        // record then carries their checksums, taken with IO stopped (see `docs/formats.md`, crash order).
        // Otherwise (`O_DIRECT`, or many blocks) data is synced before the record, with IO going on.
        let one_sync = |inner: &Inner| {
            !self.dev.direct() && !inner.fresh.is_empty() && inner.fresh.len() <= MAX_SUMMED_BLOCKS
        };
        let gate = if one_sync(&self.lock()) {
            Gate::Write(self.gate_write())
        } else {
            Gate::Read(self.gate_read())
        };
        let (record, dirty, fresh, pending, at, extra, summed) = {
            let mut inner = self.lock();
            if inner.poisoned {
                return Err(Error::Poisoned {
                    path: self.path().to_owned(),
                });
            }
            let extra = self.xattr_op(&inner, xattr)?;
            if inner.dirty.is_empty() && (extra.is_none() || when == XattrAtFlush::IfJournaling) {
                drop(inner);
                drop(gate);
                self.dev.sync().map_err(self.io("fdatasync"))?;
                lead.completed();
                return Ok(false);
            }
            let summed = matches!(gate, Gate::Write(_)) && one_sync(&inner);
            inner.committing = true;
            let dirty = std::mem::take(&mut inner.dirty);
            let fresh = std::mem::take(&mut inner.fresh);
            let mut ops = cluster_ops(&inner.meta, &dirty);
            let mut blocks = Vec::new();
            if summed {
                match self.sum_fresh(&inner, &fresh) {
                    Ok((b, op)) => {
                        blocks = b;
                        ops.push(op);
                    }
                    Err(e) => {
                        inner.committing = false;
                        inner.dirty.extend(dirty);
                        inner.fresh.extend(fresh);
                        return Err(self.io("read back a block to checksum")(e));
                    }
                }
            }
            ops.extend(extra.clone());
            let record = format::encode_record(
                &inner.sb.store_uuid,
                inner.sb.generation,
                inner.seq,
                &crate::meta::encode_ops(&ops),
            );
            if inner.journal_tail + record.len() as u64 > inner.sb.journal_len {
                // Put the changes back and checkpoint with IO stopped.
                inner.committing = false;
                inner.dirty.extend(dirty);
                inner.fresh.extend(fresh);
                drop(inner);
                drop(gate);
                let _g = self.gate_write();
                let mut inner = self.lock();
                let set = extra.is_some();
                self.commit(&mut inner, extra.into_iter().collect())?;
                lead.completed();
                return Ok(set);
            }
            if summed {
                // From here until a later record is durable, writes to these blocks wait (`seal`).
                inner.unconfirmed.extend(blocks.iter().copied());
            }
            let pending = inner.alloc.take_pending();
            (
                record,
                dirty,
                fresh,
                pending,
                inner.sb.journal_off + inner.journal_tail,
                extra,
                summed.then_some(blocks),
            )
        };
        // IO goes on while the record is synced: a write to a block just checksummed waits for `seal`.
        let gate = match gate {
            Gate::Write(g) => {
                drop(g);
                Gate::Read(self.gate_read())
            }
            g => g,
        };
        // Data before a record that maps it (a crash must not leave a block mapped over data that never landed),
        // unless the record checksums every block it newly maps (replay then drops it, as the last record, if
        // one did not land); a record of the xattr alone maps nothing: one `fdatasync` after it covers both.
        let data_first = if dirty.is_empty() || summed.is_some() {
            DataFirst::Covered
        } else {
            DataFirst::Sync
        };
        let res = self.write_record(&record, at, data_first);
        let mut inner = self.lock();
        inner.committing = false;
        if let Err(e) = self.record_written(&mut inner, record.len(), res) {
            inner.dirty.extend(dirty);
            inner.fresh.extend(fresh);
            return Err(e);
        }
        // The record before this one is no longer the last: only this one's blocks (if any) stay covered.
        inner.unconfirmed.clear();
        if let Some(blocks) = summed {
            inner.unconfirmed.extend(blocks);
            inner.one_sync_flushes += 1;
        }
        let set = extra.is_some();
        if let Some(op) = extra {
            // Journaled: now in memory too (validated above; commits are serialised, so it still applies).
            inner
                .meta
                .apply(op, self.cluster_size)
                .map_err(|e| Error::Invalid(e.to_string()))?;
        }
        drop(inner);
        drop(gate);
        lead.completed();
        self.release_freed(pending);
        Ok(set)
    }

    /// Returns to the allocator the clusters that unmaps freed, once the record of the unmaps is durable. IO
    /// stops for it only when there are some (a read that resolved to one must finish first).
    fn release_freed(&self, pending: Vec<u64>) {
        if pending.is_empty() {
            return;
        }
        let _g = self.gate_write();
        let mut inner = self.lock();
        for c in pending {
            inner.alloc.release(c);
        }
    }

    fn op(&self, make: impl FnOnce(&Meta) -> Result<Op>) -> Result<BlobId> {
        self.transaction(|m| make(m).map(|op| vec![op]))
    }

    /// Commits the ops `make` returns as one journal record (all or none after a crash; `commit` checks the whole
    /// transaction with [`Meta::validate_all`] before journaling it); returns the id of the first op's blob.
    fn transaction(&self, make: impl FnOnce(&Meta) -> Result<Vec<Op>>) -> Result<BlobId> {
        self.writable()?;
        let _c = self.commit_guard();
        let _g = self.gate_write();
        let mut inner = self.lock();
        let ops = make(&inner.meta)?;
        // Refused here, before anything is journaled, when the next checkpoint could not hold the metadata (every
        // cluster mapped once at most): a store must never reach a journal it cannot checkpoint.
        let need = inner.meta.fixed_bytes()
            + ops.iter().map(Meta::growth).sum::<u64>()
            + inner.sb.cluster_count * format::entry_bytes(self.cluster_size);
        if need > inner.sb.meta_area_len {
            return Err(Error::MetadataFull {
                path: self.path().to_owned(),
                area: inner.sb.meta_area_len,
                need,
            });
        }
        let id = match &ops[0] {
            Op::Create { id, .. } | Op::Clone { id, .. } | Op::Resize { id, .. } | Op::Rename { id, .. } => {
                *id
            }
            Op::Snapshot { snap, .. } => *snap,
            Op::SetXattr { id, .. }
            | Op::RemoveXattr { id, .. }
            | Op::Delete { id }
            | Op::Detach { id }
            | Op::Reparent { id, .. } => *id,
            Op::Cluster { id, .. } => *id,
            Op::BlockSums { .. } => 0,
        };
        self.commit(&mut inner, ops)?;
        Ok(id)
    }

    // ---- lookups ----

    /// The id of the lvol or snapshot `name`.
    pub fn lookup(&self, name: &str) -> Result<BlobId> {
        self.lock()
            .meta
            .by_name(name)
            .map(|b| b.id)
            .ok_or_else(|| Error::NotFound(name.to_owned()))
    }

    fn find<'a>(meta: &'a Meta, name: &str) -> Result<&'a Blob> {
        meta.by_name(name).ok_or_else(|| Error::NotFound(name.to_owned()))
    }

    /// Every lvol and snapshot, by name.
    pub fn list(&self) -> Vec<LvolInfo> {
        self.list_where(|_| true)
    }

    /// The lvols and snapshots whose names `keep` accepts, by name. One pass over the metadata finds every blob's
    /// children, so a listing costs O(blobs) however many it keeps (a replica's status lists its own chain in a
    /// store of thousands of lvols).
    pub fn list_where(&self, keep: impl Fn(&str) -> bool) -> Vec<LvolInfo> {
        let inner = self.lock();
        let mut children: HashMap<BlobId, Vec<&str>> = HashMap::new();
        for b in inner.meta.blobs.values() {
            if let Some(p) = b.parent {
                children.entry(p).or_default().push(&b.name);
            }
        }
        let mut v: Vec<LvolInfo> = inner
            .meta
            .blobs
            .values()
            .filter(|b| keep(&b.name))
            .map(|b| info_of(&inner.meta, b, children.remove(&b.id).unwrap_or_default()))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// One lvol or snapshot.
    pub fn info(&self, name: &str) -> Result<LvolInfo> {
        let inner = self.lock();
        let b = Self::find(&inner.meta, name)?;
        let children = inner.meta.children(b.id).map(|c| c.name.as_str()).collect();
        Ok(info_of(&inner.meta, b, children))
    }

    /// Bytes of 4 KiB blocks lvol `name` holds itself ([`LvolInfo::allocated_bytes`] without the rest of the
    /// listing: a v2 flush asks for it each time). O(1) but for the first call after an op changed the metadata,
    /// which walks the lvol's cluster map once (`tests/model.rs` checks the kept count against that walk).
    pub fn allocated_bytes(&self, name: &str) -> Result<u64> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let b = Self::find(&inner.meta, name)?;
        let blocks = *inner
            .allocated
            .entry(b.id)
            .or_insert_with(|| b.allocated_bytes() / BLOCK_SIZE);
        Ok(blocks * BLOCK_SIZE)
    }

    /// The size of lvol `id`.
    pub fn size_of(&self, id: BlobId) -> Result<u64> {
        let inner = self.lock();
        inner
            .meta
            .blobs
            .get(&id)
            .map(|b| b.size)
            .ok_or_else(|| Error::NotFound(format!("id {id}")))
    }

    pub fn space(&self) -> SpaceReport {
        let inner = self.lock();
        let sb = &inner.sb;
        let count = |kind| inner.meta.blobs.values().filter(|b| b.kind == kind).count() as u64;
        SpaceReport {
            device_bytes: self.dev.len(),
            cluster_size: sb.cluster_size,
            total_clusters: sb.cluster_count,
            used_clusters: inner.alloc.used(),
            free_clusters: inner.alloc.free(),
            metadata_bytes: sb.data_off,
            metadata_image_bytes: sb.image_len,
            metadata_area_bytes: sb.meta_area_len,
            journal_used_bytes: inner.journal_tail,
            journal_bytes: sb.journal_len,
            provisioned_bytes: inner
                .meta
                .blobs
                .values()
                .filter(|b| b.kind == BlobKind::Lvol)
                .map(|b| b.size)
                .sum(),
            lvols: count(BlobKind::Lvol),
            snapshots: count(BlobKind::Snapshot),
            journal_commits: inner.journal_commits,
            shared_flushes: self.shared_flushes.load(Ordering::SeqCst),
            plain_syncs: self.plain_syncs.load(Ordering::SeqCst),
            one_sync_flushes: inner.one_sync_flushes,
            checkpoints: inner.checkpoints,
        }
    }

    /// Re-checks the metadata in memory (what open checked) and the allocator against it.
    pub fn check(&self) -> Result<CheckReport> {
        let inner = self.lock();
        let owners = inner
            .meta
            .check(self.cluster_size, inner.sb.cluster_count)
            .map_err(|e| Self::corrupt(self.path(), e))?;
        for c in owners.keys() {
            if !inner.alloc.is_used(*c) {
                return Err(Self::corrupt(
                    self.path(),
                    FormatError::Invalid(format!("cluster {c} is owned but marked free")),
                ));
            }
        }
        Ok(CheckReport {
            generation: inner.sb.generation,
            journal_records_replayed: inner.replayed,
            blobs: inner.meta.blobs.len() as u64,
            owned_clusters: owners.len() as u64,
            leaked_clusters: inner
                .alloc
                .used()
                .saturating_sub(owners.len() as u64 + inner.alloc.pending()),
            direct_io: self.dev.direct(),
        })
    }

    // ---- metadata operations ----

    /// Creates a thin lvol of `size` bytes (a multiple of 4 KiB).
    pub fn create_lvol(&self, name: &str, size: u64) -> Result<BlobId> {
        self.create_lvol_with_xattrs(name, size, &[])
    }

    /// [`create_lvol`](Self::create_lvol) with xattrs set in the same commit: after a crash the lvol exists with
    /// all of them or not at all.
    pub fn create_lvol_with_xattrs(&self, name: &str, size: u64, xattrs: &[(&str, &[u8])]) -> Result<BlobId> {
        check_name(name)?;
        self.transaction(|m| {
            if m.by_name(name).is_some() {
                return Err(Error::Exists(name.to_owned()));
            }
            check_size(size)?;
            let id = m.next_id;
            let mut ops = vec![Op::Create {
                id,
                uuid: *uuid::Uuid::new_v4().as_bytes(),
                name: name.to_owned(),
                size,
                created: now(),
            }];
            ops.extend(xattr_ops(id, xattrs));
            Ok(ops)
        })
    }

    /// Snapshots lvol `lvol` as `snapshot` in O(1): the lvol's data becomes the read-only snapshot and the lvol
    /// (same id, name, xattrs) becomes an empty clone of it.
    pub fn snapshot(&self, lvol: &str, snapshot: &str) -> Result<BlobId> {
        self.snapshot_with_xattrs(lvol, snapshot, &[], &[])
    }

    /// [`snapshot`](Self::snapshot) with xattrs set in the same commit: `snapshot_xattrs` on the new snapshot,
    /// `lvol_xattrs` on the lvol (now its clone). One journal record: after a crash the snapshot exists with all of
    /// them or not at all, and the lvol's xattrs changed with it or not.
    pub fn snapshot_with_xattrs(
        &self,
        lvol: &str,
        snapshot: &str,
        snapshot_xattrs: &[(&str, &[u8])],
        lvol_xattrs: &[(&str, &[u8])],
    ) -> Result<BlobId> {
        check_name(snapshot)?;
        self.transaction(|m| {
            let l = Self::find(m, lvol)?;
            if l.kind != BlobKind::Lvol {
                return Err(Error::Invalid(format!(
                    "{lvol:?} is a snapshot; snapshot its clone"
                )));
            }
            if m.by_name(snapshot).is_some() {
                return Err(Error::Exists(snapshot.to_owned()));
            }
            let snap = m.next_id;
            let mut ops = vec![Op::Snapshot {
                lvol: l.id,
                snap,
                uuid: *uuid::Uuid::new_v4().as_bytes(),
                name: snapshot.to_owned(),
                created: now(),
            }];
            ops.extend(xattr_ops(snap, snapshot_xattrs));
            ops.extend(xattr_ops(l.id, lvol_xattrs));
            Ok(ops)
        })
    }

    /// A new writable lvol `name` reading through to `snapshot`.
    pub fn clone_snapshot(&self, snapshot: &str, name: &str) -> Result<BlobId> {
        self.clone_snapshot_with(snapshot, name, None, &[])
    }

    /// [`clone_snapshot`](Self::clone_snapshot) sized `size` (when it is not the snapshot's: growing reads zeros
    /// past the snapshot's end) and with xattrs, in one commit: after a crash the clone exists with its size and
    /// all of them or not at all.
    pub fn clone_snapshot_with(
        &self,
        snapshot: &str,
        name: &str,
        size: Option<u64>,
        xattrs: &[(&str, &[u8])],
    ) -> Result<BlobId> {
        check_name(name)?;
        self.transaction(|m| {
            let s = Self::find(m, snapshot)?;
            if s.kind != BlobKind::Snapshot {
                return Err(Error::Invalid(format!(
                    "{snapshot:?} is not a snapshot: snapshot it first"
                )));
            }
            if m.by_name(name).is_some() {
                return Err(Error::Exists(name.to_owned()));
            }
            let id = m.next_id;
            let mut ops = vec![Op::Clone {
                id,
                uuid: *uuid::Uuid::new_v4().as_bytes(),
                name: name.to_owned(),
                snapshot: s.id,
                created: now(),
            }];
            if let Some(size) = size.filter(|z| *z != s.size) {
                check_size(size)?;
                ops.push(Op::Resize { id, size });
            }
            ops.extend(xattr_ops(id, xattrs));
            Ok(ops)
        })
    }

    /// Grows or shrinks lvol `name` (shrinking frees the clusters past the end; growing reads zeros).
    pub fn resize(&self, name: &str, size: u64) -> Result<()> {
        self.op(|m| {
            let b = Self::find(m, name)?;
            if b.kind != BlobKind::Lvol {
                return Err(Error::Invalid(format!("{name:?} is a snapshot: read-only")));
            }
            check_size(size)?;
            Ok(Op::Resize { id: b.id, size })
        })
        .map(drop)
    }

    pub fn rename(&self, name: &str, new_name: &str) -> Result<()> {
        check_name(new_name)?;
        self.op(|m| {
            let b = Self::find(m, name)?;
            if m.by_name(new_name).is_some_and(|o| o.id != b.id) {
                return Err(Error::Exists(new_name.to_owned()));
            }
            Ok(Op::Rename {
                id: b.id,
                name: new_name.to_owned(),
            })
        })
        .map(drop)
    }

    pub fn set_xattr(&self, name: &str, key: &str, value: &[u8]) -> Result<()> {
        self.op(|m| {
            let b = Self::find(m, name)?;
            let op = Op::SetXattr {
                id: b.id,
                key: key.to_owned(),
                value: value.to_vec(),
            };
            m.validate(&op, self.cluster_size)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            Ok(op)
        })
        .map(drop)
    }

    pub fn remove_xattr(&self, name: &str, key: &str) -> Result<()> {
        self.op(|m| {
            let b = Self::find(m, name)?;
            if !b.xattrs.contains_key(key) {
                return Err(Error::NotFound(format!("xattr {key:?} of {name:?}")));
            }
            Ok(Op::RemoveXattr {
                id: b.id,
                key: key.to_owned(),
            })
        })
        .map(drop)
    }

    pub fn xattr(&self, name: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let inner = self.lock();
        Ok(Self::find(&inner.meta, name)?.xattrs.get(key).cloned())
    }

    /// Deletes an lvol or snapshot without clones. A snapshot with exactly one clone is merged into it first
    /// (the clone takes the snapshot's clusters; where both hold a cluster, the snapshot's blocks the clone lacks
    /// are copied, 4 KiB each), so deleting a middle snapshot of a chain works as in SPDK.
    pub fn delete(&self, name: &str) -> Result<()> {
        self.writable()?;
        let _c = self.commit_guard();
        let _g = self.gate_write();
        let mut inner = self.lock();
        // The merge below writes blocks: none may still be covered by the last record's checksums.
        self.seal_exclusive(&mut inner)?;
        let b = Self::find(&inner.meta, name)?.clone();
        let children: Vec<&Blob> = inner.meta.children(b.id).collect();
        if children.len() > 1 || (children.len() == 1 && b.kind != BlobKind::Snapshot) {
            return Err(Error::Invalid(format!(
                "{name:?} has {} clones ({}); delete or decouple them first",
                children.len(),
                children
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if let Some(child) = children.first() {
            let bpc = self.cluster_size / BLOCK_SIZE;
            let mut buf = vec![0u8; BS];
            for (l, e) in &b.clusters {
                let Some(mine) = child.clusters.get(l) else {
                    continue;
                };
                for blk in 0..bpc {
                    let off = l * self.cluster_size + blk * BLOCK_SIZE;
                    if e.has(blk) && !mine.has(blk) && off < child.parent_limit {
                        self.dev
                            .read_at(&mut buf, self.phys_off(e.phys, blk))
                            .map_err(self.io("merge: read"))?;
                        self.dev
                            .write_at(&buf, self.phys_off(mine.phys, blk))
                            .map_err(self.io("merge: write"))?;
                    }
                }
            }
        }
        self.commit(&mut inner, vec![Op::Delete { id: b.id }])
    }

    /// Puts lvol `name` over snapshot `snapshot`: it reads through to it instead of its current parent (up to the
    /// snapshot's size), keeping its own clusters, id and xattrs. One journaled op, so it is the commit point of a
    /// replica rebuild: the head written since the rebuild began goes over the snapshots received meanwhile.
    pub fn reparent(&self, name: &str, snapshot: &str) -> Result<()> {
        self.op(|m| {
            let b = Self::find(m, name)?;
            if b.kind != BlobKind::Lvol {
                return Err(Error::Invalid(format!(
                    "{name:?} is a snapshot: only an lvol can be re-parented"
                )));
            }
            let s = Self::find(m, snapshot)?;
            if s.kind != BlobKind::Snapshot {
                return Err(Error::Invalid(format!(
                    "{snapshot:?} is not a snapshot: snapshot it first"
                )));
            }
            Ok(Op::Reparent {
                id: b.id,
                parent: s.id,
            })
        })
        .map(drop)
    }

    /// Decouples lvol `name` from its snapshot chain: every block the chain provides is copied into the lvol,
    /// then the lvol forgets its parent (SPDK's decouple; blocks nobody wrote stay thin).
    pub fn decouple(&self, name: &str) -> Result<()> {
        self.writable()?;
        let _c = self.commit_guard();
        let _g = self.gate_write();
        // The copy below writes blocks: none may still be covered by the last record's checksums.
        self.seal_exclusive(&mut self.lock())?;
        let (id, limit) = {
            let inner = self.lock();
            let b = Self::find(&inner.meta, name)?;
            if b.kind != BlobKind::Lvol {
                return Err(Error::Invalid(format!(
                    "{name:?} is a snapshot: decouple its clone"
                )));
            }
            if b.parent.is_none() {
                return Err(Error::Invalid(format!("{name:?} has no parent to decouple from")));
            }
            (b.id, b.parent_limit.min(b.size))
        };
        let mut buf = vec![0u8; BS];
        let mut block = 0;
        while block * BLOCK_SIZE < limit {
            let src = {
                let inner = self.lock();
                let b = &inner.meta.blobs[&id];
                let (lc, blk) = self.split(block * BLOCK_SIZE);
                if b.clusters.get(&lc).is_some_and(|e| e.has(blk)) {
                    None
                } else {
                    self.resolve(&inner.meta, id, block)
                }
            };
            if let Some(src) = src {
                self.dev
                    .read_at(&mut buf, src)
                    .map_err(self.io("decouple: read"))?;
                self.write_blocks(id, block * BLOCK_SIZE, &buf)?;
            }
            block += 1;
        }
        let mut inner = self.lock();
        self.commit(&mut inner, vec![Op::Detach { id }])
    }

    // ---- data IO ----

    fn split(&self, off: u64) -> (u64, u64) {
        (off / self.cluster_size, (off % self.cluster_size) / BLOCK_SIZE)
    }

    fn phys_off(&self, phys: u64, blk: u64) -> u64 {
        self.data_off + phys * self.cluster_size + blk * BLOCK_SIZE
    }

    /// Where block `block` of blob `id` reads from, walking down the chain; `None`: zeros.
    fn resolve(&self, meta: &Meta, id: BlobId, block: u64) -> Option<u64> {
        let off = block * BLOCK_SIZE;
        let (lc, blk) = self.split(off);
        let mut b = meta.blobs.get(&id)?;
        if off >= b.size {
            return None;
        }
        loop {
            if let Some(e) = b.clusters.get(&lc)
                && e.has(blk)
            {
                return Some(self.phys_off(e.phys, blk));
            }
            match b.parent {
                Some(p) if off < b.parent_limit => b = meta.blobs.get(&p)?,
                _ => return None,
            }
        }
    }

    fn check_range(&self, meta: &Meta, id: BlobId, off: u64, len: u64) -> Result<()> {
        let b = meta
            .blobs
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("lvol id {id}")))?;
        if off.checked_add(len).is_none_or(|end| end > b.size) {
            return Err(Error::Invalid(format!(
                "{:?}: range {off}+{len} is past its end ({} bytes)",
                b.name, b.size
            )));
        }
        Ok(())
    }

    /// Fills `buf` from `offset` of lvol or snapshot `id` (any alignment).
    pub fn read_at(&self, id: BlobId, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _g = self.gate_read();
        self.check_range(&self.lock().meta, id, offset, buf.len() as u64)?;
        let start = offset - offset % BLOCK_SIZE;
        let end = (offset + buf.len() as u64).next_multiple_of(BLOCK_SIZE);
        if start == offset && end == offset + buf.len() as u64 {
            return self.read_blocks(id, offset, buf);
        }
        let mut tmp = vec![0u8; usize::try_from(end - start).unwrap_or(0)];
        self.read_blocks(id, start, &mut tmp)?;
        let skip = usize::try_from(offset - start).unwrap_or(0);
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    /// Resolves the blocks of `buf` (`len` bytes at `offset`) from byte `from` on into at most [`MAX_RUNS`]
    /// runs of contiguous device blocks (or holes); returns how many runs and the byte they end at.
    fn resolve_runs(
        &self,
        meta: &Meta,
        id: BlobId,
        offset: u64,
        len: usize,
        from: usize,
        runs: &mut Runs,
    ) -> (usize, usize) {
        let mut n = 0usize;
        let mut pos = from;
        while pos < len {
            let src = self.resolve(meta, id, (offset + pos as u64) / BLOCK_SIZE);
            let extends = n > 0 && {
                let (s, l, d) = runs[n - 1];
                s + l == pos
                    && match (d, src) {
                        (Some(d), Some(x)) => x == d + l as u64,
                        (None, None) => true,
                        _ => false,
                    }
            };
            if extends {
                runs[n - 1].1 += BS;
            } else if n == MAX_RUNS {
                break;
            } else {
                runs[n] = (pos, BS, src);
                n += 1;
            }
            pos += BS;
        }
        (n, pos)
    }

    fn read_blocks(&self, id: BlobId, offset: u64, buf: &mut [u8]) -> Result<()> {
        // Resolve blocks under the lock, then read runs of contiguous device blocks without it (a fixed array of
        // runs at a time: nothing allocated per read).
        let mut runs: Runs = [(0, 0, None); MAX_RUNS];
        let mut pos = 0usize;
        while pos < buf.len() {
            let (n, end) = {
                let inner = self.lock();
                self.resolve_runs(&inner.meta, id, offset, buf.len(), pos, &mut runs)
            };
            for &(s, l, src) in &runs[..n] {
                match src {
                    Some(d) => self
                        .dev
                        .read_at(&mut buf[s..s + l], d)
                        .map_err(self.io(format!("read at {d}")))?,
                    None => buf[s..s + l].fill(0),
                }
            }
            pos = end;
        }
        Ok(())
    }

    /// Fills `buf` from `offset` of `id` only if that needs no wait for the device: every block a hole, or (page
    /// cache IO only) every device block cached. `Ok(false)`: not done (`buf` holds anything), call
    /// [`LvStore::read_at`]. Only 4 KiB-aligned ranges of at most `MAX_RUNS` runs are tried.
    pub fn read_at_nowait(&self, id: BlobId, offset: u64, buf: &mut [u8]) -> Result<bool> {
        if !offset.is_multiple_of(BLOCK_SIZE) || !buf.len().is_multiple_of(BS) {
            return Ok(false);
        }
        let _g = self.gate_read();
        let mut runs: Runs = [(0, 0, None); MAX_RUNS];
        let (n, end) = {
            let inner = self.lock();
            self.check_range(&inner.meta, id, offset, buf.len() as u64)?;
            self.resolve_runs(&inner.meta, id, offset, buf.len(), 0, &mut runs)
        };
        if end < buf.len() {
            return Ok(false);
        }
        for &(s, l, src) in &runs[..n] {
            match src {
                Some(d) => {
                    if !self
                        .dev
                        .read_nowait(&mut buf[s..s + l], d)
                        .map_err(self.io(format!("read at {d}")))?
                    {
                        return Ok(false);
                    }
                }
                None => buf[s..s + l].fill(0),
            }
        }
        Ok(true)
    }

    /// Writes like [`LvStore::write_at`] if that needs no wait for the device (page cache IO, 4 KiB-aligned:
    /// the write lands in the page cache; allocation changes only memory until the next flush); `Ok(false)`:
    /// nothing written.
    pub fn write_at_nowait(&self, id: BlobId, offset: u64, data: &[u8]) -> Result<bool> {
        if self.dev.direct() || !offset.is_multiple_of(BLOCK_SIZE) || !data.len().is_multiple_of(BS) {
            return Ok(false);
        }
        self.write_at(id, offset, data)?;
        Ok(true)
    }

    /// Writes `data` at `offset` of lvol `id`. A write that is not 4 KiB aligned reads the blocks it partly
    /// covers first (and runs alone, so two partial writes to one block cannot lose each other's bytes).
    pub fn write_at(&self, id: BlobId, offset: u64, data: &[u8]) -> Result<()> {
        self.writable()?;
        let start = offset - offset % BLOCK_SIZE;
        let end = (offset + data.len() as u64).next_multiple_of(BLOCK_SIZE);
        // A block whose checksum is in the journal's last record is written only after a later record is durable
        // (`seal`); no flush can make a new such record while this write holds the gate.
        let aligned = start == offset && end == offset + data.len() as u64;
        let (_g, overwrite) = loop {
            let g = if aligned {
                Gate::Read(self.gate_read())
            } else {
                Gate::Write(self.gate_write())
            };
            // One look under the lock: the range, a seal to wait for, and whether this is an overwrite of blocks
            // the lvol holds already (the common case of a written volume: no map change, so no second lock).
            let inner = self.lock();
            self.check_writable_in(&inner, id, offset, data.len() as u64)?;
            if !self.must_seal(&inner, id, start, end - start) {
                let overwrite = if aligned {
                    self.mapped_here(&inner, id, offset, data.len() as u64)
                } else {
                    None
                };
                break (g, overwrite);
            }
            drop(inner);
            drop(g);
            self.seal(id, start, end - start)?;
        };
        if let Some(at) = overwrite {
            // The gate (held) keeps snapshots, clones, deletes, checkpoints and the release of clusters an unmap
            // emptied out until the bytes are written: the cluster is still where it was looked up.
            return self
                .dev
                .write_at(data, at)
                .map_err(self.io(format!("write {} bytes at {at}", data.len())));
        }
        if aligned {
            return self.write_blocks(id, offset, data);
        }
        let mut tmp = vec![0u8; usize::try_from(end - start).unwrap_or(0)];
        self.read_blocks(id, start, &mut tmp)?;
        let skip = usize::try_from(offset - start).unwrap_or(0);
        tmp[skip..skip + data.len()].copy_from_slice(data);
        self.write_blocks(id, start, &tmp)
    }

    fn check_writable(&self, id: BlobId, offset: u64, len: u64) -> Result<()> {
        self.check_writable_in(&self.lock(), id, offset, len)
    }

    fn check_writable_in(&self, inner: &Inner, id: BlobId, offset: u64, len: u64) -> Result<()> {
        self.check_range(&inner.meta, id, offset, len)?;
        if inner.meta.blobs[&id].kind != BlobKind::Lvol {
            return Err(Error::Invalid(format!(
                "{:?} is a snapshot: read-only",
                inner.meta.blobs[&id].name
            )));
        }
        Ok(())
    }

    /// The device offset of `[offset, offset + len)` of lvol `id` when that range lies in one cluster the lvol
    /// holds with every one of its blocks written (an overwrite in place); `None` otherwise.
    fn mapped_here(&self, inner: &Inner, id: BlobId, offset: u64, len: u64) -> Option<u64> {
        let (lc, blk) = self.split(offset);
        let blocks = len / BLOCK_SIZE;
        if len == 0 || blk + blocks > self.cluster_size / BLOCK_SIZE {
            return None;
        }
        let e = inner.meta.blobs.get(&id)?.clusters.get(&lc)?;
        (blk..blk + blocks)
            .all(|b| e.has(b))
            .then(|| self.phys_off(e.phys, blk))
    }

    /// Aligned write: per cluster, map it (allocating if the lvol has none: nothing is copied, the blocks not
    /// written keep reading through), write the bytes, then set the blocks' bits.
    fn write_blocks(&self, id: BlobId, offset: u64, data: &[u8]) -> Result<()> {
        let mut pos = 0usize;
        while pos < data.len() {
            let off = offset + pos as u64;
            let (lc, blk) = self.split(off);
            let in_cluster =
                usize::try_from(self.cluster_size - off % self.cluster_size).unwrap_or(usize::MAX);
            let n = in_cluster.min(data.len() - pos);
            let phys = {
                let mut inner = self.lock();
                let inner = &mut *inner;
                if let Some(e) = inner.meta.blobs.get(&id).and_then(|b| b.clusters.get(&lc)) {
                    e.phys
                } else {
                    let Some(p) = inner.alloc.allocate() else {
                        return Err(Error::NoSpace {
                            path: self.path().to_owned(),
                            clusters: inner.sb.cluster_count,
                            cluster_size: self.cluster_size,
                        });
                    };
                    let bits = vec![0u8; usize::try_from(self.cluster_size / BLOCK_SIZE / 8).unwrap_or(0)];
                    let b = inner
                        .meta
                        .blobs
                        .get_mut(&id)
                        .ok_or_else(|| Error::NotFound(format!("lvol id {id}")))?;
                    b.clusters.insert(lc, ClusterEntry { phys: p, bits });
                    inner.dirty.insert((id, lc));
                    p
                }
            };
            self.dev
                .write_at(&data[pos..pos + n], self.phys_off(phys, blk))
                .map_err(self.io(format!("write {n} bytes at {}", self.phys_off(phys, blk))))?;
            let mut inner = self.lock();
            let inner = &mut *inner;
            if let Some(e) = inner
                .meta
                .blobs
                .get_mut(&id)
                .and_then(|b| b.clusters.get_mut(&lc))
                && e.phys == phys
            {
                // Only a block newly holding data changes the map (and needs journaling at the next flush): a
                // rewrite of written blocks leaves the flush a plain `fdatasync`.
                let mut changed = 0;
                for b in blk..blk + (n / BS) as u64 {
                    if !e.has(b) {
                        e.set(b, true);
                        changed += 1;
                        if inner.fresh.len() <= MAX_SUMMED_BLOCKS {
                            inner.fresh.push((id, lc, b));
                        }
                    }
                }
                if changed > 0 {
                    inner.dirty.insert((id, lc));
                    if let Some(c) = inner.allocated.get_mut(&id) {
                        *c += changed;
                    }
                }
            }
            pos += n;
        }
        Ok(())
    }

    /// Forgets the whole 4 KiB blocks of `[offset, offset + len)` in lvol `id` (advisory: what a snapshot below
    /// holds there shows through again, as in the v1 engine). A cluster left empty is freed at the next commit.
    pub fn unmap(&self, id: BlobId, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        let _g = self.gate_read();
        self.check_writable(id, offset, len)?;
        let first = offset.div_ceil(BLOCK_SIZE);
        let end = (offset + len) / BLOCK_SIZE;
        let mut inner = self.lock();
        let inner = &mut *inner;
        let b = inner
            .meta
            .blobs
            .get_mut(&id)
            .ok_or_else(|| Error::NotFound(format!("lvol id {id}")))?;
        let mut block = first;
        while block < end {
            let (lc, blk) = self.split(block * BLOCK_SIZE);
            let bpc = self.cluster_size / BLOCK_SIZE;
            let upto = (block - blk + bpc).min(end);
            if let Some(e) = b.clusters.get_mut(&lc) {
                for x in blk..blk + (upto - block) {
                    if e.has(x) {
                        e.set(x, false);
                        if let Some(c) = inner.allocated.get_mut(&id) {
                            *c -= 1;
                        }
                    }
                }
                inner.dirty.insert((id, lc));
                if e.is_empty() {
                    let phys = e.phys;
                    b.clusters.remove(&lc);
                    inner.alloc.release_after_commit(phys);
                }
            }
            block = upto;
        }
        Ok(())
    }

    /// Zeros `[offset, offset + len)` exactly: blocks are unmapped, and real zeros are written only where a
    /// snapshot below would show through.
    pub fn write_zeroes(&self, id: BlobId, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        let start = offset.next_multiple_of(BLOCK_SIZE).min(offset + len);
        let end = ((offset + len) / BLOCK_SIZE * BLOCK_SIZE).max(start);
        if start > offset {
            self.write_at(
                id,
                offset,
                &vec![0u8; usize::try_from(start - offset).unwrap_or(0)],
            )?;
        }
        if end < offset + len {
            self.write_at(
                id,
                end,
                &vec![0u8; usize::try_from(offset + len - end).unwrap_or(0)],
            )?;
        }
        if end > start {
            self.unmap(id, start, end - start)?;
            let zero = vec![0u8; BS];
            for block in start / BLOCK_SIZE..end / BLOCK_SIZE {
                let shows = {
                    let inner = self.lock();
                    self.resolve(&inner.meta, id, block).is_some()
                };
                if shows {
                    self.write_at(id, block * BLOCK_SIZE, &zero)?;
                }
            }
        }
        Ok(())
    }

    /// The ranges of `[offset, offset + len)` that some blob of the chain holds (bytes, ascending); the rest
    /// reads as zeros.
    pub fn allocated_ranges(&self, id: BlobId, offset: u64, len: u64) -> Result<Vec<Range<u64>>> {
        let _g = self.gate_read();
        let inner = self.lock();
        self.check_range(&inner.meta, id, offset, len)?;
        let mut out: Vec<Range<u64>> = Vec::new();
        let mut off = offset - offset % BLOCK_SIZE;
        while off < offset + len {
            let (lc, _) = self.split(off);
            if !self.chain_maps(&inner.meta, id, lc) {
                off = (lc + 1) * self.cluster_size;
                continue;
            }
            if self.resolve(&inner.meta, id, off / BLOCK_SIZE).is_some() {
                let (s, e) = (off.max(offset), (off + BLOCK_SIZE).min(offset + len));
                match out.last_mut() {
                    Some(r) if r.end == s => r.end = e,
                    _ => out.push(s..e),
                }
            }
            off += BLOCK_SIZE;
        }
        Ok(out)
    }

    /// The ranges of `[offset, offset + len)` that blob `id` holds itself (bytes, ascending), not reading through
    /// to its parents: what a snapshot adds over its parent, which is what a rebuild transfers per snapshot.
    pub fn own_ranges(&self, id: BlobId, offset: u64, len: u64) -> Result<Vec<Range<u64>>> {
        let _g = self.gate_read();
        let inner = self.lock();
        self.check_range(&inner.meta, id, offset, len)?;
        let b = &inner.meta.blobs[&id];
        let end = offset + len;
        let mut out: Vec<Range<u64>> = Vec::new();
        let bpc = self.cluster_size / BLOCK_SIZE;
        for (lc, e) in b
            .clusters
            .range(offset / self.cluster_size..end.div_ceil(self.cluster_size))
        {
            for blk in 0..bpc {
                let off = lc * self.cluster_size + blk * BLOCK_SIZE;
                if !e.has(blk) || off + BLOCK_SIZE <= offset || off >= end {
                    continue;
                }
                let (s, e) = (off.max(offset), (off + BLOCK_SIZE).min(end));
                match out.last_mut() {
                    Some(r) if r.end == s => r.end = e,
                    _ => out.push(s..e),
                }
            }
        }
        Ok(out)
    }

    fn chain_maps(&self, meta: &Meta, id: BlobId, lc: u64) -> bool {
        let mut b = meta.blobs.get(&id);
        while let Some(x) = b {
            if x.clusters.contains_key(&lc) {
                return true;
            }
            b = x.parent.and_then(|p| meta.blobs.get(&p));
        }
        false
    }
}

/// The ops that set `xattrs` on blob `id`.
fn xattr_ops(id: BlobId, xattrs: &[(&str, &[u8])]) -> Vec<Op> {
    xattrs
        .iter()
        .map(|(k, v)| Op::SetXattr {
            id,
            key: (*k).to_owned(),
            value: v.to_vec(),
        })
        .collect()
}

fn info_of(meta: &Meta, b: &Blob, children: Vec<&str>) -> LvolInfo {
    let mut children: Vec<String> = children.into_iter().map(str::to_owned).collect();
    children.sort();
    LvolInfo {
        id: b.id,
        uuid: uuid::Uuid::from_bytes(b.uuid).to_string(),
        name: b.name.clone(),
        kind: b.kind,
        parent: b.parent.and_then(|p| meta.blobs.get(&p)).map(|p| p.name.clone()),
        children,
        size: b.size,
        allocated_bytes: b.allocated_bytes(),
        clusters: b.clusters.len() as u64,
        created: b.created,
        xattrs: b
            .xattrs
            .iter()
            .map(|(k, v)| {
                let s = match std::str::from_utf8(v) {
                    Ok(s) => s.to_owned(),
                    Err(_) => format!("hex:{}", v.iter().map(|x| format!("{x:02x}")).collect::<String>()),
                };
                (k.clone(), s)
            })
            .collect(),
    }
}

fn pad(mut b: Vec<u8>) -> Vec<u8> {
    b.resize(b.len().next_multiple_of(BS).max(BS), 0);
    b
}

fn read_padded(dev: &Device, off: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(std::io::Error::other)?;
    let mut b = vec![0u8; n.next_multiple_of(BS).max(BS)];
    dev.read_at(&mut b, off)?;
    b.truncate(n);
    Ok(b)
}

/// The newest valid superblock of the two slots.
fn read_superblock(dev: &Device, path: &Path) -> Result<Superblock> {
    let slots = 2 * SB_SLOT_BYTES;
    let mut head = vec![0u8; slots];
    if dev.len() < slots as u64 {
        // Too short for both slots: read what there is, to tell "not an lvstore" from "truncated".
        let mut f = std::fs::File::open(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            what: "open".into(),
            source,
        })?;
        let mut short = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut short).map_err(|source| Error::Io {
            path: path.to_owned(),
            what: "read".into(),
            source,
        })?;
        if short.len() >= 8
            && (short[..8] == format::MAGIC
                || short.get(SB_SLOT_BYTES..SB_SLOT_BYTES + 8) == Some(&format::MAGIC[..]))
        {
            return Err(LvStore::corrupt(
                path,
                FormatError::Invalid(format!(
                    "the superblock is truncated: the device has only {} bytes",
                    short.len()
                )),
            ));
        }
        return Err(Error::NotAnLvstore {
            path: path.to_owned(),
        });
    }
    dev.read_at(&mut head, 0).map_err(|source| Error::Io {
        path: path.to_owned(),
        what: "read the superblocks".into(),
        source,
    })?;
    let mut best: Option<Superblock> = None;
    let mut damage = None;
    let mut any_magic = false;
    for slot in 0..2 {
        let b = &head[slot * SB_SLOT_BYTES..(slot + 1) * SB_SLOT_BYTES];
        match Superblock::decode(b) {
            Ok(None) => {}
            Ok(Some(sb)) => {
                any_magic = true;
                if best.as_ref().is_none_or(|x| sb.generation > x.generation) {
                    best = Some(sb);
                }
            }
            Err(SuperblockError::Newer(v)) => {
                return Err(Error::NewerVersion {
                    path: path.to_owned(),
                    found: v,
                    supported: format::VERSION,
                });
            }
            Err(SuperblockError::Format(e)) => {
                any_magic = true;
                damage = Some(e);
            }
        }
    }
    match (best, damage) {
        (Some(sb), _) => Ok(sb),
        (None, Some(e)) => Err(LvStore::corrupt(path, e)),
        (None, None) if !any_magic => Err(Error::NotAnLvstore {
            path: path.to_owned(),
        }),
        (None, None) => Err(Error::NotAnLvstore {
            path: path.to_owned(),
        }),
    }
}

/// The journal ops recording the current map entries of the `dirty` clusters (an absent entry: unmapped).
fn cluster_ops(meta: &Meta, dirty: &BTreeSet<(BlobId, u64)>) -> Vec<Op> {
    dirty
        .iter()
        .filter_map(|&(id, l)| {
            let b = meta.blobs.get(&id)?;
            Some(Op::Cluster {
                id,
                lcluster: l,
                entry: b.clusters.get(&l).cloned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use super::{FormatOptions, LvStore, MAX_SUMMED_BLOCKS, OpenMode};

    fn small_store(path: &std::path::Path) -> LvStore {
        std::fs::File::create(path).unwrap().set_len(64 << 20).unwrap();
        let opts = FormatOptions {
            cluster_size: 64 << 10,
            meta_area: Some(512 << 10),
            journal_len: 256 << 10,
            force: false,
        };
        LvStore::format(path, &opts).unwrap()
    }

    /// A flush with nothing to journal syncs at once, beside a round in progress that journals nothing (as two
    /// v1 flushes of one file run side by side), instead of waiting for that round to end.
    #[test]
    fn a_flush_with_nothing_to_journal_runs_beside_a_round_in_progress() {
        let dir = testkit::scratch::disk_tempdir("lvstore-plain");
        let s = small_store(&dir.path().join("disk"));
        let lv = s.create_lvol("vol", 16 << 20).unwrap();
        s.write_at(lv, 0, &[7u8; 4096]).unwrap();
        s.flush().unwrap();
        s.write_at(lv, 0, &[8u8; 4096]).unwrap(); // an overwrite: data only
        let before = s.space().plain_syncs;
        let lead = s.lead_or_wait(false).expect("no round runs");
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                s.flush().unwrap();
                done.store(true, Ordering::SeqCst);
            });
            let deadline = Instant::now() + Duration::from_secs(30);
            while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::yield_now();
            }
            let alongside = done.load(Ordering::SeqCst);
            drop(lead); // (a flush still waiting leads the next round and returns: the scope can end)
            assert!(alongside, "the flush waited for the round in progress");
        });
        assert_eq!(s.space().plain_syncs, before + 1);
    }

    /// A flush whose writes' allocations a journaling flush has taken, but not yet made durable, does not return
    /// before that flush's record is written: an empty list of changed clusters is not enough to only sync.
    #[test]
    fn a_flush_waits_for_a_journaling_flush_in_progress() {
        let dir = testkit::scratch::disk_tempdir("lvstore-committing");
        let path = dir.path().join("disk");
        let s = small_store(&path);
        let lv = s.create_lvol("vol", 16 << 20).unwrap();
        s.write_at(lv, 0, &[9u8; 4096]).unwrap(); // allocates: a cluster state to journal
        // A journaling flush in progress: it leads the round and has taken the changed clusters.
        let lead = s.lead_or_wait(false).expect("no round runs");
        let (dirty, fresh) = {
            let mut inner = s.lock();
            inner.committing = true;
            (std::mem::take(&mut inner.dirty), std::mem::take(&mut inner.fresh))
        };
        assert!(!dirty.is_empty());
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                s.flush().unwrap();
                done.store(true, Ordering::SeqCst);
            });
            // A wrong flush returns after one fdatasync; this one must still wait when the look comes.
            std::thread::sleep(Duration::from_millis(300));
            let early = done.load(Ordering::SeqCst);
            // That flush fails and puts the changes back: the waiting flush leads the next round and journals them.
            {
                let mut inner = s.lock();
                inner.committing = false;
                inner.dirty.extend(dirty);
                inner.fresh.extend(fresh);
            }
            drop(lead);
            assert!(
                !early,
                "a flush returned while a journaling flush it depends on had not written its record"
            );
        });
        assert!(done.load(Ordering::SeqCst));
        drop(s);
        let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
        let mut buf = [0u8; 4096];
        s.read_at(s.lookup("vol").unwrap(), 0, &mut buf).unwrap();
        assert_eq!(buf, [9u8; 4096]);
    }

    /// Writes between two flushes keep at most `MAX_SUMMED_BLOCKS + 1` newly mapped blocks in memory, and a
    /// flush after more than that (data synced before its record) still makes every one durable.
    #[test]
    fn newly_mapped_blocks_kept_for_a_flush_are_bounded_and_all_land() {
        let dir = testkit::scratch::disk_tempdir("lvstore-fresh");
        let path = dir.path().join("disk");
        let s = small_store(&path);
        let lv = s.create_lvol("vol", 16 << 20).unwrap();
        let blocks = 3 * MAX_SUMMED_BLOCKS as u64;
        for b in 0..blocks {
            s.write_at(lv, b * 4096, &[u8::try_from(b % 251).unwrap() + 1; 4096])
                .unwrap();
        }
        assert_eq!(s.lock().fresh.len(), MAX_SUMMED_BLOCKS + 1);
        s.flush().unwrap();
        assert!(s.lock().fresh.is_empty());
        drop(s);
        let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
        let lv = s.lookup("vol").unwrap();
        let mut buf = [0u8; 4096];
        for b in 0..blocks {
            s.read_at(lv, b * 4096, &mut buf).unwrap();
            assert_eq!(buf, [u8::try_from(b % 251).unwrap() + 1; 4096], "block {b}");
        }
    }
}
