//! REST: backup targets (`/v1/backuptargets`), backup volumes (`/v1/backupvolumes`), backups (`/v1/backups`) and
//! restores (`/v1/volumes/{volume}/restore`), with their OpenAPI shapes ([`shape`](super::openapi::shape),
//! [`schemas`](super::openapi::schemas)). A backup or
//! backup volume is named `[TARGET:]NAME` (the default target when no target is named). Every check runs before
//! the first write. A target's credentials are taken by `PUT` and never answered: views show their names only.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use super::errors::{store_error, target_error};
use super::model::{
    Backup, BackupTarget, BackupTargetSecret, BackupTargetSpec, BackupTargetStatus, BackupVolume,
    VolumeRestore,
};
use super::restore::{check_detach, parse_ref, spec_ref};
use super::service::{
    BackupCreate, check_restore_source, ref_key, remove_backup, request_backup, start_restore,
};
use super::target::{TargetError, check, open_spec};
use crate::api::extract::{Body, Path, Query};
use crate::api::openapi::check_name;
use crate::api::routes::Routes;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{Volume, VolumeState};
use crate::store::{Object, StoreError};

pub use corral_api::backup::{
    BackupDeltaMax, BackupListQuery, BackupMaxCount, BackupTargetSet, BackupTargetView, BackupView,
    BackupVolumeView, RestoreRequest, RestoreView,
};

type ApiResult<T> = Result<Json<T>, ApiError>;

pub use super::openapi::{
    BACKUP_REF_PATTERN, BLOCK_SIZE_SETTING, CREDENTIAL_KEYS, DEFAULT_POLL_INTERVAL, TARGET_URL_PATTERN,
};

pub fn register(r: &mut Routes) {
    r.add("get", "/v1/backuptargets", "List backup targets", list_targets);
    r.add(
        "get",
        "/v1/backuptargets/{backuptarget}",
        "Get a backup target (never its credentials)",
        get_target,
    );
    r.add(
        "put",
        "/v1/backuptargets/{backuptarget}",
        "Set a backup target (`default` is used when none is named); refused unless it can be listed",
        put_target,
    );
    r.add(
        "delete",
        "/v1/backuptargets/{backuptarget}",
        "Forget a backup target (its data stays where it is)",
        delete_target,
    );
    r.add(
        "get",
        "/v1/backupvolumes",
        "List the backup volumes of every target",
        list_volumes,
    );
    r.add(
        "get",
        "/v1/backupvolumes/{backupvolume}",
        "Get a backup volume ([TARGET:]NAME)",
        get_volume,
    );
    r.add(
        "delete",
        "/v1/backupvolumes/{backupvolume}",
        "Delete a backup volume with every backup and block on its target",
        delete_volume,
    );
    r.add(
        "post",
        "/v1/backingimages/{backingimage}/backup",
        "Back a ready backing image up into a target's backing-image area (deduplicated), run by a manager holding a ready copy: follow it with GET /v1/backingimagebackups/{id}; restore it with a backing image of source type restore and its backupUrl",
        super::image_backup::request,
    );
    r.add(
        "get",
        "/v1/backingimagebackups",
        "List the backups of backing images (state, progress, error)",
        super::image_backup::list,
    );
    r.add(
        "get",
        "/v1/backingimagebackups/{backingimagebackup}",
        "Get a backup of a backing image ([TARGET:]NAME)",
        super::image_backup::get,
    );
    r.add(
        "post",
        "/v1/backingimagebackups/{backingimagebackup}/cancel",
        "Cancel a pending or running backup of a backing image: the manager running it stops at the next block and records it failed (cancelled)",
        super::image_backup::cancel,
    );
    r.add(
        "delete",
        "/v1/backingimagebackups/{backingimagebackup}",
        "Delete a finished backup of a backing image from its target (blocks no other backup of the image uses are collected) and its record; refused while it runs",
        super::image_backup::delete,
    );
    r.add(
        "get",
        "/v1/backups",
        "List backups (of every target, or of ?target=NAME; of every backup volume, or of ?volume=NAME)",
        list_backups,
    );
    r.add(
        "post",
        "/v1/backups",
        "Back up a volume (a snapshot is taken when none is named)",
        create_backup,
    );
    r.add(
        "get",
        "/v1/backups/{backup}",
        "Get a backup ([TARGET:]NAME)",
        get_backup,
    );
    r.add(
        "delete",
        "/v1/backups/{backup}",
        "Delete a backup; blocks no other backup uses are collected",
        delete_backup,
    );
    r.add(
        "put",
        "/v1/volumes/{volume}/backupmaxcount",
        "Set the volume's backup-max-count (null: the setting's)",
        put_max_count,
    );
    r.add(
        "put",
        "/v1/volumes/{volume}/backupdeltamax",
        "Set the volume's backup-delta-max (null: the setting's); a recurring job's deltaMax goes over it",
        put_delta_max,
    );
    r.add(
        "get",
        "/v1/volumes/{volume}/restore",
        "The volume's last restore from a backup",
        get_restore,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/activate",
        "Activate a standby (DR) volume: one last incremental restore of the newest backup, then a normal volume",
        activate,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/restore",
        "Restore a backup into a detached volume in place",
        restore_in_place,
    );
}

