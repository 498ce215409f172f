//! The manager's client of the node's instance manager (`corral-im`, `--instance-manager URL`): the process host
//! that owns the node's data-plane daemons so they outlive this manager. Connecting checks versions both ways:
//! an instance manager older than the API this manager needs is refused, naming what it lacks.

use std::time::Duration;

use corral_proto::v1::{self, instance_service_client::InstanceServiceClient};
use tonic::transport::Channel;

/// The instance API this manager needs (see `instance_manager::API_VERSION`).
pub const NEEDED_API_VERSION: u32 = 1;
/// This manager speaks instance API up to this version.
pub const SPOKEN_API_VERSION: u32 = 1;

/// What each instance API version added, for the refusal message of an older instance manager.
const API_FEATURES: [(u32, &str); 1] = [(
    1,
    "the process API the manager drives every engine, replica, corral-bim and corral-datasource with \
     (create/delete/get/watch, ready-file listeners)",
)];

#[derive(Debug, thiserror::Error)]
pub enum InstanceManagerError {
    #[error("cannot reach the instance manager at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error(
        "the instance manager at {url} (corral-im {version}) speaks instance API v{has}; this manager needs \
         v{needs}: it cannot run {missing}. Upgrade the node's instance manager first."
    )]
    TooOld {
        url: String,
        version: String,
        has: u32,
        needs: u32,
        missing: String,
    },
    #[error(
        "the instance manager at {url} (corral-im {version}) accepts clients from instance API v{min}; this \
         manager speaks v{speaks}. Upgrade the manager."
    )]
    TooNew {
        url: String,
        version: String,
        min: u32,
        speaks: u32,
    },
}

/// A connected, version-checked instance manager.
#[derive(Clone)]
pub struct InstanceManager {
    pub url: String,
    /// The instance manager's build version, shown in `corral node ls`.
    pub version: String,
    pub api_version: u32,
    client: InstanceServiceClient<Channel>,
}

/// What the instance manager answered to `VersionGet` at a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataPlaneReport {
    /// `VERSION (API vN)`, for `corral node ls`.
    pub shown: String,
    /// Its build version.
    pub version: String,
    /// What its data plane can do (an older instance manager's empty list already read as all).
    pub features: Vec<String>,
}

impl std::fmt::Debug for InstanceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstanceManager")
            .field("url", &self.url)
            .field("version", &self.version)
            .field("api_version", &self.api_version)
            .finish_non_exhaustive()
    }
}

impl InstanceManager {
    /// Connects to `url` and checks the versions.
    pub async fn connect(url: &str) -> Result<Self, InstanceManagerError> {
        let unreachable = |reason: String| InstanceManagerError::Unreachable {
            url: url.to_owned(),
            reason,
        };
        let ch = corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::CONTROL)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let mut client = InstanceServiceClient::new(ch);
        let v = client
            .version_get(v1::VersionGetRequest {})
            .await
            .map_err(|e| unreachable(e.message().to_owned()))?
            .into_inner();
        check_versions(url, &v)?;
        Ok(Self {
            url: url.to_owned(),
            version: v.version,
            api_version: v.api_version,
            client,
        })
    }

    /// Connects, retrying an unreachable instance manager (it may start after the manager) until `deadline`;
    /// a version refusal is final.
    pub async fn connect_retrying(url: &str, deadline: Duration) -> Result<Self, InstanceManagerError> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            match Self::connect(url).await {
                Err(InstanceManagerError::Unreachable { reason, .. })
                    if tokio::time::Instant::now() < until =>
                {
                    tracing::warn!(url, reason, "instance manager not reachable yet; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                r => return r,
            }
        }
    }

    /// The instance manager's version and features as it answers now (it may have been replaced since the
    /// connect, e.g. by an older data plane); Err with the version known from the connect, marked unreachable,
    /// when it does not answer.
    pub async fn version_now(&self) -> Result<DataPlaneReport, String> {
        match self.client.clone().version_get(v1::VersionGetRequest {}).await {
            Ok(v) => {
                let v = v.into_inner();
                if let Err(e) = check_versions(&self.url, &v) {
                    tracing::error!(error = %e, "the instance manager was replaced by an incompatible one");
                }
                Ok(DataPlaneReport {
                    shown: format!("{} (API v{})", v.version, v.api_version),
                    features: corral_proto::data_plane::effective(&v.features),
                    version: v.version,
                })
            }
            Err(s) => {
                tracing::warn!(url = self.url, status = %s, "instance manager not answering");
                Err(format!("{} (unreachable)", self.version))
            }
        }
    }

    pub async fn create(&self, req: v1::ProcessCreateRequest) -> Result<v1::ProcessInfo, tonic::Status> {
        Ok(self.client.clone().process_create(req).await?.into_inner())
    }

    /// The process `name`; None when the instance manager does not know it.
    pub async fn get(&self, name: &str) -> Result<Option<v1::ProcessInfo>, tonic::Status> {
        match self
            .client
            .clone()
            .process_get(v1::ProcessGetRequest {
                name: name.to_owned(),
            })
            .await
        {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s),
        }
    }

    /// Every process the instance manager knows, whatever its state.
    pub async fn list(&self) -> Result<Vec<v1::ProcessInfo>, tonic::Status> {
        Ok(self
            .client
            .clone()
            .process_list(v1::ProcessListRequest {})
            .await?
            .into_inner()
            .processes)
    }

    /// Stops and forgets `name` (unknown is not an error).
    pub async fn delete(&self, name: &str, grace: Duration) -> Result<(), tonic::Status> {
        let grace_ms = u32::try_from(grace.as_millis()).unwrap_or(u32::MAX);
        match self
            .client
            .clone()
            .process_delete(v1::ProcessDeleteRequest {
                name: name.to_owned(),
                grace_ms,
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(s),
        }
    }
}

fn check_versions(url: &str, v: &v1::VersionGetResponse) -> Result<(), InstanceManagerError> {
    if v.api_version < NEEDED_API_VERSION {
        let missing = API_FEATURES
            .iter()
            .filter(|(n, _)| *n > v.api_version && *n <= NEEDED_API_VERSION)
            .map(|(_, what)| *what)
            .collect::<Vec<_>>()
            .join("; ");
        return Err(InstanceManagerError::TooOld {
            url: url.to_owned(),
            version: v.version.clone(),
            has: v.api_version,
            needs: NEEDED_API_VERSION,
            missing,
        });
    }
    if v.api_min_version > SPOKEN_API_VERSION {
        return Err(InstanceManagerError::TooNew {
            url: url.to_owned(),
            version: v.version.clone(),
            min: v.api_min_version,
            speaks: SPOKEN_API_VERSION,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_or_newer_instance_api_is_refused_saying_what_to_upgrade() {
        let v = |api, min| v1::VersionGetResponse {
            version: "0.0.9".into(),
            api_version: api,
            api_min_version: min,
            features: Vec::new(),
        };
        check_versions("http://im", &v(1, 1)).unwrap();
        let e = check_versions("http://im", &v(0, 0)).unwrap_err().to_string();
        assert!(
            e.contains("v0")
                && e.contains("needs v1")
                && e.contains("process API")
                && e.contains("instance manager first"),
            "{e}"
        );
        let e = check_versions("http://im", &v(3, 2)).unwrap_err().to_string();
        assert!(e.contains("Upgrade the manager"), "{e}");
    }
}
