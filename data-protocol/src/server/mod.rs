//! The replica side: accepts connections and serves a [`BlockBackend`] over them.
//!
//! Each connection runs its requests to completion on its own OS thread (`connection`): it reads a
//! batch, runs it against the backend in order and writes the batch's replies with one call; flushes go
//! to a per-connection flusher thread. There is no hand-off between tasks on the data path unless the server
//! is given an [`IoPool`] ([`ServerConfig::io_pool`]): then what the backend cannot answer without waiting
//! for the device runs on the pool's threads, up to `io_depth` requests per connection at once, replies
//! written as they complete (`io_pool`). The async side only accepts connections and, on cancel, shuts
//! their read side down.

mod connection;
mod fence;
mod io_pool;
mod request;
mod stream;

pub use io_pool::IoPool;

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::backend::BlockBackend;
use crate::metrics::ServerMetrics;
use crate::pool::BufferPool;
use request::Executor;
use stream::Stream;

/// Server tuning. `Default` gives the documented defaults.
#[derive(Clone)]
pub struct ServerConfig {
    /// Requests a connection runs before it writes their replies, and flushes it queues for its flusher
    /// before it stops reading (default 128).
    pub window: usize,
    /// Idle payload-buffer capacity kept for reuse (default 64 MiB).
    pub buffer_pool_bytes: usize,
    /// How long a write of replies may block on a peer that does not read before the connection is
    /// dropped; bounds how long a shutdown waits for such a peer (default 10 s).
    pub shutdown_grace: Duration,
    /// Threads that run requests the backend cannot answer without waiting for the device, several per
    /// connection at once (`None`, the default: every request runs on its connection's thread). One pool
    /// can serve many servers.
    pub io_pool: Option<Arc<IoPool>>,
    /// Requests of one connection at the IO pool at once (default 64); the connection stops reading while
    /// all are in use.
    pub io_depth: usize,
    /// Mutual TLS on TCP connections (`None`, the default: plaintext). With it, a TCP peer that does not complete
    /// the handshake within [`TLS_HANDSHAKE_TIMEOUT`] with a certificate the config accepts is dropped before any
    /// frame is read. Unix sockets are never wrapped: their file mode guards them.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// How long a TCP peer may take to complete the TLS handshake (a stalled or slow peer holds no thread, only a
/// task, until then).
pub const TLS_HANDSHAKE_TIMEOUT: Duration = corral_tls::HANDSHAKE_TIMEOUT;

impl std::fmt::Debug for ServerConfig {
    // The TLS config only as on or off: it is long, and daemons log their effective config.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("window", &self.window)
            .field("buffer_pool_bytes", &self.buffer_pool_bytes)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("io_pool", &self.io_pool)
            .field("io_depth", &self.io_depth)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            window: 128,
            buffer_pool_bytes: 64 << 20,
            shutdown_grace: Duration::from_secs(10),
            io_pool: None,
            io_depth: 64,
            tls: None,
        }
    }
}

/// State shared by every connection of one server.
pub(crate) struct Shared {
    cfg: ServerConfig,
    exec: Arc<Executor>,
    /// Engine generations of the open connections ([`fence`]).
    fence: fence::Fence,
    /// Peers already logged for a refused TLS handshake.
    refused: corral_tls::RefusedPeers,
}

/// A data-protocol server for one backend. It can serve several listeners at once (TCP and unix).
pub struct DataServer {
    shared: Arc<Shared>,
}

impl DataServer {
    /// A server for `backend` (no thread runs until a connection arrives).
    pub fn new(backend: Arc<dyn BlockBackend>, cfg: ServerConfig) -> io::Result<Self> {
        let exec = Arc::new(Executor {
            backend,
            buffers: BufferPool::new(cfg.buffer_pool_bytes),
            metrics: Arc::new(ServerMetrics::default()),
        });
        Ok(Self {
            shared: Arc::new(Shared {
                cfg,
                exec,
                fence: fence::Fence::default(),
                refused: corral_tls::RefusedPeers::default(),
            }),
        })
    }

