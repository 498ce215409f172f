//! CSI snapshots of the backup type (VolumeSnapshotClass `type: backup`): a backup of the volume on one of the
//! manager's backup targets, `backup://TARGET/VOLUME/BACKUP`. The manager names a backup itself, so the CO's
//! snapshot name travels as a label of the backup ([`LABEL_SNAPSHOT_NAME`]) and a repeated CreateSnapshot finds
//! it there.
//!
//! A backup reads a snapshot through the volume's engine, so a detached volume is attached for it without a
//! frontend (maintenance mode: nobody can do IO on it meanwhile), marked by [`LABEL_ATTACHED`]. The manager refuses
//! to detach a volume while a backup reads it, so the plugin detaches it when it sees the backup ended: in the
//! call that made it (which waits up to `--backup-wait`), or in the CO's repeat of CreateSnapshot (it repeats the
//! call until `ready_to_use`), or in DeleteSnapshot. Until then ControllerPublish of the volume is ABORTED.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use corral_api::backup::BackupView;
use corral_api::backup::{Backup, BackupState};

use crate::controller::ControllerService;
use crate::error::{CsiError, CsiResult};
use crate::parameters::DEFAULT_BACKUP_TARGET;
use crate::proto::Snapshot;
use crate::snapshot_id::SnapshotId;

/// The CO's snapshot name, on the backup made for it.
pub const LABEL_SNAPSHOT_NAME: &str = "csi.corral.io/snapshot-name";
/// Set on a backup whose volume the plugin attached (without a frontend) for it, and detaches once it ended.
pub const LABEL_ATTACHED: &str = "csi.corral.io/attached-for-backup";
/// How long the plugin waits for a volume it attached for a backup to be attached or detached.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);

/// What a `backup://` content source restores: the manager's `fromBackup` (`TARGET:BACKUP`) and the backup's size.
pub struct RestoreSource {
    pub from_backup: String,
    pub size: u64,
}

