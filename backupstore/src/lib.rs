//! The Corral backup store owns everything about backups at rest: the layout of a backup target (a local
//! directory or an S3 bucket, through `object_store`), content-addressed compressed blocks, the per-backup block
//! maps, the full/incremental chain policy (`backup-delta-max`), retention and deletion with reference-counting
//! garbage collection, cross-process locks, and restore into any [`RestoreSink`]. It knows nothing about
//! replicas: a snapshot is any [`BackupSource`]. See `docs/formats.md` ("Backup store") for the layout.

pub mod backing_image;
pub mod block;
pub mod blockmap;
mod buf;
pub mod config;
mod create;
pub mod error;
pub mod file;
mod gc;
mod local;
pub mod lock;
mod restore;
pub mod target;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use block::Compression;
pub use config::{BackupConfig, BackupState, BlockRef, FullReason, VolumeConfig, ZERO_MARKER};
pub use create::{BackupMode, BackupSource, Changes, CreateOptions, SnapshotInfo, check_block_size};
pub use error::{BackupStoreError, ErrorKind, Result};
pub use gc::{GcOptions, GcOutcome};
pub use restore::{RestoreOptions, RestoreOutcome, RestoreSink, VerifyOutcome};
pub use target::{BackupUrl, TargetUrl};

/// Checks a volume or backup name: 1-63 characters of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_name(what: &str, name: &str) -> Result<String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
    if ok {
        Ok(name.to_owned())
    } else {
        Err(BackupStoreError::InvalidArgument(format!(
            "{what} name {name:?}: use 1-63 of [A-Za-z0-9._-], not starting with '.' or '-'"
        )))
    }
}

/// Progress of a backup or restore: units done of a total, and a cancellation flag the job checks per block.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    total: AtomicU64,
    bytes: AtomicU64,
    cancelled: AtomicBool,
}

impl Progress {
    /// Percent done (0-100).
    pub fn percent(&self) -> u32 {
        let (d, t) = (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        );
        (d.min(t) * 100)
            .checked_div(t)
            .map_or(0, |p| u32::try_from(p).unwrap_or(100))
    }

    /// Bytes moved so far (read for a backup, written for a restore).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Asks the job to stop at the next block.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    fn check(&self) -> Result<()> {
        if self.cancelled.load(Ordering::Relaxed) {
            Err(BackupStoreError::Cancelled)
        } else {
            Ok(())
        }
    }

    fn set_total(&self, t: u64) {
        self.total.store(t, Ordering::Relaxed);
    }

    fn step(&self, bytes: u64) {
        self.done.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// An open backup target.
#[derive(Debug, Clone)]
pub struct BackupStore {
    store: Arc<dyn ObjectStore>,
    root: Path,
    target: TargetUrl,
    lock_timing: lock::LockTiming,
    /// The directory of a `file://` target: blocks are written and read there directly (see `local`).
    local_root: Option<std::path::PathBuf>,
}

/// One backup as listed.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupSummary {
    /// `TARGET?backup=NAME&volume=VOLUME`.
    pub url: String,
    /// The backup's record without the block map.
    #[serde(flatten)]
    pub config: BackupConfig,
    /// Bytes of data the backup describes.
    pub data_bytes: u64,
}

impl BackupStore {
    /// Opens the target of `url` (a target or backup URL).
    pub fn open(url: &BackupUrl, credentials: &BTreeMap<String, String>) -> Result<Self> {
        let (store, root) = url.target.open(credentials)?;
        Ok(Self {
            store,
            root,
            target: url.target.clone(),
            lock_timing: lock::LockTiming::default(),
            local_root: (url.target.scheme == "file").then(|| url.target.location.clone().into()),
        })
    }

    /// A store over an existing `object_store` (tests: `InMemory`).
    pub fn with_store(store: Arc<dyn ObjectStore>, target: TargetUrl) -> Self {
        Self {
            store,
            root: Path::from(target.prefix.as_str()),
            target,
            lock_timing: lock::LockTiming::default(),
            local_root: None,
        }
    }

    /// The same store with other lock timings (tests; every process on a target must agree on the expiry).
    #[must_use]
    pub fn with_lock_timing(mut self, timing: lock::LockTiming) -> Self {
        self.lock_timing = timing;
        self
    }

