//! Snapshot hashing of a v2 replica: the `sha512-layout` checksum ([`crate::hash`]) of a snapshot lvol's own
//! blocks — the layout of a v1 snapshot file, so a snapshot hashes the same on a v1 replica and on the v2 replica
//! rebuilt from it (or cloned into it) — recorded in the lvol's `corral.checksum` xattr (a sparse-sync
//! [`ChecksumRecord`], one journaled store operation).
//!
//! A snapshot lvol is read-only; what changes the blocks it holds itself is a purge merging its removed parent
//! into it (its parent then changes) or its replacement by another lvol of the same name (a rebuild). So its
//! change marker, where a v1 file has its ctime, is `UUID/PARENT-UUID`: a record whose marker still matches is
//! reused, a rehash that disagrees with it flags silent corruption. The snapshot is held against purges while
//! it is hashed.

use lvstore::LvStore;
use sparse_sync::record::ChecksumRecord;

use super::lvol::{LvolReplica, lv_err};
use super::snapshot_view::LvolSnapshot;
use crate::error::{ReplicaError, Result};
use crate::hash::{ChecksumStore, HashOutcome, checksum_content, hash_recorded};
use crate::jobs::JobControl;
use crate::names;

/// Snapshot xattr: its [`ChecksumRecord`] (JSON).
pub const XATTR_CHECKSUM: &str = "corral.checksum";

struct SnapshotLvol<'a> {
    store: &'a LvStore,
    lvol: String,
    content: LvolSnapshot,
}

impl ChecksumStore for SnapshotLvol<'_> {
    fn record(&self) -> Result<Option<ChecksumRecord>> {
        let Some(v) = self
            .store
            .xattr(&self.lvol, XATTR_CHECKSUM)
            .map_err(|e| lv_err(self.store, e))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&v)
            .map(Some)
            .map_err(|e| ReplicaError::CorruptMeta {
                path: self.store.path().join(&self.lvol),
                reason: format!("xattr {XATTR_CHECKSUM}: {e}"),
            })
    }

    fn save(&self, record: &ChecksumRecord) -> Result<()> {
        let bytes = serde_json::to_vec(record).map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?;
        self.store
            .set_xattr(&self.lvol, XATTR_CHECKSUM, &bytes)
            .map_err(|e| lv_err(self.store, e))
    }

    fn change_time(&self) -> Result<String> {
        let info = self.store.info(&self.lvol).map_err(|e| lv_err(self.store, e))?;
        let parent = match &info.parent {
            Some(p) => self.store.info(p).map_err(|e| lv_err(self.store, e))?.uuid,
            None => String::new(),
        };
        Ok(format!("{}/{parent}", info.uuid))
    }

    fn compute(&self, ctl: &JobControl) -> Result<Option<String>> {
        checksum_content(&self.content, ctl)
            .map_err(|e| ReplicaError::io("read snapshot lvol", self.store.path().join(&self.lvol), e))
    }

    fn describe(&self) -> String {
        format!("{}#{}", self.store.path().display(), self.lvol)
    }
}

/// Hashes snapshot `name` of `r` and records the result (blocking), as [`crate::Replica::hash_snapshot`] does
/// for a v1 replica.
pub fn hash_snapshot(r: &LvolReplica, name: &str, rehash: bool, ctl: &JobControl) -> Result<HashOutcome> {
    let file = names::resolve_snapshot(name)?;
    // Held until the hash is recorded: no purge merges into the snapshot meanwhile.
    let (content, _held) = r.snapshot_for_sending(&file)?;
    hash_recorded(
        &SnapshotLvol {
            store: r.store(),
            lvol: r.snap_lvol(&file),
            content,
        },
        rehash,
        ctl,
    )
}
