//! The engine side: a pipelined client to one replica over several connections.
//!
//! Requests from any number of tasks share a fixed slot table (`connections × window` slots;
//! callers wait for a free one), are spread round-robin over the connections, and are matched to their
//! replies by id. Each connection has a writer task (batches frames, flushes when its queue drains) and
//! a reader task; a pinger checks every connection each `ping_interval`. The first timeout, protocol
//! error or lost connection puts the whole client in a failed state: every pending and later request
//! returns that error at once, and the engine marks the replica ERR.
//!
//! Write data travels as an owned, shared buffer ([`Bytes`]): [`DataClient::write_bytes`] sends the
//! caller's buffer itself (the engine passes one buffer to every replica), [`DataClient::write`] copies a
//! borrowed slice into a pooled buffer first. Read data is copied out of a pooled buffer after the reply
//! arrived: writing into the caller's `&mut [u8]` would need the slice to outlive the request, which a
//! borrow cannot promise (the caller's future may be dropped, or leaked, with the request still on the
//! wire).

mod connection;
mod slots;

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use crate::backend::{ErrorKind, VolumeInfo};
use crate::codec::{FrameHeader, FrameKind, MAX_IO, decode_ranges};
use crate::pool::BufferPool;
use connection::Outgoing;
use slots::{Answer, SlotTable};

/// Client tuning. `Default` gives the documented defaults.
#[derive(Clone)]
pub struct ClientConfig {
    /// TCP/unix connections to the replica (default 2).
    pub connections: usize,
    /// Requests in flight per connection (default 128); callers wait beyond `connections × window`.
    pub window: usize,
    /// Deadline for each request from the moment it is queued for sending (default 8 s).
    pub request_timeout: Duration,
    /// Interval between liveness pings on each connection (default 2 s).
    pub ping_interval: Duration,
    /// The runtime that connects, owns the sockets and runs the connections' reader, writer and ping tasks
    /// (default: the caller's). The engine puts every replica client and its NBD sessions on one
    /// current-thread runtime, so a reply wakes the waiting NBD session on the same thread instead of waking a
    /// second worker (a futex wake-up and an IPI for a microsecond of work; `bench/datapath`).
    /// A socket is driven by the runtime it was registered with, so the whole connect runs there.
    pub runtime: Option<tokio::runtime::Handle>,
    /// The engine generation presented in every connection's `Hello` (default 0: none). A replica that has
    /// accepted a higher one refuses the connection ([`ClientError::Fenced`]), and closes every connection of
    /// a lower one when a higher one connects.
    pub generation: u64,
    /// Mutual TLS on TCP connections (`None`, the default: plaintext): the client presents its certificate and
    /// accepts only a replica whose certificate names the host it dialled (`HOST` of `HOST:PORT`, a DNS name or
    /// an IP). A refused handshake fails the connect ([`ClientError::Io`]). Unix sockets are never wrapped.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for ClientConfig {
    // The TLS config only as on or off: it is long, and daemons log their effective config.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("connections", &self.connections)
            .field("window", &self.window)
            .field("request_timeout", &self.request_timeout)
            .field("ping_interval", &self.ping_interval)
            .field("runtime", &self.runtime)
            .field("generation", &self.generation)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connections: 2,
            window: 128,
            request_timeout: Duration::from_secs(8),
            ping_interval: Duration::from_secs(2),
            runtime: None,
            generation: 0,
            tls: None,
        }
    }
}

/// Why a request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The replica answered with an error.
    #[error("replica error ({kind:?}): {message}")]
    Remote { kind: ErrorKind, message: String },
    /// The replica is out of space.
    #[error("replica is out of space")]
    NoSpace,
    /// The read reaches past the end of the volume.
    #[error("read past the end of the volume")]
    Eof,
    /// A request missed its deadline; the client is failed.
    #[error("request timed out")]
    Timeout,
    /// A connection was lost (or the client was closed); the client is failed.
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The replica broke the protocol; the client is failed.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The request cannot be sent as asked (e.g. longer than [`MAX_IO`]).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Connecting failed.
    #[error("connect failed: {0}")]
    Io(Arc<io::Error>),
    /// The replica has accepted engine generation `replica`, higher than this client's `generation` (0: the
    /// client presented none): this engine is stale and must not serve the volume; the client is failed.
    #[error("fenced by generation {replica} > {generation}: {message}")]
    Fenced {
        replica: u64,
        generation: u64,
        message: String,
    },
}

