//! The API's extractors and its error safety net: whatever goes wrong before or around a handler (a missing or
//! malformed body, a wrong content type, a bad path or query, an unknown route or method, a body over the limit, a
//! panic) reaches the client as the documented `{code, message}` JSON, never as axum's `text/plain`.

use std::panic::AssertUnwindSafe;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, OptionalFromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header, request::Parts};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body (`Content-Type: application/json`), refused as [`ApiError`] when absent or malformed.
pub struct Body<T>(pub T);

/// Path parameters, refused as [`ApiError::Invalid`] when they do not decode.
pub struct Path<T>(pub T);

/// Query parameters, refused as [`ApiError::Invalid`] when they do not parse.
pub struct Query<T>(pub T);

/// No `Content-Type` and no bytes: the client sent no body at all.
fn no_body(headers: &HeaderMap) -> bool {
    !headers.contains_key(header::CONTENT_TYPE)
        && !headers.contains_key(header::TRANSFER_ENCODING)
        && headers
            .get(header::CONTENT_LENGTH)
            .is_none_or(|v| v.as_bytes() == b"0")
}

fn json_rejection(r: JsonRejection, headers: &HeaderMap) -> ApiError {
    match r {
        JsonRejection::MissingJsonContentType(_) if no_body(headers) => {
            ApiError::Invalid("this request needs a JSON body (Content-Type: application/json)".into())
        }
        JsonRejection::MissingJsonContentType(_) => ApiError::UnsupportedMediaType(format!(
            "the body must be JSON with Content-Type: application/json, not {:?}",
            headers
                .get(header::CONTENT_TYPE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default()
        )),
        r if r.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(r.body_text()),
        r => ApiError::Invalid(r.body_text()),
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let headers = req.headers().clone();
        <axum::Json<T> as FromRequest<S>>::from_request(req, state)
            .await
            .map(|axum::Json(v)| Body(v))
            .map_err(|r| json_rejection(r, &headers))
    }
}

/// An optional body: none when the request has no `Content-Type` and no bytes; refused when present and malformed.
impl<S: Send + Sync, T: DeserializeOwned> OptionalFromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Option<Self>, ApiError> {
        if no_body(req.headers()) {
            return Ok(None);
        }
        <Self as FromRequest<S>>::from_request(req, state).await.map(Some)
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(v)| Path(v))
            .map_err(|r: PathRejection| ApiError::Invalid(r.body_text()))
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(v)| Query(v))
            .map_err(|r: QueryRejection| ApiError::Invalid(r.body_text()))
    }
}

/// The largest non-JSON error body the safety net reads back to quote in its message.
const QUOTED_BODY_LIMIT: usize = 4096;

/// Middleware around every route: a panicking handler becomes a 500 `internal`, and an error response that is not
/// JSON (axum's own 405, a rejection from an extractor the API does not wrap) is rewritten into the documented
/// shape with its status and headers (e.g. `Allow`) kept.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let resp = match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(%method, path, panic = what, "API handler panicked");
            return ApiError::Internal(format!("{method} {path} failed: the handler panicked ({what})"))
                .into_response();
        }
    };
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, QUOTED_BODY_LIMIT)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let err = match status {
        // axum adds `Allow` outside this layer.
        StatusCode::METHOD_NOT_ALLOWED => ApiError::MethodNotAllowed(format!(
            "{method} is not allowed on {path} (the Allow header lists the methods it takes)"
        )),
        StatusCode::NOT_FOUND => ApiError::NotFound(format!("no route {method} {path}")),
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(or_status(text, status)),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(or_status(text, status)),
        s if s.is_server_error() => ApiError::Internal(or_status(text, status)),
        _ => ApiError::Invalid(or_status(text, status)),
    };
    let (_, code) = err.status_and_code();
    let mut out = (
        status,
        axum::Json(crate::error::ErrorBody {
            code: code.to_owned(),
            message: err.to_string(),
        }),
    )
        .into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name, value.clone());
        }
    }
    out
}

fn or_status(text: String, status: StatusCode) -> String {
    if text.is_empty() { status.to_string() } else { text }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::routing::get;

    use super::*;

    async fn boom() -> &'static str {
        panic!("boom")
    }

    /// The safety net on a bare router: a panicking handler and a handler answering text/plain both reach the
    /// client as the documented JSON, with their status.
    #[tokio::test]
    async fn panics_and_plain_text_errors_become_json() {
        let app = Router::new()
            .route("/panic", get(boom))
            .route(
                "/plain",
                get(|| async { (StatusCode::BAD_REQUEST, "plain words") }),
            )
            .layer(axum::middleware::from_fn(json_errors));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        for (path, status, code, words) in [
            ("/panic", 500, "internal", "boom"),
            ("/plain", 400, "invalid", "plain words"),
        ] {
            let resp = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
            assert_eq!(resp.status().as_u16(), status, "{path}");
            let body: crate::error::ErrorBody = resp.json().await.unwrap();
            assert_eq!(body.code, code, "{path}");
            assert!(body.message.contains(words), "{path}: {}", body.message);
        }
    }
}
