//! Deleting backups and backup volumes, retention, and mark-and-sweep garbage collection of blocks.
//!
//! Every backup's block map is complete, so deleting a backup only drops its references; a block is deleted when
//! no remaining backup references it and it is older than the safety margin. GC runs under the `deletion` lock
//! (no backup or restore can run meanwhile) and is skipped when a recent backup is still `in-progress` or the
//! list of backups changed during the scan. An `in-progress` record older than the margin belongs to a killed
//! backup (its lock has expired, or we could not hold `deletion`): it is removed, and its blocks become garbage.

use std::collections::HashSet;
use std::time::Duration;

use serde::Serialize;
use tracing::{info, warn};

use crate::config::{BackupState, VolumeConfig};
use crate::error::{BackupStoreError, Result};
use crate::lock::{LockKind, VolumeLock};
use crate::{BackupStore, validate_name};

/// Garbage collection settings.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Blocks written less than this long ago are never deleted.
    pub margin: Duration,
    /// How long to wait for running backups/restores before failing with `Locked`.
    pub lock_wait: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            margin: crate::lock::LOCK_EXPIRY * 2,
            lock_wait: Duration::from_secs(10),
        }
    }
}

/// What a garbage collection did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GcOutcome {
    /// Blocks deleted.
    pub deleted_blocks: u64,
    /// Blocks still referenced or inside the margin.
    pub kept_blocks: u64,
    /// Why no block was deleted, when GC was skipped.
    pub skipped: String,
    /// Records of killed backups removed.
    pub removed_stale: Vec<String>,
    /// Backups deleted (by retention or by request).
    pub deleted_backups: Vec<String>,
    /// Staged block files a killed backup left on a `file://` target, removed.
    pub removed_staged: u64,
}

fn hash_of(p: &object_store::path::Path) -> Option<String> {
    p.filename()?.strip_suffix(".blk").map(str::to_owned)
}

impl BackupStore {
    /// Deletes one backup and collects the blocks no other backup references.
    pub async fn delete_backup(&self, volume: &str, backup: &str, gc: &GcOptions) -> Result<GcOutcome> {
        validate_name("backup", backup)?;
        let lock = self.lock(volume, LockKind::Deletion, gc.lock_wait).await?;
        let r = async {
            let p = self.backup_cfg_path(volume, backup);
            if !self.exists(&p).await? {
                return Err(BackupStoreError::NotFound(format!(
                    "backup {backup} of volume {volume}"
                )));
            }
            self.delete(&p).await?;
            self.refresh_last_backup(volume).await?;
            let mut out = self.gc_locked(volume, gc, &lock).await?;
            out.deleted_backups.push(backup.to_owned());
            Ok(out)
        }
        .await;
        lock.release().await?;
        r
    }

    /// Keeps the newest `keep` completed backups (never `current`), deletes the rest and collects garbage.
    pub async fn apply_retention(
        &self,
        volume: &str,
        keep: u32,
        current: &str,
        gc: &GcOptions,
    ) -> Result<GcOutcome> {
        let lock = self.lock(volume, LockKind::Deletion, gc.lock_wait).await?;
        let r = async {
            let mut done: Vec<_> = self
                .list_backups(volume)
                .await?
                .into_iter()
                .filter(|b| b.state == BackupState::Complete)
                .collect();
            done.sort_by(|a, b| (&a.completed, &a.name).cmp(&(&b.completed, &b.name)));
            let excess = done
                .len()
                .saturating_sub(usize::try_from(keep.max(1)).unwrap_or(usize::MAX));
            let mut deleted = Vec::new();
            for b in done.iter().filter(|b| b.name != current).take(excess) {
                self.delete(&self.backup_cfg_path(volume, &b.name)).await?;
                deleted.push(b.name.clone());
            }
            if deleted.is_empty() {
                return Ok(GcOutcome::default());
            }
            info!(volume, keep, deleted = ?deleted, "retention deleted old backups");
            self.refresh_last_backup(volume).await?;
            let mut out = self.gc_locked(volume, gc, &lock).await?;
            out.deleted_backups = deleted;
            Ok(out)
        }
        .await;
        lock.release().await?;
        r
    }

