//! Prometheus `/metrics` (plus `/healthz`, `/readyz`) of the engine, on the daemons' shared server
//! ([`corral_daemon::metrics`]): the volume's counters and latency histograms are read at scrape time from its
//! atomics; the replica counts by mode are refreshed just before each scrape (reading them takes the replica lock).
//! Every series carries the label `volume` (escaped by the encoder, whatever the volume is called).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use corral_daemon::metrics::Metrics;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::LatencyHistogram;
use crate::replica_client::Mode;
use crate::volume::Volume;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    volume: String,
    mode: String,
}

/// Reads the volume's counters and histograms at scrape time.
#[derive(Debug)]
struct VolumeCollector(Arc<Volume>);

fn encode_latency(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    volume: &str,
    h: &LatencyHistogram,
) -> Result<(), std::fmt::Error> {
    h.encode(enc, name, help, &[("volume", volume)])
}

impl prometheus_client::collector::Collector for VolumeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let v = &self.0;
        let m = &v.metrics;
        let volume = [("volume", v.name.as_str())];
        for (name, help, val) in [
            ("engine_reads", "Reads completed", &m.reads),
            ("engine_writes", "Writes completed", &m.writes),
            ("engine_read_bytes", "Bytes read", &m.read_bytes),
            ("engine_written_bytes", "Bytes written", &m.write_bytes),
            ("engine_flushes", "Flushes", &m.flushes),
            ("engine_io_errors", "IOs failed to the client", &m.errors),
            ("engine_replica_failures", "Replica failures", &m.replica_errors),
        ] {
            let c = ConstCounter::new(val.load(Relaxed));
            let mut family = enc.encode_descriptor(name, help, None, c.metric_type())?;
            c.encode(family.encode_family(&volume)?)?;
        }
        let fenced = ConstGauge::new(
            i64::try_from(v.fenced().map_or(0, |f| f.replica_generation)).unwrap_or(i64::MAX),
        );
        let mut family = enc.encode_descriptor(
            "engine_fenced_by_generation",
            "The newer engine generation a replica accepted, fencing this engine (0: not fenced)",
            None,
            fenced.metric_type(),
        )?;
        fenced.encode(family.encode_family(&volume)?)?;
        // Empty unless built with the io-counters feature.
        for (name, help, val) in data_protocol::io_counters::metrics() {
            let c = ConstCounter::new(val);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        encode_latency(
            &mut enc,
            "engine_read_latency_seconds",
            "Read latency",
            &v.name,
            &m.read_latency,
        )?;
        encode_latency(
            &mut enc,
            "engine_write_latency_seconds",
            "Write latency",
            &v.name,
            &m.write_latency,
        )
    }
}

/// The engine's metrics (prefix `corral_`): the volume's collector and the replicas-by-mode gauges.
pub fn metrics(volume: Arc<Volume>) -> Metrics {
    let mut reg = Registry::with_prefix("corral");
    let replicas = Family::<ModeLabels, Gauge>::default();
    reg.register("engine_replicas", "Replicas by mode", replicas.clone());
    reg.register_collector(Box::new(VolumeCollector(volume.clone())));
    Metrics::new(reg).refresh_with(move || {
        let (v, replicas) = (volume.clone(), replicas.clone());
        async move {
            let reps = v.replicas().await;
            for mode in [Mode::Rw, Mode::Wo, Mode::Err] {
                let n = reps.iter().filter(|r| r.mode() == mode).count();
                replicas
                    .get_or_create(&ModeLabels {
                        volume: v.name.clone(),
                        mode: mode.as_str().to_owned(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    })
}

/// Serves `/metrics`, `/healthz` and `/readyz` until `cancel`.
pub async fn serve(
    listener: TcpListener,
    volume: Arc<Volume>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    corral_daemon::metrics::serve(listener, metrics(volume).routes(), cancel).await?;
    Ok(())
}
