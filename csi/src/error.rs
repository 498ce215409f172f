//! The plugin's one error type and its one mapping to gRPC status codes (the codes the CSI specification assigns).

use corral_api::client::ClientError;

/// Why a CSI call failed. The variant is the CSI error code; the message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A required field is missing or a value is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// The object exists with properties incompatible with the request (same name, other size or source).
    #[error("{0}")]
    AlreadyExists(String),
    /// The capacity asked for cannot be satisfied (limit below what is required, a clone smaller than its source).
    #[error("{0}")]
    OutOfRange(String),
    /// The state of the volume does not allow the call (published elsewhere, not staged, in use).
    #[error("{0}")]
    FailedPrecondition(String),
    /// Another operation on the same volume or snapshot is in flight, or a pagination token is unknown.
    #[error("{0}")]
    Aborted(String),
    /// No room for the volume where it must be accessible.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The manager or a daemon did not answer.
    #[error("{0}")]
    Unavailable(String),
    /// Waited for the manager to reach a state longer than the call may take; the CO retries.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A local tool (nbdfuse, losetup, mkfs, mount) failed.
    #[error("{0}")]
    Internal(String),
}

pub type CsiResult<T> = Result<T, CsiError>;

impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> Self {
        let code = match &e {
            CsiError::InvalidArgument(_) => tonic::Code::InvalidArgument,
            CsiError::NotFound(_) => tonic::Code::NotFound,
            CsiError::AlreadyExists(_) => tonic::Code::AlreadyExists,
            CsiError::OutOfRange(_) => tonic::Code::OutOfRange,
            CsiError::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
            CsiError::Aborted(_) => tonic::Code::Aborted,
            CsiError::ResourceExhausted(_) => tonic::Code::ResourceExhausted,
            CsiError::Unavailable(_) => tonic::Code::Unavailable,
            CsiError::DeadlineExceeded(_) => tonic::Code::DeadlineExceeded,
            CsiError::Internal(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

impl From<ClientError> for CsiError {
    /// The manager's HTTP status decides the code: 400 invalid, 404 not found, 409 conflicting state, 503 and
    /// transport failures unavailable.
    fn from(e: ClientError) -> Self {
        let msg = format!("manager: {e}");
        match e {
            ClientError::Api { status: 400, .. } => CsiError::InvalidArgument(msg),
            ClientError::Api { status: 404, .. } => CsiError::NotFound(msg),
            ClientError::Api { status: 409, .. } => CsiError::FailedPrecondition(msg),
            ClientError::Api { status: 503, .. } | ClientError::Http { .. } => CsiError::Unavailable(msg),
            ClientError::Api { .. } => CsiError::Internal(msg),
        }
    }
}
