//! Corral data source: the HTTP server that prepares the first copy of a backing image on one disk.
//!
//! One server per new image. It fetches the data from its source ([`SourceType`]: an HTTP download that resumes
//! with Range requests, a streamed multipart upload, a replica's snapshot export over sparse-sync, a sparse clone
//! of another image (its file on the disk, or a v2 copy a disk daemon exposes), a restore of a backup from a backup target) into `<disk>/tmp/<name>-<uuid>.tmp`,
//! keeping zero blocks as holes; then detects the format, converts qcow2 to raw for the v2 engine, computes the
//! SHA-512 and checks it against the expected one, and publishes `<disk>/tmp/<name>-<uuid>`. A backing-image
//! manager polls `GET /v1/file` ([`FileInfo`]) and takes the file with `POST /v1/file?action=transfer`. A failed
//! job leaves no file behind; a stalled download fails after the no-data limit instead of hanging.

pub mod clone;
pub mod download;
pub mod error;
pub mod export;
pub mod finish;
pub mod http;
pub mod info;
pub mod job;
pub mod receive;
pub mod restore;
pub mod service;
pub mod sink;
pub mod spec;
pub mod upload;

pub use error::{ApiError, ConfigError, JobError};
pub use info::{DataEngine, FileInfo, FileState, SourceType};
pub use job::JobContext;
pub use service::DataSource;
pub use spec::{DataSourceConfig, SourceSpec};

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Starts the job and serves the HTTP API on `listener` until `cancel`; then stops the job and waits for it. With
/// the process's TLS configs ([`corral_tls::installed`]) only peers with a certificate of the cluster reach the API.
pub async fn serve(
    listener: TcpListener,
    ds: Arc<DataSource>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let listener = corral_tls::TcpIncoming::new(listener, corral_tls::installed().map(|t| t.server.clone()))?;
    ds.start();
    let app = http::router(ds.clone());
    let c = cancel.clone();
    let r = axum::serve(listener, app)
        .with_graceful_shutdown(async move { c.cancelled().await })
        .await;
    ds.job().cancel_token().cancel();
    ds.join().await;
    r
}
