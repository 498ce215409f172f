//! The replica side: accepts connections and serves a [`BlockBackend`] over them.
//!
//! Per connection: one reader task that admits at most `window` requests at a time (it stops reading
//! when the window is full) and one writer task that sends replies as they complete, flushing when its
//! queue drains. Blocking backend calls run on a fixed pool of IO threads fed by one bounded queue;
//! payload buffers come from a shared [`BufferPool`].

mod connection;
mod io_pool;

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
use crate::transport::{BoxRead, BoxWrite};
use io_pool::IoPool;

/// Server tuning. `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests in flight per connection before the reader stops reading (default 128).
    pub window: usize,
    /// IO worker threads running backend calls (default 8).
    pub io_threads: usize,
    /// Jobs queued for the workers across all connections before readers wait (default 1024).
    pub io_queue: usize,
    /// Idle payload-buffer capacity kept for reuse (default 64 MiB).
    pub buffer_pool_bytes: usize,
    /// On shutdown, how long a connection may take to deliver its in-flight replies (default 10 s).
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            window: 128,
            io_threads: 8,
            io_queue: 1024,
            buffer_pool_bytes: 64 << 20,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// State shared by every connection of one server.
pub(crate) struct Shared {
    backend: Arc<dyn BlockBackend>,
    cfg: ServerConfig,
    io: IoPool,
    buffers: BufferPool,
    metrics: Arc<ServerMetrics>,
}

/// A data-protocol server for one backend. It can serve several listeners at once (TCP and unix).
pub struct DataServer {
    shared: Arc<Shared>,
}

impl DataServer {
    /// Starts the IO worker threads.
    pub fn new(backend: Arc<dyn BlockBackend>, cfg: ServerConfig) -> io::Result<Self> {
        let buffers = BufferPool::new(cfg.buffer_pool_bytes);
        let metrics = Arc::new(ServerMetrics::default());
        let io = IoPool::start(
            backend.clone(),
            buffers.clone(),
            metrics.clone(),
            cfg.io_threads,
            cfg.io_queue,
        )?;
        Ok(Self {
            shared: Arc::new(Shared {
                backend,
                cfg,
                io,
                buffers,
                metrics,
            }),
        })
    }

    /// The server's counters.
    pub fn metrics(&self) -> Arc<ServerMetrics> {
        self.shared.metrics.clone()
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

    /// Stops the IO workers and joins them. Call after every `serve_*` returned.
    pub async fn shutdown(self) {
        let Ok(mut shared) = Arc::try_unwrap(self.shared) else {
            // Still serving elsewhere: dropping our handle is all we can do.
            return;
        };
        let threads = shared.io.close();
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }

    async fn accept_loop(&self, listener: impl Acceptor, cancel: CancellationToken) {
        let tasks = TaskTracker::new();
        let mut conn_seq = 0u64;
        loop {
            let accepted = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                a = listener.accept_boxed() => a,
            };
            match accepted {
                Ok((read, write, peer)) => {
                    conn_seq += 1;
                    self.shared.metrics.connections_accepted.fetch_add(1, Relaxed);
                    let span = tracing::info_span!("data_conn", peer = %peer, conn = conn_seq);
                    let shared = self.shared.clone();
                    let cancel = cancel.clone();
                    tasks.spawn(
                        async move {
                            shared.metrics.connections_active.fetch_add(1, Relaxed);
                            tracing::debug!("connection accepted");
                            connection::serve_connection(shared.clone(), read, write, cancel).await;
                            shared.metrics.connections_active.fetch_sub(1, Relaxed);
                            tracing::debug!("connection closed");
                        }
                        .instrument(span),
                    );
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

/// A listener whose connections are split into boxed halves (one allocation per connection).
trait Acceptor {
    async fn accept_boxed(&self) -> io::Result<(BoxRead, BoxWrite, String)>;
}

impl Acceptor for TcpListener {
    async fn accept_boxed(&self) -> io::Result<(BoxRead, BoxWrite, String)> {
        let (stream, peer) = self.accept().await?;
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        Ok((Box::new(r), Box::new(w), peer.to_string()))
    }
}

impl Acceptor for UnixListener {
    async fn accept_boxed(&self) -> io::Result<(BoxRead, BoxWrite, String)> {
        let (stream, peer) = self.accept().await?;
        let peer = match peer.as_pathname() {
            Some(p) => format!("unix:{}", p.display()),
            None => "unix".to_owned(),
        };
        let (r, w) = stream.into_split();
        Ok((Box::new(r), Box::new(w), peer))
    }
}
