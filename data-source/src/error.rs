//! Errors: [`ConfigError`] (refused at start, nothing touched), [`JobError`] (a job failed: state `failed`, the
//! message is the error) and [`ApiError`] (a refused HTTP request; the one mapping to HTTP statuses).

use std::io;
use std::path::PathBuf;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::info::FileState;

/// A data source that cannot be started as asked; nothing on disk was changed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A name or uuid that would become a path component is not a plain name.
    #[error("{0}")]
    InvalidName(String),
    /// The source type is not one of the known ones.
    #[error("{0}")]
    UnknownSourceType(String),
    /// A parameter the source type needs is missing.
    #[error("source type {source_type} needs parameter {param:?}")]
    MissingParam {
        source_type: &'static str,
        param: &'static str,
    },
    /// A parameter has a value that cannot work.
    #[error("parameter {param:?}: {reason}")]
    BadParam { param: String, reason: String },
    /// The expected checksum is not a SHA-512 in hex.
    #[error("expected checksum {0:?} is not a SHA-512 (128 hex digits)")]
    BadChecksum(String),
    /// The disk directory is not the disk it should be.
    #[error(transparent)]
    Disk(#[from] corral_disk::identity::DiskIdentityError),
    /// Preparing the work directory failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// Why a job failed; the text becomes the `message` of the failed file.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Nothing arrived for the no-data limit (no response, or a stalled body).
    #[error("no data received from {url} for {secs} s (after {received} bytes): {why}")]
    NoData {
        url: String,
        secs: u64,
        received: u64,
        /// What the last attempt met (e.g. connection refused), so the user can tell a dead server from a slow one.
        why: String,
    },
    /// The server answered with an error status that retrying cannot fix.
    #[error("GET {url}: HTTP {status}")]
    HttpStatus { url: String, status: u16 },
    /// The transfer kept failing.
    #[error("GET {url}: {reason} (gave up after {attempts} attempts)")]
    Transfer {
        url: String,
        reason: String,
        attempts: u32,
    },
    /// The server sent something that contradicts the request.
    #[error("GET {url}: {reason}")]
    Protocol { url: String, reason: String },
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The data does not have the size it was announced with.
    #[error("size mismatch: received {got} bytes, expected {expected}")]
    SizeMismatch { got: u64, expected: u64 },
    /// The finished file does not have the expected checksum.
    #[error("checksum mismatch: expected SHA-512 {expected}, the data has {got}")]
    ChecksumMismatch { expected: String, got: String },
    /// The upload body broke off or was malformed.
    #[error("upload: {0}")]
    Upload(String),
    /// The replica export failed.
    #[error("export from volume: {0}")]
    Export(String),
    /// Receiving another image's v2 copy from its disk daemon failed.
    #[error("clone of backing image {image}: {reason}")]
    Clone { image: String, reason: String },
    /// The restore from a backup failed (unknown backup, unreachable target, corrupt block, ...).
    #[error("restore of {url}: {source}")]
    Restore {
        url: String,
        source: Box<backupstore::BackupStoreError>,
    },
    /// The backup target stopped answering.
    #[error("restore of {url}: {reason}")]
    RestoreStalled { url: String, reason: String },
    /// Detecting, converting or checksumming the image failed.
    #[error(transparent)]
    Image(#[from] disk_image::ImageError),
    /// The image cannot be a backing image.
    #[error("{0}")]
    NotUsable(String),
    /// A worker task died.
    #[error("internal: {0}")]
    Task(String),
    /// The source type is known but this build cannot serve it yet.
    #[error("{0}")]
    Unsupported(String),
    /// The job was stopped (server shutdown).
    #[error("cancelled: {0}")]
    Cancelled(&'static str),
}

impl JobError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        JobError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// A refused HTTP request. Refusals never change the job or the disk.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed (missing or bad query parameter).
    #[error("{0}")]
    BadRequest(String),
    /// The action does not fit the source type.
    #[error("action {action:?} is not available for a {source_type} data source")]
    WrongSourceType {
        action: String,
        source_type: &'static str,
    },
    /// The action does not fit the current state.
    #[error("action {action:?} is not possible in state {state}: {hint}")]
    WrongState {
        action: &'static str,
        state: FileState,
        hint: &'static str,
    },
    /// The upload arrived and was refused or broke off (the job failed with the same message).
    #[error("{0}")]
    UploadFailed(String),
}

#[derive(Serialize)]
struct ErrorBody {
    kind: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (kind, status) = match &self {
            ApiError::BadRequest(_) => ("bad-request", StatusCode::BAD_REQUEST),
            ApiError::WrongSourceType { .. } => ("wrong-source-type", StatusCode::CONFLICT),
            ApiError::WrongState { .. } => ("wrong-state", StatusCode::CONFLICT),
            ApiError::UploadFailed(_) => ("upload-failed", StatusCode::BAD_REQUEST),
        };
        let body = ErrorBody {
            kind,
            message: self.to_string(),
        };
        (status, Json(body)).into_response()
    }
}