    /// The server's counters.
    pub fn metrics(&self) -> Arc<ServerMetrics> {
        self.shared.exec.metrics.clone()
    }

    /// Serves TCP connections until `cancel`; then stops accepting, lets every connection finish its
    /// in-flight requests, and returns once all connection tasks are joined.
    pub async fn serve_tcp(&self, listener: TcpListener, cancel: CancellationToken) {
        self.accept_loop(listener, cancel).await;
    }

    /// Like [`serve_tcp`](Self::serve_tcp) for a unix socket.
    pub async fn serve_unix(&self, listener: UnixListener, cancel: CancellationToken) {
        self.accept_loop(listener, cancel).await;
    }

    /// Releases the server. Call after every `serve_*` returned (they join their connection threads).
    pub async fn shutdown(self) {
        drop(self.shared);
    }

    async fn accept_loop(&self, listener: impl Acceptor, cancel: CancellationToken) {
        let tasks = TaskTracker::new();
        let mut conn_seq = 0u64;
        let tls = self.shared.cfg.tls.clone().map(tokio_rustls::TlsAcceptor::from);
        loop {
            let accepted = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                a = listener.accept_boxed(tls.is_some()) => a,
            };
            match accepted {
                Ok((accepted, peer)) => {
                    conn_seq += 1;
                    self.shared
                        .exec
                        .metrics
                        .connections_accepted
                        .fetch_add(1, Relaxed);
                    let span = tracing::info_span!("data_conn", peer = %peer, conn = conn_seq);
                    let (shared, cancel) = (self.shared.clone(), cancel.clone());
                    let conn = match (accepted, &tls) {
                        (Accepted::Ready(stream), _) => {
                            serve_connection(shared, stream, conn_seq, &span, cancel)
                        }
                        (Accepted::Tcp(tcp), Some(tls)) => {
                            let tls = tls.clone();
                            serve_tls_connection(shared, tls, tcp, peer, conn_seq, span.clone(), cancel)
                        }
                        (Accepted::Tcp(_), None) => {
                            unreachable!("a TCP stream is handed over raw only for TLS")
                        }
                    };
                    tasks.spawn(conn.instrument(span));
                }
                Err(err) => {
                    // Usually EMFILE/ENFILE: back off instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
            }
        }
        tasks.close();
        tasks.wait().await;
    }
}

/// Serves one accepted connection to its end (see [`start_connection`]).
fn serve_connection(
    shared: Arc<Shared>,
    stream: Stream,
    seq: u64,
    span: &tracing::Span,
    cancel: CancellationToken,
) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    match start_connection(shared, stream, seq, span.clone(), cancel) {
        Ok(conn) => Box::pin(conn),
        Err(err) => {
            tracing::warn!(parent: span, error = %err, "cannot serve connection");
            Box::pin(std::future::ready(()))
        }
    }
}

/// Completes the TLS handshake of a TCP connection (bounded by [`TLS_HANDSHAKE_TIMEOUT`] and `cancel`), then
/// serves it. A refused peer is logged once per address; no frame of it is read.
fn serve_tls_connection(
    shared: Arc<Shared>,
    tls: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: String,
    seq: u64,
    span: tracing::Span,
    cancel: CancellationToken,
) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        let peer_ip = tcp.peer_addr().map(|a| a.ip()).ok();
        let handshake = tokio::select! {
            () = cancel.cancelled() => return,
            r = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(tcp)) => r,
        };
        let stream = match handshake {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => return shared.refused.log(peer_ip, &peer, &err),
            Err(_) => {
                let err = std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake not done in time");
                return shared.refused.log(peer_ip, &peer, &err);
            }
        };
        let (tcp, session) = stream.into_inner();
        let stream = match tcp.into_std() {
            Ok(tcp) => Stream::Tls(stream::TlsSocket::new(tcp, session)),
            Err(err) => return tracing::warn!(error = %err, "cannot serve connection"),
        };
        serve_connection(shared, stream, seq, &span, cancel).await;
    })
}

