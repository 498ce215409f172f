//! Prometheus metrics of the manager (`/metrics` on the HTTP address), gathered at scrape time.

use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::state::FileState;

/// Counters updated as work happens.
#[derive(Debug, Default)]
pub struct Metrics {
    pub fetches: Counter,
    pub syncs: Counter,
    pub sends: Counter,
    pub send_bytes: Counter,
    pub received_bytes: Counter,
    pub download_bytes: Counter,
    pub failures: Counter,
    pub reverifications: Counter,
}

/// What the scrape reads from the manager at scrape time (the manager implements it; this module does not depend
/// on the manager's).
pub trait ImageStats: Send + Sync + 'static {
    /// The counters.
    fn metrics(&self) -> &Metrics;
    /// Images per reported state.
    fn state_counts(&self) -> BTreeMap<FileState, u64>;
    /// Ports of the receiver range held by syncs.
    fn receiver_ports_in_use(&self) -> usize;
}

struct Collector(Arc<dyn ImageStats>);

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("bim-collector")
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = self.0.metrics();
        let counters = [
            (
                "bim_fetches",
                "Fetch requests that took over or reused a file",
                &m.fetches,
            ),
            ("bim_syncs", "Sync requests that started a receiver", &m.syncs),
            ("bim_sends", "Sends to other managers that completed", &m.sends),
            (
                "bim_sent_bytes",
                "Data bytes sent to other managers",
                &m.send_bytes,
            ),
            (
                "bim_received_bytes",
                "Data bytes written by sync receivers",
                &m.received_bytes,
            ),
            (
                "bim_download_bytes",
                "Bytes served by HTTP downloads",
                &m.download_bytes,
            ),
            ("bim_failures", "Images that became failed", &m.failures),
            (
                "bim_reverifications",
                "Ready files re-hashed because their mtime changed",
                &m.reverifications,
            ),
        ];
        for (name, help, c) in counters {
            let c = ConstCounter::new(c.get());
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let counts = self.0.state_counts();
        let mut family = enc.encode_descriptor(
            "bim_images",
            "Images on this disk by reported state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for st in FileState::ALL {
            let g = ConstGauge::new(i64::try_from(counts.get(&st).copied().unwrap_or(0)).unwrap_or(i64::MAX));
            g.encode(family.encode_family(&[("state", st.as_str())])?)?;
        }
        let ports = ConstGauge::new(i64::try_from(self.0.receiver_ports_in_use()).unwrap_or(i64::MAX));
        ports.encode(enc.encode_descriptor(
            "bim_receiver_ports_in_use",
            "Ports of the range held by sync receivers",
            None,
            ports.metric_type(),
        )?)?;
        Ok(())
    }
}

/// A registry exposing `manager`'s metrics (prefix `corral_`).
pub fn registry(manager: Arc<dyn ImageStats>) -> Registry {
    let mut reg = Registry::with_prefix("corral");
    reg.register_collector(Box::new(Collector(manager)));
    reg
}
