//! The gRPC client edge: another manager as a sync needs it (is the copy ready, send it to my receiver), in domain
//! terms; and the raw client the CLI and tests use.

use std::time::Duration;

use corral_proto::grpc::{ConnectError, GrpcTimeouts};
use corral_proto::v1;
use corral_proto::v1::backing_image_manager_service_client::BackingImageManagerServiceClient;
use tonic::transport::Channel;

use crate::error::BimError;

/// A gRPC client of another manager.
pub type BimClient = BackingImageManagerServiceClient<Channel>;

/// How long a peer may take to say what it holds.
const PEER_GET_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to a manager at `HOST:PORT` (or an `http://` URL) for control calls between daemons.
pub async fn connect(address: &str) -> Result<BimClient, BimError> {
    connect_with(address, GrpcTimeouts::CONTROL).await
}

/// [`connect`] with other timeouts (the CLI waits as long as its user: [`GrpcTimeouts::OPERATOR`]).
pub async fn connect_with(address: &str, timeouts: GrpcTimeouts) -> Result<BimClient, BimError> {
    let ch = corral_proto::grpc::connect(address, timeouts)
        .await
        .map_err(|e| match e {
            ConnectError::Address { .. } => BimError::InvalidArgument(e.to_string()),
            e => BimError::Peer(format!("backing-image manager: {e}")),
        })?;
    Ok(BimClient::new(ch))
}

/// What a peer reports about its copy of an image.
#[derive(Debug, Clone, Default)]
pub(crate) struct PeerCopy {
    /// The state as the peer names it (`ready`, ...).
    pub(crate) state: String,
    pub(crate) size: u64,
    /// Allocated bytes of the peer's file (the share of data a sync receives).
    pub(crate) real_size: u64,
    pub(crate) current_checksum: String,
}

/// Another manager, the source of a sync.
pub(crate) struct Peer {
    address: String,
    client: BimClient,
}

impl Peer {
    pub(crate) async fn connect(address: &str) -> Result<Self, BimError> {
        Ok(Peer {
            address: address.to_owned(),
            client: connect(address).await?,
        })
    }

    /// The peer's copy of `name`/`uuid`; an error that says whether the peer lacks it or is no manager at all.
    pub(crate) async fn copy_of(&mut self, name: &str, uuid: &str) -> Result<PeerCopy, BimError> {
        let from = &self.address;
        let req = v1::BimImageRef {
            name: name.to_owned(),
            uuid: uuid.to_owned(),
        };
        let remote = tokio::time::timeout(PEER_GET_TIMEOUT, self.client.get(req))
            .await
            .map_err(|_| {
                BimError::Peer(format!(
                    "{from} did not answer within 5 s: is it a backing-image manager?"
                ))
            })?
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => {
                    BimError::FailedPrecondition(format!("{from} does not hold {name}: {}", s.message()))
                }
                _ => BimError::Peer(format!(
                    "{from} is not a backing-image manager that can send {name} ({:?}: {})",
                    s.code(),
                    s.message()
                )),
            })?
            .into_inner();
        let st = remote.status.unwrap_or_default();
        Ok(PeerCopy {
            state: st.state,
            size: st.size,
            real_size: st.real_size,
            current_checksum: st.current_checksum,
        })
    }

    /// Asks the peer to send `name`/`uuid` to the sparse-sync receiver at `to`; ends when the peer's send ended.
    /// The error is the peer's message.
    pub(crate) async fn send(&mut self, name: String, uuid: String, to: String) -> Result<(), String> {
        let req = v1::BimSendRequest {
            name,
            uuid,
            to_address: to,
        };
        self.client
            .send(req)
            .await
            .map(|_| ())
            .map_err(|s| s.message().to_owned())
    }
}
