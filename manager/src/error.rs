//! The manager's one error type for API operations and its one mapping to HTTP (`{code, message}` bodies).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::store::StoreError;

/// What an API operation can fail with. The variant decides the HTTP status; the message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Bad input: wrong size, bad name, impossible request.
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the current state (attached elsewhere, exists, changed meanwhile).
    #[error("{0}")]
    Conflict(String),
    /// A daemon the operation needs did not answer.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The JSON body of every error response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// `invalid`, `not-found`, `conflict`, `unavailable` or `internal`.
    pub code: String,
    pub message: String,
}

impl ApiError {
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid"),
            ApiError::NotFound(_) | ApiError::Store(StoreError::NotFound { .. }) => {
                (StatusCode::NOT_FOUND, "not-found")
            }
            ApiError::Conflict(_)
            | ApiError::Store(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
                (StatusCode::CONFLICT, "conflict")
            }
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        match s.code() {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => {
                ApiError::Invalid(s.message().to_owned())
            }
            tonic::Code::NotFound => ApiError::NotFound(s.message().to_owned()),
            tonic::Code::AlreadyExists | tonic::Code::FailedPrecondition | tonic::Code::Aborted => {
                ApiError::Conflict(s.message().to_owned())
            }
            _ => ApiError::Unavailable(format!("engine: {}", s.message())),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let body = ErrorBody {
            code: code.to_owned(),
            message: self.to_string(),
        };
        (status, Json(body)).into_response()
    }
}
