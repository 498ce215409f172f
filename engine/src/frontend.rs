//! The NBD frontend of a volume: listeners on unix sockets and/or TCP, started and stopped on request (revert
//! needs the frontend down).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::error::EngineError;
use crate::nbd::{NbdConfig, NbdServer};
use crate::volume::Volume;

/// Where the NBD frontend listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdListen {
    /// A unix socket path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(String),
}

impl std::str::FromStr for NbdListen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            Ok(Self::Unix(PathBuf::from(p)))
        } else if let Some(a) = s.strip_prefix("tcp:") {
            Ok(Self::Tcp(a.to_owned()))
        } else {
            Err(format!("{s:?}: expected unix:PATH or tcp:HOST:PORT"))
        }
    }
}

impl std::fmt::Display for NbdListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
            Self::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

struct Running {
    cancel: CancellationToken,
    tasks: JoinSet<()>,
}

/// The frontend of one volume.
pub struct Frontend {
    volume: Arc<Volume>,
    /// The configured listeners; a TCP port 0 is replaced by the port bound first, so a frontend stopped and
    /// started again (revert) comes back where its clients and the ready report expect it.
    listens: std::sync::Mutex<Vec<NbdListen>>,
    /// Each TCP listener stays bound from its first start to the engine's end, by bound address: closing it while
    /// the frontend is down (revert, restore) would let another process take the port in between, and the
    /// frontend could not come back. While down, clients wait in the listen backlog until it serves again.
    held_tcp: std::sync::Mutex<HashMap<String, std::net::TcpListener>>,
    config: NbdConfig,
    running: Mutex<Option<Running>>,
    /// Where the listeners and sessions run (`None`: the runtime that calls `start`).
    runtime: Option<tokio::runtime::Handle>,
}

impl Frontend {
    /// A stopped frontend.
    pub fn new(volume: Arc<Volume>, listens: Vec<NbdListen>, config: NbdConfig) -> Self {
        Self {
            volume,
            listens: std::sync::Mutex::new(listens),
            held_tcp: std::sync::Mutex::new(HashMap::new()),
            config,
            running: Mutex::new(None),
            runtime: None,
        }
    }

    /// Accept clients and run their sessions on `runtime` (the engine's data path thread,
    /// [`crate::io_runtime`]) whoever calls `start`: each listener is registered with that runtime's reactor, so
    /// every socket it accepts is driven there too.
    #[must_use]
    pub fn on_runtime(mut self, runtime: tokio::runtime::Handle) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// Endpoints as strings (after a start: the addresses actually bound).
    pub fn endpoints(&self) -> Vec<String> {
        self.listeners().iter().map(ToString::to_string).collect()
    }

    /// The listeners (after a start: TCP port 0 resolved to the port bound).
    pub fn listeners(&self) -> Vec<NbdListen> {
        self.listens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Is it serving?
    pub async fn is_up(&self) -> bool {
        self.running.lock().await.is_some()
    }

    /// Binds every listener and starts serving (no-op when up). An engine started without listeners runs without
    /// a frontend (maintenance: revert, restore, clone target) and refuses, so nobody can reach it for IO.
    pub async fn start(&self) -> Result<(), EngineError> {
        if self.listeners().is_empty() {
            return Err(EngineError::FailedPrecondition(format!(
                "volume {} runs without a frontend (no --nbd-listen): restart the engine with one to serve IO",
                self.volume.name
            )));
        }
        let mut running = self.running.lock().await;
        if running.is_some() {
            return Ok(());
        }
        let server = Arc::new(NbdServer::new(self.volume.clone(), self.config.clone()));
        let runtime = self
            .runtime
            .clone()
            .unwrap_or_else(tokio::runtime::Handle::current);
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut bound = Vec::new();
        for l in self.listeners() {
            match &l {
                NbdListen::Unix(path) => {
                    let bind_err = |e: std::io::Error| EngineError::Internal(format!("NBD socket: {e}"));
                    // Access (issue 40): no TLS here; the socket is 0600 (`bind_private`): only the engine's user
                    // (and root) can connect. A socket left by a killed engine is replaced.
                    let listener = corral_daemon::unix::bind_private(path).map_err(bind_err)?;
                    listener.set_nonblocking(true).map_err(bind_err)?;
                    let (s, c, p) = (server.clone(), cancel.clone(), path.clone());
                    tasks.spawn_on(
                        async move {
                            match UnixListener::from_std(listener) {
                                Ok(listener) => {
                                    if let Err(e) = s.serve_unix(listener, c).await {
                                        error!(socket = %p.display(), error = %e, "NBD frontend stopped");
                                    }
                                }
                                Err(e) => error!(socket = %p.display(), error = %e, "NBD socket not served"),
                            }
                            let _ = std::fs::remove_file(&p);
                        },
                        &runtime,
                    );
                    bound.push(l.clone());
                }
                NbdListen::Tcp(addr) => {
                    let listener = self.tcp_listener(addr).await?;
                    let local = listener
                        .local_addr()
                        .map_err(|e| EngineError::Internal(format!("NBD address {addr}: {e}")))?;
                    bound.push(NbdListen::Tcp(local.to_string()));
                    let (s, c, a) = (server.clone(), cancel.clone(), local.to_string());
                    tasks.spawn_on(
                        async move {
                            match TcpListener::from_std(listener) {
                                Ok(listener) => {
                                    if let Err(e) = s.serve_tcp(listener, c).await {
                                        error!(address = %a, error = %e, "NBD frontend stopped");
                                    }
                                }
                                Err(e) => error!(address = %a, error = %e, "NBD address not served"),
                            }
                        },
                        &runtime,
                    );
                }
            }
        }
        *self
            .listens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = bound;
        self.volume.frontend_up.store(true, Ordering::Release);
        info!(volume = %self.volume.name, endpoints = ?self.endpoints(), "NBD frontend up");
        *running = Some(Running { cancel, tasks });
        Ok(())
    }

    /// A non-blocking duplicate of the socket held for `addr`, binding it on first use (made a tokio listener on
    /// the runtime that serves it).
    async fn tcp_listener(&self, addr: &str) -> Result<std::net::TcpListener, EngineError> {
        let err = |e: std::io::Error| EngineError::Internal(format!("bind NBD address {addr}: {e}"));
        let held = self
            .held_tcp
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(addr)
            .map(std::net::TcpListener::try_clone)
            .transpose()
            .map_err(err)?;
        let socket = match held {
            Some(s) => s,
            None => {
                let bound = TcpListener::bind(addr)
                    .await
                    .map_err(err)?
                    .into_std()
                    .map_err(err)?;
                let local = bound.local_addr().map_err(err)?.to_string();
                let dup = bound.try_clone().map_err(err)?;
                self.held_tcp
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(local, bound);
                dup
            }
        };
        socket.set_nonblocking(true).map_err(err)?;
        Ok(socket)
    }

    /// Stops serving: accepts no new client (TCP ones wait in the backlog of the held socket until the next start;
    /// the unix socket is removed), lets in-flight requests finish, closes connections.
    pub async fn stop(&self) {
        let mut running = self.running.lock().await;
        if let Some(mut r) = running.take() {
            r.cancel.cancel();
            while r.tasks.join_next().await.is_some() {}
            self.volume.frontend_up.store(false, Ordering::Release);
            info!(volume = %self.volume.name, "NBD frontend down");
        }
    }
}
