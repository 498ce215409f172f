//! The replica as a backup source and a restore sink for the `backupstore` crate.
//!
//! [`SnapshotSource`] reads one snapshot flattened over its own ancestry (its files opened read-only, with an
//! extent map of just those layers), so a snapshot on a side branch after a revert reads correctly too. Change
//! tracking comes from the chain: the blocks that may differ from an ancestor snapshot are the allocated extents of
//! the layers above it up to the backed-up one. When the last backed-up snapshot was deleted locally (purged into
//! its child), the nearest of its recorded ancestors that is still in this snapshot's chain is the diff base; the
//! union of the layers above it includes the purged data, and blocks that did not change deduplicate against the
//! store. A last snapshot that still exists but is not an ancestor means the volume was reverted: the chain ends.
//!
//! [`ReplicaSink`] writes restored blocks into the replica's head; ranges without blocks are made to read as
//! zeros only where the chain holds data, so holes stay holes.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use backupstore::{BackupSource, Changes, RestoreSink, SnapshotInfo};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use corral_disk::{BLOCK_SIZE, durable};

use crate::chain::{Layer, build_map};
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::ExtentMap;
use crate::locks::read_lock;
use crate::meta::DiskMeta;
use crate::names;
use crate::replica::Replica;

/// Where a v1 replica records the backup its data equals after a restore (for incremental / DR restores).
pub const RESTORE_STATE_FILE: &str = "backup-restore.json";

/// Where a v1 replica records that its backup chain was ended (a backup was restored into it): the next backup of
/// the volume is full. Removed after a full backup completes.
pub const CHAIN_END_FILE: &str = "backup-chain-end.json";

/// The two backup records a replica keeps beside its data: files in a v1 replica's directory, xattrs of a v2
/// replica's head lvol (`docs/formats.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackupRecord {
    /// [`RestoreState`].
    RestoreState,
    /// [`ChainEnd`].
    ChainEnd,
}

impl BackupRecord {
    /// The v1 file name.
    pub fn file(self) -> &'static str {
        match self {
            Self::RestoreState => RESTORE_STATE_FILE,
            Self::ChainEnd => CHAIN_END_FILE,
        }
    }
}

/// Where a replica keeps its [`BackupRecord`]s (JSON bytes); every save and clear is crash-atomic.
pub trait BackupRecords: Send + Sync {
    /// The record's bytes, `None` when unset.
    fn load(&self, record: BackupRecord) -> Result<Option<Vec<u8>>>;
    /// Replaces the record.
    fn save(&self, record: BackupRecord, bytes: &[u8]) -> Result<()>;
    /// Removes the record (no-op when unset).
    fn clear(&self, record: BackupRecord) -> Result<()>;
}

/// A v1 replica's records: files in its directory, written temp + fsync + rename.
#[derive(Debug, Clone)]
pub struct DirRecords(pub PathBuf);

impl BackupRecords for DirRecords {
    fn load(&self, record: BackupRecord) -> Result<Option<Vec<u8>>> {
        let p = self.0.join(record.file());
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ReplicaError::io("read", &p, e)),
        }
    }

    fn save(&self, record: BackupRecord, bytes: &[u8]) -> Result<()> {
        let p = self.0.join(record.file());
        durable::write_atomic(&p, bytes).ctx("write crash-safely", &p)
    }

    fn clear(&self, record: BackupRecord) -> Result<()> {
        crate::meta::remove_if_exists(&self.0.join(record.file()))
    }
}

fn load_record<T: serde::de::DeserializeOwned>(
    records: &dyn BackupRecords,
    record: BackupRecord,
) -> Result<Option<T>> {
    let Some(bytes) = records.load(record)? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ReplicaError::CorruptMeta {
            path: PathBuf::from(record.file()),
            reason: e.to_string(),
        })
}

fn save_record<T: Serialize>(records: &dyn BackupRecords, record: BackupRecord, v: &T) -> Result<()> {
    let bytes = serde_json::to_vec(v)
        .map_err(|e| ReplicaError::InvalidArgument(format!("cannot encode {}: {e}", record.file())))?;
    records.save(record, &bytes)
}

/// Contents of the [`BackupRecord::ChainEnd`] record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainEnd {
    /// Why the chain ended (becomes the next backup's full reason).
    pub reason: String,
    /// RFC 3339.
    pub at: String,
}

impl ChainEnd {
    /// The marker, if set.
    pub fn load(records: &dyn BackupRecords) -> Result<Option<Self>> {
        load_record(records, BackupRecord::ChainEnd)
    }

    /// Sets the marker crash-safely.
    pub fn save(&self, records: &dyn BackupRecords) -> Result<()> {
        save_record(records, BackupRecord::ChainEnd, self)
    }

    /// Clears the marker (a new chain started).
    pub fn clear(records: &dyn BackupRecords) -> Result<()> {
        records.clear(BackupRecord::ChainEnd)
    }
}

