//! The one metrics and health server of the daemons: Prometheus (OpenMetrics text) on `/metrics`, liveness on
//! `/healthz`, readiness on `/readyz`.
//!
//! Metrics are `prometheus-client` registries: each daemon registers its metrics (or a collector reading its
//! counters at scrape time) under the `corral` prefix, and this module encodes them, label values escaped as the
//! exposition format requires (`\\`, `"`, newline). A daemon whose figures need async work to gather (the engine's
//! replica modes) gives a refresh hook run before each scrape.
//!
//! `/healthz` answers `ok` while the process serves HTTP at all; `/readyz` answers 200 once the daemon announced
//! itself ready ([`crate::ready::ReadyReport::announce`]: every listener bound) and 503 before.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The content type of OpenMetrics text, what `prometheus_client::encoding::text` writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `--metrics-listen`: the flag of a daemon that serves `/metrics` on a listener of its own.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MetricsListenArg {
    /// Serve Prometheus /metrics, /healthz and /readyz on this address (port 0: any; --ready-file reports it as
    /// `metrics`).
    #[arg(long, env = "CORRAL_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<SocketAddr>,
}

type Refresh = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What `/metrics` serves: a registry, and what to refresh before encoding it.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    refresh: Option<Refresh>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("refresh", &self.refresh.is_some())
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// Serves `registry` as it is at each scrape.
    pub fn new(registry: Registry) -> Self {
        Self {
            registry: Arc::new(registry),
            refresh: None,
        }
    }

    /// Runs `refresh` before each scrape (to set gauges whose values take async work to read).
    #[must_use]
    pub fn refresh_with<F, Fut>(mut self, refresh: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.refresh = Some(Arc::new(move || Box::pin(refresh())));
        self
    }

    /// The exposition text of the registry now.
    pub async fn scrape(&self) -> Result<String, std::fmt::Error> {
        if let Some(r) = &self.refresh {
            r().await;
        }
        encode(&self.registry)
    }

    /// `/metrics`, `/healthz` and `/readyz`, to serve alone ([`serve`]) or merged into a daemon's HTTP API.
    pub fn routes(self) -> Router {
        Router::new()
            .route(
                "/metrics",
                get(move || {
                    let m = self.clone();
                    async move { metrics_response(m.scrape().await) }
                }),
            )
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
    }
}

/// Encodes `registry` as OpenMetrics text.
///
/// # Errors
/// When a collector fails to encode.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

fn metrics_response(text: Result<String, std::fmt::Error>) -> Response {
    match text {
        Ok(t) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], t).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding the metrics failed").into_response(),
    }
}

async fn readyz() -> Response {
    if crate::ready::announced() {
        "ready".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting").into_response()
    }
}

/// Serves `app` (usually [`Metrics::routes`], perhaps with more routes merged) on `listener` until `cancel`.
///
/// # Errors
/// When the server fails to accept.
pub async fn serve(listener: TcpListener, app: Router, cancel: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;

    use super::*;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct VolumeLabel {
        volume: String,
    }

    #[test]
    fn label_values_are_escaped() {
        let mut reg = Registry::with_prefix("corral");
        let f = Family::<VolumeLabel, Counter>::default();
        reg.register("test_reads", "Reads", f.clone());
        f.get_or_create(&VolumeLabel {
            volume: "a\\b\"c\nd".into(),
        })
        .inc();
        let text = encode(&reg).unwrap();
        assert!(
            text.contains(r#"corral_test_reads_total{volume="a\\b\"c\nd"} 1"#),
            "{text}"
        );
        // Every sample stays on one line: the newline in the value did not break the exposition.
        assert!(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .all(|l| l.starts_with("corral_test_reads_total{")),
            "{text}"
        );
    }

    #[tokio::test]
    async fn the_server_answers_metrics_health_and_readiness() {
        let mut reg = Registry::with_prefix("corral");
        let c = Counter::<u64>::default();
        reg.register("test_events", "Events", c.clone());
        let refreshed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let r = refreshed.clone();
        let m = Metrics::new(reg).refresh_with(move || {
            let r = r.clone();
            async move {
                r.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        c.inc_by(7);
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let server = tokio::spawn(serve(l, m.routes(), cancel.clone()));
        let (status, body) = get_http(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("corral_test_events_total 7"), "{body}");
        assert_eq!(refreshed.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(get_http(addr, "/healthz").await, (200, "ok".to_owned()));
        let (status, _) = get_http(addr, "/readyz").await;
        let expected = if crate::ready::announced() { 200 } else { 503 };
        assert_eq!(status, expected);
        cancel.cancel();
        server.await.unwrap().unwrap();
    }

    /// A bare HTTP/1.0 GET (this crate has no HTTP client).
    async fn get_http(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let status = buf
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap();
        let body = buf
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }
}

/// Upper bounds (µs) of the latency histogram buckets; the last bucket is +Inf.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    50, 100, 200, 400, 800, 1_600, 3_200, 6_400, 12_800, 25_600, 51_200, 102_400, 409_600, 1_638_400,
];

/// A fixed-bucket latency histogram of atomics (no allocation, no lock on the IO path): the engine's volume
/// latencies and the v2 disk daemon's per-replica ones.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Cumulative counts are computed at export; these are per-bucket counts, index 14 = +Inf.
    pub buckets: [AtomicU64; 15],
    /// Sum of observed latencies in µs.
    pub sum_us: AtomicU64,
    /// Observations.
    pub count: AtomicU64,
}

impl LatencyHistogram {
    /// Records one latency.
    pub fn observe(&self, start: Instant) {
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Approximate quantile (upper bound of the bucket holding it), in µs.
    pub fn quantile_us(&self, q: f64) -> u64 {
        let total = self.count.load(Relaxed);
        if total == 0 {
            return 0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((total as f64) * q).ceil() as u64;
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Relaxed);
            if seen >= rank {
                return LATENCY_BUCKETS_US.get(i).copied().unwrap_or(u64::MAX);
            }
        }
        u64::MAX
    }

    /// Encodes the histogram as the Prometheus histogram `name` (in seconds) with `labels`.
    ///
    /// # Errors
    /// When the encoder fails.
    pub fn encode(
        &self,
        enc: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<(), std::fmt::Error> {
        encode_latency_family(enc, name, help, [(labels, self)])
    }
}

/// Encodes one Prometheus histogram `name` (in seconds) with a series per `(labels, histogram)`.
///
/// # Errors
/// When the encoder fails.
pub fn encode_latency_family<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (&'a [(&'a str, &'a str)], &'a LatencyHistogram)>,
) -> Result<(), std::fmt::Error> {
    #[allow(
        clippy::cast_precision_loss,
        reason = "bucket bounds and sums in seconds need no 53-bit precision"
    )]
    let seconds = |us: u64| us as f64 / 1e6;
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in series {
        let buckets: Vec<(f64, u64)> = h
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let le = LATENCY_BUCKETS_US.get(i).map_or(f64::INFINITY, |us| seconds(*us));
                (le, b.load(Relaxed))
            })
            .collect();
        m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
            seconds(h.sum_us.load(Relaxed)),
            h.count.load(Relaxed),
            &buckets,
            None,
        )?;
    }
    Ok(())
}
