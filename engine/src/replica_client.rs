//! The engine's view of one replica: its address, gRPC control and sync-agent clients, the data-protocol client,
//! and its mode (RW, WO, ERR) with the reason it went ERR. ERR is terminal for this engine instance.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use corral_proto::v1::{
    self, replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use corral_proto::{REPLICA_DATA_PORT_OFFSET, REPLICA_SYNC_AGENT_PORT_OFFSET};
use data_protocol::{ClientConfig, DataClient};
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};
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
    /// `tcp://HOST:PORT` of the replica's gRPC port.
    pub address: String,
    /// `None` when it could not be reached (then the mode is ERR).
    pub conn: Option<Connection>,
    state: Mutex<(Mode, String)>,
}

/// How long a replica may take to answer its first `ReplicaGet`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Splits `tcp://HOST:PORT` or `HOST:PORT` into host and port.
pub fn parse_address(address: &str) -> Result<(String, u16), EngineError> {
    let hp = address.strip_prefix("tcp://").unwrap_or(address);
    let (host, port) = hp.rsplit_once(':').ok_or_else(|| {
        EngineError::InvalidArgument(format!("replica address {address:?}: expected tcp://HOST:PORT"))
    })?;
    let port: u16 = port
        .parse()
        .map_err(|_| EngineError::InvalidArgument(format!("replica address {address:?}: bad port")))?;
    if host.is_empty() {
        return Err(EngineError::InvalidArgument(format!(
            "replica address {address:?}: empty host"
        )));
    }
    Ok((host.to_owned(), port))
}

/// The canonical form `tcp://HOST:PORT`.
pub fn canonical(address: &str) -> Result<String, EngineError> {
    let (h, p) = parse_address(address)?;
    Ok(format!("tcp://{h}:{p}"))
}

fn endpoint(host: &str, port: u16) -> Result<Endpoint, EngineError> {
    Endpoint::from_shared(format!("http://{host}:{port}"))
        .map(|e| {
            e.connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(60))
        })
        .map_err(|e| EngineError::InvalidArgument(format!("{host}:{port}: {e}")))
}

/// Connects to a replica's three ports. Returns the connection and the replica's status; a replica that is
/// closed is opened, one that was never created is created with `create_size` when given.
pub async fn connect(
    address: &str,
    client: &ClientConfig,
    create: Option<(u64, bool)>,
    name: &str,
) -> Result<(Connection, v1::Replica), EngineError> {
    let (host, port) = parse_address(address)?;
    let sync_port = port
        .checked_add(REPLICA_SYNC_AGENT_PORT_OFFSET)
        .ok_or_else(|| EngineError::InvalidArgument("port".into()))?;
    let data_port = port
        .checked_add(REPLICA_DATA_PORT_OFFSET)
        .ok_or_else(|| EngineError::InvalidArgument("port".into()))?;
    let not_replica = |e: &dyn std::fmt::Display| {
        EngineError::FailedPrecondition(format!("{address} is not a reachable Corral replica: {e}"))
    };
    // Something that accepts TCP but does not speak gRPC would otherwise hold the start for the full timeout.
    let channel = tokio::time::timeout(PROBE_TIMEOUT, endpoint(&host, port)?.connect())
        .await
        .map_err(|_| {
            not_replica(&format!(
                "no HTTP/2 handshake within {} s",
                PROBE_TIMEOUT.as_secs()
            ))
        })?
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
    let sync_channel = tokio::time::timeout(PROBE_TIMEOUT, endpoint(&host, sync_port)?.connect())
        .await
        .map_err(|_| {
            not_replica(&format!(
                "sync agent: no HTTP/2 handshake within {} s",
                PROBE_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| not_replica(&e))?;
    let data = DataClient::connect(&format!("{host}:{data_port}"), client.clone())
        .await
        .map_err(|e| not_replica(&format!("data port {data_port}: {e}")))?;
    let _ = name;
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
    pub fn new(address: String, conn: Connection, mode: Mode) -> Self {
        Self {
            address,
            conn: Some(conn),
            state: Mutex::new((mode, String::new())),
        }
    }

    /// A replica that could not be used, with the reason.
    pub fn failed(address: String, conn: Option<Connection>, reason: String) -> Self {
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
