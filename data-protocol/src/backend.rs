//! The storage side of the protocol: what a replica implements to be served.

use std::ops::Range;

/// What a `Hello` reply tells the client about the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Volume size in bytes.
    pub size: u64,
    /// Logical sector size in bytes (512 or 4096).
    pub sector_size: u32,
    /// Volume name, empty when the replica does not know it. At most [`crate::MAX_NAME_LEN`] bytes go
    /// on the wire.
    pub name: String,
}

/// The small, stable error classification that travels on the wire (the `length` of an `Error` reply).
/// Callers branch on the kind; the message is for humans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorKind {
    /// The device failed the operation.
    Io = 1,
    /// The range reaches past the end of the volume (a read answers `Eof` instead).
    OutOfRange = 2,
    /// The request is malformed for this volume (e.g. misaligned, offset overflow).
    Invalid = 3,
    /// No space left on the replica's disk (answered with a `NoSpace` reply).
    NoSpace = 4,
    /// The replica cannot serve IO right now (closing, in error, read-only).
    Unavailable = 5,
    /// The engine is stale: the replica has accepted a higher engine generation than the one this connection
    /// presented (or none, from an engine too old to present one). The `Error` reply's `offset` carries the
    /// replica's generation. Sent by the server itself, not by a backend.
    Fenced = 6,
    /// Not a wire code, never sent: the server answers nothing and drops the connection the request
    /// came on, as if the network had failed. For fault injection, and for a backend that knows its
    /// client must reconnect.
    DropConnection = 0x100,
}

impl ErrorKind {
    /// The wire code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The kind for a wire code; an unknown code from a newer peer is treated as a plain IO error.
    pub fn from_code(code: u32) -> Self {
        match code {
            2 => Self::OutOfRange,
            3 => Self::Invalid,
            4 => Self::NoSpace,
            5 => Self::Unavailable,
            6 => Self::Fenced,
            _ => Self::Io,
        }
    }
}

/// An error from a [`BlockBackend`]: a kind for control flow, a message with the context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BackendError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl From<std::io::Error> for BackendError {
    fn from(err: std::io::Error) -> Self {
        // ENOSPC and EDQUOT both mean "no room for this write" to the engine.
        let kind = match err.kind() {
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => ErrorKind::NoSpace,
            std::io::ErrorKind::InvalidInput => ErrorKind::Invalid,
            _ => ErrorKind::Io,
        };
        Self {
            kind,
            message: err.to_string(),
        }
    }
}

/// A block device as the data-protocol server sees it. Implemented by the replica.
///
/// All calls are blocking and run on the thread of the connection that received the request (flushes on
/// that connection's flusher thread), or, for a server with an IO pool, on a pool thread; never on an async
/// reactor thread. They may be called concurrently from several threads (connections, pool threads, several
/// requests of one connection); ordering between concurrent requests is the client's business (it only sends
/// a flush after the writes it covers were acknowledged). Without a pool, reads and writes should be cheap
/// when the data is cached: the connection does nothing else while one runs.
pub trait BlockBackend: Send + Sync + 'static {
    /// Size, sector size and name, answered at `Hello`.
    fn info(&self) -> Result<VolumeInfo, BackendError>;
    /// Fills all of `buf` from `offset` (it is a reused buffer: bytes left unwritten would leak stale
    /// data). A range past the end should fail with [`ErrorKind::OutOfRange`].
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError>;
    /// Writes `buf` at `offset`.
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError>;
    /// With an IO pool only: does the read on the connection's thread if it needs no wait for the device
    /// (cached data, a hole) and answers `Ok(true)`; `Ok(false)` (the default) sends it to the pool, which
    /// calls [`read_at`](Self::read_at) (`buf` may then hold anything).
    fn read_at_nowait(&self, offset: u64, buf: &mut [u8]) -> Result<bool, BackendError> {
        let _ = (offset, buf);
        Ok(false)
    }
    /// With an IO pool only: as [`read_at_nowait`](Self::read_at_nowait) for a write (`Ok(false)`: nothing
    /// was written).
    fn write_at_nowait(&self, offset: u64, buf: &[u8]) -> Result<bool, BackendError> {
        let _ = (offset, buf);
        Ok(false)
    }
    /// Discards a range; later reads return zeros.
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError>;
    /// Writes zeros over a range (may be implemented as an unmap when that reads back as zeros).
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError>;
    /// Makes every completed write durable.
    fn flush(&self) -> Result<(), BackendError>;
    /// With an IO pool only: whether a flush received now should run at the pool, beside the connection's other
    /// flushes (`true`: it will do more than sync — an lvstore flush that journals — so flushes in the backend
    /// at once can share that work), rather than on the connection's flusher thread, one after another (the
    /// default: a plain sync costs least there; measured in `bench/datapath`). A hint: either place is correct.
    fn flush_at_pool(&self) -> bool {
        false
    }
    /// The allocated parts of `[offset, offset + len)` (`len` > 0): ranges in bytes, ascending and
    /// non-overlapping; everything else in the span is a hole that reads as zeros. The server clips
    /// ranges to the span, merges touching ones and cuts the list to what one reply carries. A range
    /// past the end should fail with [`ErrorKind::OutOfRange`]. The default reports the whole span as
    /// allocated, which is always correct, only not sparse.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>, BackendError> {
        Ok(std::iter::once(offset..offset.saturating_add(len)).collect())
    }
    /// The highest engine generation this replica has accepted (0: none yet), as durably recorded. Called at
    /// every `Hello` (per connection, never per request). An error (a record that cannot be read) refuses the
    /// connection with it: a replica that does not know its generation must not guess one. The default keeps
    /// none.
    fn generation(&self) -> Result<u64, BackendError> {
        Ok(0)
    }
    /// Records durably (it survives a crash once this returns) that `generation`, higher than what
    /// [`generation`](Self::generation) returns, is now the highest accepted. The server answers the `Hello`
    /// that presented it only after this returned `Ok`. The default keeps none and refuses.
    fn record_generation(&self, generation: u64) -> Result<(), BackendError> {
        Err(BackendError::new(
            ErrorKind::Unavailable,
            format!("this replica cannot record engine generation {generation}: it keeps no generations"),
        ))
    }
}
