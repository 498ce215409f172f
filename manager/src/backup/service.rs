//! What other features ask of backups: request a backup (the one path of `POST /v1/backups` and of recurring
//! backup jobs), remove one, and check and start the restore of a new volume from one. Errors are the API's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::controller::MAX_COUNT_SETTING;
use super::errors::{store_error, target_error, target_reachable};
use super::model::{Backup, BackupMode, BackupState, DEFAULT_TARGET, VolumeRestore, key};
use super::openapi::BLOCK_SIZE_SETTING;
use super::restore::{completed_backup, parse_ref, record_for, spec_ref};
use crate::api::openapi::check_name;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{ProcessState, Volume, VolumeState};
use crate::store::{Object, StoreError};
use crate::volume_engine::VolumeEngine;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(deny_unknown_fields)]
pub struct BackupCreate {
    pub volume: String,
    /// Back up this snapshot; none: one is taken.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Read and upload everything, whatever the chain policy says.
    #[serde(default)]
    pub full: bool,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Default: `default`.
    #[serde(default)]
    pub target: Option<String>,
    /// This backup's `backup-delta-max` (backups in a chain, its full one included) over the setting's: what a
    /// recurring job with its own `deltaMax` asks for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_max: Option<u32>,
    /// Block size in bytes of the backup volume this backup creates if it is the volume's first on the target (a
    /// power of two from 4 KiB to 16 MiB; default: the `backup-block-size` setting). Refused when the backup
    /// volume exists with another block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
}

/// `[TARGET:]NAME` → store key, names checked.
pub(super) fn ref_key(what: &str, r: &str) -> Result<String, ApiError> {
    let (t, n) = parse_ref(r);
    check_name("backup target", &t)?;
    backupstore::validate_name(what, &n).map_err(|e| ApiError::Invalid(e.to_string()))?;
    Ok(key(&t, &n))
}

/// Deletes `[TARGET:]NAME` from its target and the store: the one path of `DELETE /v1/backups/{backup}` and of a
/// recurring job's retention. Refused while it runs or a restore reads it.
pub async fn remove_backup(ctx: &Ctx, r: &str) -> Result<(), ApiError> {
    let k = ref_key("backup", r)?;
    let b = ctx
        .db
        .get::<Backup>(&k)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup {r:?} not found")))?;
    if !b.data.source_volume.is_empty() && b.data.state.active() {
        return Err(ApiError::Conflict(format!(
            "backup {} is {} ({}%): delete it once it completed or failed",
            b.data.name,
            b.data.state.as_str(),
            b.data.progress
        )));
    }
    if let Some(rs) = ctx
        .db
        .list::<VolumeRestore>()
        .await?
        .into_iter()
        .find(|x| x.data.target == b.data.target && x.data.backup == b.data.name && x.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "volume {} is being restored from backup {}",
            rs.name, b.data.name
        )));
    }
    let t = super::target::open(ctx, &b.data.target)
        .await
        .map_err(target_error)?;
    match t
        .store
        .delete_backup(&b.data.volume, &b.data.name, &backupstore::GcOptions::default())
        .await
    {
        Ok(o) => {
            tracing::info!(backup = %b.data.name, volume = %b.data.volume, blocks = o.deleted_blocks, "backup deleted");
        }
        // A failed job that never wrote its record, or deleted on the target meanwhile.
        Err(e) if e.kind() == backupstore::ErrorKind::NotFound => {}
        Err(e) => return Err(store_error(&e)),
    }
    ctx.db.delete_any::<Backup>(&k).await?;
    Ok(())
}

