//! `download`: GET a URL into the work file, streaming, with zero blocks left as holes.
//!
//! A broken transfer (connection reset, truncated body, 5xx) is retried with exponential backoff; when the server
//! answers a `Range: bytes=N-` request with `206` the download continues at byte N, when it answers `200` it starts
//! again from byte 0. The retry budget is renewed whenever an attempt brought data. A connection that goes quiet
//! for a third of the no-data limit (a silently dropped TCP connection sends no reset) is abandoned and the
//! download resumes on a new one. Independently of retries, the job fails when no data arrives for the no-data
//! limit: nothing ever hangs in an unknown state.

use std::path::Path;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, ETAG, HeaderValue, IF_RANGE, LAST_MODIFIED, RANGE};

use crate::error::JobError;
use crate::job::{Counters, JobContext};
use crate::sink::FileSink;

/// How one attempt ended when it did not finish the download.
enum Broken {
    /// Retrying may help (with the reason, for the log and the final message).
    Transient(String),
    /// Retrying cannot help.
    Fatal(JobError),
}

fn backoff(retries: usize) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(8))
        .with_jitter()
        .with_max_times(retries)
        .build()
}

/// Parses `Content-Range: bytes START-END/TOTAL` into (START, TOTAL); TOTAL is None for `*`.
fn content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _end) = range.split_once('-')?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().ok()?)
    };
    Some((start.parse().ok()?, total))
}

/// Downloads `url` into `work`.
pub async fn run(ds: &JobContext, url: &str, work: &Path) -> Result<(), JobError> {
    let cfg = ds.config();
    let no_data = cfg.no_data_timeout;
    let client = reqwest::Client::builder()
        .connect_timeout(no_data)
        .build()
        .map_err(|e| JobError::Protocol {
            url: url.to_owned(),
            reason: format!("building the HTTP client: {e}"),
        })?;
    let mut sink = FileSink::create(work)?;
    let mut delays = backoff(cfg.download_retries);
    let mut last_data = Instant::now();
    let mut total: Option<u64> = None;
    // ETag (or Last-Modified) of the first response: a resume asks `If-Range` so a changed file comes back whole.
    let mut validator: Option<HeaderValue> = None;
    let mut attempts = 0u32;
    let cancel = ds.cancel_token().clone();
    loop {
        attempts += 1;
        Counters::add(&ds.counters.download_attempts, 1);
        let before = sink.len();
        let r = tokio::select! {
            () = cancel.cancelled() => return Err(JobError::Cancelled("the data source is shutting down")),
            r = attempt(ds, &client, url, &mut sink, (&mut total, &mut validator), &mut last_data, no_data) => r,
        };
        let reason = match r {
            Ok(()) => break,
            Err(Broken::Fatal(e)) => return Err(e),
            Err(Broken::Transient(reason)) => reason,
        };
        if sink.len() > before {
            // Progress was made: a later blip gets the full retry budget again.
            delays = backoff(cfg.download_retries);
        }
        let Some(delay) = delays.next() else {
            return Err(JobError::Transfer {
                url: url.to_owned(),
                reason,
                attempts,
            });
        };
        let remaining = no_data.saturating_sub(last_data.elapsed());
        if delay >= remaining {
            return Err(no_data_error(
                url,
                no_data,
                sink.len(),
                &format!("last attempt: {reason}"),
            ));
        }
        tracing::warn!(%reason, offset = sink.len(), retry_in_ms = delay.as_millis(), attempts, "download broke off; retrying");
        tokio::select! {
            () = cancel.cancelled() => return Err(JobError::Cancelled("the data source is shutting down")),
            () = tokio::time::sleep(delay) => {}
        }
    }
    let done = sink.finish().await?;
    let size = done.size;
    if let Some(t) = total
        && t != size
    {
        return Err(JobError::SizeMismatch {
            got: size,
            expected: t,
        });
    }
    tracing::info!(size, attempts, "download complete");
    ds.set_received_checksum(done.sha512);
    Ok(())
}

/// How long one connection may stay quiet before it is given up for a new one.
fn stall_limit(no_data: Duration) -> Duration {
    (no_data / 3).max(Duration::from_secs(1))
}

/// Waits for `fut` at most until the next stall check; `Err` carries whether the no-data limit is exhausted.
async fn quiet_wait<T>(
    fut: impl std::future::Future<Output = T>,
    last_data: Instant,
    no_data: Duration,
) -> Result<T, bool> {
    let remaining = no_data.saturating_sub(last_data.elapsed());
    let wait = remaining.min(stall_limit(no_data));
    tokio::time::timeout(wait, fut)
        .await
        .map_err(|_| wait >= remaining)
}

