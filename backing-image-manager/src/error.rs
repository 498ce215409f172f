//! Errors of the manager, with the one mapping to gRPC status codes and the one mapping to HTTP statuses.

use std::io;
use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// What went wrong, with the context a caller needs to act on it.
#[derive(Debug, thiserror::Error)]
pub enum BimError {
    /// The request itself is wrong (a name with path tricks, a size disagreeing with the file, a bad checksum).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The image is not on this disk.
    #[error("not found: {0}")]
    NotFound(String),
    /// An image of this name with another uuid is on the disk.
    #[error("{0}")]
    AlreadyExists(String),
    /// The image (or a peer) is not in a state that allows the request.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A limit was hit: no free port in the range, or too many sends of one image.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The disk identity cannot be verified: nothing is touched.
    #[error("disk unavailable: {0}")]
    DiskUnavailable(String),
    /// A peer (data source, other manager) cannot be reached or answered nonsense.
    #[error("{0}")]
    Peer(String),
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// Work on the image was cancelled (deleted, or the daemon stops).
    #[error("cancelled")]
    Cancelled,
    /// A background task died.
    #[error("internal error: {0}")]
    Internal(String),
}

impl BimError {
    /// An IO error on `path`.
    pub fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        BimError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

impl From<BimError> for tonic::Status {
    fn from(e: BimError) -> Self {
        let msg = e.to_string();
        match e {
            BimError::InvalidArgument(_) => tonic::Status::invalid_argument(msg),
            BimError::NotFound(_) => tonic::Status::not_found(msg),
            BimError::AlreadyExists(_) => tonic::Status::already_exists(msg),
            BimError::FailedPrecondition(_) => tonic::Status::failed_precondition(msg),
            BimError::ResourceExhausted(_) => tonic::Status::resource_exhausted(msg),
            BimError::DiskUnavailable(_) | BimError::Peer(_) => tonic::Status::unavailable(msg),
            BimError::Cancelled => tonic::Status::cancelled(msg),
            BimError::Io { .. } | BimError::Internal(_) => tonic::Status::internal(msg),
        }
    }
}

impl IntoResponse for BimError {
    fn into_response(self) -> Response {
        let status = match &self {
            BimError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            BimError::NotFound(_) => StatusCode::NOT_FOUND,
            BimError::AlreadyExists(_) | BimError::FailedPrecondition(_) => StatusCode::CONFLICT,
            BimError::ResourceExhausted(_) => StatusCode::TOO_MANY_REQUESTS,
            BimError::DiskUnavailable(_) | BimError::Peer(_) => StatusCode::SERVICE_UNAVAILABLE,
            BimError::Cancelled | BimError::Io { .. } | BimError::Internal(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        (status, format!("{self}\n")).into_response()
    }
}
