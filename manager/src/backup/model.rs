//! The backup feature's resources in the store: the targets and the backups they hold
//! ([`crate::backup_target::model`], re-exported here), a restore — a [`VolumeRestore`] record named after the
//! volume it fills, like a clone's record — and a [`BackingImageBackup`].

use serde::{Deserialize, Serialize};

pub use crate::backup_target::model::{
    Backup, BackupMode, BackupState, BackupTarget, BackupTargetSecret, BackupTargetSpec, BackupTargetStatus,
    BackupVolume, DEFAULT_TARGET, key,
};
pub use corral_api::backup::{RestoreState, VolumeRestore};

use crate::store::Resource;

impl Resource for VolumeRestore {
    const KIND: &'static str = "volume-restore";
}

/// A backup of a backing image into a target's backing-image area (key `TARGET:NAME`), tracked like a volume's
/// [`Backup`]: recorded `pending` by the request, run by the manager of `node_id` (which holds a ready copy of
/// the image) whatever happens to the client, `in-progress` with its progress, then `completed` or `failed`
/// with the reason.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageBackup {
    pub target: String,
    /// The backing image.
    pub image: String,
    /// Its UUID when the backup was asked for: a copy of another image of the same name is never read.
    pub image_uuid: String,
    /// The backup's name in the target's backing-image area.
    pub backup: String,
    /// What a backing image of source type `restore` takes as `backupURL`.
    pub backup_url: String,
    /// SHA-512 of the image, recorded in the backup.
    pub checksum: String,
    /// The node whose copy is read.
    pub node_id: String,
    pub state: BackupState,
    /// 0-100.
    pub progress: u32,
    pub size: u64,
    /// Bytes uploaded (blocks the area did not hold).
    pub new_bytes: u64,
    pub deduplicated_blocks: u64,
    pub started: String,
    pub completed: String,
    pub error: String,
    /// Bytes of block data per second the upload may take (0: unlimited).
    #[serde(default)]
    pub max_upload_rate: u64,
    /// A cancel was asked for (`POST .../cancel`): the manager running it stops at the next block and records the
    /// backup `failed` with "cancelled".
    #[serde(default)]
    pub cancel_requested: bool,
}

impl Resource for BackingImageBackup {
    const KIND: &'static str = "backing-image-backup";
}