fn no_data_error(url: &str, no_data: Duration, received: u64, why: &str) -> JobError {
    JobError::NoData {
        url: url.to_owned(),
        secs: no_data.as_secs(),
        received,
        why: why.to_owned(),
    }
}

/// One GET, from `sink.len()` on.
async fn attempt(
    ds: &JobContext,
    client: &reqwest::Client,
    url: &str,
    sink: &mut FileSink,
    (total, validator): (&mut Option<u64>, &mut Option<HeaderValue>),
    last_data: &mut Instant,
    no_data: Duration,
) -> Result<(), Broken> {
    let offset = sink.len();
    let mut req = client.get(url);
    if offset > 0 {
        req = req.header(RANGE, format!("bytes={offset}-"));
        if let Some(v) = validator.as_ref() {
            req = req.header(IF_RANGE, v.clone());
        }
    }
    let resp = match quiet_wait(req.send(), *last_data, no_data).await {
        Err(true) => {
            return Err(Broken::Fatal(no_data_error(
                url,
                no_data,
                offset,
                "the server accepted the connection but sent no response",
            )));
        }
        Err(false) => {
            return Err(Broken::Transient(
                "no response yet; trying a new connection".into(),
            ));
        }
        Ok(Err(e)) => return Err(Broken::Transient(error_chain(&e))),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    match status {
        StatusCode::PARTIAL_CONTENT if offset > 0 => {
            let cr = resp
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(content_range);
            match cr {
                Some((start, t)) if start == offset && (total.is_none() || t.is_none() || t == *total) => {
                    if t.is_some() {
                        *total = t;
                    }
                }
                _ => {
                    return Err(Broken::Fatal(JobError::Protocol {
                        url: url.to_owned(),
                        reason: format!(
                            "asked for bytes from {offset} of {total:?}, got Content-Range {cr:?} (did the file change?)"
                        ),
                    }));
                }
            }
            tracing::info!(offset, "resuming with a range request");
        }
        StatusCode::RANGE_NOT_SATISFIABLE if offset > 0 && *total == Some(offset) => return Ok(()),
        StatusCode::OK => {
            if offset > 0 {
                tracing::warn!(
                    offset,
                    "the server does not resume (no Range support): starting again from byte 0"
                );
                Counters::add(&ds.counters.download_restarts, 1);
                sink.reset().await.map_err(Broken::Fatal)?;
                ds.set_processed(0);
            }
            *total = resp.content_length();
            *validator = resp
                .headers()
                .get(ETAG)
                .or_else(|| resp.headers().get(LAST_MODIFIED))
                .cloned();
            ds.set_size(total.unwrap_or(0));
        }
        s if s.is_server_error()
            || s == StatusCode::TOO_MANY_REQUESTS
            || s == StatusCode::REQUEST_TIMEOUT =>
        {
            return Err(Broken::Transient(format!("HTTP {}", s.as_u16())));
        }
        s => {
            return Err(Broken::Fatal(JobError::HttpStatus {
                url: url.to_owned(),
                status: s.as_u16(),
            }));
        }
    }
    let mut body = resp.bytes_stream();
    loop {
        let next = match quiet_wait(body.next(), *last_data, no_data).await {
            Err(true) => {
                return Err(Broken::Fatal(no_data_error(
                    url,
                    no_data,
                    sink.len(),
                    "the response body stalled",
                )));
            }
            Err(false) => {
                // The connection went quiet: give it up and resume on a new one (the outer loop checks that
                // the no-data limit leaves room for that).
                return Err(Broken::Transient(format!(
                    "no data for {} s on this connection",
                    stall_limit(no_data).as_secs()
                )));
            }
            Ok(n) => n,
        };
        match next {
            None => break,
            Some(Err(e)) => return Err(Broken::Transient(error_chain(&e))),
            Some(Ok(chunk)) => {
                if chunk.is_empty() {
                    continue;
                }
                *last_data = Instant::now();
                Counters::add(&ds.counters.bytes_fetched, chunk.len() as u64);
                sink.write(&chunk).await.map_err(Broken::Fatal)?;
                ds.set_processed(sink.len());
            }
        }
    }
    match *total {
        Some(t) if sink.len() < t => Err(Broken::Transient(format!(
            "the body ended at byte {} of {t}",
            sink.len()
        ))),
        Some(t) if sink.len() > t => Err(Broken::Fatal(JobError::SizeMismatch {
            got: sink.len(),
            expected: t,
        })),
        _ => Ok(()),
    }
}

/// An error with its causes (reqwest's own message alone hides the interesting part).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::content_range;

    #[test]
    fn content_range_parses_start_and_total() {
        assert_eq!(content_range("bytes 100-199/1000"), Some((100, Some(1000))));
        assert_eq!(content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(content_range("items 1-2/3"), None);
        assert_eq!(content_range("bytes x-2/3"), None);
    }
}
