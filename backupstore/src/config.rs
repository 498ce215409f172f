//! `volume.cfg` and `backups/backup_<name>.cfg`: JSON documents, each with the store format version.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::block::{Compression, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};

/// Version of the store layout and of these documents. Readers refuse newer versions. 2: block maps may hold
/// zero markers ([`ZERO_MARKER`]); version-1 documents read unchanged.
pub const FORMAT_VERSION: u32 = 2;
/// The `hash` of a block-map entry whose block the volume zeroed over its backing image: it restores as
/// explicit zeros, not as a hole (through which the backing image's data would show).
pub const ZERO_MARKER: &str = "zero";
/// Default `backup-delta-max`: backups in a chain, its full one included (7: a full and 6 incrementals; the 8th
/// backup starts a new chain).
pub const DEFAULT_DELTA_MAX: u32 = 7;

/// `volume.cfg`: one per backup volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeConfig {
    /// Store format version.
    pub format_version: u32,
    /// Volume name.
    pub name: String,
    /// Size of the volume at the last backup, bytes.
    pub size: u64,
    /// Block size of every backup of this volume (fixed when the volume is first backed up).
    pub block_size: u64,
    /// Compression of new blocks.
    pub compression: Compression,
    /// RFC 3339.
    pub created: String,
    /// Newest completed backup.
    pub last_backup_name: String,
    /// RFC 3339 completion time of the newest backup.
    pub last_backup_at: String,
    /// Backing image under the volume's data (backups hold only the volume's own layers).
    pub backing_image_name: String,
    /// Checksum of that backing image.
    pub backing_image_checksum: String,
    /// Labels of the last backup.
    pub labels: BTreeMap<String, String>,
}

/// State of one backup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackupState {
    /// Blocks are being uploaded; the block map is not written yet.
    #[default]
    InProgress,
    /// Every block of the map is stored.
    Complete,
}

/// Why a backup is full (read everything, uploaded every block) instead of an incremental of the previous one.
/// Serialized as `{"kind": "...", "detail": ...}`; a reader keeps unknown kinds readable as text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "detail")]
pub enum FullReason {
    /// A full backup was asked for (`--full`, `mode: full`).
    Requested,
    /// No completed backup of the volume exists.
    FirstBackup,
    /// The previous chain holds `backup-delta-max` backups (its full one included). Records of format 1 stored
    /// the previous backup's position here; both mean "the chain was full".
    DeltaMaxReached(u32),
    /// The chain was ended: the volume was reverted, or a backup was restored into it (the detail says which).
    ChainEnded(String),
    /// No snapshot of the previous backup's chain survives on the volume: nothing to compute changes from.
    BaseMissing(String),
    /// Incremental backups are turned off (`backup-incremental` false): every backup is full and ends its chain.
    IncrementalDisabled,
}

impl FullReason {
    /// The kind as a stable lower-case word (`requested`, `first-backup`, `delta-max-reached`, `chain-ended`,
    /// `base-missing`, `incremental-disabled`), for APIs that list it beside the human text.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Requested => "requested",
            Self::FirstBackup => "first-backup",
            Self::DeltaMaxReached(_) => "delta-max-reached",
            Self::ChainEnded(_) => "chain-ended",
            Self::BaseMissing(_) => "base-missing",
            Self::IncrementalDisabled => "incremental-disabled",
        }
    }
}

impl std::fmt::Display for FullReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Requested => write!(f, "full backup requested"),
            Self::FirstBackup => write!(f, "first backup of the volume"),
            Self::DeltaMaxReached(n) => write!(
                f,
                "the previous chain reached backup-delta-max ({n} backups including its full one)"
            ),
            Self::ChainEnded(why) => write!(f, "chain ended: {why}"),
            Self::BaseMissing(why) => write!(f, "base missing: {why}"),
            Self::IncrementalDisabled => write!(f, "incremental backups are disabled (backup-incremental)"),
        }
    }
}

/// One block of a backup: its byte offset in the volume and its SHA-256, or [`ZERO_MARKER`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockRef {
    /// Byte offset (a multiple of the block size).
    pub offset: u64,
    /// SHA-256 hex of the uncompressed block, or `zero` (format 2): zeros written over the backing image.
    pub hash: String,
}

impl BlockRef {
    /// A zero marker (nothing stored; restores as explicit zeros).
    pub fn is_zero(&self) -> bool {
        self.hash == ZERO_MARKER
    }
}

