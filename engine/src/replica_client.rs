//! The engine's view of one replica: its address, gRPC control and sync-agent clients, the data-protocol client,
//! and its mode (RW, WO, ERR) with the reason it went ERR. ERR is terminal for this engine instance.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use corral_proto::ReplicaAddress;
use corral_proto::engine_generation::EngineGeneration;
use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{
    self, replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use serde::Serialize;
use tonic::service::interceptor::InterceptedService;
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
    fn to_u8(self) -> u8 {
        match self {
            Self::Rw => 0,
            Self::Wo => 1,
            Self::Err => 2,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Rw,
            1 => Self::Wo,
            _ => Self::Err,
        }
    }

    /// The API string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rw => "RW",
            Self::Wo => "WO",
            Self::Err => "ERR",
        }
    }
}

/// A gRPC channel to a replica whose every call carries this engine's generation (`docs/formats.md`, "Engine
/// generation"): a replica that accepted a newer one refuses the calls of this engine.
pub type ReplicaChannel = InterceptedService<Channel, EngineGeneration>;

/// Live connections to a replica.
#[derive(Debug, Clone)]
pub struct Connection {
    /// `ReplicaService` client.
    pub control: ReplicaServiceClient<ReplicaChannel>,
    /// `SyncAgentService` client.
    pub sync: SyncAgentServiceClient<ReplicaChannel>,
    /// Data-protocol client.
    pub data: DataClient,
    /// `data` runs over the replica's unix socket: the replica is on this node (reads prefer it).
    pub local: bool,
}

/// One replica of the volume.
#[derive(Debug)]
pub struct ReplicaEntry {
    /// Where the replica is: its control, data and sync endpoints.
    pub address: ReplicaAddress,
    /// `None` when it could not be reached (then the mode is ERR).
    pub conn: Option<Connection>,
    /// [`Mode`], read by every IO without a lock.
    mode: AtomicU8,
    /// Why it went ERR; written once, under this lock, on the way to ERR.
    reason: Mutex<String>,
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
    let generation = EngineGeneration(client.generation);
    let mut control = ReplicaServiceClient::with_interceptor(channel, generation);
    let probe = tokio::time::timeout(PROBE_TIMEOUT, control.replica_get(v1::Empty {}))
        .await
        .map_err(|_| not_replica(&format!("no gRPC answer within {} s", PROBE_TIMEOUT.as_secs())))?
        .map_err(|e| not_replica(&format!("ReplicaGet: {} {}", e.code(), e.message())))?
        .into_inner();
    let local_data = probe.data_local_endpoint;
    let mut status = probe.replica.unwrap_or_default();
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
    let (data, local) = match connect_local_data(address, &local_data, client).await {
        Some(data) => (data, true),
        None => (
            DataClient::connect(&address.data.to_socket_string(), client.clone())
                .await
                .map_err(|e| not_replica(&format!("data endpoint {}: {e}", address.data)))?,
            false,
        ),
    };
    Ok((
        Connection {
            control,
            sync: SyncAgentServiceClient::with_interceptor(sync_channel, generation),
            data,
            local,
        },
        status,
    ))
}

/// The data client over the replica's unix socket (`local`, from `ReplicaGet`) when that socket is on this node:
/// a replica beside the engine is reached without TCP (issue 16 item 4; the manager starts every replica with
/// one). `None` — use the address's TCP data endpoint — when the replica serves none, the path is not here (the
/// replica is on another node), or connecting fails. The replica's address, with its TCP endpoint, stays what
/// names it; the socket path holds the replica's own name, so a path found here is that replica's.
async fn connect_local_data(
    address: &ReplicaAddress,
    local: &str,
    client: &ClientConfig,
) -> Option<DataClient> {
    let path = local.strip_prefix("unix:")?;
    if !std::path::Path::new(path).exists() {
        return None;
    }
    match DataClient::connect(local, client.clone()).await {
        Ok(data) => {
            info!(replica = %address, socket = path, "data protocol over the replica's unix socket");
            Some(data)
        }
        Err(e) => {
            warn!(replica = %address, socket = path, error = %e, "unix data socket refused: using TCP");
            None
        }
    }
}

impl ReplicaEntry {
    /// A connected replica in `mode`.
    pub fn new(address: ReplicaAddress, conn: Connection, mode: Mode) -> Self {
        Self {
            address,
            conn: Some(conn),
            mode: AtomicU8::new(mode.to_u8()),
            reason: Mutex::new(String::new()),
        }
    }

    /// A replica that could not be used, with the reason.
    pub fn failed(address: ReplicaAddress, conn: Option<Connection>, reason: String) -> Self {
        Self {
            address,
            conn,
            mode: AtomicU8::new(Mode::Err.to_u8()),
            reason: Mutex::new(reason),
        }
    }

    /// Current mode.
    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Acquire))
    }

    /// Why it is ERR ("" otherwise).
    pub fn error(&self) -> String {
        self.reason.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Sets RW or WO (ignored once ERR).
    pub fn set_mode(&self, mode: Mode) {
        let _ = self.mode.fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
            (Mode::from_u8(m) != Mode::Err).then_some(mode.to_u8())
        });
    }

    /// Puts the replica out of the volume (terminal). Returns true if it was not ERR before.
    pub fn set_err(&self, reason: &str) -> bool {
        // The reason is written before the mode turns ERR, so whoever sees ERR finds it.
        let mut r = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        let was = Mode::from_u8(self.mode.load(Ordering::Acquire));
        if was == Mode::Err {
            return false;
        }
        reason.clone_into(&mut r);
        let was = Mode::from_u8(self.mode.swap(Mode::Err.to_u8(), Ordering::AcqRel));
        drop(r);
        warn!(replica = %self.address, was = was.as_str(), reason, "replica set to ERR");
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

    /// Whether the data connection runs over the replica's unix socket (the replica is on this node).
    pub fn is_local(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.local)
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
