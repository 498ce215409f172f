//! The UI's static files, compiled into the binary: the manager serves its own UI with nothing to install beside it.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::extract::Path;
use crate::error::ApiError;

/// (path under `/ui/`, content type, content).
const FILES: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("assets/style.css"),
    ),
    ("app.js", JS, include_str!("assets/app.js")),
    ("api.js", JS, include_str!("assets/api.js")),
    ("dom.js", JS, include_str!("assets/dom.js")),
    (
        "pages/dashboard.js",
        JS,
        include_str!("assets/pages/dashboard.js"),
    ),
    ("pages/volumes.js", JS, include_str!("assets/pages/volumes.js")),
    (
        "pages/backing_images.js",
        JS,
        include_str!("assets/pages/backing_images.js"),
    ),
    ("pages/backups.js", JS, include_str!("assets/pages/backups.js")),
    ("pages/nodes.js", JS, include_str!("assets/pages/nodes.js")),
    ("pages/settings.js", JS, include_str!("assets/pages/settings.js")),
    (
        "pages/recurring_jobs.js",
        JS,
        include_str!("assets/pages/recurring_jobs.js"),
    ),
];

const JS: &str = "text/javascript; charset=utf-8";

const INDEX: &str = include_str!("assets/index.html");

pub async fn index() -> Response {
    page(INDEX, "text/html; charset=utf-8")
}

pub async fn file(Path(file): Path<String>) -> Result<Response, ApiError> {
    FILES
        .iter()
        .find(|(p, _, _)| *p == file)
        .map(|(_, ct, body)| page(body, ct))
        .ok_or_else(|| ApiError::NotFound(format!("no UI file {file:?}")))
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, content_type),
            // The files change with the binary: a browser revalidates instead of running an old page against a new API.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