/// Contents of the [`BackupRecord::RestoreState`] record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreState {
    /// Backup volume.
    pub volume: String,
    /// Backup name last restored completely.
    pub last_restored: String,
    /// Its URL.
    pub url: String,
}

impl RestoreState {
    /// Loads the state (default when never restored).
    pub fn load(records: &dyn BackupRecords) -> Result<Self> {
        Ok(load_record(records, BackupRecord::RestoreState)?.unwrap_or_default())
    }

    /// Saves it crash-safely.
    pub fn save(&self, records: &dyn BackupRecords) -> Result<()> {
        save_record(records, BackupRecord::RestoreState, self)
    }
}

/// Change tracking over a snapshot chain, for v1 files and v2 lvols alike. `chain` holds the snapshot names of
/// the layers, root first, `name` last; `extents_from(i)` is the union of the data ranges of layers `i..`;
/// `exists_locally` says whether a snapshot is still on the replica (to tell deleted from reverted-away ones).
pub fn chain_changes(
    chain: &[String],
    exists_locally: &dyn Fn(&str) -> bool,
    extents_from: &dyn Fn(usize) -> io::Result<Vec<Range<u64>>>,
    base: &str,
    base_ancestors: &[String],
) -> io::Result<Changes> {
    let name = chain.last().map_or("", String::as_str);
    let pos = |n: &str| chain.iter().position(|x| x == n);
    let since = |i: usize, diff_from: &str| -> io::Result<Changes> {
        Ok(Changes::Since {
            diff_from: diff_from.to_owned(),
            ranges: extents_from(i)?,
        })
    };
    if let Some(i) = pos(base) {
        return since(i + 1, base);
    }
    let ended = |s: &str| {
        Ok(Changes::ChainEnded(format!(
            "snapshot {s} of the last backup is not an ancestor of {name} (the volume was reverted)"
        )))
    };
    if exists_locally(base) {
        return ended(base);
    }
    // The last backed-up snapshot was deleted: diff from its nearest surviving ancestor.
    for a in base_ancestors {
        if let Some(i) = pos(a) {
            return since(i + 1, a);
        }
        if exists_locally(a) {
            return ended(a);
        }
    }
    since(0, "")
}

/// One snapshot of a replica, readable without the live chain.
#[derive(Debug)]
pub struct SnapshotSource {
    dir: PathBuf,
    info: SnapshotInfo,
    /// Snapshot names of the layers, root first; the last is the snapshot itself.
    chain: Vec<String>,
    layers: Vec<Layer>,
    map: ExtentMap,
    /// The replica, for reads of the backing image (shared by every snapshot of the chain).
    replica: Arc<Replica>,
    backing_path: Option<PathBuf>,
    /// Every disk of the replica when the source was opened (to tell deleted from reverted-away snapshots).
    disks: std::collections::BTreeMap<String, DiskMeta>,
    size: u64,
    /// The replica's chain-end marker when the source was opened.
    chain_end: Option<ChainEnd>,
}

fn to_io(e: &ReplicaError) -> io::Error {
    io::Error::other(e.to_string())
}