impl From<io::Error> for ClientError {
    fn from(err: io::Error) -> Self {
        Self::Io(Arc::new(err))
    }
}

/// The answer to [`DataClient::block_status`]: what is allocated in `[offset, offset + covered)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStatus {
    /// Bytes from the request's offset the answer describes: the whole request, or less (never 0) when
    /// the replica cut a long list; ask again from `offset + covered` for the rest.
    pub covered: u64,
    /// Allocated byte ranges within the covered span, ascending and non-overlapping; the rest of the span
    /// is holes (reads as zeros).
    pub allocated: Vec<Range<u64>>,
}

/// State shared by the client handles and its background tasks.
pub(crate) struct Core {
    cfg: ClientConfig,
    addr: String,
    slots: SlotTable,
    outgoing: Vec<mpsc::Sender<Outgoing>>,
    next_conn: AtomicUsize,
    buffers: BufferPool,
    failure: OnceLock<ClientError>,
    cancel: CancellationToken,
}

/// A connected, shareable client to one replica. Clones share the connections.
#[derive(Clone)]
pub struct DataClient {
    core: Arc<Core>,
    info: Arc<VolumeInfo>,
    tasks: TaskTracker,
    // Stops the background tasks when the last handle is dropped.
    _stop_on_drop: Arc<DropGuard>,
}

impl std::fmt::Debug for DataClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataClient")
            .field("addr", &self.core.addr)
            .field("info", &self.info)
            .finish()
    }
}

impl DataClient {
    /// Connects to `addr` (`HOST:PORT` or `unix:/path`), performs `Hello` on every connection and starts
    /// the connection and ping tasks.
    pub async fn connect(addr: &str, cfg: ClientConfig) -> Result<Self, ClientError> {
        match cfg.runtime.clone() {
            Some(runtime) => {
                let addr = addr.to_owned();
                runtime
                    .spawn(async move { connection::connect(&addr, cfg).await })
                    .await
                    .map_err(|e| {
                        ClientError::Disconnected(format!("connect task on the client's runtime: {e}"))
                    })?
            }
            None => connection::connect(addr, cfg).await,
        }
    }

    /// The volume as announced by the replica at `Hello`.
    pub fn info(&self) -> &VolumeInfo {
        &self.info
    }

    /// The error that failed this client, if it failed.
    pub fn failure(&self) -> Option<ClientError> {
        self.core.failure.get().cloned()
    }

    /// Reads `buf.len()` bytes at `offset` (at most [`MAX_IO`]).
    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let length = io_length(buf.len())?;
        let answer = self
            .core
            .request(FrameKind::Read, offset, length, None, None)
            .await?;
        match answer.payload {
            Some(data) if data.len() == buf.len() => {
                crate::io_counters::copy(buf.len());
                buf.copy_from_slice(&data);
                Ok(())
            }
            _ => Err(self
                .core
                .fail(ClientError::Protocol("read reply without its data".to_owned()))),
        }
    }

    /// Writes `data` at `offset` (at most [`MAX_IO`] bytes); the data is copied into a pooled buffer.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        let length = io_length(data.len())?;
        let mut buf = self.core.buffers.get(data.len());
        crate::io_counters::copy(data.len());
        buf.copy_from_slice(data);
        self.core
            .request(
                FrameKind::Write,
                offset,
                length,
                Some(Bytes::from_owner(buf)),
                None,
            )
            .await
            .map(drop)
    }

    /// Writes `data` at `offset` (at most [`MAX_IO`] bytes) without copying it: the same buffer can go
    /// to every replica, and is sent from where it is.
    pub async fn write_bytes(&self, offset: u64, data: Bytes) -> Result<(), ClientError> {
        let length = io_length(data.len())?;
        self.core
            .request(FrameKind::Write, offset, length, Some(data), None)
            .await
            .map(drop)
    }

    /// Discards `len` bytes at `offset`.
    pub async fn unmap(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.core
            .request(FrameKind::Unmap, offset, len, None, None)
            .await
            .map(drop)
    }

    /// Writes `len` zero bytes at `offset` without sending them.
    pub async fn write_zeroes(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.core
            .request(FrameKind::WriteZeroes, offset, len, None, None)
            .await
            .map(drop)
    }

    /// Makes every write acknowledged so far durable on the replica.
    pub async fn flush(&self) -> Result<(), ClientError> {
        self.core
            .request(FrameKind::Flush, 0, 0, None, None)
            .await
            .map(drop)
    }

    /// Which parts of `len` bytes at `offset` are allocated (`len` > 0). The answer may cover less than
    /// asked (see [`BlockStatus::covered`]). A malformed answer is a protocol error and fails the client.
    pub async fn block_status(&self, offset: u64, len: u32) -> Result<BlockStatus, ClientError> {
        if len == 0 {
            return Err(ClientError::Invalid("BlockStatus of zero bytes".to_owned()));
        }
        let answer = self
            .core
            .request(FrameKind::BlockStatus, offset, len, None, None)
            .await?;
        // The reader checked 0 < length <= len.
        let covered = u64::from(answer.length);
        let span = offset..offset.saturating_add(covered);
        let payload = answer.payload.as_deref().unwrap_or(&[]);
        match decode_ranges(span, payload) {
            Ok(allocated) => Ok(BlockStatus { covered, allocated }),
            Err(e) => Err(self
                .core
                .fail(ClientError::Protocol(format!("BlockStatus reply: {e}")))),
        }
    }

    /// One round trip on every connection.
    pub async fn ping(&self) -> Result<(), ClientError> {
        for conn in 0..self.core.outgoing.len() {
            self.core.request(FrameKind::Ping, 0, 0, None, Some(conn)).await?;
        }
        Ok(())
    }

    /// Fails pending requests with `Disconnected`, closes the connections and joins the tasks.
    pub async fn close(&self) {
        self.core
            .fail(ClientError::Disconnected("client closed".to_owned()));
        self.tasks.close();
        self.tasks.wait().await;
    }
}

