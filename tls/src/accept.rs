//! Accepting TCP connections under mutual TLS for servers that take ready streams (axum's `serve`; tonic can wrap
//! [`TcpIncoming::accept`] the same way). Each accepted socket handshakes in its own task, bounded by
//! [`HANDSHAKE_TIMEOUT`], so a stalled, slow or garbage-speaking peer holds a task for at most that long and never
//! delays anyone else; only a completed handshake reaches the server. A refused peer is logged once per address
//! ([`RefusedPeers`]). Without a config the listener's sockets are handed over as they are (plaintext).

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::either::Either;
use tokio_util::task::AbortOnDropHandle;

/// How long a TCP peer may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once per listener; past that, new connections wait in the kernel's backlog.
const MAX_HANDSHAKES: usize = 256;

/// How often, at most, a listener warns that it is at [`MAX_HANDSHAKES`] (a flood must not flood the log).
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Addresses remembered for [`RefusedPeers`] at most; past that a refusal is logged at debug level only (bounded
/// memory against a scan from many addresses).
const MAX_REMEMBERED: usize = 4096;

/// Peers refused at the TLS handshake, so each address is logged once: a stranger retrying in a loop must not
/// flood the log, and the first refusal is what an operator needs to see.
#[derive(Default)]
pub struct RefusedPeers {
    seen: Mutex<HashSet<IpAddr>>,
}

impl RefusedPeers {
    /// Logs a refused handshake: a warning the first time for `ip`, debug after.
    pub fn log(&self, ip: Option<IpAddr>, peer: &str, err: &io::Error) {
        let first = ip.is_some_and(|ip| {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            seen.len() < MAX_REMEMBERED && seen.insert(ip)
        });
        if first {
            tracing::warn!(peer, error = %err, "TLS handshake refused; no data touched (logged once per peer address)");
        } else {
            tracing::debug!(peer, error = %err, "TLS handshake refused");
        }
    }
}

/// A TLS session a server accepted on TCP.
pub type TlsServerStream = TlsStream<TcpStream>;

/// An accepted connection: the TCP socket itself (plaintext) or its TLS session.
pub type ServerStream = Either<TcpStream, TlsServerStream>;

/// The server side of one TLS handshake on an accepted socket, bounded by [`HANDSHAKE_TIMEOUT`]; a refusal is
/// logged through `refused` (once per address) and returned. Run it in the connection's own task, never in an
/// accept loop: [`TcpIncoming`] does, and so does a server that negotiates TLS inside its own protocol (NBD's
/// STARTTLS).
pub async fn handshake(
    config: &Arc<rustls::ServerConfig>,
    tcp: TcpStream,
    peer: SocketAddr,
    refused: &RefusedPeers,
) -> io::Result<TlsServerStream> {
    let err =
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, TlsAcceptor::from(config.clone()).accept(tcp)).await {
            Ok(Ok(tls)) => return Ok(tls),
            Ok(Err(err)) => err,
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "TLS handshake not done in time"),
        };
    refused.log(Some(peer.ip()), &peer.to_string(), &err);
    Err(err)
}

/// A TCP listener whose connections come out ready to serve: with a TLS config, only those whose handshake
/// completed (see the module doc).
pub struct TcpIncoming {
    local: SocketAddr,
    inner: Inner,
}

enum Inner {
    Plain(TcpListener),
    Tls {
        ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
        /// The accept loop and, through its `JoinSet`, every handshake in progress end when this is dropped.
        _accepting: AbortOnDropHandle<()>,
    },
}

impl TcpIncoming {
    /// Wraps `listener`; with `tls`, starts accepting at once (in a task this value owns).
    pub fn new(listener: TcpListener, tls: Option<Arc<rustls::ServerConfig>>) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let inner = match tls {
            None => Inner::Plain(listener),
            Some(config) => {
                let (tx, ready) = mpsc::channel(16);
                Inner::Tls {
                    ready,
                    _accepting: AbortOnDropHandle::new(tokio::spawn(accept_loop(listener, config, tx))),
                }
            }
        };
        Ok(TcpIncoming { local, inner })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Whether connections are TLS sessions.
    pub fn is_tls(&self) -> bool {
        matches!(self.inner, Inner::Tls { .. })
    }

    /// The next connection ready to serve. Failures to accept are logged and retried, never returned.
    pub async fn accept(&mut self) -> (ServerStream, SocketAddr) {
        match &mut self.inner {
            Inner::Plain(listener) => {
                let (tcp, peer) = accept_tcp(listener).await;
                (Either::Left(tcp), peer)
            }
            Inner::Tls { ready, .. } => match ready.recv().await {
                Some((tls, peer)) => (Either::Right(tls), peer),
                // The accept loop never ends while `ready` lives (it only stops when aborted).
                None => std::future::pending().await,
            },
        }
    }
}

impl axum::serve::Listener for TcpIncoming {
    type Io = ServerStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        TcpIncoming::accept(self).await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// Accepts one TCP connection, riding out transient failures (a peer that reset before `accept`, or EMFILE, after
/// which it backs off instead of spinning).
async fn accept_tcp(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let _ = tcp.set_nodelay(true);
                return (tcp, peer);
            }
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                ) => {}
            Err(err) => {
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let refused = Arc::new(RefusedPeers::default());
    let mut handshakes = JoinSet::new();
    let mut warned_full: Option<Instant> = None;
    loop {
        if handshakes.len() >= MAX_HANDSHAKES {
            // Bounded: every one of them ends within HANDSHAKE_TIMEOUT, so a waiting client is accepted by then.
            if warned_full.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
                tracing::warn!(
                    in_progress = MAX_HANDSHAKES,
                    "TLS handshakes in progress at the cap; new connections wait in the backlog until one ends \
                     (each within {HANDSHAKE_TIMEOUT:?})"
                );
                warned_full = Some(Instant::now());
            }
            handshakes.join_next().await;
            continue;
        }
        let (tcp, peer) = tokio::select! {
            accepted = accept_tcp(&listener) => accepted,
            Some(_) = handshakes.join_next() => continue,
        };
        let (config, ready, refused) = (config.clone(), ready.clone(), refused.clone());
        handshakes.spawn(async move {
            if let Ok(tls) = handshake(&config, tcp, peer, &refused).await {
                let _ = ready.send((tls, peer)).await;
            }
        });
    }
}
