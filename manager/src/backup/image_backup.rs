//! Backups of backing images (seed 000) into a target's backing-image area (`backupstore::backing_image`), as
//! tracked operations like volume backups: `POST /v1/backingimages/{name}/backup` checks the request and records
//! a [`BackingImageBackup`] `pending` for the manager of a node holding a ready copy (this one when it does; a v2
//! image's copies are snapshot lvols, read through their disk daemon into a staging file); that
//! manager's [`super::image_backup_runner`] runs it, so the client may go away; `GET /v1/backingimagebackups[/ID]`
//! shows its state, progress and error; `POST .../cancel` stops a running one (the manager running it stops at the
//! next block and records it `failed`, "cancelled"); `DELETE` removes a finished one from the target (its record
//! there, or the in-progress marker a failed or cancelled one left; blocks no other backup of the image uses are
//! collected) and then its record. A backup is restored elsewhere by a backing image of source type `restore` with
//! the record's `backupUrl`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::errors::{store_error, target_error, target_reachable};
use super::model::{BackingImageBackup, BackupState, DEFAULT_TARGET, key};
use super::restore::parse_ref;
use crate::api::extract::{Body, Path};
use crate::api::openapi::check_name;
use crate::backing_image::model::{BackingImage, BackingImageManager, state};
use crate::backing_image::strategy::CopyStrategy as _;
use crate::backing_image::v2_source::ready_v2_copies;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::store::Object;

/// `POST /v1/backingimages/{backingimage}/backup`: the target to back the image up into.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackingImageBackupRequest {
    /// Default: `default`.
    #[serde(default)]
    pub target: Option<String>,
    /// Upload at most this many bytes of block data per second (default 0: unlimited).
    #[serde(default)]
    pub max_upload_rate: Option<u64>,
}

/// A backing image's backup as shown: its id (`TARGET:NAME`) and record.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageBackupView {
    pub id: String,
    #[serde(flatten)]
    pub backup: BackingImageBackup,
}

impl BackingImageBackupView {
    fn new(o: Object<BackingImageBackup>) -> Self {
        Self {
            id: o.name,
            backup: o.data,
        }
    }
}

/// The path of a ready copy of image `name` (UUID `uuid`) that the manager of `node` reports, if any.
pub(super) fn ready_copy(
    managers: &[Object<BackingImageManager>],
    node: &str,
    name: &str,
    uuid: &str,
) -> Option<String> {
    managers
        .iter()
        .filter(|m| m.data.spec.node_id == node)
        .find_map(|m| {
            m.data
                .status
                .files
                .get(name)
                .filter(|f| f.uuid == uuid && f.state == state::READY && !f.path.is_empty())
                .map(|f| f.path.clone())
        })
}

/// Checks a backup of a ready backing image and records it `pending` for the manager of a node that holds a
/// ready copy (this node first); answers at once, the backup runs there.
pub async fn request(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    body: Option<Body<BackingImageBackupRequest>>,
) -> Result<(StatusCode, Json<BackingImageBackupView>), ApiError> {
    let req = body.map(|Body(b)| b).unwrap_or_default();
    check_name("backing image", &name)?;
    let target = req.target.unwrap_or_else(|| DEFAULT_TARGET.to_owned());
    check_name("backup target", &target)?;
    let bi = ctx
        .db
        .get::<BackingImage>(&name)
        .await?
        .filter(|b| b.data.spec.deletion_timestamp.is_none())
        .ok_or_else(|| ApiError::NotFound(format!("backing image {name:?} does not exist")))?;
    backupstore::validate_name("backing image", &name).map_err(|e| ApiError::Conflict(e.to_string()))?;
    let Some(checksum) = super::backing::sha512_hex(&bi.data.status.current_checksum) else {
        return Err(ApiError::Conflict(format!(
            "backing image {name} is not ready (no verified SHA-512 yet): back it up once it is"
        )));
    };
    let uuid = bi.data.spec.uuid.clone();
    // The nodes holding a ready copy: a v1 image's files, a v2 image's snapshot lvols (read through their disk
    // daemons, `backing_image::v2_source`).
    let mut nodes: Vec<String> = if bi.data.spec.data_engine.copies_are_lvols() {
        ready_v2_copies(&ctx, &bi.data)
            .await
            .map_err(|e| ApiError::Unavailable(format!("{e:#}")))?
            .into_iter()
            .map(|c| c.node_id)
            .collect()
    } else {
        let managers = ctx.db.list::<BackingImageManager>().await?;
        managers
            .iter()
            .map(|m| m.data.spec.node_id.clone())
            .filter(|n| ready_copy(&managers, n, &name, &uuid).is_some())
            .collect()
    };
    nodes.sort();
    nodes.dedup();
    // This node's copy first (no network hop), then any node's.
    nodes.sort_by_key(|n| *n != ctx.cfg.node_id);
    let node = nodes
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::Conflict(format!("no node holds a ready copy of backing image {name}")))?;
    let t = super::target::open(&ctx, &target).await.map_err(target_error)?;
    // Before anything is recorded: an unreachable target changes nothing.
    target_reachable(&ctx, &target).await?;
    if let Some(b) = ctx
        .db
        .list::<BackingImageBackup>()
        .await?
        .into_iter()
        .find(|b| b.data.image == name && b.data.target == target && b.data.state.active())
    {
        return Err(ApiError::Conflict(format!(
            "backing image {name} is being backed up to target {target} ({}, {}%): one at a time",
            b.name, b.data.progress
        )));
    }
    let backup = format!("bi-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let record = BackingImageBackup {
        target: target.clone(),
        image: name.clone(),
        image_uuid: uuid,
        backup_url: t.store.backing_images().backup_url(&name, &backup),
        backup: backup.clone(),
        checksum,
        node_id: node.clone(),
        state: BackupState::Pending,
        size: bi.data.status.size,
        max_upload_rate: req.max_upload_rate.unwrap_or(0),
        started: chrono::Utc::now().to_rfc3339(),
        ..Default::default()
    };
    let o = ctx.db.create(&key(&target, &backup), record).await?;
    tracing::info!(image = %name, %target, %backup, %node, "backing image backup requested");
    Ok((StatusCode::CREATED, Json(BackingImageBackupView::new(o))))
}