    /// The target URL.
    pub fn target(&self) -> &TargetUrl {
        &self.target
    }

    /// The URL of one backup.
    pub fn backup_url(&self, volume: &str, backup: &str) -> String {
        BackupUrl {
            target: self.target.clone(),
            volume: Some(volume.to_owned()),
            backup: Some(backup.to_owned()),
        }
        .to_string()
    }

    fn path(&self, rel: &str) -> Path {
        let mut p = self.root.clone();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            p = p.join(part);
        }
        p
    }

    fn volume_dir(&self, volume: &str) -> Path {
        self.path(&format!("volumes/{volume}"))
    }

    fn volume_cfg_path(&self, volume: &str) -> Path {
        self.path(&format!("volumes/{volume}/volume.cfg"))
    }

    fn backup_cfg_path(&self, volume: &str, backup: &str) -> Path {
        self.path(&format!("volumes/{volume}/backups/backup_{backup}.cfg"))
    }

    fn blocks_dir(&self, volume: &str) -> Path {
        self.path(&format!("volumes/{volume}/blocks"))
    }

    fn block_path(&self, volume: &str, hash: &str) -> Path {
        let (a, b) = (hash.get(..2).unwrap_or("00"), hash.get(2..4).unwrap_or("00"));
        self.path(&format!("volumes/{volume}/blocks/{a}/{b}/{hash}.blk"))
    }

    async fn get_bytes(&self, p: &Path) -> Result<Option<Bytes>> {
        match self.store.get(p).await {
            Ok(r) => Ok(Some(
                r.bytes()
                    .await
                    .map_err(|e| BackupStoreError::store("get", p, e))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(BackupStoreError::store("get", p, e)),
        }
    }

    async fn put_bytes(&self, p: &Path, data: impl Into<PutPayload>) -> Result<()> {
        self.store
            .put(p, data.into())
            .await
            .map(|_| ())
            .map_err(|e| BackupStoreError::store("put", p, e))
    }

    async fn delete(&self, p: &Path) -> Result<()> {
        match self.store.delete(p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(BackupStoreError::store("delete", p, e)),
        }
    }

    async fn exists(&self, p: &Path) -> Result<bool> {
        match self.store.head(p).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(BackupStoreError::store("head", p, e)),
        }
    }

    async fn list(&self, prefix: &Path) -> Result<Vec<object_store::ObjectMeta>> {
        self.store
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(|e| BackupStoreError::store("list", prefix, e))
    }

    async fn get_json<T: DeserializeOwned>(&self, p: &Path) -> Result<Option<T>> {
        let Some(b) = self.get_bytes(p).await? else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_slice(&b).map_err(|e| BackupStoreError::Corrupt {
            path: p.to_string(),
            reason: e.to_string(),
        })?;
        let version = v
            .get("formatVersion")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        if version > u64::from(config::FORMAT_VERSION) {
            return Err(BackupStoreError::FailedPrecondition(format!(
                "{p} has format version {version}; this build reads up to {}",
                config::FORMAT_VERSION
            )));
        }
        serde_json::from_value(v)
            .map(Some)
            .map_err(|e| BackupStoreError::Corrupt {
                path: p.to_string(),
                reason: e.to_string(),
            })
    }

    async fn put_json<T: Serialize>(&self, p: &Path, v: &T) -> Result<()> {
        let b = serde_json::to_vec_pretty(v).map_err(|e| BackupStoreError::Corrupt {
            path: p.to_string(),
            reason: e.to_string(),
        })?;
        self.put_bytes(p, b).await
    }

    /// The volume's `volume.cfg`.
    pub async fn volume_config(&self, volume: &str) -> Result<VolumeConfig> {
        validate_name("volume", volume)?;
        self.get_json(&self.volume_cfg_path(volume))
            .await?
            .ok_or_else(|| BackupStoreError::NotFound(format!("backup volume {volume}")))
    }

    /// Backup volumes on the target.
    pub async fn list_volumes(&self) -> Result<Vec<String>> {
        let dir = self.path("volumes");
        let r = self
            .store
            .list_with_delimiter(Some(&dir))
            .await
            .map_err(|e| BackupStoreError::store("list", &dir, e))?;
        let mut v: Vec<String> = r
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Names of the volume's backups (any state), sorted.
    pub async fn backup_names(&self, volume: &str) -> Result<Vec<String>> {
        let dir = self.path(&format!("volumes/{volume}/backups"));
        let mut v: Vec<String> = self
            .list(&dir)
            .await?
            .iter()
            .filter_map(|m| m.location.filename())
            .filter_map(|f| f.strip_prefix("backup_")?.strip_suffix(".cfg").map(str::to_owned))
            .collect();
        v.sort();
        Ok(v)
    }

    /// One backup's record.
    pub async fn backup_config(&self, volume: &str, backup: &str) -> Result<BackupConfig> {
        validate_name("volume", volume)?;
        validate_name("backup", backup)?;
        self.get_json(&self.backup_cfg_path(volume, backup))
            .await?
            .ok_or_else(|| BackupStoreError::NotFound(format!("backup {backup} of volume {volume}")))
    }

    /// Every backup of a volume, oldest first (by start time, then name).
    pub async fn list_backups(&self, volume: &str) -> Result<Vec<BackupConfig>> {
        let mut out = Vec::new();
        for n in self.backup_names(volume).await? {
            match self.backup_config(volume, &n).await {
                Ok(c) => out.push(c),
                // Deleted between the listing and the read.
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| (&a.started, &a.name).cmp(&(&b.started, &b.name)));
        Ok(out)
    }

    /// Listing rows (block maps dropped) for `backup ls`.
    pub async fn summaries(&self, volume: &str) -> Result<Vec<BackupSummary>> {
        Ok(self
            .list_backups(volume)
            .await?
            .into_iter()
            .map(|mut c| {
                let data_bytes = c.data_bytes();
                c.blocks = Vec::new();
                BackupSummary {
                    url: self.backup_url(volume, &c.name),
                    config: c,
                    data_bytes,
                }
            })
            .collect())
    }

    /// The chain of `backup`: the backups from its full up to it, oldest first, by following `baseBackup`
    /// (a deleted link shows as `name (deleted)`).
    pub async fn chain_of(&self, volume: &str, backup: &str) -> Result<Vec<String>> {
        let mut out = vec![backup.to_owned()];
        let mut cur = self.backup_config(volume, backup).await?;
        while cur.is_incremental && !cur.base_backup.is_empty() {
            match self.backup_config(volume, &cur.base_backup).await {
                Ok(c) => {
                    out.push(c.name.clone());
                    cur = c;
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    out.push(format!("{} (deleted)", cur.base_backup));
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        out.reverse();
        Ok(out)
    }

    /// Reads and verifies one stored block.
    pub async fn read_block(&self, volume: &str, hash: &str) -> Result<Vec<u8>> {
        let p = self.block_path(volume, hash);
        if let Some(root) = &self.local_root {
            // A file:// target: read and verify in one blocking call (no detour through the object store's
            // chunked reads).
            let (file, h, p2) = (root.join(p.as_ref()), hash.to_owned(), p.clone());
            return tokio::task::spawn_blocking(move || match std::fs::read(&file) {
                Ok(stored) => {
                    block::decode_block_owned(stored, &h).map_err(|reason| BackupStoreError::Corrupt {
                        path: p2.to_string(),
                        reason,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(BackupStoreError::Corrupt {
                    path: p2.to_string(),
                    reason: "block missing".into(),
                }),
                Err(e) => Err(BackupStoreError::store("get", &p2, local::local_error(e))),
            })
            .await
            .map_err(|e| join_error(&e))?;
        }
        let stored = self
            .get_bytes(&p)
            .await?
            .ok_or_else(|| BackupStoreError::Corrupt {
                path: p.to_string(),
                reason: "block missing".into(),
            })?;
        let (p2, h) = (p.clone(), hash.to_owned());
        tokio::task::spawn_blocking(move || block::decode_block(&stored, &h))
            .await
            .map_err(|e| join_error(&e))?
            .map_err(|reason| BackupStoreError::Corrupt {
                path: p2.to_string(),
                reason,
            })
    }

    /// Object path of a block (tests corrupt blocks through it).
    pub fn block_object(&self, volume: &str, hash: &str) -> Path {
        self.block_path(volume, hash)
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }
}

pub(crate) fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A blocking task that panicked or was cancelled.
pub(crate) fn join_error(e: &tokio::task::JoinError) -> BackupStoreError {
    BackupStoreError::FailedPrecondition(format!("block task failed: {e}"))
}
