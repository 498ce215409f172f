//! The backing image a restore takes (seeds 000 and 001): a backup records the volume's backing image by name and
//! SHA-512; a restore into a new volume takes that image (or the one the user names, which must be the same name)
//! and checks, before anything is created, that the image of that name here has the SHA-512 the backup recorded.
//! An image of the same name with other content would show through every block the volume never wrote: refused.
//! And a backing image itself is backed up into the target's backing-image area (`backupstore::backing_image`),
//! to be restored elsewhere by a backing image of source type `restore`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::model::{Backup, BackupVolume, DEFAULT_TARGET, key};
use crate::api::extract::{Body, Path};
use crate::api::openapi::check_name;
use crate::backing_image::model::{BackingImage, BackingImageManager, state};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::store::StoreError;

/// The image a backup records: its own record, else (a backup listed before records carried it) its backup
/// volume's. `None` without a backing image.
pub async fn recorded(ctx: &Ctx, b: &Backup) -> Result<Option<(String, String)>, StoreError> {
    if !b.backing_image_name.is_empty() {
        return Ok(Some((
            b.backing_image_name.clone(),
            b.backing_image_checksum.clone(),
        )));
    }
    Ok(ctx
        .db
        .get::<BackupVolume>(&key(&b.target, &b.volume))
        .await?
        .map(|v| (v.data.backing_image_name, v.data.backing_image_checksum))
        .filter(|(n, _)| !n.is_empty()))
}

/// A SHA-512 as 128 lower-case hex digits (`sha512:` prefix dropped); `None` for anything else (an image hashed
/// by a bare replica records `sha256:HEX`, which cannot be compared with the control plane's SHA-512).
fn sha512_hex(c: &str) -> Option<String> {
    let hex = c.strip_prefix("sha512:").unwrap_or(c);
    (hex.len() == 128 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| hex.to_ascii_lowercase())
}

fn short(hex: &str) -> &str {
    hex.get(..16).unwrap_or(hex)
}

/// Refuses a restore of `b` over backing image `image` unless that image's SHA-512 is the one the backup recorded.
pub async fn check_checksum(ctx: &Ctx, b: &Backup, image: &str, recorded: &str) -> Result<(), ApiError> {
    let Some(want) = sha512_hex(recorded) else {
        tracing::warn!(backup = %b.name, image, recorded,
            "the backup records no SHA-512 of its backing image: the image is used unverified");
        return Ok(());
    };
    let Some(bi) = ctx.db.get::<BackingImage>(image).await? else {
        return Err(ApiError::NotFound(format!(
            "backup {} was made over backing image {image}, which does not exist here: create it (same content, \
             SHA-512 {}…) first",
            b.name,
            short(&want)
        )));
    };
    // The checksum of the copies once one is ready; before that, the one the image must have to become ready.
    let have = [&bi.data.status.current_checksum, &bi.data.spec.expected_checksum]
        .into_iter()
        .find_map(|c| sha512_hex(c));
    match have {
        Some(have) if have == want => Ok(()),
        Some(have) => Err(ApiError::Conflict(format!(
            "backing image checksum mismatch: backup {} was made over backing image {image} with SHA-512 {}…, but \
             backing image {image} here has SHA-512 {}… (same name, other content); the restore is refused",
            b.name,
            short(&want),
            short(&have)
        ))),
        None => Err(ApiError::Conflict(format!(
            "backing image {image} has no verified SHA-512 yet: restore backup {} once the image is ready, so its \
             checksum can be compared with the one the backup recorded",
            b.name
        ))),
    }
}

/// `POST /v1/backingimages/{backingimage}/backup`: the target to back the image up into.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackingImageBackupRequest {
    /// Default: `default`.
    #[serde(default)]
    pub target: Option<String>,
}

/// A backing image's backup in the target's backing-image area.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageBackupView {
    pub image: String,
    pub target: String,
    pub backup: String,
    /// What a backing image of source type `restore` takes as `backupURL`.
    pub backup_url: String,
    /// SHA-512 of the image, recorded in the backup.
    pub checksum: String,
    pub size: u64,
    /// Bytes uploaded (blocks the area did not hold).
    pub new_bytes: u64,
    pub deduplicated_blocks: u64,
    pub completed: String,
}

/// Backs a ready backing image up into a target (from this node's ready copy), deduplicated against the image's
/// earlier backups; restore it elsewhere with a backing image of source type `restore` and the `backupUrl`.
pub async fn backup_image(
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
        .ok_or_else(|| ApiError::NotFound(format!("backing image {name:?} does not exist")))?;
    if bi.data.spec.deletion_timestamp.is_some() {
        return Err(ApiError::Conflict(format!(
            "backing image {name} is being deleted"
        )));
    }
    backupstore::validate_name("backing image", &name).map_err(|e| ApiError::Conflict(e.to_string()))?;
    let Some(checksum) = sha512_hex(&bi.data.status.current_checksum) else {
        return Err(ApiError::Conflict(format!(
            "backing image {name} is not ready (no verified SHA-512 yet): back it up once it is"
        )));
    };
    let node = ctx.cfg.node_id.clone();
    let path = ctx
        .db
        .list::<BackingImageManager>()
        .await?
        .into_iter()
        .filter(|m| m.data.spec.node_id == node)
        .find_map(|m| {
            m.data
                .status
                .files
                .get(&name)
                .filter(|f| f.uuid == bi.data.spec.uuid && f.state == state::READY && !f.path.is_empty())
                .map(|f| f.path.clone())
        })
        .ok_or_else(|| {
            ApiError::Conflict(format!(
                "no ready copy of backing image {name} on node {node}: back it up through a node that holds one"
            ))
        })?;
    super::errors::target_reachable(&ctx, &target).await?;
    let t = super::target::open(&ctx, &target)
        .await
        .map_err(|e| ApiError::Conflict(e.to_string()))?;
    let backup = format!("bi-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    tracing::info!(image = %name, %target, %backup, path, "backing image backup started");
    let cfg = t
        .store
        .backup_backing_image(
            &name,
            std::path::Path::new(&path),
            &checksum,
            &backup,
            &backupstore::Progress::default(),
        )
        .await
        .map_err(|e| super::errors::store_error(&e))?;
    tracing::info!(image = %name, %target, %backup, new_bytes = cfg.stats.new_bytes, "backing image backup completed");
    Ok((
        StatusCode::CREATED,
        Json(BackingImageBackupView {
            image: name.clone(),
            target,
            backup_url: t.store.backing_images().backup_url(&name, &backup),
            backup,
            checksum,
            size: cfg.size,
            new_bytes: cfg.stats.new_bytes,
            deduplicated_blocks: cfg.stats.deduplicated_blocks,
            completed: cfg.completed,
        }),
    ))
}
