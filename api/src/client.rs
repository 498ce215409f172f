//! A small typed client of the manager's REST API (used by the `corral` CLI, `corral-csi` and the tests), and the
//! JSON body of every error response.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The JSON body of every error response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// One of the manager's error codes (its `ERROR_CODES`, listed in the OpenAPI document).
    pub code: String,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The manager refused the request.
    #[error("{message} ({status} {code})")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    #[error("cannot reach the manager at {url}: {reason}")]
    Http { url: String, reason: String },
}

#[derive(Clone)]
pub struct Client {
    base: String,
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer` with every request (never printed: `Client` has no `Debug`).
    token: Option<String>,
}

impl Client {
    pub fn new(base: &str) -> Self {
        let base = if base.starts_with("http://") || base.starts_with("https://") {
            base.trim_end_matches('/').to_owned()
        } else {
            format!("http://{}", base.trim_end_matches('/'))
        };
        Self {
            base,
            http: reqwest::Client::new(),
            token: None,
        }
    }

    /// This client presenting `token` (the manager's `token` feature) with every request.
    #[must_use]
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// `req` with this client's token: for a request built outside these helpers (a streamed upload).
    pub fn authorize(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    async fn send<T: DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<T, ClientError> {
        let http = |e: reqwest::Error| ClientError::Http {
            url: url.to_owned(),
            reason: e.to_string(),
        };
        let resp = self.authorize(req).send().await.map_err(http)?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(http)?;
        if !status.is_success() {
            let body: ErrorBody = serde_json::from_slice(&bytes).unwrap_or_else(|_| ErrorBody {
                code: "unknown".into(),
                message: String::from_utf8_lossy(&bytes).into_owned(),
            });
            return Err(ClientError::Api {
                status: status.as_u16(),
                code: body.code,
                message: body.message,
            });
        }
        let bytes = if bytes.is_empty() {
            &b"null"[..]
        } else {
            &bytes[..]
        };
        serde_json::from_slice(bytes).map_err(|e| ClientError::Http {
            url: url.to_owned(),
            reason: format!("unexpected response: {e}"),
        })
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let url = format!("{}{path}", self.base);
        self.send(self.http.get(&url), &url).await
    }

    pub async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, ClientError> {
        let url = format!("{}{path}", self.base);
        self.send(self.http.post(&url).json(body), &url).await
    }

    pub async fn put<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, ClientError> {
        let url = format!("{}{path}", self.base);
        self.send(self.http.put(&url).json(body), &url).await
    }

    pub async fn delete(&self, path: &str) -> Result<(), ClientError> {
        let url = format!("{}{path}", self.base);
        self.send::<serde_json::Value>(self.http.delete(&url), &url)
            .await
            .map(|_| ())
    }
}
