//! gRPC calls to a manager's daemons with or without a client certificate: whether an engine or a replica answers.

use std::str::FromStr;
use std::sync::Arc;

use corral_proto::grpc::{GrpcTimeouts, connect_with};
use corral_proto::v1;
use corral_proto::v1::controller_service_client::ControllerServiceClient;
use corral_proto::v1::replica_service_client::ReplicaServiceClient;

/// A client config to dial with; `None` is plaintext.
pub type Client = Option<Arc<corral_tls::rustls::ClientConfig>>;

/// Whether the engine whose ControllerService is at `addr` answers `VolumeGet` to `tls`.
pub async fn engine_answers(addr: &str, tls: &Client) -> Result<(), String> {
    let ch = connect_with(addr, GrpcTimeouts::CONTROL, tls.as_ref())
        .await
        .map_err(|e| e.to_string())?;
    ControllerServiceClient::new(ch)
        .volume_get(v1::Empty {})
        .await
        .map(drop)
        .map_err(|s| s.to_string())
}

/// Whether the replica at `addr` (a replica address) answers `ReplicaGet` to `tls`.
pub async fn replica_answers(addr: &str, tls: &Client) -> Result<(), String> {
    let addr = corral_proto::ReplicaAddress::from_str(addr).unwrap();
    let ch = connect_with(&addr.control.to_string(), GrpcTimeouts::CONTROL, tls.as_ref())
        .await
        .map_err(|e| e.to_string())?;
    ReplicaServiceClient::new(ch)
        .replica_get(v1::Empty {})
        .await
        .map(drop)
        .map_err(|s| s.to_string())
}