/// A new backup's name: `backup-` and 16 hex digits.
fn new_backup_name() -> String {
    format!("backup-{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

/// Checks a backup request and records it `pending` for the leader's backup controller: the one path of
/// `POST /v1/backups` and of recurring backup jobs (which run their retention before it, so that the
/// `backup-max-count` check here sees the room it made).
pub async fn request_backup(ctx: &Ctx, req: &BackupCreate) -> Result<Object<Backup>, ApiError> {
    check_name("volume name", &req.volume)?;
    backupstore::validate_name("volume", &req.volume).map_err(|e| ApiError::Invalid(e.to_string()))?;
    if let Some(s) = &req.snapshot {
        check_name("snapshot name", s)?;
    }
    let target = req.target.clone().unwrap_or_else(|| DEFAULT_TARGET.to_owned());
    check_name("backup target", &target)?;
    if req.delta_max == Some(0) {
        return Err(ApiError::Invalid(
            "deltaMax 0: a chain holds at least its full backup (1 makes every backup full)".into(),
        ));
    }
    if let Some(bs) = req.block_size {
        backupstore::check_block_size(bs).map_err(|e| ApiError::Invalid(e.to_string()))?;
    }
    let v = ctx
        .db
        .get::<Volume>(&req.volume)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("volume {:?} not found", req.volume)))?;
    crate::v2::support::check(v.data.spec.data_engine, crate::v2::support::Op::Backup)
        .map_err(ApiError::Conflict)?;
    let t = super::target::open(ctx, &target).await.map_err(target_error)?;
    // Before the snapshot is taken: an unreachable target changes nothing.
    target_reachable(ctx, &target).await?;
    // A backup volume's block size is fixed by its first backup: one asked for must be the volume's.
    let block_size = match req.block_size {
        Some(bs) => {
            match t.store.volume_config(&req.volume).await {
                Ok(c) if c.block_size != bs => {
                    return Err(ApiError::Conflict(format!(
                        "backup volume {} on target {target} has block size {} (fixed by its first backup), not {bs}: \
                         back up without a block size, or to another target",
                        req.volume, c.block_size
                    )));
                }
                Ok(_) => {}
                Err(e) if e.kind() == backupstore::ErrorKind::NotFound => {}
                Err(e) => return Err(store_error(&e)),
            }
            bs
        }
        None => ctx.setting_u64(BLOCK_SIZE_SETTING).await,
    };
    if let Some((b, s)) = super::running_on(ctx, &req.volume).await? {
        return Err(ApiError::Conflict(format!(
            "backup {b} of volume {} (snapshot {s}) is running: one at a time",
            req.volume
        )));
    }
    if let Some(r) = ctx.db.get::<VolumeRestore>(&req.volume).await?
        && r.data.state.active()
    {
        return Err(ApiError::Conflict(format!(
            "volume {} is being restored: back it up once the restore completed",
            req.volume
        )));
    }
    // backup-max-count: the volume's own limit, else the setting (0 = none).
    let max = match v.data.spec.backup_max_count {
        Some(n) => u64::from(n),
        None => ctx.setting_u64(MAX_COUNT_SETTING).await,
    };
    if max > 0 {
        let have = ctx
            .db
            .list::<Backup>()
            .await?
            .iter()
            .filter(|b| {
                b.data.target == target && b.data.volume == req.volume && b.data.state != BackupState::Failed
            })
            .count();
        if u64::try_from(have).unwrap_or(u64::MAX) >= max {
            return Err(ApiError::Conflict(format!(
                "volume {} has {have} backups on target {target}, its limit (backup-max-count) is {max}: delete some first",
                req.volume
            )));
        }
    }
    let e = ctx
        .db
        .get::<crate::model::Engine>(&req.volume)
        .await?
        .filter(|e| e.data.status.state == ProcessState::Running && v.data.status.state == VolumeState::Attached)
        .ok_or_else(|| {
            ApiError::Conflict(format!(
                "volume {} is not attached: attach it (corral volume attach --maintenance serves no IO) and back it up",
                req.volume
            ))
        })?;
    let mut engine = VolumeEngine::connect(&e).await.map_err(ApiError::Unavailable)?;
    let name = new_backup_name();
    let (snapshot, taken) = match &req.snapshot {
        Some(s) => {
            if !engine.has_snapshot(ctx, s).await? {
                return Err(ApiError::NotFound(format!(
                    "volume {} has no snapshot {s:?}",
                    req.volume
                )));
            }
            (s.clone(), false)
        }
        None => {
            let labels = [("corral.io/backup".to_owned(), name.clone())].into();
            (engine.snapshot_create(ctx, name.clone(), labels).await?, true)
        }
    };
    let b = Backup {
        target: target.clone(),
        volume: req.volume.clone(),
        name: name.clone(),
        snapshot,
        labels: req.labels.clone(),
        state: BackupState::Pending,
        size: v.data.spec.size,
        source_volume: req.volume.clone(),
        mode: if req.full {
            BackupMode::Full
        } else {
            BackupMode::Auto
        },
        snapshot_taken: taken,
        delta_max: req.delta_max,
        block_size,
        started: chrono::Utc::now().to_rfc3339(),
        ..Default::default()
    };
    let k = key(&target, &name);
    ctx.db.create(&k, b).await?;
    tracing::info!(backup = %name, volume = %req.volume, target = %t.name, "backup requested");
    Ok(ctx.db.must_get::<Backup>(&k).await?)
}

/// Checks a restore of `[TARGET:]BACKUP` into a volume of `size` bytes: the backup completed, fits, and its
/// backing image (if any) is the one asked for. Returns the backup and the backing image the volume takes.
pub async fn check_restore_source(
    ctx: &Ctx,
    r: &str,
    size: u64,
    backing_image: Option<&str>,
) -> Result<(Backup, Option<String>), ApiError> {
    let b = completed_backup(ctx, r).await?.data;
    if size < b.size {
        return Err(ApiError::Conflict(format!(
            "backup {} is {} bytes: a volume restored from it cannot be smaller ({size} bytes asked for)",
            b.name, b.size
        )));
    }
    let recorded = super::backing::recorded(ctx, &b).await?;
    let image = match (backing_image, &recorded) {
        (Some(asked), Some((rec, _))) if asked != rec => {
            return Err(ApiError::Conflict(format!(
                "backup {} was made over backing image {rec}, not {asked}",
                b.name
            )));
        }
        (Some(asked), _) => Some(asked.to_owned()),
        (None, rec) => rec.as_ref().map(|(n, _)| n.clone()),
    };
    if let (Some(image), Some((_, checksum))) = (&image, &recorded) {
        super::backing::check_checksum(ctx, &b, image, checksum).await?;
    }
    target_reachable(ctx, &b.target).await?;
    Ok((b, image))
}

/// Creates the restore record of a volume just created with `fromBackup`.
pub async fn start_restore(ctx: &Ctx, volume: &str, b: &Backup, standby: bool) -> Result<(), StoreError> {
    ctx.db.delete_any::<VolumeRestore>(volume).await?;
    let mut r = record_for(b);
    r.standby = standby;
    ctx.db.create(volume, r).await.map(|_| ())
}

/// `fromBackup` for a new volume's spec.
pub fn from_backup_ref(b: &Backup) -> String {
    spec_ref(b)
}
