//! Talking to *another* volume's engine: the source of a clone, or the volume a CLI export reads. The engine's own
//! replicas are reached through [`crate::replica_client`]; this module is only the client side of a peer's
//! `ControllerService`.

use corral_proto::ReplicaAddress;
use corral_proto::v1::{self, controller_service_client::ControllerServiceClient};
use tonic::transport::Channel;

use crate::error::EngineError;
use crate::replica_client::{Mode, parse_address};

/// Connects to an engine's `ControllerService` (`HOST:PORT`, `tcp://` or `http://` prefixes accepted).
pub async fn engine_client(url: &str) -> Result<ControllerServiceClient<Channel>, EngineError> {
    corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::OPERATOR)
        .await
        .map(ControllerServiceClient::new)
        .map_err(|e| EngineError::FailedPrecondition(format!("engine: {e}")))
}

/// An error answered by the engine at `url`, as a replica-style error naming it.
pub fn engine_err(url: &str, s: &tonic::Status) -> EngineError {
    EngineError::Replica {
        address: format!("engine {url}"),
        code: s.code(),
        message: s.message().to_owned(),
    }
}

/// A RW replica of the volume served by the engine at `url`.
pub async fn rw_replica_of(url: &str) -> Result<ReplicaAddress, EngineError> {
    let list = engine_client(url)
        .await?
        .replica_list(v1::Empty {})
        .await
        .map_err(|e| engine_err(url, &e))?
        .into_inner();
    list.replicas
        .into_iter()
        .find(|r| r.mode == Mode::Rw.as_str())
        .ok_or_else(|| EngineError::FailedPrecondition(format!("the volume at {url} has no RW replica")))
        .and_then(|r| parse_address(&r.address))
}
