//! The engine a new volume gets (`POST /v1/volumes`), refusing what v2 cannot do yet; a new disk's checks are its
//! engine's ([`crate::data_engine::Strategy::check_new_disk`]).

use super::support::{self, Op};
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::error::ApiError;
use crate::model::{DataEngine, Volume};

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
    engine.check_volume_name(name)?;
    Ok(engine)
}
