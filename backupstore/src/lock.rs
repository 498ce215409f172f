//! Cross-process locks on a backup volume, as objects in the store: `volumes/<v>/locks/<kind>-<uuid>.lck`.
//!
//! Backups and restores take `backup`/`restore` locks, which never conflict with each other; deletion and GC take
//! `deletion` locks, which conflict with both. To acquire, a process writes its lock object, then lists the
//! volume's locks: if an unexpired conflicting lock is already acquired, or is older (by the store's
//! modification time, then by name), it removes its own object and fails with [`BackupStoreError::Locked`];
//! otherwise it rewrites its object with `acquired: true`. A held lock is rewritten every [`LOCK_REFRESH`] and
//! expires [`LOCK_EXPIRY`] after its last write, so a killed process blocks the other kind for at most that long.
//!
//! A `backup` lock also names the backup it creates: two `backup` locks for the same backup name conflict, so two
//! processes creating a backup of the same name cannot both pass the "already exists" check.
//!
//! A lock that cannot be refreshed is **lost**: its object was removed by another process, or rewriting it failed
//! until half the expiry had passed since the last good write (after which another process may take the
//! conflicting lock). The holder learns it through [`VolumeLock::lost`] / [`VolumeLock::check`] and stops: a
//! backup, restore or garbage collection never goes on without the lock that protects it.

use std::time::Duration;

use object_store::path::Path;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, error, warn};

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

    /// Conflict between two locks, counting the backup name of `backup` locks.
    fn conflicts_with(self, backup: &str, other: Self, other_backup: &str) -> bool {
        self.conflicts(other)
            || (self == Self::Backup && other == Self::Backup && !backup.is_empty() && backup == other_backup)
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
    /// For a `backup` lock: the backup being created (same-name backups conflict). Absent in older locks.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backup: String,
}

/// A held lock; refreshed in the background until [`VolumeLock::release`] (or drop, best effort).
#[derive(Debug)]
pub struct VolumeLock {
    store: BackupStore,
    volume: String,
    path: Path,
    refresher: Option<JoinHandle<()>>,
    /// Set (once) by the refresher when the lock is lost, with the reason.
    lost: watch::Receiver<Option<String>>,
}

impl BackupStore {
    pub(crate) fn lock_dir(&self, volume: &str) -> Path {
        self.path(&format!("volumes/{volume}/locks"))
    }

    /// Acquires a lock of `kind` on `volume`, retrying for up to `wait` while a conflicting lock is held.
    pub async fn lock(&self, volume: &str, kind: LockKind, wait: Duration) -> Result<VolumeLock> {
        self.lock_named(volume, kind, "", wait).await
    }

    /// Acquires the `backup` lock for creating backup `backup` of `volume`: it also conflicts with any other
    /// process creating a backup of the same name.
    pub async fn lock_backup(&self, volume: &str, backup: &str, wait: Duration) -> Result<VolumeLock> {
        self.lock_named(volume, LockKind::Backup, backup, wait).await
    }