pub async fn list(State(ctx): State<Ctx>) -> Result<Json<Vec<BackingImageBackupView>>, ApiError> {
    let mut all: Vec<BackingImageBackupView> = ctx
        .db
        .list::<BackingImageBackup>()
        .await?
        .into_iter()
        .map(BackingImageBackupView::new)
        .collect();
    all.sort_by(|a, b| {
        (&a.backup.image, &a.backup.started, &a.id).cmp(&(&b.backup.image, &b.backup.started, &b.id))
    });
    Ok(Json(all))
}

/// `[TARGET:]NAME` of a backing image's backup → its store key, names checked.
fn ref_key(r: &str) -> Result<String, ApiError> {
    let (t, n) = parse_ref(r);
    check_name("backup target", &t)?;
    backupstore::validate_name("backup", &n).map_err(|e| ApiError::Invalid(e.to_string()))?;
    Ok(key(&t, &n))
}

async fn must_get(ctx: &Ctx, r: &str) -> Result<Object<BackingImageBackup>, ApiError> {
    let k = ref_key(r)?;
    ctx.db
        .get::<BackingImageBackup>(&k)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backing image backup {r:?} not found")))
}

/// `[TARGET:]NAME` of a backing image's backup.
pub async fn get(
    State(ctx): State<Ctx>,
    Path(r): Path<String>,
) -> Result<Json<BackingImageBackupView>, ApiError> {
    Ok(Json(BackingImageBackupView::new(must_get(&ctx, &r).await?)))
}

/// `POST /v1/backingimagebackups/{id}/cancel`: a pending backup is failed at once; a running one is marked, and
/// the manager running it stops it at the next block (it is `failed`, "cancelled", once stopped). Refused for a
/// backup that already ended.
pub async fn cancel(
    State(ctx): State<Ctx>,
    Path(r): Path<String>,
) -> Result<Json<BackingImageBackupView>, ApiError> {
    let k = must_get(&ctx, &r).await?.name;
    let mut ended = None;
    let o = ctx
        .db
        .modify::<BackingImageBackup>(&k, |b| {
            if !b.state.active() {
                ended = Some(b.state);
                return false;
            }
            ended = None;
            b.cancel_requested = true;
            // Not claimed by its runner yet: nothing to stop.
            if b.state == BackupState::Pending {
                b.state = BackupState::Failed;
                b.error = CANCELLED.to_owned();
            }
            true
        })
        .await?;
    if let Some(s) = ended {
        return Err(ApiError::Conflict(format!(
            "backup {r} of backing image {} is {}: there is nothing to cancel",
            o.data.image,
            s.as_str()
        )));
    }
    tracing::info!(key = %k, image = %o.data.image, state = o.data.state.as_str(), "backing image backup cancel requested");
    Ok(Json(BackingImageBackupView::new(o)))
}

/// The error a cancelled backup records.
pub const CANCELLED: &str = "cancelled (POST /v1/backingimagebackups/{id}/cancel)";

/// `DELETE /v1/backingimagebackups/{id}`: the backup in the target's backing-image area (a completed one, or the
/// in-progress marker a failed or cancelled one left), blocks no other backup of the image uses, then the record.
/// Refused while it runs (cancel it first). A backing image being restored from it keeps the target's lock: the
/// deletion waits for it, then fails without changing anything.
pub async fn delete(State(ctx): State<Ctx>, Path(r): Path<String>) -> Result<StatusCode, ApiError> {
    let b = must_get(&ctx, &r).await?;
    if b.data.state.active() {
        return Err(ApiError::Conflict(format!(
            "backup {r} of backing image {} is {} ({}%): cancel it (corral backup backing-image-cancel) and delete it once it failed",
            b.data.image,
            b.data.state.as_str(),
            b.data.progress
        )));
    }
    let t = super::target::open(&ctx, &b.data.target)
        .await
        .map_err(target_error)?;
    match t
        .store
        .backing_images()
        .delete_backup(&b.data.image, &b.data.backup, &backupstore::GcOptions::default())
        .await
    {
        Ok(o) => {
            tracing::info!(key = %b.name, image = %b.data.image, blocks = o.deleted_blocks, "backing image backup deleted");
        }
        // Failed before it wrote anything, or deleted on the target meanwhile.
        Err(e) if e.kind() == backupstore::ErrorKind::NotFound => {
            tracing::info!(key = %b.name, image = %b.data.image, "backing image backup record deleted (nothing on the target)");
        }
        Err(e) => return Err(store_error(&e)),
    }
    ctx.db.delete_any::<BackingImageBackup>(&b.name).await?;
    Ok(StatusCode::NO_CONTENT)
}
