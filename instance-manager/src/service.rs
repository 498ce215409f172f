//! The gRPC face of the process table (`corral.v1.InstanceService`).

use std::sync::Arc;
use std::time::Duration;

use corral_proto::v1::{self, instance_service_server::InstanceService};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::table::{DEFAULT_GRACE, ProcessSpec, ProcessTable};
use crate::{API_MIN_VERSION, API_VERSION};

type Reply<T> = Result<Response<T>, Status>;

pub struct InstanceGrpc {
    table: Arc<ProcessTable>,
    cancel: CancellationToken,
    /// What this build's data plane can do (`crate::build_info::features`).
    features: Vec<&'static str>,
}

impl InstanceGrpc {
    pub fn new(table: Arc<ProcessTable>, cancel: CancellationToken, features: Vec<&'static str>) -> Self {
        Self {
            table,
            cancel,
            features,
        }
    }
}

#[tonic::async_trait]
impl InstanceService for InstanceGrpc {
    async fn process_create(&self, req: Request<v1::ProcessCreateRequest>) -> Reply<v1::ProcessInfo> {
        let r = req.into_inner();
        crate::build_info::check_process(&self.features, &r.binary, &r.args)?;
        let spec = ProcessSpec {
            name: r.name,
            kind: r.kind,
            binary: r.binary,
            args: r.args,
            env: r.env.into_iter().collect(),
        };
        Ok(Response::new(self.table.create(spec).await?))
    }

    async fn process_delete(&self, req: Request<v1::ProcessDeleteRequest>) -> Reply<v1::ProcessInfo> {
        let r = req.into_inner();
        let grace = if r.grace_ms == 0 {
            DEFAULT_GRACE
        } else {
            Duration::from_millis(u64::from(r.grace_ms))
        };
        Ok(Response::new(self.table.delete(&r.name, grace).await?))
    }

    async fn process_get(&self, req: Request<v1::ProcessGetRequest>) -> Reply<v1::ProcessInfo> {
        Ok(Response::new(self.table.get(&req.into_inner().name)?))
    }

    async fn process_list(&self, _req: Request<v1::ProcessListRequest>) -> Reply<v1::ProcessListResponse> {
        Ok(Response::new(v1::ProcessListResponse {
            processes: self.table.list(),
        }))
    }

    type ProcessWatchStream = ReceiverStream<Result<v1::ProcessInfo, Status>>;

    async fn process_watch(&self, _req: Request<v1::ProcessWatchRequest>) -> Reply<Self::ProcessWatchStream> {
        // Subscribe before listing: a change between the two is sent twice rather than lost.
        let mut changes = self.table.subscribe();
        let now = self.table.list();
        let (tx, rx) = mpsc::channel(64);
        let stop = self.cancel.clone();
        tokio::spawn(async move {
            for info in now {
                if tx.send(Ok(info)).await.is_err() {
                    return;
                }
            }
            loop {
                let next = tokio::select! {
                    () = stop.cancelled() => return,
                    () = tx.closed() => return,
                    n = changes.recv() => n,
                };
                let item = match next {
                    Ok(info) => Ok(info),
                    Err(broadcast::error::RecvError::Lagged(n)) => Err(Status::data_loss(format!(
                        "watcher fell {n} changes behind: watch again"
                    ))),
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let lagged = item.is_err();
                if tx.send(item).await.is_err() || lagged {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn process_log(&self, req: Request<v1::ProcessLogRequest>) -> Reply<v1::ProcessLogResponse> {
        let r = req.into_inner();
        let path = self.table.log_path(&r.name)?;
        let lines = if r.lines == 0 { 100 } else { r.lines as usize };
        let lines = tokio::task::spawn_blocking(move || crate::table::tail(&path, lines))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(v1::ProcessLogResponse { lines }))
    }

    async fn version_get(&self, _req: Request<v1::VersionGetRequest>) -> Reply<v1::VersionGetResponse> {
        Ok(Response::new(v1::VersionGetResponse {
            version: crate::build_info::VERSION.to_owned(),
            api_version: api_version(),
            api_min_version: API_MIN_VERSION,
            features: self.features.iter().map(|f| (*f).to_owned()).collect(),
        }))
    }
}

/// The API version this build announces. `CORRAL_IM_API_VERSION` overrides it, so a test can stand in for an
/// older instance manager without building one.
fn api_version() -> u32 {
    std::env::var("CORRAL_IM_API_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(API_VERSION)
}