    async fn lock_named(
        &self,
        volume: &str,
        kind: LockKind,
        backup: &str,
        wait: Duration,
    ) -> Result<VolumeLock> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut delay = Duration::from_millis(200);
        loop {
            match self.try_lock(volume, kind, backup).await {
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

    async fn try_lock(&self, volume: &str, kind: LockKind, backup: &str) -> Result<VolumeLock> {
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
            backup: backup.to_owned(),
        };
        self.put_json(&path, &rec).await?;
        let mine = self.head_time(&path).await?;
        let now = chrono::Utc::now();
        for meta in self.list(&self.lock_dir(volume)).await? {
            if meta.location == path {
                continue;
            }
            let age = now.signed_duration_since(meta.last_modified);
            if age.to_std().is_ok_and(|a| a > self.lock_timing.expiry) {
                continue;
            }
            let Some(other) = self.get_json::<LockRecord>(&meta.location).await.ok().flatten() else {
                continue; // released meanwhile, or a partial write: not a holder
            };
            if !kind.conflicts_with(backup, other.kind, &other.backup) {
                continue;
            }
            let other_name = meta.location.filename().unwrap_or_default().to_owned();
            let wins = other.acquired || (meta.last_modified, other_name.as_str()) < (mine, name.as_str());
            if wins {
                self.delete(&path).await?;
                let holder = if other.backup.is_empty() {
                    other.kind.as_str().to_owned()
                } else {
                    format!("{} {}", other.kind.as_str(), other.backup)
                };
                return Err(BackupStoreError::Locked {
                    volume: volume.to_owned(),
                    holder,
                    lock: other_name,
                });
            }
        }
        rec.acquired = true;
        self.put_json(&path, &rec).await?;
        let (tx, lost) = watch::channel(None);
        let refresher = tokio::spawn(refresh_loop(self.clone(), path.clone(), rec, tx));
        Ok(VolumeLock {
            store: self.clone(),
            volume: volume.to_owned(),
            path,
            refresher: Some(refresher),
            lost,
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

/// Rewrites the lock every refresh interval until aborted; reports the lock lost (and stops) when its object
/// disappeared or it could not be rewritten within half the expiry since the last good write.
async fn refresh_loop(store: BackupStore, p: Path, rec: LockRecord, tx: watch::Sender<Option<String>>) {
    let timing = store.lock_timing;
    let mut last_ok = tokio::time::Instant::now();
    let mut wait = timing.refresh;
    loop {
        tokio::time::sleep(wait).await;
        let r = match store.exists(&p).await {
            Ok(false) => {
                let why = "its lock object was removed by another process".to_owned();
                error!(lock = %p, reason = %why, "backup lock lost");
                let _ = tx.send(Some(why));
                return;
            }
            Ok(true) => store.put_json(&p, &rec).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => {
                last_ok = tokio::time::Instant::now();
                wait = timing.refresh;
            }
            Err(e) if last_ok.elapsed() + timing.refresh / 4 < timing.expiry / 2 => {
                warn!(lock = %p, error = %e, "refreshing backup lock failed; retrying");
                wait = timing.refresh / 4;
            }
            Err(e) => {
                let why = format!("refreshing it failed since {:?}: {e}", last_ok.elapsed());
                error!(lock = %p, reason = %why, "backup lock lost");
                let _ = tx.send(Some(why));
                return;
            }
        }
    }
}

/// Lock refresh interval and expiry of a store handle (the defaults [`LOCK_REFRESH`], [`LOCK_EXPIRY`]; tests
/// shorten them; every process on a target must use the same expiry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockTiming {
    /// How often a held lock is rewritten.
    pub refresh: Duration,
    /// A lock not rewritten for this long is ignored.
    pub expiry: Duration,
}

impl Default for LockTiming {
    fn default() -> Self {
        Self {
            refresh: LOCK_REFRESH,
            expiry: LOCK_EXPIRY,
        }
    }
}

impl VolumeLock {
    /// `Ok` while the lock is held; the [`BackupStoreError::LockLost`] error once it was lost.
    pub fn check(&self) -> Result<()> {
        match &*self.lost.borrow() {
            None => Ok(()),
            Some(why) => Err(self.lost_error(why)),
        }
    }

    /// Resolves when the lock is lost, with the error to stop the protected operation with.
    pub async fn lost(&self) -> BackupStoreError {
        let mut rx = self.lost.clone();
        loop {
            if let Some(why) = &*rx.borrow_and_update() {
                return self.lost_error(why);
            }
            if rx.changed().await.is_err() {
                // The refresher ended without reporting (aborted on release): the lock is not lost.
                std::future::pending::<()>().await;
            }
        }
    }

    fn lost_error(&self, why: &str) -> BackupStoreError {
        BackupStoreError::LockLost {
            volume: self.volume.clone(),
            lock: self.path.filename().unwrap_or_default().to_owned(),
            reason: why.to_owned(),
        }
    }

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
