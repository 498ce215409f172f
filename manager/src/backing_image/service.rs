//! What other features ask of backing images: the checks a volume with a backing image must pass.

use super::model::BackingImage;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::DataEngine;

/// A volume's backing image must exist, not be deleted, and fit: the volume at least its virtual size.
pub async fn check_volume_image(
    ctx: &Ctx,
    image: Option<&str>,
    size: u64,
    engine: DataEngine,
) -> Result<(), ApiError> {
    let Some(image) = image else { return Ok(()) };
    let bi = ctx
        .db
        .get::<BackingImage>(image)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("backing image {image:?} does not exist")))?;
    if bi.data.spec.deletion_timestamp.is_some() {
        return Err(ApiError::Conflict(format!(
            "backing image {image} is being deleted"
        )));
    }
    let bi_engine = bi.data.spec.data_engine;
    if bi_engine != engine {
        return Err(ApiError::Conflict(format!(
            "backing image {image} is a {bi_engine} backing image and the volume a {engine} volume: a {engine} volume \
             needs a {engine} backing image"
        )));
    }
    let vsize = bi.data.status.virtual_size;
    if vsize > size {
        return Err(ApiError::Conflict(format!(
            "volume size {size} is smaller than the virtual size {vsize} of backing image {image}"
        )));
    }
    Ok(())
}
