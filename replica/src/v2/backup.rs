//! Backup and restore of a v2 replica: the same `ReplicaBackupService` jobs as v1
//! ([`crate::backup_service::ReplicaBackupGrpc`] over [`V2Backup`]), reading snapshot lvols and writing the head
//! lvol.
//!
//! - [`LvolBackupSource`] reads one snapshot lvol (the store reads through to its ancestors). Change tracking is
//!   the v1 rule ([`chain_changes`]) over the lvol chain: the blocks that may differ from an ancestor snapshot are
//!   the blocks the lvols above it hold themselves (`own_ranges`). A purge merges a deleted snapshot's blocks into
//!   its child, so diffing from the nearest surviving ancestor of a deleted base still covers every change.
//!   Purges are held off while a backup reads (the count a rebuild's sender uses).
//! - [`LvolRestoreSink`] writes restored blocks into the head; a range without blocks is zeroed only where the
//!   chain holds data (the store unmaps the head's own blocks there and writes zeros only over a snapshot's data),
//!   so holes stay holes.
//! - The restore state and the chain-end marker live in the head lvol's xattrs [`XATTR_RESTORE_STATE`] and
//!   [`XATTR_CHAIN_END`] (one journaled store operation each; `docs/formats.md`, "v2 replica"), not in side files.

use std::collections::BTreeSet;
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use backupstore::{BackupSource, Changes, RestoreSink, SnapshotInfo};
use lvstore::{BlobId, LvStore};

use super::lvol::{LvolReplica, XATTR_CHAIN_END, XATTR_RESTORE_STATE, lv_err};
use crate::backup::{BackupRecord, BackupRecords, ChainEnd, chain_changes};
use crate::backup_service::{BackupHost, OpenedSource};
use crate::error::{ReplicaError, Result};
use crate::names;

fn xattr_of(record: BackupRecord) -> &'static str {
    match record {
        BackupRecord::RestoreState => XATTR_RESTORE_STATE,
        BackupRecord::ChainEnd => XATTR_CHAIN_END,
    }
}

fn to_io(e: &ReplicaError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The backup records of a v2 replica: xattrs of its head lvol.
#[derive(Debug)]
pub struct XattrRecords(pub Arc<LvolReplica>);

impl BackupRecords for XattrRecords {
    fn load(&self, record: BackupRecord) -> Result<Option<Vec<u8>>> {
        let r = &self.0;
        r.store()
            .xattr(r.name(), xattr_of(record))
            .map_err(|e| lv_err(r.store(), e))
    }

    fn save(&self, record: BackupRecord, bytes: &[u8]) -> Result<()> {
        let r = &self.0;
        r.store()
            .set_xattr(r.name(), xattr_of(record), bytes)
            .map_err(|e| lv_err(r.store(), e))
    }

    fn clear(&self, record: BackupRecord) -> Result<()> {
        if self.load(record)?.is_none() {
            return Ok(());
        }
        let r = &self.0;
        r.store()
            .remove_xattr(r.name(), xattr_of(record))
            .map_err(|e| lv_err(r.store(), e))
    }
}

/// Holds off purges of a v2 replica while a backup reads its snapshot lvols (counted with rebuild senders).
struct PurgeHold(Arc<LvolReplica>);

impl PurgeHold {
    fn new(r: &Arc<LvolReplica>) -> Result<Self> {
        r.sending.fetch_add(1, Ordering::AcqRel);
        let hold = Self(r.clone());
        if r.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "a purge is running; back up after it finishes".into(),
            ));
        }
        Ok(hold)
    }
}

