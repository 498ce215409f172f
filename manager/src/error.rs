//! The manager's one error type for API operations and its one mapping to HTTP (`{code, message}` bodies).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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
    /// The route exists, the method does not (the response names the allowed ones in `Allow`).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The body is larger than the route accepts.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The body is not `application/json` (or, for an upload, not the multipart form).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No, a malformed, an unknown or a revoked token (`manager::token::auth`).
    #[error("{0}")]
    Unauthorized(String),
    /// The token's role does not allow the request.
    #[error("{0}")]
    Forbidden(String),
    /// A request header (Authorization) is larger than the API takes.
    #[error("{0}")]
    HeaderTooLarge(String),
    /// A bug: a handler panicked or failed in a way no variant describes.
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The JSON body of every error response (its `code` one of [`ERROR_CODES`]).
pub use corral_api::client::ErrorBody;

/// Every `code` an error body can carry, with its HTTP status: the OpenAPI document lists them from here.
pub const ERROR_CODES: &[(u16, &str, &str)] = &[
    (
        400,
        "invalid",
        "Bad input: a malformed body, path or query, or a value the server refuses",
    ),
    (
        401,
        "unauthorized",
        "No, a malformed, an unknown or a revoked token: send Authorization: Bearer TOKEN",
    ),
    (403, "forbidden", "The token's role does not allow this request"),
    (404, "not-found", "No such route or object"),
    (
        405,
        "method-not-allowed",
        "The route does not take this method (see the Allow header)",
    ),
    (
        409,
        "conflict",
        "The request conflicts with the current state (exists, attached, in use, no room)",
    ),
    (413, "too-large", "The body is larger than the route accepts"),
    (415, "unsupported-media-type", "The body is not application/json"),
    (431, "header-too-large", "The Authorization header is over 4 KiB"),
    (500, "internal", "A bug or a store failure"),
    (
        503,
        "unavailable",
        "A daemon or the store the operation needs did not answer",
    ),
];

impl ApiError {
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid"),
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed"),
            ApiError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too-large"),
            ApiError::UnsupportedMediaType(_) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type")
            }
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::HeaderTooLarge(_) => (StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "header-too-large"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ApiError::NotFound(_) | ApiError::Store(StoreError::NotFound { .. }) => {
                (StatusCode::NOT_FOUND, "not-found")
            }
            ApiError::Conflict(_)
            | ApiError::Store(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
                (StatusCode::CONFLICT, "conflict")
            }
            ApiError::Unavailable(_) | ApiError::Store(StoreError::Unavailable(_)) => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
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
