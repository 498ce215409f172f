//! gRPC calls to a manager's daemons with or without a client certificate: whether an engine or a replica answers;
//! the node certificate a test's own clients present (managers run `--tls auto` by default).

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use corral_proto::grpc::{GrpcTimeouts, connect_with};
use corral_proto::v1;
use corral_proto::v1::controller_service_client::ControllerServiceClient;
use corral_proto::v1::lvstore_service_client::LvstoreServiceClient;
use corral_proto::v1::replica_service_client::ReplicaServiceClient;
use tonic::transport::Channel;

/// A client config to dial with; `None` is plaintext.
pub type Client = Option<Arc<corral_tls::rustls::ClientConfig>>;

/// The node certificate this test's own clients present to the manager's daemons: the last manager started's
/// (a test may run several single-node clusters one after another, each with its own CA; the managers of one
/// cluster share one).
static NODE_CLIENT: Mutex<Client> = Mutex::new(None);

/// Makes the node directory `dir` the one [`node_client`] presents.
pub fn use_node(dir: &Path) {
    *NODE_CLIENT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(testkit::TestPki::client(dir));
}

/// The client config of the node directory last given to [`use_node`] (`None`: plaintext).
pub fn node_client() -> Client {
    NODE_CLIENT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// A client of the disk daemon's `LvstoreService` at `address` presenting [`node_client`].
pub async fn lvstore_client(address: &str) -> LvstoreServiceClient<Channel> {
    let ch = connect_with(address, GrpcTimeouts::CONTROL, node_client().as_ref())
        .await
        .unwrap_or_else(|e| panic!("cannot reach the disk daemon at {address}: {e}"));
    LvstoreServiceClient::new(ch)
}

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
