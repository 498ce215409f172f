//! The UI's static files, compiled into the binary: the manager serves its own UI with nothing to install beside it.
//! Each file is there twice: as written and gzipped at build time (`build.rs`), so a browser that accepts gzip
//! (every one does) gets the small form and nothing is compressed per request.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::extract::Path;
use crate::error::ApiError;

/// One file: its path under `/ui/`, content type, content and gzipped content.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
    gzip: &'static [u8],
}

/// `asset!("pages/volumes.js", JS)`: the file under `assets/` with its build-time gzip from `OUT_DIR/ui/`.
macro_rules! asset {
    ($path:literal, $ct:expr) => {
        Asset {
            path: $path,
            content_type: $ct,
            body: include_bytes!(concat!("assets/", $path)),
            gzip: include_bytes!(concat!(env!("OUT_DIR"), "/ui/", $path, ".gz")),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";

const FILES: &[Asset] = &[
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("app.js", JS),
    asset!("api.js", JS),
    asset!("dom.js", JS),
    asset!("pages/dashboard.js", JS),
    asset!("pages/volumes.js", JS),
    asset!("pages/backing_images.js", JS),
    asset!("pages/backups.js", JS),
    asset!("pages/nodes.js", JS),
    asset!("pages/settings.js", JS),
    asset!("pages/recurring_jobs.js", JS),
];

const INDEX: Asset = asset!("index.html", "text/html; charset=utf-8");

pub async fn index(headers: HeaderMap) -> Response {
    page(&INDEX, &headers)
}

pub async fn file(headers: HeaderMap, Path(file): Path<String>) -> Result<Response, ApiError> {
    FILES
        .iter()
        .find(|a| a.path == file)
        .map(|a| page(a, &headers))
        .ok_or_else(|| ApiError::NotFound(format!("no UI file {file:?}")))
}

/// Whether the request's `Accept-Encoding` takes gzip (and does not refuse it with `q=0`).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let mut parts = coding.split(';').map(str::trim);
            let name = parts.next().unwrap_or_default();
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !refused
        })
}

fn page(a: &Asset, headers: &HeaderMap) -> Response {
    let gzip = accepts_gzip(headers);
    let mut resp = (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, a.content_type),
            // The files change with the binary: a browser revalidates instead of running an old page against a new API.
            (header::CACHE_CONTROL, "no-cache"),
            // The body depends on Accept-Encoding: a cache must not serve one form to a client asking the other.
            (header::VARY, "accept-encoding"),
        ],
        if gzip { a.gzip } else { a.body },
    )
        .into_response();
    if gzip {
        resp.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(ae: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_str(ae).unwrap());
        h
    }

    #[test]
    fn gzip_only_when_accepted() {
        assert!(accepts_gzip(&with("gzip, deflate, br, zstd")));
        assert!(accepts_gzip(&with("br;q=1.0, GZIP;q=0.5")));
        assert!(accepts_gzip(&with("*")));
        assert!(!accepts_gzip(&with("gzip;q=0")));
        assert!(!accepts_gzip(&with("br, identity")));
        assert!(!accepts_gzip(&HeaderMap::new()));
    }

    #[test]
    fn every_gzipped_file_unpacks_to_the_file() {
        use std::io::Read;
        for a in FILES.iter().chain([&INDEX]) {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(a.gzip)
                .read_to_end(&mut out)
                .unwrap();
            assert_eq!(out, a.body, "{}", a.path);
            assert!(a.gzip.len() < a.body.len(), "{} is smaller gzipped", a.path);
        }
    }
}
