//! The instance manager's one error type and its one mapping to gRPC status codes.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ImError {
    /// The request is malformed (a bad name, a binary outside the allowlist, a reserved flag).
    #[error("{0}")]
    InvalidArgument(String),
    /// The process needs a data-plane feature this build lacks (`crate::build_info`).
    #[error("{0}")]
    Unsupported(String),
    #[error("no process named {0:?}")]
    NotFound(String),
    #[error("process {name:?} is {state} (pid {pid}): delete it first")]
    AlreadyExists {
        name: String,
        state: &'static str,
        pid: i32,
    },
    #[error("cannot start {name:?}: {source}")]
    Spawn {
        name: String,
        source: corral_daemon::supervise::SpawnError,
    },
    #[error("cannot write the process table {path}: {source}")]
    Persist { path: PathBuf, source: std::io::Error },
    #[error("cannot read the process table {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("cannot read the log {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
}

impl From<ImError> for tonic::Status {
    fn from(e: ImError) -> Self {
        let msg = e.to_string();
        match e {
            ImError::InvalidArgument(_) => Self::invalid_argument(msg),
            ImError::NotFound(_) => Self::not_found(msg),
            ImError::AlreadyExists { .. } => Self::already_exists(msg),
            ImError::Spawn { .. } | ImError::Unsupported(_) => Self::failed_precondition(msg),
            ImError::Persist { .. } | ImError::Load { .. } | ImError::Log { .. } => Self::internal(msg),
        }
    }
}