impl Drop for PurgeHold {
    fn drop(&mut self) {
        self.0.sending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One snapshot lvol of a v2 replica as a backup source.
pub struct LvolBackupSource {
    store: Arc<LvStore>,
    /// The snapshot lvol.
    id: BlobId,
    size: u64,
    info: SnapshotInfo,
    /// Snapshot names of the chain, root first; the last is the snapshot itself.
    chain: Vec<String>,
    /// The lvols of `chain` with their sizes.
    layers: Vec<(BlobId, u64)>,
    /// Snapshot names of every snapshot of the replica when the source was opened.
    local: BTreeSet<String>,
    chain_end: Option<ChainEnd>,
}

impl LvolBackupSource {
    /// Opens snapshot `snapshot` (a name or file name) of `r`.
    pub fn open(r: &Arc<LvolReplica>, snapshot: &str) -> Result<Self> {
        let store = r.store().clone();
        let err = |e| lv_err(&store, e);
        let file = names::resolve_snapshot(snapshot)?;
        let lvol = r.snap_lvol(&file);
        let id = store
            .lookup(&lvol)
            .map_err(|_| ReplicaError::NotFound(format!("snapshot {file}")))?;
        if r.snapshot_xattr(&lvol)?.removed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "snapshot {file} is marked removed"
            )));
        }
        let snapshot_name = |lvol: &str| {
            r.snap_file(lvol)
                .and_then(|f| names::snapshot_name(&f).map(str::to_owned))
                .unwrap_or_else(|| lvol.to_owned())
        };
        let mut chain = Vec::new();
        let mut layers = Vec::new();
        let mut cur = Some(lvol.clone());
        while let Some(n) = cur {
            let info = store.info(&n).map_err(err)?;
            layers.push((info.id, info.size));
            chain.push(snapshot_name(&n));
            cur = info.parent;
        }
        chain.reverse();
        layers.reverse();
        let local = store
            .list()
            .into_iter()
            .filter(|l| r.snap_file(&l.name).is_some())
            .map(|l| snapshot_name(&l.name))
            .collect();
        let created = r.snapshot_xattr(&lvol)?.created;
        let info = SnapshotInfo {
            name: chain[chain.len() - 1].clone(),
            created,
            ancestors: chain[..chain.len() - 1].iter().rev().cloned().collect(),
        };
        let size = store.size_of(id).map_err(err)?;
        let chain_end = ChainEnd::load(&XattrRecords(r.clone()))?;
        Ok(Self {
            store,
            id,
            size,
            info,
            chain,
            layers,
            local,
            chain_end,
        })
    }

    /// The union of the blocks layers `from..` hold themselves.
    fn own_extents(&self, from: usize) -> io::Result<Vec<Range<u64>>> {
        let mut out = Vec::new();
        for &(id, size) in &self.layers[from..] {
            let len = size.min(self.size);
            if len == 0 {
                continue;
            }
            out.extend(
                self.store
                    .own_ranges(id, 0, len)
                    .map_err(|e| io::Error::other(e.to_string()))?,
            );
        }
        Ok(out)
    }
}

impl BackupSource for LvolBackupSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn snapshot(&self) -> SnapshotInfo {
        self.info.clone()
    }

    fn allocated(&self) -> io::Result<Vec<Range<u64>>> {
        self.own_extents(0)
    }

    fn changes_since(&self, base: &str, base_ancestors: &[String]) -> io::Result<Changes> {
        chain_changes(
            &self.chain,
            &|s| self.local.contains(s),
            &|i| self.own_extents(i),
            base,
            base_ancestors,
        )
    }

    fn chain_ended(&self) -> Option<String> {
        self.chain_end.as_ref().map(|c| c.reason.clone())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.store
            .read_at(self.id, offset, buf)
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

/// Restores into a v2 replica's head lvol.
#[derive(Debug, Clone)]
pub struct LvolRestoreSink(pub Arc<LvolReplica>);

impl RestoreSink for LvolRestoreSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write_at(offset, data).map_err(|e| to_io(&e))
    }

    /// Zeroes only where the chain holds data: elsewhere the range already reads as zeros and stays a hole.
    fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        for r in self.0.allocated_ranges(offset, len).map_err(|e| to_io(&e))? {
            self.0
                .write_zeroes(r.start, r.end - r.start)
                .map_err(|e| to_io(&e))?;
        }
        Ok(())
    }

    fn size(&self) -> Option<u64> {
        Some(self.0.size())
    }
}

/// A hosted v2 replica as the backup service's [`BackupHost`].
#[derive(Debug)]
pub struct V2Backup(pub Arc<LvolReplica>);

impl V2Backup {
    fn open_replica(&self) -> Result<&Arc<LvolReplica>> {
        if self.0.is_open() {
            Ok(&self.0)
        } else {
            Err(ReplicaError::FailedPrecondition(format!(
                "replica {} is not open",
                self.0.name()
            )))
        }
    }
}

impl BackupHost for V2Backup {
    /// The daemon hosts replicas by name only; the engine names the volume in each request.
    fn volume(&self) -> String {
        String::new()
    }

    fn open_source(&self, snapshot: &str) -> Result<OpenedSource> {
        let r = self.open_replica()?;
        let hold = PurgeHold::new(r)?;
        let source = LvolBackupSource::open(r, snapshot)?;
        Ok(OpenedSource {
            source: Arc::new(source),
            // A v2 replica does not know its backing image by name and SHA-512: the manager names it in
            // `BackupCreate` (`manager/src/backup`), so the replica reports none of its own.
            backing_image: Box::new(|| Ok(None)),
            guard: Box::new(hold),
        })
    }

    fn sink(&self) -> Result<(Arc<dyn RestoreSink>, u64)> {
        let r = self.open_replica()?;
        Ok((Arc::new(LvolRestoreSink(r.clone())), r.size()))
    }

    fn flush(&self) -> Result<()> {
        self.0.flush()
    }

    fn records(&self) -> Result<Arc<dyn BackupRecords>> {
        Ok(Arc::new(XattrRecords(self.0.clone())))
    }
}
