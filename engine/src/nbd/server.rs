//! Listeners: accept loops for unix sockets and TCP, one task per connection (handshake, then transmission),
//! and orderly shutdown through a [`CancellationToken`].

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use corral_tls::TlsServerStream;
use corral_tls::rustls::ServerConfig;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::time::error::Elapsed;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use super::connection::{self, Transmission};
use super::handshake::{self, ExportInfo, HandshakeError, HandshakeOutcome, Negotiated, Tls};
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
    /// Peers refused for want of TLS or at the TLS handshake, logged once each.
    refused: corral_tls::RefusedPeers,
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
            refused: corral_tls::RefusedPeers::default(),
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

    /// Accepts clients on TCP until `cancel` fires, then waits for every connection of this server to end. With
    /// [`NbdConfig::tls`](super::NbdConfig::tls) every client must start TLS first (see `handshake`).
    pub async fn serve_tcp(
        &self,
        listener: TcpListener,
        cancel: CancellationToken,
    ) -> Result<(), ServeError> {
        let export = &self.inner.config.export_name;
        let tls = self.inner.config.tls.clone();
        info!(addr = ?listener.local_addr().ok(), %export, tls = tls.is_some(), "NBD serving on TCP");
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
                    match &tls {
                        None => self.spawn_connection(&connections, stream, span, &cancel),
                        Some(config) => {
                            let (server, config, cancel) = (self.clone(), config.clone(), cancel.clone());
                            connections.spawn(
                                async move { server.run_tls_connection(stream, peer, config, cancel).await }
                                    .instrument(span),
                            );
                        }
                    }
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
        let _active = self.connection_started();
        let export = self.export_info();
        let negotiation = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake::negotiate(&mut stream, &export));
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            o = negotiation => o,
        };
        let outcome = outcome.map(|o| {
            o.map(|o| match o {
                HandshakeOutcome::Transmission(n) => Some(n),
                HandshakeOutcome::Aborted | HandshakeOutcome::StartTls => None,
            })
        });
        if let Some(negotiated) = self.settle(outcome) {
            self.transmit(stream, split, negotiated, cancel).await;
        }
    }

    /// A client of a TLS-only TCP listener: plaintext negotiation until NBD_OPT_STARTTLS, the TLS handshake
    /// (client certificate required), negotiation again inside TLS, then transmission over the TLS session. The
    /// session is split with `tokio::io::split`: reader and writer stay in this one task, so its lock is never
    /// contended.
    async fn run_tls_connection(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        config: Arc<ServerConfig>,
        cancel: CancellationToken,
    ) {
        let _active = self.connection_started();
        let export = self.export_info();
        let negotiation =
            tokio::time::timeout(HANDSHAKE_TIMEOUT, self.negotiate_tls(tcp, peer, &config, &export));
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            o = negotiation => o,
        };
        if let Some((stream, negotiated)) = self.settle(outcome) {
            self.transmit(stream, tokio::io::split, negotiated, cancel).await;
        }
    }

    async fn negotiate_tls(
        &self,
        mut tcp: TcpStream,
        peer: SocketAddr,
        config: &Arc<ServerConfig>,
        export: &ExportInfo,
    ) -> Result<Option<(TlsServerStream, Negotiated)>, HandshakeError> {
        let mut n = handshake::greet(&mut tcp, Tls::Required).await?;
        let plain = handshake::negotiate_options(&mut tcp, export, &mut n).await;
        if n.refused_without_tls > 0 && !matches!(plain, Ok(HandshakeOutcome::StartTls)) {
            let err = io::Error::new(
                io::ErrorKind::PermissionDenied,
                "NBD client negotiated without TLS (NBD_OPT_STARTTLS); this listener requires it",
            );
            self.inner.refused.log(Some(peer.ip()), &peer.to_string(), &err);
            return Err(HandshakeError::Refused(err));
        }
        match plain? {
            HandshakeOutcome::StartTls => {}
            HandshakeOutcome::Aborted | HandshakeOutcome::Transmission(_) => return Ok(None),
        }
        let mut tls = corral_tls::handshake(config, tcp, peer, &self.inner.refused)
            .await
            .map_err(HandshakeError::Refused)?;
        n.start_tls();
        match handshake::negotiate_options(&mut tls, export, &mut n).await? {
            HandshakeOutcome::Transmission(negotiated) => Ok(Some((tls, negotiated))),
            HandshakeOutcome::Aborted | HandshakeOutcome::StartTls => Ok(None),
        }
    }

    /// Counts a new connection; the guard counts it gone.
    fn connection_started(&self) -> ActiveGuard {
        let counters = &self.inner.counters;
        counters.connections_accepted.fetch_add(1, Ordering::Relaxed);
        counters.connections_active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(counters.clone())
    }

    fn export_info(&self) -> ExportInfo {
        let config = &self.inner.config;
        ExportInfo {
            name: config.export_name.clone(),
            description: config.description.clone(),
            size: self.inner.device.size(),
            transmission_flags: self.transmission_flags(),
            min_block: 1,
            preferred_block: 4096,
            max_block: config.max_block,
        }
    }

    /// Logs and counts how a negotiation ended; `Some` when transmission starts, `None` when the connection
    /// closes.
    fn settle<T>(&self, outcome: Result<Result<Option<T>, HandshakeError>, Elapsed>) -> Option<T> {
        let failures = &self.inner.counters.handshake_failures;
        match outcome {
            Ok(Ok(Some(t))) => return Some(t),
            Ok(Ok(None)) => debug!("client aborted the negotiation"),
            Ok(Err(HandshakeError::Io(e))) if e.kind() == io::ErrorKind::UnexpectedEof => {
                failures.fetch_add(1, Ordering::Relaxed);
                debug!("client closed the connection during the handshake");
            }
            Ok(Err(HandshakeError::Refused(e))) => {
                // Logged where it was refused, once per peer address.
                failures.fetch_add(1, Ordering::Relaxed);
                debug!(error = %e, "client refused");
            }
            Ok(Err(e)) => {
                failures.fetch_add(1, Ordering::Relaxed);
                warn!(error = %e, "closing connection: handshake failed");
            }
            Err(_) => {
                failures.fetch_add(1, Ordering::Relaxed);
                warn!(timeout = ?HANDSHAKE_TIMEOUT, "closing connection: handshake not finished in time");
            }
        }
        None
    }

    async fn transmit<S, R, W>(
        &self,
        stream: S,
        split: impl FnOnce(S) -> (R, W),
        negotiated: Negotiated,
        cancel: CancellationToken,
    ) where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        debug!(?negotiated, "transmission phase");
        let config = &self.inner.config;
        let t = Transmission {
            negotiated,
            read_only: config.read_only,
            max_block: config.max_block,
            max_in_flight: config.max_in_flight,
        };
        let (reader, writer) = split(stream);
        let device = self.inner.device.clone();
        let counters = self.inner.counters.clone();
        match connection::transmit(device, t, reader, writer, counters, cancel).await {
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
