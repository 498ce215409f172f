//! Counters of the NBD frontend: plain atomics, updated on the data path without locks, read by the engine's
//! metrics exporter.

use std::sync::atomic::{AtomicU64, Ordering};

/// The commands counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandKind {
    /// NBD_CMD_READ.
    Read,
    /// NBD_CMD_WRITE.
    Write,
    /// NBD_CMD_FLUSH.
    Flush,
    /// NBD_CMD_TRIM.
    Trim,
    /// NBD_CMD_WRITE_ZEROES.
    WriteZeroes,
    /// NBD_CMD_BLOCK_STATUS.
    BlockStatus,
    /// Anything else (unknown commands, rejected before reaching the device).
    Other,
}

/// Requests, bytes and errors of one command kind.
#[derive(Debug, Default)]
pub struct CommandCounters {
    /// Requests received.
    pub requests: AtomicU64,
    /// Bytes moved (read/write payloads) or covered (trim, write-zeroes, block status).
    pub bytes: AtomicU64,
    /// Requests answered with an error.
    pub errors: AtomicU64,
}

/// All counters of one [`NbdServer`](super::NbdServer), shared by its connections.
#[derive(Debug, Default)]
pub struct NbdCounters {
    /// Connections accepted.
    pub connections_accepted: AtomicU64,
    /// Connections currently open.
    pub connections_active: AtomicU64,
    /// Connections closed because of a malformed or failed handshake.
    pub handshake_failures: AtomicU64,
    /// Connections closed because of a protocol violation during transmission (bad request magic).
    pub protocol_errors: AtomicU64,
    /// NBD_CMD_READ.
    pub read: CommandCounters,
    /// NBD_CMD_WRITE.
    pub write: CommandCounters,
    /// NBD_CMD_FLUSH.
    pub flush: CommandCounters,
    /// NBD_CMD_TRIM.
    pub trim: CommandCounters,
    /// NBD_CMD_WRITE_ZEROES.
    pub write_zeroes: CommandCounters,
    /// NBD_CMD_BLOCK_STATUS.
    pub block_status: CommandCounters,
    /// Unknown commands.
    pub other: CommandCounters,
}

impl NbdCounters {
    /// The counters of one command kind.
    pub fn command(&self, kind: CommandKind) -> &CommandCounters {
        match kind {
            CommandKind::Read => &self.read,
            CommandKind::Write => &self.write,
            CommandKind::Flush => &self.flush,
            CommandKind::Trim => &self.trim,
            CommandKind::WriteZeroes => &self.write_zeroes,
            CommandKind::BlockStatus => &self.block_status,
            CommandKind::Other => &self.other,
        }
    }

    pub(crate) fn record(&self, kind: CommandKind, bytes: u64, ok: bool) {
        let c = self.command(kind);
        c.requests.fetch_add(1, Ordering::Relaxed);
        if ok {
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}