    /// Deletes a backup volume with every backup and block.
    pub async fn delete_volume(&self, volume: &str, gc: &GcOptions) -> Result<u64> {
        validate_name("volume", volume)?;
        if self.get_bytes(&self.volume_cfg_path(volume)).await?.is_none()
            && self.backup_names(volume).await?.is_empty()
        {
            return Err(BackupStoreError::NotFound(format!("backup volume {volume}")));
        }
        let lock = self.lock(volume, LockKind::Deletion, gc.lock_wait).await?;
        let r = async {
            let lock_dir = self.lock_dir(volume);
            let mut n = 0;
            // volume.cfg first, so a half-deleted volume is not mistaken for a usable one.
            self.delete(&self.volume_cfg_path(volume)).await?;
            for m in self.list(&self.volume_dir(volume)).await? {
                if !m.location.prefix_matches(&lock_dir) {
                    self.delete(&m.location).await?;
                    n += 1;
                }
            }
            Ok(n)
        }
        .await;
        lock.release().await?;
        // Other processes' locks stay: a backup or restore that acquired its lock after ours was released must
        // keep it (removing it would let a deletion collect the blocks it uses). Only expired locks go.
        let expiry = chrono::Duration::from_std(self.lock_timing.expiry).unwrap_or(chrono::Duration::MAX);
        let now = chrono::Utc::now();
        for m in self.list(&self.lock_dir(volume)).await? {
            if now.signed_duration_since(m.last_modified) > expiry {
                self.delete(&m.location).await?;
            }
        }
        r
    }

    /// Garbage-collects the volume's blocks (takes the deletion lock).
    pub async fn gc(&self, volume: &str, gc: &GcOptions) -> Result<GcOutcome> {
        let lock = self.lock(volume, LockKind::Deletion, gc.lock_wait).await?;
        let r = self.gc_locked(volume, gc, &lock).await;
        lock.release().await?;
        r
    }

    async fn refresh_last_backup(&self, volume: &str) -> Result<()> {
        let Some(mut vol) = self
            .get_json::<VolumeConfig>(&self.volume_cfg_path(volume))
            .await?
        else {
            return Ok(());
        };
        let newest = self
            .list_backups(volume)
            .await?
            .into_iter()
            .filter(|b| b.state == BackupState::Complete)
            .max_by(|a, b| (&a.completed, &a.name).cmp(&(&b.completed, &b.name)));
        vol.last_backup_name = newest.as_ref().map(|b| b.name.clone()).unwrap_or_default();
        vol.last_backup_at = newest.map(|b| b.completed).unwrap_or_default();
        self.put_json(&self.volume_cfg_path(volume), &vol).await
    }

    async fn gc_locked(&self, volume: &str, opts: &GcOptions, lock: &VolumeLock) -> Result<GcOutcome> {
        let mut out = GcOutcome::default();
        let now = chrono::Utc::now();
        let margin = chrono::Duration::from_std(opts.margin).unwrap_or(chrono::Duration::MAX);
        let cutoff = now - margin;
        for b in self.list_backups(volume).await? {
            if b.state == BackupState::Complete {
                continue;
            }
            let started = chrono::DateTime::parse_from_rfc3339(&b.started).map(|t| t.to_utc());
            if started.is_ok_and(|t| t > cutoff) {
                out.skipped = format!("backup {} is in progress", b.name);
                info!(volume, reason = %out.skipped, "garbage collection skipped");
                return Ok(out);
            }
            warn!(volume, backup = %b.name, started = %b.started, "removing the record of an interrupted backup");
            self.delete(&self.backup_cfg_path(volume, &b.name)).await?;
            out.removed_stale.push(b.name);
        }
        let names = self.backup_names(volume).await?;
        let mut referenced = HashSet::new();
        for n in &names {
            let c = self.backup_config(volume, n).await?;
            if c.state != BackupState::Complete {
                out.skipped = format!("backup {n} appeared during the scan");
                return Ok(out);
            }
            referenced.extend(c.blocks.into_iter().filter(|b| !b.is_zero()).map(|b| b.hash));
        }
        let blocks = self.list(&self.blocks_dir(volume)).await?;
        if self.backup_names(volume).await? != names {
            out.skipped = "the list of backups changed during the scan".into();
            info!(volume, reason = %out.skipped, "garbage collection skipped");
            return Ok(out);
        }
        for m in blocks {
            let unreferenced = hash_of(&m.location).is_none_or(|h| !referenced.contains(&h));
            if unreferenced && m.last_modified <= cutoff {
                // Without the deletion lock a backup may have started and be reusing this block.
                lock.check()?;
                self.delete(&m.location).await?;
                out.deleted_blocks += 1;
            } else {
                out.kept_blocks += 1;
            }
        }
        if let Some(root) = &self.local_root {
            let dir = root.join(self.blocks_dir(volume).as_ref());
            let staged_cutoff = std::time::SystemTime::now()
                .checked_sub(opts.margin)
                .unwrap_or(std::time::UNIX_EPOCH);
            out.removed_staged =
                tokio::task::spawn_blocking(move || crate::local::remove_stale_staged(&dir, staged_cutoff))
                    .await
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .and_then(|r| r)
                    .map_err(|e| BackupStoreError::Store {
                        op: "remove staged blocks",
                        path: self.blocks_dir(volume).to_string(),
                        source: crate::local::local_error(e),
                    })?;
        }
        info!(
            volume,
            deleted = out.deleted_blocks,
            removed_staged = out.removed_staged,
            kept = out.kept_blocks,
            "garbage collection done"
        );
        Ok(out)
    }
}
