//! Client of a data source (`corral-datasource`): `GET /v1/file` to see its file, `POST /v1/file?action=transfer`
//! to take the file over. After a transfer the file at `filePath` is this manager's to rename.

use std::time::Duration;

use crate::error::BimError;

/// A data source's `GET /v1/file` reply: the wire type the data source serializes, so both sides share one
/// definition (without this crate depending on the data source's).
pub use corral_proto::backing_image::FileInfo as DataSourceFile;
use corral_proto::backing_image::FileState;
/// The state a data source reports for a finished file nobody took yet.
pub const READY_FOR_TRANSFER: FileState = FileState::ReadyForTransfer;

/// A data source at `HOST:PORT` (or a URL), over HTTPS with the process's TLS configs when it has them.
pub struct DataSourceClient {
    base: String,
    http: reqwest::Client,
}

impl DataSourceClient {
    pub fn new(address: &str) -> Result<Self, BimError> {
        let tls = corral_tls::installed().map(|t| &*t.client);
        let base = sparse_sync::http_base(address, tls.is_some());
        let http = sparse_sync::reqwest_tls(reqwest::Client::builder(), tls)
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| BimError::Internal(format!("HTTP client: {e}")))?;
        Ok(DataSourceClient { base, http })
    }

    /// `GET /v1/file`.
    pub async fn file(&self) -> Result<DataSourceFile, BimError> {
        let url = format!("{}/v1/file", self.base);
        let resp = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| BimError::Peer(format!("data source {url}: {e}")))?;
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| BimError::Peer(format!("data source {url}: {e}")))?;
        if !status.is_success() {
            return Err(BimError::Peer(format!(
                "data source {url} answered HTTP {status}: {}",
                String::from_utf8_lossy(&body).trim()
            )));
        }
        serde_json::from_slice(&body)
            .map_err(|e| BimError::Peer(format!("{url} is not a data source (unexpected reply: {e})")))
    }

    /// `POST /v1/file?action=transfer`: the data source forgets the file; it is now ours.
    pub async fn transfer(&self) -> Result<(), BimError> {
        let url = format!("{}/v1/file?action=transfer", self.base);
        let resp = self
            .http
            .post(&url)
            .send()
            .await
            .map_err(|e| BimError::Peer(format!("data source {url}: {e}")))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let body = resp.text().await.unwrap_or_default();
        Err(BimError::FailedPrecondition(format!(
            "data source refused the transfer (HTTP {status}): {}",
            body.trim()
        )))
    }
}
