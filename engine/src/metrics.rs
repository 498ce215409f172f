//! Per-volume IO counters and latency histograms, exported to Prometheus by the daemon.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Upper bounds (µs) of the latency histogram buckets; the last bucket is +Inf.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    50, 100, 200, 400, 800, 1_600, 3_200, 6_400, 12_800, 25_600, 51_200, 102_400, 409_600, 1_638_400,
];

/// A fixed-bucket latency histogram of atomics (no allocation, no lock on the IO path).
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Cumulative counts are computed at export; these are per-bucket counts, index 14 = +Inf.
    pub buckets: [AtomicU64; 15],
    /// Sum of observed latencies in µs.
    pub sum_us: AtomicU64,
    /// Observations.
    pub count: AtomicU64,
}

impl LatencyHistogram {
    /// Records one latency.
    pub fn observe(&self, start: Instant) {
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Approximate quantile (upper bound of the bucket holding it), in µs.
    pub fn quantile_us(&self, q: f64) -> u64 {
        let total = self.count.load(Relaxed);
        if total == 0 {
            return 0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((total as f64) * q).ceil() as u64;
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Relaxed);
            if seen >= rank {
                return LATENCY_BUCKETS_US.get(i).copied().unwrap_or(u64::MAX);
            }
        }
        u64::MAX
    }
}

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
