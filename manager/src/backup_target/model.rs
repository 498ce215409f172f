//! The backup targets and what they hold, in the store. A [`BackupTarget`] names where backups go (the one called
//! `default` plus named ones); its credentials are a separate [`BackupTargetSecret`] document that no view
//! serializes. The leader mirrors what it finds on each target into [`BackupVolume`] and [`Backup`] documents
//! (keyed `TARGET:NAME`, see [`key`]), so backups made by another cluster on the same target appear; a backup this
//! cluster runs is a [`Backup`] document from its request on, driven by the leader's backup controller.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::store::Resource;

/// The name of the target used when none is named.
pub const DEFAULT_TARGET: &str = "default";

/// Store key of a backup volume or backup of a target: `TARGET:NAME` (neither name can hold a `:`).
pub fn key(target: &str, name: &str) -> String {
    format!("{target}:{name}")
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTarget {
    pub spec: BackupTargetSpec,
    pub status: BackupTargetStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetSpec {
    /// `file:///DIR` or `s3://BUCKET[/PREFIX]`, without a query.
    pub url: String,
    /// S3 endpoint (`http://HOST:PORT`); empty for AWS or a file target.
    #[serde(default)]
    pub endpoint: String,
    /// S3 region; empty = us-east-1.
    #[serde(default)]
    pub region: String,
    /// Seconds between two listings of the target by the leader.
    pub poll_interval: u64,
    /// Names of the credentials kept in the target's secret (never their values).
    #[serde(default)]
    pub credential_keys: Vec<String>,
}

impl BackupTargetSpec {
    /// The URL the backup store and the replicas take: `s3://B/P?endpoint=E&region=R` or `file:///DIR`.
    pub fn store_url(&self) -> String {
        let mut q = Vec::new();
        if !self.endpoint.is_empty() {
            q.push(format!("endpoint={}", self.endpoint));
        }
        if !self.region.is_empty() {
            q.push(format!("region={}", self.region));
        }
        if q.is_empty() {
            self.url.clone()
        } else {
            format!("{}?{}", self.url, q.join("&"))
        }
    }

    /// The backup store's URL of one backup on this target, `TARGET?backup=NAME&volume=VOLUME`: what a backing
    /// image of source type `restore` takes.
    pub fn backup_url(&self, volume: &str, backup: &str) -> String {
        let url = self.store_url();
        match backupstore::BackupUrl::parse(&url) {
            Ok(mut u) => {
                u.volume = Some(volume.to_owned());
                u.backup = Some(backup.to_owned());
                u.to_string()
            }
            // A stored target URL always parses (`PUT` checked it); shown as written otherwise.
            Err(_) => url,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetStatus {
    pub available: bool,
    /// Why the last listing failed (empty when available).
    pub message: String,
    /// Unix seconds of the last listing that worked.
    pub last_synced_at: i64,
}

impl Resource for BackupTarget {
    const KIND: &'static str = "backup-target";
}

/// The credentials of a target (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), named after
/// it. Kept apart from the target so that nothing showing a target can show them; `Debug` prints only the keys.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetSecret {
    pub credentials: BTreeMap<String, String>,
}

impl std::fmt::Debug for BackupTargetSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackupTargetSecret")
            .field("credentials", &self.credentials.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Resource for BackupTargetSecret {
    const KIND: &'static str = "backup-target-secret";
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

impl Resource for BackupVolume {
    const KIND: &'static str = "backup-volume";
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

impl Resource for Backup {
    const KIND: &'static str = "backup";
}
