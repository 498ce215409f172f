//! Prometheus metrics of the replica daemon, gathered at scrape time, on the daemons' shared metrics server
//! ([`corral_daemon::metrics`]: `/metrics`, `/healthz`, `/readyz`).

use std::sync::Arc;

use corral_daemon::metrics::Metrics;
use data_protocol::ServerMetrics;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::host::ReplicaHost;

#[derive(Debug)]
struct Collector {
    host: Arc<ReplicaHost>,
    data: Arc<ServerMetrics>,
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let d = self.data.snapshot();
        let counters = [
            (
                "replica_data_requests",
                "Data-protocol requests served",
                d.requests,
            ),
            (
                "replica_data_read_bytes",
                "Bytes read through the data protocol",
                d.bytes_read,
            ),
            (
                "replica_data_written_bytes",
                "Bytes written through the data protocol",
                d.bytes_written,
            ),
            (
                "replica_data_errors",
                "Data-protocol requests answered with an error",
                d.errors,
            ),
            (
                "replica_data_protocol_violations",
                "Connections dropped for protocol violations",
                d.protocol_violations,
            ),
            (
                "replica_data_connections_accepted",
                "Data-protocol connections accepted",
                d.connections_accepted,
            ),
        ];
        // The io-counters totals (none unless built with that feature) are taken with the others, before
        // this scrape takes any lock of its own.
        for (name, help, v) in counters.into_iter().chain(data_protocol::io_counters::metrics()) {
            let c = ConstCounter::new(v);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let (open, layers, runs, rev, size) = match self.host.replica().and_then(|r| r.status()) {
            Ok(s) => (1, s.chain.len(), s.extent_map_runs, s.revision_counter, s.size),
            Err(_) => (0, 0, 0, 0, 0),
        };
        let gauges = [
            ("replica_open", "1 when the replica is open", 1i64.min(open)),
            (
                "replica_data_connections_active",
                "Open data-protocol connections",
                i64::try_from(d.connections_active).unwrap_or(i64::MAX),
            ),
            (
                "replica_chain_layers",
                "Layers in the live chain",
                i64::try_from(layers).unwrap_or(i64::MAX),
            ),
            (
                "replica_extent_map_runs",
                "Runs in the block location map",
                i64::try_from(runs).unwrap_or(i64::MAX),
            ),
            (
                "replica_revision_counter",
                "Revision counter",
                i64::try_from(rev).unwrap_or(i64::MAX),
            ),
            (
                "replica_size_bytes",
                "Volume size",
                i64::try_from(size).unwrap_or(i64::MAX),
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

/// Serves `/metrics`, `/healthz`, `/readyz` (and `/debug/faults` with the `fault-injection` feature) until `cancel`.
pub async fn serve_metrics(
    listener: TcpListener,
    host: Arc<ReplicaHost>,
    data: Arc<ServerMetrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut reg = Registry::with_prefix("corral");
    #[cfg(feature = "fault-injection")]
    let faults = crate::fault::routes(host.faults().clone());
    reg.register_collector(Box::new(Collector { host, data }));
    let app = Metrics::new(reg).routes();
    #[cfg(feature = "fault-injection")]
    let app = app.merge(faults);
    corral_daemon::metrics::serve(listener, app, cancel).await?;
    Ok(())
}