/// The view of target `name`: its spec without the credentials' values, and its status.
fn target_view(name: &str, t: &BackupTarget) -> BackupTargetView {
    BackupTargetView {
        name: name.to_owned(),
        url: t.spec.url.clone(),
        endpoint: t.spec.endpoint.clone(),
        region: t.spec.region.clone(),
        poll_interval: t.spec.poll_interval,
        credential_keys: t.spec.credential_keys.clone(),
        status: t.status.clone(),
    }
}

/// The views of some backups, each with its URL on its target.
async fn views(ctx: &Ctx, bs: Vec<Object<Backup>>) -> Result<Vec<BackupView>, StoreError> {
    let targets: BTreeMap<String, BackupTargetSpec> = ctx
        .db
        .list::<BackupTarget>()
        .await?
        .into_iter()
        .map(|t| (t.name, t.data.spec))
        .collect();
    Ok(bs
        .into_iter()
        .map(|b| BackupView {
            id: b.name,
            url: targets
                .get(&b.data.target)
                .map(|t| t.backup_url(&b.data.volume, &b.data.name))
                .unwrap_or_default(),
            backup: b.data,
        })
        .collect())
}

async fn view(ctx: &Ctx, b: Object<Backup>) -> Result<BackupView, ApiError> {
    views(ctx, vec![b])
        .await?
        .pop()
        .ok_or_else(|| ApiError::Internal("no view of a backup".into()))
}

async fn list_targets(State(ctx): State<Ctx>) -> ApiResult<Vec<BackupTargetView>> {
    Ok(Json(
        ctx.db
            .list::<BackupTarget>()
            .await?
            .iter()
            .map(|t| target_view(&t.name, &t.data))
            .collect(),
    ))
}