fn snapshot_of(b: &Backup) -> Snapshot {
    let at = [&b.started, &b.completed]
        .into_iter()
        .find_map(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map_or_else(chrono::Utc::now, |t| t.with_timezone(&chrono::Utc));
    Snapshot {
        size_bytes: i64::try_from(b.size).unwrap_or(i64::MAX),
        snapshot_id: SnapshotId::backup(&b.target, &b.volume, &b.name),
        source_volume_id: b.volume.clone(),
        creation_time: Some(prost_types::Timestamp {
            seconds: at.timestamp(),
            nanos: i32::try_from(at.timestamp_subsec_nanos()).unwrap_or(0),
        }),
        ready_to_use: b.state == BackupState::Completed,
        group_snapshot_id: String::new(),
    }
}

impl ControllerService {
    /// CreateSnapshot with `type: backup`.
    pub(crate) async fn create_backup_snapshot(
        &self,
        volume: &str,
        name: &str,
        target: &str,
    ) -> CsiResult<Snapshot> {
        let _guard = self.in_flight.begin(volume)?;
        let made = self
            .manager
            .backups()
            .await?
            .into_iter()
            .find(|b| b.backup.labels.get(LABEL_SNAPSHOT_NAME).map(String::as_str) == Some(name));
        if let Some(b) = made {
            if b.backup.volume != volume || b.backup.target != target {
                return Err(CsiError::AlreadyExists(format!(
                    "snapshot {name} is backup {} of volume {} on target {}, not of {volume} on {target}",
                    b.backup.name, b.backup.volume, b.backup.target
                )));
            }
            return self.backup_ended(b.backup).await;
        }
        let v = self
            .manager
            .volume(volume)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("source volume {volume} does not exist")))?;
        if self.manager.backup_target(target).await?.is_none() {
            return Err(if target == DEFAULT_BACKUP_TARGET {
                CsiError::FailedPrecondition(format!(
                    "the manager has no backup target {target}: set one (corral backup target set URL)"
                ))
            } else {
                CsiError::InvalidArgument(format!(
                    "parameter backupTarget={target:?}: the manager has no such backup target"
                ))
            });
        }
        let mut labels = BTreeMap::from([(LABEL_SNAPSHOT_NAME.to_owned(), name.to_owned())]);
        let attach_here = v.view.node_id.is_none();
        if attach_here {
            labels.insert(LABEL_ATTACHED.to_owned(), "true".to_owned());
            self.manager.attach_without_frontend(volume).await?;
            let attached = self
                .manager
                .wait_volume(volume, "attached for a backup", ATTACH_TIMEOUT, |v| {
                    v.view.state == corral_api::model::VolumeState::Attached && v.view.frontend_disabled
                })
                .await;
            if let Err(e) = attached {
                self.detach(volume).await?;
                return Err(e);
            }
        }
        match self.manager.create_backup(volume, target, &labels).await {
            Ok(b) => self.backup_ended(b.backup).await,
            Err(e) => {
                if attach_here {
                    self.detach(volume).await?;
                }
                Err(e)
            }
        }
    }

    /// Waits up to `backup_wait` for the backup to end. Completed: ready to use. Failed: deleted (the CO's
    /// repeat backs up again) and INTERNAL with the reason. Either way the volume the plugin attached for it is
    /// detached again.
    async fn backup_ended(&self, b: Backup) -> CsiResult<Snapshot> {
        let end = Instant::now() + self.backup_wait;
        let mut b = b;
        while b.state.active() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(200)).await;
            b = self
                .manager
                .backup(&b.target, &b.name)
                .await?
                .ok_or_else(|| {
                    CsiError::Aborted(format!("backup {} disappeared while it ran; retry", b.name))
                })?
                .backup;
        }
        if b.state.active() {
            return Ok(snapshot_of(&b));
        }
        self.release_attach(&b).await?;
        if b.state == BackupState::Failed {
            self.manager.delete_backup(&b.target, &b.name).await?;
            return Err(CsiError::Internal(format!(
                "backup {} of volume {} failed: {}; it was deleted, a retry backs up again",
                b.name, b.volume, b.error
            )));
        }
        Ok(snapshot_of(&b))
    }

    /// Detaches the volume the plugin attached (without a frontend) for `b`, once `b` ended.
    async fn release_attach(&self, b: &Backup) -> CsiResult<()> {
        if b.labels.get(LABEL_ATTACHED).map(String::as_str) != Some("true") {
            return Ok(());
        }
        let volume = if b.source_volume.is_empty() {
            &b.volume
        } else {
            &b.source_volume
        };
        match self.manager.volume(volume).await? {
            Some(v) if v.view.node_id.is_some() && v.view.disable_frontend => self.detach(volume).await,
            _ => Ok(()),
        }
    }

    async fn detach(&self, volume: &str) -> CsiResult<()> {
        self.manager.detach(volume).await?;
        self.manager.wait_detached(volume, ATTACH_TIMEOUT).await?;
        Ok(())
    }

    /// DeleteSnapshot of `backup://TARGET/VOLUME/BACKUP`: a running backup is ABORTED (the CO retries once it
    /// ended), a gone one is deleted.
    pub(crate) async fn delete_backup_snapshot(
        &self,
        target: &str,
        volume: &str,
        backup: &str,
    ) -> CsiResult<()> {
        let _guard = self.in_flight.begin(volume)?;
        let Some(b) = self
            .manager
            .backup(target, backup)
            .await?
            .filter(|b| b.backup.volume == volume)
        else {
            return Ok(());
        };
        if b.backup.state.active() {
            return Err(CsiError::Aborted(format!(
                "backup {backup} of {volume} is {} ({}%): it can be deleted once it ended",
                b.backup.state.as_str(),
                b.backup.progress
            )));
        }
        self.release_attach(&b.backup).await?;
        self.manager.delete_backup(target, backup).await
    }

    /// Backups as CSI snapshots (failed ones are none): the one `id` names, or those of `volume`, or all.
    pub(crate) async fn backup_snapshots(
        &self,
        id: Option<(&str, &str, &str)>,
        volume: Option<&str>,
    ) -> CsiResult<Vec<Snapshot>> {
        let backups: Vec<BackupView> = match id {
            Some((target, vol, backup)) => self
                .manager
                .backup(target, backup)
                .await?
                .filter(|b| b.backup.volume == vol)
                .into_iter()
                .collect(),
            None => self.manager.backups().await?,
        };
        Ok(backups
            .iter()
            .filter(|b| b.backup.state != BackupState::Failed)
            .filter(|b| volume.is_none_or(|v| b.backup.volume == v))
            .map(|b| snapshot_of(&b.backup))
            .collect())
    }

    /// The manager's `fromBackup` for a `backup://` content source, after checking the backup exists (NOT_FOUND)
    /// and completed (ABORTED while it runs: the CO retries).
    pub(crate) async fn restore_source(
        &self,
        id: &str,
        target: &str,
        volume: &str,
        backup: &str,
    ) -> CsiResult<RestoreSource> {
        let b = self
            .manager
            .backup(target, backup)
            .await?
            .map(|b| b.backup)
            .filter(|b| b.volume == volume && b.state != BackupState::Failed)
            .ok_or_else(|| CsiError::NotFound(format!("source snapshot {id} does not exist")))?;
        if b.state != BackupState::Completed {
            return Err(CsiError::Aborted(format!(
                "source snapshot {id} is a backup still {} ({}%): a volume can be restored from it once it completed",
                b.state.as_str(),
                b.progress
            )));
        }
        Ok(RestoreSource {
            from_backup: format!("{target}:{backup}"),
            size: b.size,
        })
    }

    /// Waits for the restore into `name` to complete (ABORTED with the progress after `wait`: the CO retries). A
    /// failed restore's volume is deleted, so the retry restores again.
    pub(crate) async fn restore_completed(&self, name: &str, wait: Duration) -> CsiResult<()> {
        use corral_api::backup::RestoreState;
        let end = Instant::now() + wait;
        loop {
            let r = self
                .manager
                .restore(name)
                .await?
                .ok_or_else(|| CsiError::Internal(format!("volume {name} has no restore record")))?
                .restore;
            match r.state {
                RestoreState::Completed => return Ok(()),
                RestoreState::Failed => {
                    self.manager.delete_volume(name).await?;
                    return Err(CsiError::Internal(format!(
                        "the restore of backup {} into {name} failed: {}; the volume was deleted, a retry restores it again",
                        r.backup, r.message
                    )));
                }
                RestoreState::Initiated | RestoreState::Restoring if Instant::now() >= end => {
                    return Err(CsiError::Aborted(format!(
                        "volume {name} is still being restored from backup {} ({}%)",
                        r.backup, r.progress
                    )));
                }
                RestoreState::Initiated | RestoreState::Restoring => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}
