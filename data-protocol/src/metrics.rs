//! Server counters: plain atomics the replica daemon exports (e.g. to Prometheus) as it sees fit.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Live counters of one [`crate::DataServer`]. All counts are monotonic except `connections_active`.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    /// Requests received after `Hello` (including pings).
    pub requests: AtomicU64,
    /// Payload bytes returned by successful reads.
    pub bytes_read: AtomicU64,
    /// Payload bytes accepted by successful writes.
    pub bytes_written: AtomicU64,
    /// Requests answered with `Error`, `Eof` or `NoSpace`.
    pub errors: AtomicU64,
    /// Connections dropped for violating the protocol.
    pub protocol_violations: AtomicU64,
    /// Requests handed to the IO pool (the rest ran on their connection's thread).
    pub pooled: AtomicU64,
}

/// A point-in-time copy of [`ServerMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerMetricsSnapshot {
    pub connections_accepted: u64,
    pub connections_active: u64,
    pub requests: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub errors: u64,
    pub protocol_violations: u64,
    pub pooled: u64,
}

impl ServerMetrics {
    pub fn snapshot(&self) -> ServerMetricsSnapshot {
        ServerMetricsSnapshot {
            connections_accepted: self.connections_accepted.load(Relaxed),
            connections_active: self.connections_active.load(Relaxed),
            requests: self.requests.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            errors: self.errors.load(Relaxed),
            protocol_violations: self.protocol_violations.load(Relaxed),
            pooled: self.pooled.load(Relaxed),
        }
    }
}
