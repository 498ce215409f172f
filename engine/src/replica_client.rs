//! The engine's view of one replica: its address, gRPC control and sync-agent clients, the data-protocol client,
//! and its mode (RW, WO, ERR) with the reason it went ERR. ERR is terminal for this engine instance.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use corral_proto::ReplicaAddress;
use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{
    self, replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use serde::Serialize;
use tonic::transport::Channel;
use tracing::{info, warn};

use crate::error::EngineError;

/// Replica mode within this engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// Serves reads and writes.
    #[serde(rename = "RW")]
    Rw,
    /// Rebuilding: receives writes, serves no reads.
    #[serde(rename = "WO")]
    Wo,
    /// Out of the volume until removed and added again.
    #[serde(rename = "ERR")]
    Err,
}

impl Mode {
    /// The API string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rw => "RW",
            Self::Wo => "WO",
            Self::Err => "ERR",
        }
    }
}

/// Live connections to a replica.
#[derive(Debug, Clone)]
pub struct Connection {
    /// `ReplicaService` client.
    pub control: ReplicaServiceClient<Channel>,
    /// `SyncAgentService` client.
    pub sync: SyncAgentServiceClient<Channel>,
    /// Data-protocol client.
    pub data: DataClient,
}

/// One replica of the volume.
#[derive(Debug)]
pub struct ReplicaEntry {
    /// Where the replica is: its control, data and sync endpoints.
    pub address: ReplicaAddress,
    /// `None` when it could not be reached (then the mode is ERR).
    pub conn: Option<Connection>,
    state: Mutex<(Mode, String)>,
}

/// How long a replica may take to answer its first `ReplicaGet`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Parses a replica address (`tcp://HOST:PORT?data=PORT&sync=PORT[&replica=NAME]`, `docs/formats.md`); the
/// single-port `tcp://HOST:PORT` is refused with what to add.
pub fn parse_address(address: &str) -> Result<ReplicaAddress, EngineError> {
    address
        .parse()
        .map_err(|e: corral_proto::replica_address::AddressError| EngineError::InvalidArgument(e.to_string()))
}

/// Connects to a replica's three endpoints. Returns the connection and the replica's status; a replica that is
/// closed is opened, one that was never created is created with `create_size` when given.
pub async fn connect(
    address: &ReplicaAddress,
    client: &ClientConfig,
    create: Option<(u64, bool)>,
) -> Result<(Connection, v1::Replica), EngineError> {
    let not_replica = |e: &dyn std::fmt::Display| {
        EngineError::FailedPrecondition(format!("{address} is not a reachable Corral replica: {e}"))
    };
    let channel = connect_endpoint(&address.control, GrpcTimeouts::CONTROL)
        .await
        .map_err(|e| not_replica(&e))?;
    let mut control = ReplicaServiceClient::new(channel);
    let mut status = tokio::time::timeout(PROBE_TIMEOUT, control.replica_get(v1::Empty {}))
        .await
        .map_err(|_| not_replica(&format!("no gRPC answer within {} s", PROBE_TIMEOUT.as_secs())))?
        .map_err(|e| not_replica(&format!("ReplicaGet: {} {}", e.code(), e.message())))?
        .into_inner()
        .replica
        .unwrap_or_default();
    if status.state == "initial" {
        let Some((size, disable_rc)) = create else {
            return Err(EngineError::FailedPrecondition(format!(
                "replica {address} holds no volume yet"
            )));
        };
        info!(replica = %address, size, "creating the replica");
        status = control
            .replica_create(v1::ReplicaCreateRequest {
                size,
                disable_revision_counter: disable_rc,
            })
            .await
            .map_err(|e| EngineError::replica(address, &e))?
            .into_inner()
            .replica
            .unwrap_or_default();
    } else if status.state == "closed" {
        status = control
            .replica_open(v1::ReplicaOpenRequest {})
            .await
            .map_err(|e| EngineError::replica(address, &e))?
            .into_inner()
            .replica
            .unwrap_or_default();
    }
    let sync_channel = connect_endpoint(&address.sync, GrpcTimeouts::CONTROL)
        .await
        .map_err(|e| not_replica(&format!("sync endpoint: {e}")))?;
    let data = DataClient::connect(&address.data.to_socket_string(), client.clone())
        .await
        .map_err(|e| not_replica(&format!("data endpoint {}: {e}", address.data)))?;
    Ok((
        Connection {
            control,
            sync: SyncAgentServiceClient::new(sync_channel),
            data,
        },
        status,
    ))
}

impl ReplicaEntry {
    /// A connected replica in `mode`.
    pub fn new(address: ReplicaAddress, conn: Connection, mode: Mode) -> Self {
        Self {
            address,
            conn: Some(conn),
            state: Mutex::new((mode, String::new())),
        }
    }

    /// A replica that could not be used, with the reason.
    pub fn failed(address: ReplicaAddress, conn: Option<Connection>, reason: String) -> Self {
        Self {
            address,
            conn,
            state: Mutex::new((Mode::Err, reason)),
        }
    }

    /// Current mode.
    pub fn mode(&self) -> Mode {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Why it is ERR ("" otherwise).
    pub fn error(&self) -> String {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .clone()
    }

    /// Sets RW or WO (ignored once ERR).
    pub fn set_mode(&self, mode: Mode) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.0 != Mode::Err {
            s.0 = mode;
        }
    }

    /// Puts the replica out of the volume (terminal). Returns true if it was not ERR before.
    pub fn set_err(&self, reason: &str) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.0 == Mode::Err {
            return false;
        }
        warn!(replica = %self.address, was = s.0.as_str(), reason, "replica set to ERR");
        *s = (Mode::Err, reason.to_owned());
        if let Some(c) = &self.conn {
            let data = c.data.clone();
            tokio::spawn(async move { data.close().await });
        }
        true
    }

    /// The data client when the replica takes writes (RW or WO).
    pub fn writer(&self) -> Option<&DataClient> {
        match self.mode() {
            Mode::Rw | Mode::Wo => self.conn.as_ref().map(|c| &c.data),
            Mode::Err => None,
        }
    }

    /// The data client when the replica serves reads (RW).
    pub fn reader(&self) -> Option<&DataClient> {
        match self.mode() {
            Mode::Rw => self.conn.as_ref().map(|c| &c.data),
            _ => None,
        }
    }

    /// The connection, or a clear error.
    pub fn connection(&self) -> Result<&Connection, EngineError> {
        self.conn.as_ref().ok_or_else(|| {
            EngineError::FailedPrecondition(format!("replica {} is not connected", self.address))
        })
    }
}
