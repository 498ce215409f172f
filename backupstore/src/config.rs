//! `volume.cfg` and `backups/backup_<name>.cfg`: JSON documents, each with the store format version.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::block::{Compression, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};

/// Version of the store layout and of these documents. Readers refuse newer versions.
pub const FORMAT_VERSION: u32 = 1;
/// Default `backup-delta-max`: incremental backups after a full before the next full.
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

/// Why a backup read everything instead of the changes since the previous one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "detail")]
pub enum FullReason {
    /// `--mode full`.
    Requested,
    /// No completed backup of the volume exists.
    FirstBackup,
    /// `backup-delta-max` incrementals followed the last full.
    DeltaMaxReached(u32),
    /// The volume was reverted (or the previous snapshot is on another branch): the chain ended.
    ChainEnded(String),
}

impl std::fmt::Display for FullReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Requested => write!(f, "full backup requested"),
            Self::FirstBackup => write!(f, "first backup of the volume"),
            Self::DeltaMaxReached(n) => write!(
                f,
                "{n} incremental backups since the last full (backup-delta-max)"
            ),
            Self::ChainEnded(why) => write!(f, "chain ended: {why}"),
        }
    }
}

/// One stored block of a backup: its byte offset in the volume and its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockRef {
    /// Byte offset (a multiple of the block size).
    pub offset: u64,
    /// SHA-256 hex of the uncompressed block.
    pub hash: String,
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
    /// 0 for a full backup, n for the n-th incremental after it.
    pub chain_position: u32,
    /// For a full backup: why.
    pub full_reason: Option<FullReason>,
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
            if b.hash.len() != 64 || !b.hash.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(format!("block at offset {}: bad hash {:?}", b.offset, b.hash));
            }
        }
        Ok(())
    }
}
