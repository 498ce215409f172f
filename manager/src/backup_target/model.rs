//! The backup targets and what they hold, in the store. A [`BackupTarget`] names where backups go (the one called
//! `default` plus named ones); its credentials are a separate [`BackupTargetSecret`] document that no view
//! serializes. The leader mirrors what it finds on each target into [`BackupVolume`] and [`Backup`] documents
//! (keyed `TARGET:NAME`, see [`key`]), so backups made by another cluster on the same target appear; a backup this
//! cluster runs is a [`Backup`] document from its request on, driven by the leader's backup controller.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use corral_api::backup::{Backup, BackupMode, BackupState, BackupTargetStatus, BackupVolume};

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

impl Resource for BackupVolume {
    const KIND: &'static str = "backup-volume";
}

impl Resource for Backup {
    const KIND: &'static str = "backup";
}