impl SnapshotSource {
    /// Opens `snapshot` (a name or file name) of `replica`.
    pub fn open(replica: &Arc<Replica>, snapshot: &str) -> Result<Self> {
        let chain = replica.chain_read_open()?;
        let file = names::resolve_snapshot(snapshot)?;
        let Some(meta) = chain.disks.get(&file) else {
            return Err(ReplicaError::NotFound(format!("snapshot {file}")));
        };
        if meta.removed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "snapshot {file} is marked removed"
            )));
        }
        let mut files = Vec::new();
        let mut cur = file.clone();
        while !cur.is_empty() {
            let m = chain.disks.get(&cur).ok_or_else(|| ReplicaError::MissingParent {
                dir: replica.dir().to_owned(),
                disk: files.last().cloned().unwrap_or_default(),
                parent: cur.clone(),
            })?;
            files.push(cur.clone());
            cur.clone_from(&m.parent);
        }
        files.reverse();
        let dir = replica.dir().to_owned();
        let mut layers = Vec::with_capacity(files.len());
        for f in &files {
            let p = dir.join(f);
            layers.push(Layer {
                name: f.clone(),
                file: File::open(&p).ctx("open", &p)?,
            });
        }
        let size = layers[layers.len() - 1]
            .file
            .metadata()
            .ctx("stat", dir.join(&file))?
            .len();
        let map = build_map(&dir, &layers)?;
        let backing_path =
            Some(PathBuf::from(&chain.info.backing_file_path)).filter(|p| !p.as_os_str().is_empty());
        let snap_names: Vec<String> = files
            .iter()
            .map(|f| names::snapshot_name(f).unwrap_or(f).to_owned())
            .collect();
        let info = SnapshotInfo {
            name: snap_names[snap_names.len() - 1].clone(),
            created: meta.created.clone(),
            ancestors: snap_names[..snap_names.len() - 1].iter().rev().cloned().collect(),
        };
        let chain_end = ChainEnd::load(&DirRecords(dir.clone()))?;
        Ok(Self {
            dir,
            info,
            chain: snap_names,
            layers,
            map,
            replica: replica.clone(),
            backing_path,
            disks: chain.disks.clone(),
            size,
            chain_end,
        })
    }

    /// Name and checksum of the backing image, if any: the name and SHA-512 (hex) the control plane gave the replica
    /// (`--backing-image-name`/`--backing-image-checksum`), else the file's name and `sha256:HEX` of it (read in
    /// full: call from a blocking thread).
    pub fn backing_image(&self) -> Result<Option<(String, String)>> {
        if let Some(id) = read_lock(&self.replica.chain)
            .backing
            .as_ref()
            .and_then(|b| b.id.clone())
        {
            return Ok(Some((id.name, id.checksum)));
        }
        let Some(path) = &self.backing_path else {
            return Ok(None);
        };
        let mut h = Sha256::new();
        let f = File::open(path).ctx("open", path)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = io::Read::read(&mut &f, &mut buf).ctx("read", path)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Some((name, format!("sha256:{}", hex::encode(h.finalize())))))
    }

    fn extents_of(&self, layers: &[Layer]) -> io::Result<Vec<Range<u64>>> {
        let mut out = Vec::new();
        for l in layers {
            let len = l.file.metadata()?.len();
            for r in corral_disk::sparse::data_extents(&l.file, 0..len) {
                out.push(r?);
            }
        }
        Ok(out)
    }

    fn exists_locally(&self, snapshot: &str) -> bool {
        self.disks.contains_key(&names::snapshot_file(snapshot))
    }
}

impl BackupSource for SnapshotSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn snapshot(&self) -> SnapshotInfo {
        self.info.clone()
    }

    fn allocated(&self) -> io::Result<Vec<Range<u64>>> {
        self.extents_of(&self.layers)
    }

    fn changes_since(&self, base: &str, base_ancestors: &[String]) -> io::Result<Changes> {
        chain_changes(
            &self.chain,
            &|s| self.exists_locally(s),
            &|i| self.extents_of(&self.layers[i..]),
            base,
            base_ancestors,
        )
    }

    fn chain_ended(&self) -> Option<String> {
        self.chain_end.as_ref().map(|c| c.reason.clone())
    }

    fn zero_hides_backing(&self) -> bool {
        self.backing_path.is_some()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        let mut pieces = Vec::new();
        self.map
            .visit(offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE), |s, e, l| {
                pieces.push((s, e, l));
                true
            });
        for (s, e, l) in pieces {
            let (bs, be) = ((s * BLOCK_SIZE).max(offset), (e * BLOCK_SIZE).min(end));
            let dst = &mut buf[usize::try_from(bs - offset).unwrap_or(usize::MAX)
                ..usize::try_from(be - offset).unwrap_or(usize::MAX)];
            match l {
                Some(i) => {
                    let l = &self.layers[usize::try_from(i).unwrap_or(usize::MAX)];
                    crate::io::pread_full(&l.file, dst, bs).map_err(|e| {
                        io::Error::new(e.kind(), format!("{}: {e}", self.dir.join(&l.name).display()))
                    })?;
                }
                None => match &read_lock(&self.replica.chain).backing {
                    Some(b) => b.read(dst, bs).map_err(|e| to_io(&e))?,
                    None => dst.fill(0),
                },
            }
        }
        Ok(())
    }
}

/// Restores into a replica's head.
#[derive(Debug, Clone)]
pub struct ReplicaSink {
    /// The open replica.
    pub replica: Arc<Replica>,
}

impl RestoreSink for ReplicaSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.replica.write_at(offset, data).map_err(|e| to_io(&e))
    }

    /// Zeroes only where a layer holds data: a backing image under the volume keeps showing through, as it
    /// did when the backup was taken (backups hold the volume's own layers only).
    fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let mut held = Vec::new();
        read_lock(&self.replica.map).visit(offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE), |s, e, l| {
            if l.is_some() {
                held.push((s * BLOCK_SIZE).max(offset)..(e * BLOCK_SIZE).min(end));
            }
            true
        });
        for r in held {
            self.replica
                .write_zeroes(r.start, r.end - r.start)
                .map_err(|e| to_io(&e))?;
        }
        Ok(())
    }

    fn size(&self) -> Option<u64> {
        Some(self.replica.size())
    }

    /// Zeros that must hide the backing image (a zero marker): the replica writes explicit zeros where backing
    /// data would show through.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.replica.write_zeroes(offset, len).map_err(|e| to_io(&e))
    }
}
