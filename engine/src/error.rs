//! The engine's error type, and its one mapping to gRPC status codes.

use tonic::Status;

/// Errors of engine operations. Each message names the volume or replica it is about.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed (bad size, bad address, bad name).
    #[error("{0}")]
    InvalidArgument(String),
    /// Not possible in the current state (frontend up during revert, rebuild running, no RW replica).
    #[error("{0}")]
    FailedPrecondition(String),
    /// No such replica or snapshot.
    #[error("{0}")]
    NotFound(String),
    /// Already exists (snapshot name, replica address).
    #[error("{0}")]
    AlreadyExists(String),
    /// Every replica is unusable.
    #[error("volume {volume} has no healthy replica: {detail}")]
    NoHealthyReplica { volume: String, detail: String },
    /// The disks of the replicas are full.
    #[error("no space left on the replicas of volume {0}")]
    NoSpace(String),
    /// A replica answered with an error.
    #[error("replica {address}: {message}")]
    Replica {
        address: String,
        code: tonic::Code,
        message: String,
    },
    /// A replica accepted a newer engine generation: this engine is stale and serves no more IO.
    #[error("{0}")]
    Fenced(String),
    /// Other failures.
    #[error("{0}")]
    Internal(String),
}

impl EngineError {
    /// Wraps a replica's gRPC error.
    pub fn replica(address: &impl std::fmt::Display, s: &Status) -> Self {
        Self::Replica {
            address: address.to_string(),
            code: s.code(),
            message: s.message().to_owned(),
        }
    }
}

impl From<EngineError> for Status {
    fn from(e: EngineError) -> Self {
        let msg = e.to_string();
        match e {
            EngineError::InvalidArgument(_) => Status::invalid_argument(msg),
            EngineError::FailedPrecondition(_) => Status::failed_precondition(msg),
            EngineError::NotFound(_) => Status::not_found(msg),
            EngineError::AlreadyExists(_) => Status::already_exists(msg),
            EngineError::NoHealthyReplica { .. } => Status::unavailable(msg),
            EngineError::NoSpace(_) => Status::resource_exhausted(msg),
            EngineError::Replica { code, .. } => Status::new(code, msg),
            EngineError::Fenced(_) => Status::failed_precondition(msg),
            EngineError::Internal(_) => Status::internal(msg),
        }
    }
}
