//! How target and backup-store failures answer an API request: one mapping for the routes and the backing-image
//! backups (a leaf below both, so neither depends on the other for it).

use super::target::TargetError;
use crate::context::Ctx;
use crate::error::ApiError;

/// A target that is not set, not usable or not readable.
pub(super) fn target_error(e: TargetError) -> ApiError {
    match e {
        TargetError::NotSet(_) => ApiError::Conflict(e.to_string()),
        TargetError::Unusable { .. } => ApiError::Invalid(e.to_string()),
        TargetError::Store(e) => e.into(),
    }
}

/// The target answers (a listing within `target::LIST_TIMEOUT`): a backup or restore against one that does not
/// is refused before a snapshot is taken or a volume created (503: try again once the target is back).
pub(super) async fn target_reachable(ctx: &Ctx, name: &str) -> Result<(), ApiError> {
    let t = super::target::open(ctx, name).await.map_err(target_error)?;
    super::target::check(&t).await.map(|_| ()).map_err(|e| match e {
        TargetError::Unusable { .. } => ApiError::Unavailable(format!("{e}: nothing was changed")),
        e => target_error(e),
    })
}

pub(super) fn store_error(e: &backupstore::BackupStoreError) -> ApiError {
    use backupstore::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidArgument => ApiError::Invalid(e.to_string()),
        ErrorKind::NotFound => ApiError::NotFound(e.to_string()),
        ErrorKind::FailedPrecondition | ErrorKind::Cancelled => ApiError::Conflict(e.to_string()),
        ErrorKind::Corrupt | ErrorKind::Io => ApiError::Unavailable(e.to_string()),
    }
}
