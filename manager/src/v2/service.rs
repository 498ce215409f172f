//! The checks `POST /v1/nodes/{node}/disks` and `POST /v1/volumes` make for v2: a disk's store device and size,
//! and the engine a new volume gets.

use super::device::{self, Probe};
use super::support::{self, Op};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{DataEngine, Volume};

/// Largest `lvstoreSize`: 64 TiB.
pub const MAX_LVSTORE_SIZE: u64 = 64 << 40;

/// Checks a disk to add (`engine`, `lvstoreSize`, `path`): its `lvstoreSize`, and for a v2 disk on this host that
/// its store device is usable (an lvstore, or nothing yet: never foreign data). Returns the store size to record
/// (0: the default).
pub fn check_disk(
    engine: DataEngine,
    lvstore_size: Option<u64>,
    path: &str,
    local: bool,
) -> Result<u64, ApiError> {
    if engine == DataEngine::V1 {
        if lvstore_size.is_some() {
            return Err(ApiError::Invalid(
                "lvstoreSize is for v2 disks (--disk-engine v2)".into(),
            ));
        }
        return Ok(0);
    }
    let size = lvstore_size.unwrap_or(0);
    if lvstore_size.is_some()
        && (!(device::MIN_SIZE..=MAX_LVSTORE_SIZE).contains(&size)
            || !size.is_multiple_of(device::SIZE_MULTIPLE))
    {
        return Err(ApiError::Invalid(format!(
            "lvstoreSize {size} is not a whole number of MiB from {} to {MAX_LVSTORE_SIZE}",
            device::MIN_SIZE
        )));
    }
    if local {
        let dir = std::path::Path::new(path);
        if dir.exists() && !dir.is_dir() {
            return Err(ApiError::Conflict(format!(
                "{path} is not a directory: a v2 disk is a directory holding its store device {}",
                device::DEVICE_FILE
            )));
        }
        if let Probe::Foreign(why) = device::probe(&device::device_path(dir)) {
            return Err(ApiError::Conflict(why));
        }
    }
    Ok(size)
}

/// The engine of a volume `name` to create (`dataEngine`, else the `default-data-engine` setting), refusing what
/// v2 cannot do yet ([`support`]): a restore into v2 (`restore`: created from a backup), a backing image under v2.
pub async fn volume_engine(
    ctx: &Ctx,
    name: &str,
    data_engine: Option<DataEngine>,
    restore: bool,
    clone_source: Option<&Volume>,
    backing_image: Option<&str>,
) -> Result<DataEngine, ApiError> {
    let engine = match data_engine {
        Some(e) => e,
        None => ctx
            .setting("default-data-engine")
            .await
            .parse()
            .unwrap_or_default(),
    };
    let refuse = |e: DataEngine, op| support::check(e, op).map_err(ApiError::Conflict);
    if let Some(source) = clone_source {
        refuse(source.spec.data_engine, Op::Clone)?;
        refuse(engine, Op::Clone)?;
    }
    if restore {
        refuse(engine, Op::Restore)?;
    }
    if backing_image.is_some() {
        refuse(engine, Op::BackingImage)?;
    }
    if engine == DataEngine::V2 && name.contains('.') {
        return Err(ApiError::Invalid(format!(
            "volume name {name:?}: a v2 volume's name holds no '.' (its replicas are lvols named after it)"
        )));
    }
    Ok(engine)
}