fn io_length(len: usize) -> Result<u32, ClientError> {
    u32::try_from(len)
        .ok()
        .filter(|&l| l <= MAX_IO)
        .ok_or_else(|| ClientError::Invalid(format!("{len} bytes exceed the {MAX_IO}-byte request limit")))
}

impl Core {
    /// Puts the client in the failed state (first reason wins) and returns the error callers should see.
    pub(crate) fn fail(&self, err: ClientError) -> ClientError {
        let first = self.failure.get_or_init(|| err).clone();
        if !self.cancel.is_cancelled() {
            tracing::warn!(replica = %self.addr, error = %first, "data client failed");
            self.cancel.cancel();
        }
        self.slots.fail_all(&first);
        first
    }

    fn failed(&self) -> Result<(), ClientError> {
        match self.failure.get() {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// Sends one request and waits for its outcome. `conn` pins it to a connection (pings).
    pub(crate) async fn request(
        &self,
        kind: FrameKind,
        offset: u64,
        length: u32,
        payload: Option<Bytes>,
        conn: Option<usize>,
    ) -> Result<Answer, ClientError> {
        self.failed()?;
        let Some(slot) = self.slots.acquire().await else {
            return Err(self
                .failed()
                .err()
                .unwrap_or(ClientError::Disconnected("client closed".to_owned())));
        };
        let id = slot.begin(kind, length);
        // Checked after `begin`: `fail` either saw this slot pending or set the failure before we look.
        self.failed()?;
        let header = FrameHeader {
            kind,
            id,
            offset,
            length,
            payload_len: if payload.is_some() { length } else { 0 },
        };
        let conn = conn.unwrap_or_else(|| self.next_conn.fetch_add(1, Relaxed)) % self.outgoing.len();
        // `try_send`, not `send().await`: the queue holds as many frames as there are slots so it is
        // never full, and with no await between `begin` and queueing, a caller that gives up can only do
        // so once the frame is on its way (its reply then frees the slot; see `SlotGuard`).
        if self.outgoing[conn]
            .try_send(Outgoing { header, payload })
            .is_err()
        {
            return Err(self.fail(ClientError::Disconnected("connection writer stopped".to_owned())));
        }
        // tokio's time driver locks its wheel to register the deadline and again to remove it.
        crate::io_counters::lock();
        crate::io_counters::lock();
        match tokio::time::timeout(self.cfg.request_timeout, slot.wait()).await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::warn!(replica = %self.addr, ?kind, offset, length, "request timed out");
                Err(self.fail(ClientError::Timeout))
            }
        }
    }
}
