//! Listeners: accept loops for unix sockets and TCP, one task per connection (handshake, then transmission),
//! and orderly shutdown through a [`CancellationToken`].

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use super::connection::{self, Transmission};
use super::handshake::{self, ExportInfo, HandshakeError, HandshakeOutcome};
use super::metrics::NbdCounters;
use super::wire::tflag;
use super::{BlockDevice, NbdConfig};

/// A client that has not finished negotiating by then is disconnected.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// The protocol's own limit for a payload is 2^32 - 1; clients (qemu) cap requests at 32 MiB.
const MAX_BLOCK_LIMIT: u32 = 32 << 20;

/// Why a listener stopped other than by cancellation.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The configuration cannot be served.
    #[error("invalid NBD configuration: {0}")]
    Config(String),
    /// The listener itself failed.
    #[error("NBD listener: {0}")]
    Listener(#[from] io::Error),
}

/// Serves one device as one NBD export to any number of clients, on any number of listeners.
pub struct NbdServer<D: BlockDevice> {
    inner: Arc<Inner<D>>,
}

impl<D: BlockDevice> Clone for NbdServer<D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<D> {
    device: Arc<D>,
    config: NbdConfig,
    counters: Arc<NbdCounters>,
}

impl<D: BlockDevice> NbdServer<D> {
    /// A server for `device`. `config.max_block` is clamped to 1..=32 MiB and `max_in_flight` to at least 1.
    pub fn new(device: Arc<D>, mut config: NbdConfig) -> Self {
        config.max_block = config.max_block.clamp(1, MAX_BLOCK_LIMIT);
        config.max_in_flight = config.max_in_flight.max(1);
        let inner = Inner {
            device,
            config,
            counters: Arc::default(),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The server's counters (shared with its connections; read them at any time).
    pub fn counters(&self) -> Arc<NbdCounters> {
        self.inner.counters.clone()
    }

    /// The transmission flags this server advertises.
    pub fn transmission_flags(&self) -> u16 {
        let mut flags = tflag::HAS_FLAGS
            | tflag::SEND_FLUSH
            | tflag::SEND_FUA
            | tflag::SEND_TRIM
            | tflag::SEND_WRITE_ZEROES
            | tflag::CAN_MULTI_CONN;
        if self.inner.config.read_only {
            flags |= tflag::READ_ONLY;
        }
        flags
    }

    /// Accepts clients on a unix socket until `cancel` fires, then waits for every connection of this server
    /// to end (their in-flight requests are completed and answered first).
    pub async fn serve_unix(
        &self,
        listener: UnixListener,
        cancel: CancellationToken,
    ) -> Result<(), ServeError> {
        let export = &self.inner.config.export_name;
        info!(addr = ?listener.local_addr().ok(), %export, "NBD serving on unix socket");
        let connections = TaskTracker::new();
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => break,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((stream, _)) => {
                    let span = info_span!("nbd_conn", transport = "unix");
                    self.spawn_connection(&connections, stream, span, &cancel);
                }
                Err(e) => accept_failed(&e).await,
            }
        }
        connections.close();
        connections.wait().await;
        Ok(())
    }

    /// Accepts clients on TCP until `cancel` fires, then waits for every connection of this server to end.
    pub async fn serve_tcp(
        &self,
        listener: TcpListener,
        cancel: CancellationToken,
    ) -> Result<(), ServeError> {
        let export = &self.inner.config.export_name;
        info!(addr = ?listener.local_addr().ok(), %export, "NBD serving on TCP");
        let connections = TaskTracker::new();
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => break,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((stream, peer)) => {
                    // Replies are batched by the writer already; Nagle would only add latency.
                    if let Err(e) = stream.set_nodelay(true) {
                        debug!(%peer, error = %e, "TCP_NODELAY not set");
                    }
                    let span = info_span!("nbd_conn", transport = "tcp", %peer);
                    self.spawn_connection(&connections, stream, span, &cancel);
                }
                Err(e) => accept_failed(&e).await,
            }
        }
        connections.close();
        connections.wait().await;
        Ok(())
    }

    /// Serves one already-connected client over any byte stream (a socketpair, a TLS stream, a test harness)
    /// until it disconnects or `cancel` fires. The listeners use the same path with owned socket halves.
    pub async fn serve_stream<S>(&self, stream: S, cancel: CancellationToken)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        self.run_connection(stream, tokio::io::split, cancel).await;
    }

    fn spawn_connection<S: SplitStream>(
        &self,
        connections: &TaskTracker,
        stream: S,
        span: tracing::Span,
        cancel: &CancellationToken,
    ) {
        let server = self.clone();
        let cancel = cancel.clone();
        connections.spawn(
            async move { server.run_connection(stream, S::split_owned, cancel).await }.instrument(span),
        );
    }

    async fn run_connection<S, R, W>(
        &self,
        mut stream: S,
        split: impl FnOnce(S) -> (R, W),
        cancel: CancellationToken,
    ) where
        S: AsyncRead + AsyncWrite + Unpin,
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let counters = &self.inner.counters;
        counters.connections_accepted.fetch_add(1, Ordering::Relaxed);
        counters.connections_active.fetch_add(1, Ordering::Relaxed);
        let _active = ActiveGuard(counters.clone());

        let config = &self.inner.config;
        let export = ExportInfo {
            name: config.export_name.clone(),
            description: config.description.clone(),
            size: self.inner.device.size(),
            transmission_flags: self.transmission_flags(),
            min_block: 1,
            preferred_block: 4096,
            max_block: config.max_block,
        };
        let negotiation = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake::negotiate(&mut stream, &export));
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            o = negotiation => o,
        };
        let negotiated = match outcome {
            Ok(Ok(HandshakeOutcome::Transmission(n))) => n,
            Ok(Ok(HandshakeOutcome::Aborted)) => {
                debug!("client aborted the negotiation");
                return;
            }
            Ok(Err(HandshakeError::Io(e))) if e.kind() == io::ErrorKind::UnexpectedEof => {
                counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                debug!("client closed the connection during the handshake");
                return;
            }
            Ok(Err(e)) => {
                counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                warn!(error = %e, "closing connection: handshake failed");
                return;
            }
            Err(_) => {
                counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                warn!(timeout = ?HANDSHAKE_TIMEOUT, "closing connection: handshake not finished in time");
                return;
            }
        };
        debug!(?negotiated, "transmission phase");
        let t = Transmission {
            negotiated,
            read_only: config.read_only,
            max_block: config.max_block,
            max_in_flight: config.max_in_flight,
        };
        let (reader, writer) = split(stream);
        let device = self.inner.device.clone();
        match connection::transmit(device, t, reader, writer, counters.clone(), cancel).await {
            Ok(()) => debug!("connection closed"),
            Err(e) => warn!(error = %e, "connection closed on error"),
        }
    }
}

async fn accept_failed(e: &io::Error) {
    warn!(error = %e, "accept failed");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

struct ActiveGuard(Arc<NbdCounters>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.connections_active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A stream that splits into independently owned halves, so reader and writer run as separate tasks.
trait SplitStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn split_owned(self) -> (Self::Read, Self::Write);
}

impl SplitStream for TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split_owned(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl SplitStream for UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn split_owned(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}
