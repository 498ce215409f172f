//! The backing image a restore takes (seeds 000 and 001): a backup records the volume's backing image by name and
//! SHA-512; a restore into a new volume takes that image (or the one the user names, which must be the same name)
//! and checks, before anything is created, that the image of that name here has the SHA-512 the backup recorded.
//! An image of the same name with other content would show through every block the volume never wrote: refused.
//! (A backing image itself is backed up by [`super::image_backup`].)

use super::model::{Backup, BackupVolume, key};
use crate::backing_image::model::BackingImage;
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
pub(super) fn sha512_hex(c: &str) -> Option<String> {
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