/// Byte counters of one backup.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupStats {
    /// Bytes read from the snapshot.
    pub read_bytes: u64,
    /// Blocks read that were all zeros (not stored).
    pub zero_blocks: u64,
    /// Blocks uploaded that the store did not hold.
    pub new_blocks: u64,
    /// Their uncompressed bytes.
    pub new_bytes: u64,
    /// Bytes actually written to the store for them (after compression, with headers).
    pub new_stored_bytes: u64,
    /// Blocks the store already held but a full backup uploaded again (heals damaged copies).
    pub reuploaded_blocks: u64,
    /// Their uncompressed bytes.
    pub reuploaded_bytes: u64,
    /// Blocks found already stored (deduplicated) and not uploaded.
    pub deduplicated_blocks: u64,
}

/// `backups/backup_<name>.cfg`: one per backup; the block map is complete (every stored block of the volume at
/// that snapshot), so deleting any other backup never breaks this one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupConfig {
    /// Store format version.
    pub format_version: u32,
    /// Backup name.
    pub name: String,
    /// Volume name.
    pub volume: String,
    /// `in-progress` until the block map is written.
    pub state: BackupState,
    /// Snapshot backed up.
    pub snapshot: String,
    /// Snapshot creation time (RFC 3339).
    pub snapshot_created: String,
    /// The snapshot's ancestors at backup time, nearest first (finds a surviving diff base later).
    pub snapshot_ancestors: Vec<String>,
    /// RFC 3339 start.
    pub started: String,
    /// RFC 3339 completion; empty while in progress.
    pub completed: String,
    /// Volume size in bytes.
    pub size: u64,
    /// Block size in bytes.
    pub block_size: u64,
    /// Compression of blocks uploaded by this backup.
    pub compression: Compression,
    /// User labels.
    pub labels: BTreeMap<String, String>,
    /// Diffed against the previous backup.
    pub is_incremental: bool,
    /// 0 for a full backup, n for the n-th incremental after it (the backup is the (n+1)-th of its chain).
    pub chain_position: u32,
    /// For a full backup: why.
    pub full_reason: Option<FullReason>,
    /// The chain ends with this backup: the next backup of the volume is full, for `chain_end_reason`. Set when
    /// the backup is the `backup-delta-max`-th of its chain or a full with incrementals disabled, or later (by
    /// [`crate::BackupStore::end_chain`] after a revert or a restore into the volume, or when a newer full
    /// backup started a new chain). Absent (false) in records of format 1.
    #[serde(default)]
    pub end_of_chain: bool,
    /// Why the chain ended here (the next backup's full reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_end_reason: Option<FullReason>,
    /// Backing image under the volume when backed up: its name (empty: none, or not told).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backing_image_name: String,
    /// Its checksum, `sha512:HEX` (or `sha256:HEX` when only the file's SHA-256 was known).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backing_image_checksum: String,
    /// For an incremental: the backup whose block map it extends.
    pub base_backup: String,
    /// For an incremental: the local snapshot the changes were computed from (empty: from the chain's bottom).
    pub diff_from_snapshot: String,
    /// Byte counters.
    pub stats: BackupStats,
    /// Block map, sorted by offset; absent offsets are zeros.
    pub blocks: Vec<BlockRef>,
}

impl BackupConfig {
    /// Bytes of data the backup describes (stored blocks × block size, last block clipped).
    pub fn data_bytes(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| !b.is_zero())
            .map(|b| self.block_size.min(self.size.saturating_sub(b.offset)))
            .sum()
    }

    /// Checks what a restore or an incremental relies on in a record read from the store: a valid block size,
    /// block offsets aligned, inside the volume and strictly ascending, hashes of 64 lower-case hex digits.
    pub fn check(&self) -> Result<(), String> {
        let bs = self.block_size;
        if !((MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) && bs.is_power_of_two()) {
            return Err(format!(
                "block size {bs} is not a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}"
            ));
        }
        let mut next = 0;
        for b in &self.blocks {
            if b.offset % bs != 0 || b.offset >= self.size || b.offset < next {
                return Err(format!(
                    "block offset {} is unaligned, past the size {} or out of order",
                    b.offset, self.size
                ));
            }
            next = b.offset + 1;
            let hex = b.hash.len() == 64 && b.hash.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
            let zero_marker = b.is_zero() && self.format_version >= 2;
            if !hex && !zero_marker {
                return Err(format!("block at offset {}: bad hash {:?}", b.offset, b.hash));
            }
        }
        Ok(())
    }
}
