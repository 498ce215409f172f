//! The backup feature as the API shows it: the targets (never their credentials), the backup volumes and backups
//! listed on them, the restores into volumes, and the routes' requests. `Backup`, `BackupVolume` and
//! `VolumeRestore` are the store's documents, shown as they are stored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetStatus {
    pub available: bool,
    /// Why the last listing failed (empty when available).
    pub message: String,
    /// Unix seconds of the last listing that worked.
    pub last_synced_at: i64,
}

/// A volume on a target, as the leader last listed it (key `TARGET:VOLUME`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupVolume {
    pub target: String,
    /// The backup volume's name (the name of the volume it was made from).
    pub name: String,
    /// Size of the volume at its last backup.
    pub size: u64,
    pub last_backup_name: String,
    pub last_backup_at: String,
    pub backing_image_name: String,
    /// SHA-512 of that backing image.
    pub backing_image_checksum: String,
    pub labels: BTreeMap<String, String>,
    pub created: String,
    /// Backups listed on the target (any state).
    pub backup_count: u32,
    /// Block size of every backup of the volume (fixed by its first backup; 0 in documents written before it was
    /// shown).
    #[serde(default)]
    pub block_size: u64,
}

/// pending (asked for, not started) → in-progress → completed | failed. A backup found on a target is
/// `in-progress` or `completed` as its record there says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackupState {
    #[default]
    Pending,
    InProgress,
    Completed,
    Failed,
}

impl BackupState {
    /// Still running here: its snapshot is being read, its name is taken.
    pub fn active(self) -> bool {
        matches!(self, Self::Pending | Self::InProgress)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::InProgress => "in-progress",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }
}

/// auto: incremental unless the chain policy says full; full: read and upload everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackupMode {
    #[default]
    Auto,
    Full,
}

/// One backup (key `TARGET:NAME`). The first block of fields describes the backup as the target records it; the
/// second is this cluster's job, set only for backups made here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Backup {
    pub target: String,
    /// The backup volume it belongs to.
    pub volume: String,
    pub name: String,
    pub snapshot: String,
    pub labels: BTreeMap<String, String>,
    pub state: BackupState,
    /// 0-100.
    pub progress: u32,
    /// The volume's size in bytes.
    pub size: u64,
    pub is_incremental: bool,
    /// 0 for a full, n for the n-th incremental after it.
    pub chain_position: u32,
    /// Why a full was full (empty for an incremental).
    pub full_reason: String,
    /// The backup an incremental extends.
    pub base_backup: String,
    pub read_bytes: u64,
    /// Bytes uploaded because the target did not hold them.
    pub new_bytes: u64,
    pub started: String,
    pub completed: String,
    pub error: String,
    /// The backing image under the volume when the backup was made (empty without one), and its SHA-512: a
    /// restore takes that image and refuses one of the same name with other content.
    #[serde(default)]
    pub backing_image_name: String,
    #[serde(default)]
    pub backing_image_checksum: String,

    /// The volume of this cluster it was made from (empty for a backup found on the target).
    #[serde(default)]
    pub source_volume: String,
    #[serde(default)]
    pub mode: BackupMode,
    /// The snapshot was taken for this backup (no snapshot named).
    #[serde(default)]
    pub snapshot_taken: bool,
    /// Address of the replica that runs the job, once asked.
    #[serde(default)]
    pub replica: String,
    /// The `backup-delta-max` asked for with the backup (a recurring job's own); None: the setting's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_max: Option<u32>,
    /// Block size for the backup volume if this backup is its first (`--block-size`, else the
    /// `backup-block-size` setting when the backup was asked for); an existing backup volume keeps its own.
    /// 0: the backup store's default (records written before the setting existed).
    #[serde(default)]
    pub block_size: u64,
}

/// initiated → restoring → completed | failed, like a clone's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreState {
    #[default]
    Initiated,
    Restoring,
    Completed,
    Failed,
}

impl RestoreState {
    /// Still running: the volume may not be attached for IO, detached or deleted.
    pub fn active(self) -> bool {
        matches!(self, Self::Initiated | Self::Restoring)
    }
}

/// A restore into a volume (a new one, or a detached one in place), named after the volume; written by the
/// leader's restore controller only, each step recorded before the next.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestore {
    pub target: String,
    pub backup_volume: String,
    pub backup: String,
    pub state: RestoreState,
    /// Lowest over the volume's replicas.
    pub progress: u32,
    pub message: String,
    /// Replica addresses asked to restore (a replica that restarted meanwhile is asked again).
    #[serde(default)]
    pub replicas: Vec<String>,
    /// Every replica restored: what is left is the detach.
    #[serde(default)]
    pub restored: bool,
    /// How many times the restore was started again (a replica or engine restarted mid-way).
    #[serde(default)]
    pub attempts: u32,
    /// A standby (DR) volume: stays attached without a frontend after each restore and restores every newer
    /// completed backup of `backup_volume` incrementally, until activated.
    #[serde(default)]
    pub standby: bool,
    /// `volume activate` asked: one last incremental restore of the newest backup, then a normal volume.
    #[serde(default)]
    pub activate: bool,
    /// The replicas were asked for an incremental restore (only the blocks changed since the last one).
    #[serde(default)]
    pub incremental: bool,
    /// Bytes the last restore wrote into the first replica (an incremental writes only the changed blocks).
    #[serde(default)]
    pub bytes_written: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct BackupTargetSet {
    pub url: String,
    #[serde(default)]
    pub endpoint: String,
    #[serde(default)]
    pub region: String,
    /// Seconds between two listings (default 300).
    #[serde(default)]
    pub poll_interval: Option<u64>,
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`. None keeps the stored ones.
    #[serde(default)]
    pub credentials: Option<BTreeMap<String, String>>,
}

/// A target as shown: never its credentials' values.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetView {
    pub name: String,
    pub url: String,
    pub endpoint: String,
    pub region: String,
    pub poll_interval: u64,
    pub credential_keys: Vec<String>,
    #[serde(flatten)]
    pub status: BackupTargetStatus,
}

/// `GET /v1/backups?target=T&volume=V`: only the backups of target T and/or of backup volume V.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct BackupListQuery {
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default)]
    pub volume: Option<String>,
}

/// A volume's own `backup-max-count`: None falls back to the setting; 0 = no limit.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct BackupMaxCount {
    #[serde(default)]
    pub backup_max_count: Option<u32>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// `[TARGET:]BACKUP`.
    pub backup: String,
}

/// A backup as shown: its id (`TARGET:NAME`), its URL in the backup store and its record.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupView {
    pub id: String,
    /// `TARGET?backup=NAME&volume=VOLUME` (what `corral backing-image create --source restore --backup-url`
    /// takes); empty when the target is not set here any more.
    #[serde(default)]
    pub url: String,
    #[serde(flatten)]
    pub backup: Backup,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupVolumeView {
    pub id: String,
    #[serde(flatten)]
    pub volume: BackupVolume,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreView {
    pub volume: String,
    #[serde(flatten)]
    pub restore: VolumeRestore,
}

/// A volume's own `backup-delta-max`: None falls back to the setting.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct BackupDeltaMax {
    #[serde(default)]
    pub backup_delta_max: Option<u32>,
}