async fn get_target(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<BackupTargetView> {
    let t = ctx
        .db
        .get::<BackupTarget>(&name)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup target {name:?} is not set")))?;
    Ok(Json(target_view(&name, &t.data)))
}

async fn put_target(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<BackupTargetSet>,
) -> ApiResult<BackupTargetView> {
    check_name("backup target", &name)?;
    if !regex_is_match(TARGET_URL_PATTERN, &req.url) {
        return Err(ApiError::Invalid(format!(
            "backup target URL {:?}: expected file:///DIR or s3://BUCKET[/PREFIX] (endpoint and region are fields of their own)",
            req.url
        )));
    }
    let is_s3 = req.url.starts_with("s3://");
    if !is_s3 && (!req.endpoint.is_empty() || !req.region.is_empty()) {
        return Err(ApiError::Invalid(
            "endpoint and region are for s3:// targets".into(),
        ));
    }
    if !(req.endpoint.is_empty()
        || req.endpoint.starts_with("http://")
        || req.endpoint.starts_with("https://"))
    {
        return Err(ApiError::Invalid(format!(
            "endpoint {:?} is not an http:// or https:// URL",
            req.endpoint
        )));
    }
    if req.endpoint.contains(['?', '&', '#']) || req.region.contains(['?', '&', '#', '=']) {
        return Err(ApiError::Invalid(
            "endpoint and region cannot hold ?, &, # or =".into(),
        ));
    }
    if let Some(p) = req.poll_interval
        && p == 0
    {
        return Err(ApiError::Invalid("pollInterval must be at least 1 second".into()));
    }
    let credentials = match &req.credentials {
        Some(c) => {
            if let Some(k) = c.keys().find(|k| !CREDENTIAL_KEYS.contains(&k.as_str())) {
                return Err(ApiError::Invalid(format!(
                    "unknown credential {k:?}; known: {}",
                    CREDENTIAL_KEYS.join(", ")
                )));
            }
            c.clone()
        }
        None => ctx
            .db
            .get::<BackupTargetSecret>(&name)
            .await?
            .map(|s| s.data.credentials)
            .unwrap_or_default(),
    };
    if let Some(dir) = req.url.strip_prefix("file://")
        && !std::path::Path::new(dir).is_dir()
    {
        return Err(ApiError::Invalid(format!(
            "backup target directory {dir} does not exist: create it first"
        )));
    }
    let spec = BackupTargetSpec {
        url: req.url.trim_end_matches('/').to_owned(),
        endpoint: req.endpoint.clone(),
        region: req.region.clone(),
        poll_interval: req.poll_interval.unwrap_or(DEFAULT_POLL_INTERVAL),
        credential_keys: credentials.keys().cloned().collect(),
    };
    if spec.url == "file://" {
        return Err(ApiError::Invalid(
            "a file target needs a directory: file:///DIR".into(),
        ));
    }
    // Reachable, the bucket exists, the credentials are accepted: before anything is written.
    let ot = open_spec(&name, &spec, credentials.clone()).map_err(target_error)?;
    match check(&ot).await {
        Ok(_) => {}
        Err(TargetError::Unusable { reason, .. }) if reason.starts_with("no answer") => {
            return Err(ApiError::Unavailable(format!("backup target {name}: {reason}")));
        }
        Err(e) => return Err(target_error(e)),
    }
    let secret = BackupTargetSecret { credentials };
    match ctx.db.get::<BackupTargetSecret>(&name).await? {
        Some(mut s) if s.data != secret => {
            s.data = secret;
            ctx.db.update(&mut s).await?;
        }
        Some(_) => {}
        None => {
            ctx.db.create(&name, secret).await?;
        }
    }
    let status = BackupTargetStatus {
        available: true,
        message: String::new(),
        last_synced_at: 0,
    };
    let t = match ctx.db.get::<BackupTarget>(&name).await? {
        Some(mut t) => {
            t.data.spec = spec;
            t.data.status = status;
            ctx.db.update(&mut t).await?;
            t
        }
        None => ctx.db.create(&name, BackupTarget { spec, status }).await?,
    };
    tracing::info!(target = %name, url = %t.data.spec.store_url(), credentials = ?t.data.spec.credential_keys, "backup target set");
    Ok(Json(target_view(&name, &t.data)))
}

fn regex_is_match(pattern: &str, s: &str) -> bool {
    regex::Regex::new(pattern).is_ok_and(|r| r.is_match(s))
}

async fn delete_target(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    ctx.db
        .get::<BackupTarget>(&name)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup target {name:?} is not set")))?;
    if let Some(b) = ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .find(|b| b.data.target == name && !b.data.source_volume.is_empty() && b.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "backup {} to target {name} is running",
            b.data.name
        )));
    }
    if let Some(r) = ctx
        .db
        .list::<VolumeRestore>()
        .await?
        .into_iter()
        .find(|r| r.data.target == name && r.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "volume {} is being restored from target {name}",
            r.name
        )));
    }
    ctx.db.delete_any::<BackupTarget>(&name).await?;
    ctx.db.delete_any::<BackupTargetSecret>(&name).await?;
    for b in ctx.db.list::<Backup>().await? {
        if b.data.target == name {
            ctx.db.delete_any::<Backup>(&b.name).await?;
        }
    }
    for v in ctx.db.list::<BackupVolume>().await? {
        if v.data.target == name {
            ctx.db.delete_any::<BackupVolume>(&v.name).await?;
        }
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn list_volumes(State(ctx): State<Ctx>) -> ApiResult<Vec<BackupVolumeView>> {
    Ok(Json(
        ctx.db
            .list::<BackupVolume>()
            .await?
            .into_iter()
            .map(|v| BackupVolumeView {
                id: v.name,
                volume: v.data,
            })
            .collect(),
    ))
}

async fn get_volume(State(ctx): State<Ctx>, Path(r): Path<String>) -> ApiResult<BackupVolumeView> {
    let k = ref_key("volume", &r)?;
    let v = ctx
        .db
        .get::<BackupVolume>(&k)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup volume {r:?} not found")))?;
    Ok(Json(BackupVolumeView {
        id: v.name,
        volume: v.data,
    }))
}

async fn delete_volume(State(ctx): State<Ctx>, Path(r): Path<String>) -> Result<StatusCode, ApiError> {
    let k = ref_key("volume", &r)?;
    let (target, volume) = parse_ref(&r);
    let known = ctx.db.get::<BackupVolume>(&k).await?.is_some();
    let backups: Vec<_> = ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .filter(|b| b.data.target == target && b.data.volume == volume)
        .collect();
    if !known && backups.is_empty() {
        return Err(ApiError::NotFound(format!("backup volume {r:?} not found")));
    }
    if let Some(b) = backups
        .iter()
        .find(|b| !b.data.source_volume.is_empty() && b.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "backup {} of {volume} is running",
            b.data.name
        )));
    }
    if let Some(rs) = ctx
        .db
        .list::<VolumeRestore>()
        .await?
        .into_iter()
        .find(|x| x.data.target == target && x.data.backup_volume == volume && x.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "volume {} is being restored from {volume}",
            rs.name
        )));
    }
    let t = super::target::open(&ctx, &target).await.map_err(target_error)?;
    t.store
        .delete_volume(&volume, &backupstore::GcOptions::default())
        .await
        .map_err(|e| store_error(&e))?;
    tracing::info!(target = %target, volume = %volume, "backup volume deleted");
    for b in backups {
        ctx.db.delete_any::<Backup>(&b.name).await?;
    }
    ctx.db.delete_any::<BackupVolume>(&k).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_backups(
    State(ctx): State<Ctx>,
    Query(q): Query<BackupListQuery>,
) -> ApiResult<Vec<BackupView>> {
    if let Some(t) = &q.target {
        check_name("backup target", t)?;
        // A typo in a filter shows as an error, not as an empty list.
        if ctx.db.get::<BackupTarget>(t).await?.is_none() {
            return Err(ApiError::NotFound(format!("backup target {t:?} not found")));
        }
    }
    if let Some(v) = &q.volume {
        backupstore::validate_name("volume", v).map_err(|e| ApiError::Invalid(e.to_string()))?;
    }
    let bs = ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .filter(|b| q.target.as_ref().is_none_or(|t| b.data.target == *t))
        .filter(|b| q.volume.as_ref().is_none_or(|v| b.data.volume == *v))
        .collect();
    let mut out = views(&ctx, bs).await?;
    out.sort_by(|a, b| {
        (&a.backup.target, &a.backup.volume, &a.backup.started, &a.id).cmp(&(
            &b.backup.target,
            &b.backup.volume,
            &b.backup.started,
            &b.id,
        ))
    });
    Ok(Json(out))
}

