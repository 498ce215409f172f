//! Prometheus metrics of the v2 disk daemon (`serve-lvstore --metrics-listen`), gathered at scrape time, on the
//! daemons' shared metrics server ([`corral_daemon::metrics`]): per hosted replica (label `replica`) the
//! data-protocol counters a v1 replica exports (same names) and read/write/flush latency histograms measured
//! around the lvol IO; for the disk, the store's space (clusters used/free, lvols, snapshots) and its metadata
//! journal commits and checkpoints.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use corral_daemon::metrics::{LatencyHistogram, Metrics, encode_latency_family};
use data_protocol::{BackendError, BlockBackend, ServerMetrics, VolumeInfo};
use lvstore::LvStore;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::service::V2Replica;
use crate::locks::lock;

/// Latency of one hosted replica's data-protocol IO, measured around the lvol call (queueing excluded).
#[derive(Debug, Default)]
pub struct ReplicaIoLatency {
    pub read: LatencyHistogram,
    pub write: LatencyHistogram,
    pub flush: LatencyHistogram,
}

/// The data-protocol backend of a hosted replica with its IO timed: every call goes to the replica.
pub struct TimedBackend {
    pub replica: Arc<V2Replica>,
    pub latency: Arc<ReplicaIoLatency>,
}

impl BlockBackend for TimedBackend {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        self.replica.info()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let t = Instant::now();
        let r = self.replica.read_at(offset, buf);
        self.latency.read.observe(t);
        r
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError> {
        let t = Instant::now();
        let r = self.replica.write_at(offset, buf);
        self.latency.write.observe(t);
        r
    }

    fn read_at_nowait(&self, offset: u64, buf: &mut [u8]) -> Result<bool, BackendError> {
        let t = Instant::now();
        let r = self.replica.read_at_nowait(offset, buf);
        if matches!(r, Ok(true)) {
            self.latency.read.observe(t);
        }
        r
    }

    fn write_at_nowait(&self, offset: u64, buf: &[u8]) -> Result<bool, BackendError> {
        let t = Instant::now();
        let r = self.replica.write_at_nowait(offset, buf);
        if matches!(r, Ok(true)) {
            self.latency.write.observe(t);
        }
        r
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.replica.unmap(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.replica.write_zeroes(offset, len)
    }

    fn flush(&self) -> Result<(), BackendError> {
        let t = Instant::now();
        let r = self.replica.flush();
        self.latency.flush.observe(t);
        r
    }

    fn flush_at_pool(&self) -> bool {
        self.replica.flush_at_pool()
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>, BackendError> {
        self.replica.block_status(offset, len)
    }

    fn generation(&self) -> Result<u64, BackendError> {
        self.replica.generation()
    }

    fn record_generation(&self, generation: u64) -> Result<(), BackendError> {
        self.replica.record_generation(generation)
    }
}

/// What the collector reads of one hosted replica.
#[derive(Debug, Clone)]
pub struct ReplicaMetrics {
    pub replica: Arc<V2Replica>,
    pub data: Arc<ServerMetrics>,
    pub latency: Arc<ReplicaIoLatency>,
}

/// The hosted replicas' metrics by name: the daemon adds one when it starts serving a replica and drops it when
/// it stops (a plain mutex: the collector runs synchronously inside the HTTP handler).
pub type MetricsTable = Arc<Mutex<BTreeMap<String, ReplicaMetrics>>>;

struct Collector {
    store: Arc<LvStore>,
    replicas: MetricsTable,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector")
            .field("store", &self.store.path())
            .finish_non_exhaustive()
    }
}

fn gauge(v: u64) -> ConstGauge {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_store(&mut enc)?;
        self.encode_replicas(&mut enc)
    }
}

