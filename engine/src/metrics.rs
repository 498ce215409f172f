//! Per-volume IO counters and latency histograms, exported to Prometheus by the daemon.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

pub use corral_daemon::metrics::{LATENCY_BUCKETS_US, LatencyHistogram};

/// Counters of one volume.
#[derive(Debug, Default)]
pub struct VolumeMetrics {
    /// Reads completed.
    pub reads: AtomicU64,
    /// Writes completed.
    pub writes: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Flushes.
    pub flushes: AtomicU64,
    /// IOs that failed to the client.
    pub errors: AtomicU64,
    /// Replica failures (each put a replica ERR).
    pub replica_errors: AtomicU64,
    /// Read latency.
    pub read_latency: LatencyHistogram,
    /// Write latency.
    pub write_latency: LatencyHistogram,
}

impl VolumeMetrics {
    pub(crate) fn record_read(&self, bytes: u64, start: Instant, ok: bool) {
        if ok {
            self.reads.fetch_add(1, Relaxed);
            self.read_bytes.fetch_add(bytes, Relaxed);
            self.read_latency.observe(start);
        } else {
            self.errors.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn record_write(&self, bytes: u64, start: Instant, ok: bool) {
        if ok {
            self.writes.fetch_add(1, Relaxed);
            self.write_bytes.fetch_add(bytes, Relaxed);
            self.write_latency.observe(start);
        } else {
            self.errors.fetch_add(1, Relaxed);
        }
    }
}