async fn get_backup(State(ctx): State<Ctx>, Path(r): Path<String>) -> ApiResult<BackupView> {
    let k = ref_key("backup", &r)?;
    let b = ctx
        .db
        .get::<Backup>(&k)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backup {r:?} not found")))?;
    Ok(Json(view(&ctx, b).await?))
}

async fn delete_backup(State(ctx): State<Ctx>, Path(r): Path<String>) -> Result<StatusCode, ApiError> {
    remove_backup(&ctx, &r).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn create_backup(
    State(ctx): State<Ctx>,
    Body(req): Body<BackupCreate>,
) -> Result<(StatusCode, Json<BackupView>), ApiError> {
    let b = request_backup(&ctx, &req).await?;
    Ok((StatusCode::CREATED, Json(view(&ctx, b).await?)))
}

async fn put_max_count(
    State(ctx): State<Ctx>,
    Path(volume): Path<String>,
    Body(req): Body<BackupMaxCount>,
) -> ApiResult<BackupMaxCount> {
    let v = ctx
        .db
        .modify::<Volume>(&volume, |v| {
            let changed = v.spec.backup_max_count != req.backup_max_count;
            v.spec.backup_max_count = req.backup_max_count;
            changed
        })
        .await
        .map_err(|e| match e {
            StoreError::NotFound { .. } => ApiError::NotFound(format!("volume {volume:?} not found")),
            e => e.into(),
        })?;
    Ok(Json(BackupMaxCount {
        backup_max_count: v.data.spec.backup_max_count,
    }))
}

async fn put_delta_max(
    State(ctx): State<Ctx>,
    Path(volume): Path<String>,
    Body(req): Body<BackupDeltaMax>,
) -> ApiResult<BackupDeltaMax> {
    if req.backup_delta_max == Some(0) {
        return Err(ApiError::Invalid(
            "backupDeltaMax 0: a chain holds at least its full backup (1 makes every backup full)".into(),
        ));
    }
    let v = ctx
        .db
        .modify::<Volume>(&volume, |v| {
            let changed = v.spec.backup_delta_max != req.backup_delta_max;
            v.spec.backup_delta_max = req.backup_delta_max;
            changed
        })
        .await
        .map_err(|e| match e {
            StoreError::NotFound { .. } => ApiError::NotFound(format!("volume {volume:?} not found")),
            e => e.into(),
        })?;
    Ok(Json(BackupDeltaMax {
        backup_delta_max: v.data.spec.backup_delta_max,
    }))
}

async fn activate(State(ctx): State<Ctx>, Path(volume): Path<String>) -> ApiResult<RestoreView> {
    let r = ctx
        .db
        .get::<VolumeRestore>(&volume)
        .await?
        .filter(|r| r.data.standby && r.data.state.active())
        .ok_or_else(|| ApiError::Conflict(format!("volume {volume:?} is not a standby volume")))?;
    let r = if r.data.activate {
        r
    } else {
        ctx.db
            .modify::<VolumeRestore>(&volume, |r| {
                r.activate = true;
                true
            })
            .await?
    };
    Ok(Json(RestoreView {
        volume,
        restore: r.data,
    }))
}

async fn get_restore(State(ctx): State<Ctx>, Path(volume): Path<String>) -> ApiResult<RestoreView> {
    let r = ctx
        .db
        .get::<VolumeRestore>(&volume)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("volume {volume:?} has no restore")))?;
    Ok(Json(RestoreView {
        volume,
        restore: r.data,
    }))
}

