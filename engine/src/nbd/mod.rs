//! NBD frontend: serves one [`BlockDevice`] to NBD clients (qemu, libnbd tools, fio, nbdfuse) over a unix
//! socket and/or TCP.
//!
//! This module owns the NBD wire protocol and nothing below it: the fixed newstyle handshake ([`handshake`]),
//! the transmission phase (one task per connection that parses every request a read brings, runs them as
//! concurrent futures and writes finished replies in batches, see `connection.rs`), the listeners ([`NbdServer`])
//! and the per-server counters ([`NbdCounters`]). What a read, write or flush *means* is the device's
//! business: the engine's volume implements [`BlockDevice`] and fans the request out to its replicas.
//!
//! Protocol choices (see `README.md` beside this file for the whole list):
//! - Fixed newstyle only (NO_ZEROES honoured); options GO, INFO, LIST, ABORT, EXPORT_NAME, STRUCTURED_REPLY,
//!   SET/LIST_META_CONTEXT (`base:allocation`), STARTTLS; anything else is answered with `NBD_REP_ERR_UNSUP`.
//! - Transmission flags: HAS_FLAGS, SEND_FLUSH, SEND_FUA, SEND_TRIM, SEND_WRITE_ZEROES, CAN_MULTI_CONN (plus
//!   READ_ONLY for a read-only export). The engine guarantees that a flush covers writes completed on any
//!   connection.
//! - Invalid requests get an error reply and the connection stays up: past the end → `ENOSPC` for writes (as
//!   the spec asks) and `EINVAL` otherwise; zero length, unknown commands or flags, lengths above the maximum
//!   block size → `EINVAL`. A write whose payload is larger than the maximum block size is drained (discarded
//!   in bounded chunks) and answered `EINVAL`, so one bad request does not cost the client its connection.
//! - A malformed handshake closes that connection only, with a log line.
//! - TLS (NBD_OPT_STARTTLS) on TCP listeners when [`NbdConfig::tls`] is set, and then mandatory: before it every
//!   option but STARTTLS and ABORT is answered `NBD_REP_ERR_TLS_REQD`, and the client must present a certificate
//!   of the cluster CA. Unix sockets are plaintext (mode 0600).

use std::future::Future;

use thiserror::Error;

mod connection;
pub mod handshake;
mod memory;
mod metrics;
mod server;
pub mod wire;

pub use memory::MemoryDevice;
pub use metrics::{CommandCounters, CommandKind, NbdCounters};
pub use server::{NbdServer, ServeError};

/// A byte-addressable device the NBD server exports. The engine's volume implements it; tests use
/// [`MemoryDevice`].
///
/// Requests reach the device already validated: `offset + len <= size()`, lengths non-zero, reads and writes
/// at most the configured maximum block size (trim, write-zeroes and block status up to 4 GiB - 1). Several
/// requests run concurrently (up to `max_in_flight` per connection, from any number of connections), so
/// implementations order overlapping IO themselves if they need to.
pub trait BlockDevice: Send + Sync + 'static {
    /// Size of the export in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> impl Future<Output = Result<(), DeviceError>> + Send;
    /// Writes `data` at `offset`; with `fua`, the data is durable when the future resolves. The buffer is
    /// owned and cheap to clone, so a device can pass it on (to every replica) without copying it.
    fn write(
        &self,
        offset: u64,
        data: bytes::Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), DeviceError>> + Send;
    /// Makes every write completed before the call (on any connection) durable.
    fn flush(&self) -> impl Future<Output = Result<(), DeviceError>> + Send;
    /// Discards `[offset, offset+len)`; later reads may return anything until it is written again.
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = Result<(), DeviceError>> + Send;
    /// Makes `[offset, offset+len)` read as zeros; with `may_trim` the range may become a hole.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
    ) -> impl Future<Output = Result<(), DeviceError>> + Send;
    /// Allocation of [offset, offset+len): consecutive (length, Allocation) pieces covering at least the
    /// first byte.
    fn block_status(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<Vec<(u64, Allocation)>, DeviceError>> + Send;
}

/// Allocation state of a range, as reported through the `base:allocation` metadata context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Allocated and holding data (possibly zeros the device did not notice).
    Data,
    /// Unallocated; reads as zeros.
    Hole,
    /// Allocated, reads as zeros.
    Zero,
}

/// Coarse class of a device failure; decides the errno the NBD client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// The device could not do the IO (`EIO`).
    Io,
    /// The request is not acceptable to the device (`EINVAL`).
    Invalid,
    /// Out of space (`ENOSPC`).
    NoSpace,
}

/// A failed device request: a stable kind for control flow plus a message for humans (sent to clients that
/// negotiated structured replies, and logged).
#[derive(Debug, Clone, Error)]
#[error("{kind:?}: {message}")]
pub struct DeviceError {
    /// What class of failure this is.
    pub kind: DeviceErrorKind,
    /// Context: which replica, offset, cause.
    pub message: String,
}

impl DeviceError {
    /// An IO failure with context.
    pub fn io(message: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::Io,
            message: message.into(),
        }
    }
    /// An invalid request with context.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::Invalid,
            message: message.into(),
        }
    }
    /// Out of space, with context.
    pub fn no_space(message: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::NoSpace,
            message: message.into(),
        }
    }
}

/// How an export is offered to clients.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    /// Name clients ask for; the empty name also selects this export (the default export).
    pub export_name: String,
    /// Optional description shown by `nbdinfo` (NBD_INFO_DESCRIPTION).
    pub description: String,
    /// Refuse writes, trims and write-zeroes with `EPERM` and advertise READ_ONLY.
    pub read_only: bool,
    /// Largest request payload accepted (advertised as the maximum block size). At most 32 MiB.
    pub max_block: u32,
    /// Requests of one connection processed concurrently; the reader stops reading when all are busy.
    pub max_in_flight: usize,
    /// TCP listeners only serve clients that start TLS (NBD_OPT_STARTTLS) and present a certificate this server
    /// config accepts (the process's `--tls-dir` one: a certificate of the cluster CA). `None`: plaintext TCP.
    /// Unix listeners never use it.
    pub tls: Option<std::sync::Arc<corral_tls::rustls::ServerConfig>>,
}

impl Default for NbdConfig {
    fn default() -> Self {
        Self {
            export_name: String::new(),
            description: String::new(),
            read_only: false,
            max_block: 16 << 20,
            max_in_flight: 64,
            tls: None,
        }
    }
}
