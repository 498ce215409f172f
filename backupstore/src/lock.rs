//! Cross-process locks on a backup volume, as objects in the store: `volumes/<v>/locks/<kind>-<uuid>.lck`.
//!
//! Backups and restores take `backup`/`restore` locks, which never conflict with each other; deletion and GC take
//! `deletion` locks, which conflict with both. To acquire, a process writes its lock object, then lists the
//! volume's locks: if an unexpired conflicting lock is already acquired, or is older (by the store's
//! modification time, then by name), it removes its own object and fails with [`BackupStoreError::Locked`];
//! otherwise it rewrites its object with `acquired: true`. A held lock is rewritten every [`LOCK_REFRESH`] and
//! expires [`LOCK_EXPIRY`] after its last write, so a killed process blocks the other kind for at most that long.

use std::time::Duration;

use object_store::path::Path;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::error::{BackupStoreError, Result};
use crate::{BackupStore, now_rfc3339};

/// A lock not rewritten for this long is ignored.
pub const LOCK_EXPIRY: Duration = Duration::from_secs(150);
/// How often a held lock is rewritten.
pub const LOCK_REFRESH: Duration = Duration::from_secs(30);

/// What a lock protects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockKind {
    /// A backup is uploading blocks.
    Backup,
    /// A restore is reading blocks.
    Restore,
    /// Backups are being deleted and blocks garbage-collected.
    Deletion,
}

impl LockKind {
    fn conflicts(self, other: Self) -> bool {
        (self == Self::Deletion) != (other == Self::Deletion)
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Backup => "backup",
            Self::Restore => "restore",
            Self::Deletion => "deletion",
        }
    }
}

/// The lock object's contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LockRecord {
    /// Lock id.
    pub id: String,
    /// Kind.
    pub kind: LockKind,
    /// Won the race and is held.
    pub acquired: bool,
    /// Holder, for humans: `host pid`.
    pub holder: String,
    /// RFC 3339 first write.
    pub created: String,
}

/// A held lock; refreshed in the background until [`VolumeLock::release`] (or drop, best effort).
#[derive(Debug)]
pub struct VolumeLock {
    store: BackupStore,
    path: Path,
    refresher: Option<JoinHandle<()>>,
}

impl BackupStore {
    pub(crate) fn lock_dir(&self, volume: &str) -> Path {
        self.path(&format!("volumes/{volume}/locks"))
    }

    /// Acquires a lock of `kind` on `volume`, retrying for up to `wait` while a conflicting lock is held.
    pub async fn lock(&self, volume: &str, kind: LockKind, wait: Duration) -> Result<VolumeLock> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut delay = Duration::from_millis(200);
        loop {
            match self.try_lock(volume, kind).await {
                Err(e @ BackupStoreError::Locked { .. }) => {
                    if tokio::time::Instant::now() + delay > deadline {
                        return Err(e);
                    }
                    debug!(volume, kind = kind.as_str(), "lock busy, retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                r => return r,
            }
        }
    }

    async fn try_lock(&self, volume: &str, kind: LockKind) -> Result<VolumeLock> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{}-{id}.lck", kind.as_str());
        let path = self.path(&format!("volumes/{volume}/locks/{name}"));
        let mut rec = LockRecord {
            id,
            kind,
            acquired: false,
            holder: format!(
                "{} pid {}",
                std::fs::read_to_string("/etc/hostname")
                    .unwrap_or_default()
                    .trim(),
                std::process::id()
            ),
            created: now_rfc3339(),
        };
        self.put_json(&path, &rec).await?;
        let mine = self.head_time(&path).await?;
        let now = chrono::Utc::now();
        for meta in self.list(&self.lock_dir(volume)).await? {
            if meta.location == path {
                continue;
            }
            let age = now.signed_duration_since(meta.last_modified);
            if age.to_std().is_ok_and(|a| a > LOCK_EXPIRY) {
                continue;
            }
            let Some(other) = self.get_json::<LockRecord>(&meta.location).await.ok().flatten() else {
                continue; // released meanwhile, or a partial write: not a holder
            };
            if !kind.conflicts(other.kind) {
                continue;
            }
            let other_name = meta.location.filename().unwrap_or_default().to_owned();
            let wins = other.acquired || (meta.last_modified, other_name.as_str()) < (mine, name.as_str());
            if wins {
                self.delete(&path).await?;
                return Err(BackupStoreError::Locked {
                    volume: volume.to_owned(),
                    holder: other.kind.as_str().to_owned(),
                    lock: other_name,
                });
            }
        }
        rec.acquired = true;
        self.put_json(&path, &rec).await?;
        let (store, p) = (self.clone(), path.clone());
        let refresher = tokio::spawn(async move {
            loop {
                tokio::time::sleep(LOCK_REFRESH).await;
                if let Err(e) = store.put_json(&p, &rec).await {
                    warn!(lock = %p, error = %e, "refreshing backup lock failed");
                }
            }
        });
        Ok(VolumeLock {
            store: self.clone(),
            path,
            refresher: Some(refresher),
        })
    }

    async fn head_time(&self, p: &Path) -> Result<chrono::DateTime<chrono::Utc>> {
        use object_store::ObjectStoreExt;
        self.store
            .head(p)
            .await
            .map(|m| m.last_modified)
            .map_err(|e| BackupStoreError::store("head", p, e))
    }
}

impl VolumeLock {
    /// Releases the lock.
    pub async fn release(mut self) -> Result<()> {
        if let Some(r) = self.refresher.take() {
            r.abort();
        }
        self.store.delete(&self.path).await
    }
}

impl Drop for VolumeLock {
    fn drop(&mut self) {
        if let Some(r) = self.refresher.take() {
            r.abort();
            let (s, p) = (self.store.clone(), self.path.clone());
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = s.delete(&p).await;
                });
            }
        }
    }
}