async fn restore_in_place(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<RestoreRequest>,
) -> ApiResult<RestoreView> {
    let v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("volume {name:?} not found")))?;
    let (b, _) = check_restore_source(
        &ctx,
        &req.backup,
        v.data.spec.size,
        v.data.spec.backing_image.as_deref(),
    )
    .await?;
    check_detach(&ctx, &name).await?;
    if let Some(c) = ctx.db.get::<crate::clone::model::VolumeClone>(&name).await?
        && c.data.state.active()
    {
        return Err(ApiError::Conflict(format!("volume {name} is being cloned")));
    }
    if v.data.spec.node_id.is_some() || v.data.status.state != VolumeState::Detached {
        return Err(ApiError::Conflict(format!(
            "volume {name} is {}: detach it first (a restore replaces its data)",
            serde_json::to_string(&v.data.status.state)
                .unwrap_or_default()
                .trim_matches('"')
        )));
    }
    let from = spec_ref(&b);
    // The spec first: from here on attach is refused until the record says completed.
    ctx.db
        .modify::<Volume>(&name, |v| {
            v.spec.from_backup = Some(from.clone());
            true
        })
        .await?;
    start_restore(&ctx, &name, &b, false).await?;
    let r = ctx.db.must_get::<VolumeRestore>(&name).await?;
    Ok(Json(RestoreView {
        volume: name,
        restore: r.data,
    }))
}
