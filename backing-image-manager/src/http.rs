//! HTTP side of the manager: `GET|HEAD /v1/files/{name}/download` of a ready image (raw with `Content-Length` and
//! single `Range` requests, or a gzip stream with `?compress=gzip`), `/metrics`, `/healthz` and `/readyz` (the
//! daemons' shared metrics routes, [`corral_daemon::metrics`]).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::BimError;
use crate::manager::Manager;

const CHUNK: usize = 1 << 20;

#[derive(Clone)]
struct AppState {
    manager: Arc<Manager>,
}

/// The router of the HTTP address.
pub fn router(manager: Arc<Manager>) -> Router {
    let metrics = corral_daemon::metrics::Metrics::new(crate::metrics::registry(manager.clone()));
    Router::new()
        .route("/v1/files/{name}/download", get(download))
        .with_state(AppState { manager })
        .merge(metrics.routes())
}

#[derive(Debug, Deserialize)]
struct DownloadQuery {
    compress: Option<String>,
}

/// Parses a single `bytes=` range against `size` into an inclusive `(first, last)`.
pub fn parse_range(value: &str, size: u64) -> Result<(u64, u64), String> {
    let spec = value
        .trim()
        .strip_prefix("bytes=")
        .ok_or_else(|| format!("unsupported range {value:?}: expected bytes=A-B"))?;
    if spec.contains(',') {
        return Err("multiple ranges are not supported".into());
    }
    let (a, b) = spec
        .split_once('-')
        .ok_or_else(|| format!("bad range {value:?}"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|_| format!("bad range {value:?}"))
    };
    let (first, last) = match (a.trim().is_empty(), b.trim().is_empty()) {
        (true, false) => {
            let n = num(b)?.min(size);
            if n == 0 {
                return Err("empty suffix range".into());
            }
            (size - n, size - 1)
        }
        (false, true) => (num(a)?, size.saturating_sub(1)),
        (false, false) => (num(a)?, num(b)?.min(size.saturating_sub(1))),
        (true, true) => return Err(format!("bad range {value:?}")),
    };
    if first >= size || first > last {
        return Err(format!("range {value:?} is outside the file of {size} bytes"));
    }
    Ok((first, last))
}

async fn download(
    State(s): State<AppState>,
    Path(name): Path<String>,
    Query(q): Query<DownloadQuery>,
    method: Method,
    headers: HeaderMap,
) -> Result<Response, BimError> {
    let (path, size, checksum) = s.manager.download_target(&name).await?;
    // The verified SHA-512 names the content: a client resuming with `If-Range` gets the whole file when the image
    // behind the name is not the one it started with (deleted and fetched again), never a splice of two files.
    let etag = HeaderValue::from_str(&format!("\"{checksum}\"")).ok();
    let head = method == Method::HEAD;
    match q.compress.as_deref() {
        None | Some("" | "none") => {}
        Some("gzip") => {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/gzip"));
            if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename={name}.gz")) {
                h.insert(header::CONTENT_DISPOSITION, v);
            }
            if head {
                return Ok((h, Body::empty()).into_response());
            }
            let file = open_at(path, 0).await?;
            let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(4);
            let m = s.manager.clone();
            tokio::task::spawn_blocking(move || {
                let writer = ChannelWriter { tx: tx.clone() };
                let mut gz = flate2::write::GzEncoder::new(writer, flate2::Compression::fast());
                let r = copy_file(file, u64::MAX, &mut gz).and_then(|n| {
                    gz.finish()?;
                    Ok(n)
                });
                match r {
                    Ok(n) => {
                        m.metrics.download_bytes.inc_by(n);
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                    }
                }
            });
            return Ok((h, Body::from_stream(ReceiverStream::new(rx))).into_response());
        }
        Some(other) => {
            return Err(BimError::InvalidArgument(format!(
                "compress={other:?} is not supported: use gzip or leave it out"
            )));
        }
    }
    let if_range_matches = match headers.get(header::IF_RANGE) {
        None => true,
        Some(v) => etag.as_ref() == Some(v),
    };
    let range = match headers.get(header::RANGE) {
        None => None,
        Some(_) if !if_range_matches => None,
        Some(v) => {
            let v = v.to_str().unwrap_or_default();
            match parse_range(v, size) {
                Ok(r) => Some(r),
                Err(e) => {
                    let mut resp = (StatusCode::RANGE_NOT_SATISFIABLE, format!("{e}\n")).into_response();
                    if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
                        resp.headers_mut().insert(header::CONTENT_RANGE, v);
                    }
                    return Ok(resp);
                }
            }
        }
    };
    let (first, len, status) = match range {
        Some((a, b)) => (a, b - a + 1, StatusCode::PARTIAL_CONTENT),
        None => (0, size, StatusCode::OK),
    };
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(v) = etag {
        h.insert(header::ETAG, v);
    }
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if let Some((a, b)) = range
        && let Ok(v) = HeaderValue::from_str(&format!("bytes {a}-{b}/{size}"))
    {
        h.insert(header::CONTENT_RANGE, v);
    }
    if head {
        return Ok((status, h).into_response());
    }
    let mut file = File::open(&path).map_err(|e| BimError::io("open", &path, e))?;
    file.seek(SeekFrom::Start(first))
        .map_err(|e| BimError::io("seek", &path, e))?;
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(4);
    let m = s.manager.clone();
    tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter { tx: tx.clone() };
        match copy_file(file, len, &mut writer) {
            Ok(n) => {
                m.metrics.download_bytes.inc_by(n);
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
            }
        }
    });
    Ok((status, h, Body::from_stream(ReceiverStream::new(rx))).into_response())
}

/// Opens `path` positioned at `offset` (off the reactor).
async fn open_at(path: std::path::PathBuf, offset: u64) -> Result<File, BimError> {
    tokio::task::spawn_blocking(move || {
        let mut f = File::open(&path).map_err(|e| BimError::io("open", &path, e))?;
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| BimError::io("seek", &path, e))?;
        Ok(f)
    })
    .await
    .map_err(|e| BimError::Internal(e.to_string()))?
}

/// Copies up to `len` bytes of `file` into `out` in 1 MiB pieces.
fn copy_file(mut file: File, len: u64, out: &mut impl Write) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    let mut done = 0;
    while left > 0 {
        let want = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
        let n = file.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        left -= n as u64;
        done += n as u64;
    }
    out.flush()?;
    Ok(done)
}

/// A blocking writer feeding the body stream; fails when the client went away.
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "client went away"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_clipped_and_bad_ones_refused() {
        assert_eq!(parse_range("bytes=0-99", 1000), Ok((0, 99)));
        assert_eq!(parse_range("bytes=900-", 1000), Ok((900, 999)));
        assert_eq!(parse_range("bytes=-100", 1000), Ok((900, 999)));
        assert_eq!(parse_range("bytes=990-5000", 1000), Ok((990, 999)));
        for bad in [
            "bytes=1000-",
            "bytes=5-2",
            "items=0-1",
            "bytes=0-1,4-5",
            "bytes=-0",
            "bytes=-",
            "bytes=a-b",
        ] {
            assert!(parse_range(bad, 1000).is_err(), "{bad} accepted");
        }
    }
}