impl Collector {
    /// The lvstore's space and journal figures.
    fn encode_store(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.store.space();
        for (name, help, v) in [
            (
                "lvstore_clusters_total",
                "Data clusters of the disk's lvstore",
                s.total_clusters,
            ),
            (
                "lvstore_clusters_used",
                "Data clusters owned by lvols and snapshots",
                s.used_clusters,
            ),
            ("lvstore_clusters_free", "Data clusters free", s.free_clusters),
            ("lvstore_cluster_size_bytes", "Cluster size", s.cluster_size),
            (
                "lvstore_provisioned_bytes",
                "Sum of the lvols' sizes (thin: may exceed the disk)",
                s.provisioned_bytes,
            ),
            ("lvstore_lvols", "Writable lvols (heads and clones)", s.lvols),
            ("lvstore_snapshots", "Read-only snapshot lvols", s.snapshots),
            (
                "lvstore_journal_used_bytes",
                "Metadata journal bytes used",
                s.journal_used_bytes,
            ),
        ] {
            let g = gauge(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        for (name, help, v) in [
            (
                "lvstore_journal_commits",
                "Metadata journal records appended since the daemon opened the store",
                s.journal_commits,
            ),
            (
                "lvstore_checkpoints",
                "Metadata checkpoints written since the daemon opened the store",
                s.checkpoints,
            ),
            (
                "lvstore_shared_flushes",
                "Flushes that needed no sync of their own: a concurrent flush of the store covered them",
                s.shared_flushes,
            ),
            (
                "lvstore_plain_syncs",
                "Flushes with nothing to journal, each one fdatasync beside any other flush's",
                s.plain_syncs,
            ),
        ] {
            let c = ConstCounter::new(v);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }

        Ok(())
    }

    /// Each replica's data-protocol counters, gauges and latency histograms, labelled by replica.
    fn encode_replicas(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // A copy of the table: encoding must not hold the lock the daemon takes to add or drop a replica.
        let replicas: Vec<(String, ReplicaMetrics)> = lock(&self.replicas)
            .iter()
            .map(|(n, m)| (n.clone(), m.clone()))
            .collect();
        type Counter = fn(&data_protocol::ServerMetricsSnapshot) -> u64;
        let counters: [(&str, &str, Counter); 7] = [
            ("replica_data_requests", "Data-protocol requests served", |d| {
                d.requests
            }),
            (
                "replica_data_read_bytes",
                "Bytes read through the data protocol",
                |d| d.bytes_read,
            ),
            (
                "replica_data_written_bytes",
                "Bytes written through the data protocol",
                |d| d.bytes_written,
            ),
            (
                "replica_data_errors",
                "Data-protocol requests answered with an error",
                |d| d.errors,
            ),
            (
                "replica_data_protocol_violations",
                "Connections dropped for protocol violations",
                |d| d.protocol_violations,
            ),
            (
                "replica_data_connections_accepted",
                "Data-protocol connections accepted",
                |d| d.connections_accepted,
            ),
            (
                "replica_data_pooled_requests",
                "Data-protocol requests run on the disk's IO pool (the rest ran on their connection's thread)",
                |d| d.pooled,
            ),
        ];
        let snaps: Vec<_> = replicas.iter().map(|(_, m)| m.data.snapshot()).collect();
        for (name, help, get) in counters {
            let mut family =
                enc.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
            for ((n, _), d) in replicas.iter().zip(&snaps) {
                ConstCounter::new(get(d)).encode(family.encode_family(&[("replica", n.as_str())])?)?;
            }
        }
        type Gauge = fn(&ReplicaMetrics, &data_protocol::ServerMetricsSnapshot) -> u64;
        let gauges: [(&str, &str, Gauge); 3] = [
            ("replica_open", "1 when the replica is open", |m, _| {
                u64::from(m.replica.replica.is_open())
            }),
            (
                "replica_data_connections_active",
                "Open data-protocol connections",
                |_, d| d.connections_active,
            ),
            ("replica_size_bytes", "Volume size", |m, _| {
                m.replica.replica.size()
            }),
        ];
        for (name, help, get) in gauges {
            let mut family = enc.encode_descriptor(name, help, None, gauge(0).metric_type())?;
            for ((n, m), d) in replicas.iter().zip(&snaps) {
                gauge(get(m, d)).encode(family.encode_family(&[("replica", n.as_str())])?)?;
            }
        }
        let labels: Vec<[(&str, &str); 1]> =
            replicas.iter().map(|(n, _)| [("replica", n.as_str())]).collect();
        type Pick = fn(&ReplicaIoLatency) -> &LatencyHistogram;
        let histograms: [(&str, &str, Pick); 3] = [
            (
                "replica_read_latency_seconds",
                "Read latency of the lvol chain",
                |l| &l.read,
            ),
            (
                "replica_write_latency_seconds",
                "Write latency of the lvol chain",
                |l| &l.write,
            ),
            (
                "replica_flush_latency_seconds",
                "Flush latency of the replica (its journal commit)",
                |l| &l.flush,
            ),
        ];
        for (name, help, pick) in histograms {
            let series = labels
                .iter()
                .zip(&replicas)
                .map(|(l, (_, m))| (&l[..], pick(&m.latency)));
            encode_latency_family(enc, name, help, series)?;
        }
        Ok(())
    }
}

/// The daemon's `/metrics` registry (prefix `corral_`).
pub fn metrics(store: Arc<LvStore>, replicas: MetricsTable) -> Metrics {
    let mut reg = Registry::with_prefix("corral");
    reg.register_collector(Box::new(Collector { store, replicas }));
    Metrics::new(reg)
}