/// Starts the connection's thread; the returned future ends when the thread did, and on `cancel`
/// shuts the socket's read side down so the thread answers what it read and stops.
fn start_connection(
    shared: Arc<Shared>,
    stream: Stream,
    seq: u64,
    span: tracing::Span,
    cancel: CancellationToken,
) -> io::Result<impl Future<Output = ()> + use<>> {
    stream.prepare(shared.cfg.shutdown_grace)?;
    let mut control = SocketGuard(Some(stream.try_clone()?));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(format!("dp-conn-{seq}"))
        .spawn(move || {
            let _span = span.enter();
            let metrics = &shared.exec.metrics;
            metrics.connections_active.fetch_add(1, Relaxed);
            tracing::debug!("connection accepted");
            connection::serve(&shared, stream);
            metrics.connections_active.fetch_sub(1, Relaxed);
            tracing::debug!("connection closed");
            drop(done_tx);
        })?;
    Ok(async move {
        let mut done = done_rx;
        tokio::select! {
            _ = &mut done => {}
            () = cancel.cancelled() => {
                if let Some(s) = &control.0 {
                    s.shutdown(std::net::Shutdown::Read);
                }
                let _ = done.await;
            }
        }
        // The thread is done: close our handle without touching the socket.
        drop(control.0.take());
    })
}

/// Shuts the socket down when dropped: a connection task dropped without finishing (its runtime was shut
/// down) must not leave the thread serving, nor the peer connected.
struct SocketGuard(Option<Stream>);

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Serves `backend` on a TCP listener until `cancel`, then joins every connection and IO worker.
pub async fn serve_tcp(
    listener: TcpListener,
    backend: Arc<dyn BlockBackend>,
    cfg: ServerConfig,
    cancel: CancellationToken,
) -> io::Result<()> {
    let server = DataServer::new(backend, cfg)?;
    server.serve_tcp(listener, cancel).await;
    server.shutdown().await;
    Ok(())
}

/// Serves `backend` on a unix-socket listener until `cancel`, then joins every connection and IO worker.
pub async fn serve_unix(
    listener: UnixListener,
    backend: Arc<dyn BlockBackend>,
    cfg: ServerConfig,
    cancel: CancellationToken,
) -> io::Result<()> {
    let server = DataServer::new(backend, cfg)?;
    server.serve_unix(listener, cancel).await;
    server.shutdown().await;
    Ok(())
}

/// An accepted connection: ready to serve on a blocking socket, or a TCP stream whose TLS handshake comes first.
enum Accepted {
    Ready(Stream),
    Tcp(tokio::net::TcpStream),
}

/// A listener whose connections are handed over as blocking sockets (or, for TLS, as async TCP streams).
trait Acceptor {
    async fn accept_boxed(&self, tls: bool) -> io::Result<(Accepted, String)>;
}

impl Acceptor for TcpListener {
    async fn accept_boxed(&self, tls: bool) -> io::Result<(Accepted, String)> {
        let (stream, peer) = self.accept().await?;
        stream.set_nodelay(true)?;
        let accepted = if tls {
            Accepted::Tcp(stream)
        } else {
            Accepted::Ready(Stream::Tcp(stream.into_std()?))
        };
        Ok((accepted, peer.to_string()))
    }
}

impl Acceptor for UnixListener {
    async fn accept_boxed(&self, _tls: bool) -> io::Result<(Accepted, String)> {
        let (stream, peer) = self.accept().await?;
        let peer = match peer.as_pathname() {
            Some(p) => format!("unix:{}", p.display()),
            None => "unix".to_owned(),
        };
        Ok((Accepted::Ready(Stream::Unix(stream.into_std()?)), peer))
    }
}
