//! The HTTP API: `GET /v1/file`, `POST /v1/file?action=upload&size=N|transfer`, `GET /metrics`, `GET /healthz`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, Query, Request, State};
use axum::routing::get;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use tracing::Instrument;

use crate::error::ApiError;
use crate::info::FileInfo;
use crate::service::DataSource;
use crate::upload;

#[derive(Clone)]
struct App {
    ds: Arc<DataSource>,
}

/// The router of a data-source server.
pub fn router(ds: Arc<DataSource>) -> Router {
    let mut registry = Registry::with_prefix("corral_datasource");
    registry.register_collector(Box::new(Collector { ds: ds.clone() }));
    let metrics = corral_daemon::metrics::Metrics::new(registry);
    let app = App { ds };
    Router::new()
        // Uploads are streamed to disk, so the body size is not limited here (the announced size is).
        .route(
            "/v1/file",
            get(get_file).post(post_file).layer(DefaultBodyLimit::disable()),
        )
        .with_state(app)
        .merge(metrics.routes())
}

async fn get_file(State(app): State<App>) -> Json<FileInfo> {
    Json(app.ds.job().info())
}

async fn post_file(
    State(app): State<App>,
    Query(q): Query<HashMap<String, String>>,
    req: Request,
) -> Result<Json<FileInfo>, ApiError> {
    match q.get("action").map(String::as_str) {
        Some("transfer") => app.ds.job().transfer().map(Json),
        Some("upload") => {
            let size = upload::parse_size(q.get("size"))?;
            let form = axum::extract::Multipart::from_request(req, &())
                .await
                .map_err(|e| {
                    ApiError::BadRequest(format!("an upload needs a multipart body: {}", e.body_text()))
                })?;
            // Own task: a client that disconnects drops this handler, but the job must still fail and clean up.
            let ds = app.ds.clone();
            let span = ds.job().span();
            tokio::spawn(async move { upload::receive(&ds, size, form).await }.instrument(span))
                .await
                .map_err(|e| ApiError::UploadFailed(format!("upload task: {e}")))?
                .map(Json)
        }
        Some(other) => Err(ApiError::BadRequest(format!(
            "unknown action {other:?}; expected upload or transfer"
        ))),
        None => Err(ApiError::BadRequest("missing ?action=upload|transfer".into())),
    }
}

#[derive(Debug)]
struct Collector {
    ds: Arc<DataSource>,
}

impl std::fmt::Debug for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataSource")
            .field("info", &self.job().info())
            .finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = &self.ds.job().counters;
        let counters = [
            (
                "fetched_bytes",
                "Bytes received from the network (download, upload, export), retries included",
                c.bytes_fetched.load(Ordering::Relaxed),
            ),
            (
                "download_attempts",
                "HTTP requests made by a download (1 + retries)",
                c.download_attempts.load(Ordering::Relaxed),
            ),
            (
                "download_restarts",
                "Times a download started again from byte 0 because the server ignored a Range request",
                c.download_restarts.load(Ordering::Relaxed),
            ),
            (
                "hashed_bytes",
                "Bytes read to compute SHA-512 checksums",
                c.bytes_hashed.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            let m = ConstCounter::new(v);
            m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)?;
        }
        let info = self.ds.job().info();
        let gauges = [
            (
                "progress_percent",
                "Progress of the file, 0-100",
                i64::from(info.progress),
            ),
            (
                "processed_bytes",
                "Bytes of source data received",
                i64::try_from(info.processed_size).unwrap_or(i64::MAX),
            ),
            (
                "size_bytes",
                "Size of the file (0 while unknown)",
                i64::try_from(info.size).unwrap_or(i64::MAX),
            ),
        ];
        for (name, help, v) in gauges {
            let m = ConstGauge::new(v);
            m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)?;
        }
        // One series per state, 1 for the current one: `corral_datasource_state{state="in-progress"} 1`.
        let mut fam = enc.encode_descriptor(
            "state",
            "Current state of the file",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for s in [
            crate::info::FileState::Pending,
            crate::info::FileState::Starting,
            crate::info::FileState::InProgress,
            crate::info::FileState::ReadyForTransfer,
            crate::info::FileState::Ready,
            crate::info::FileState::Failed,
        ] {
            let labels = [("state", s.as_str())];
            let g = ConstGauge::new(i64::from(info.state == s));
            g.encode(fam.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
