//! The manager's Prometheus metrics, served on `/metrics`.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Mutex<Registry>>,
    reconciles: Family<ReconcileLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    volumes: Family<StateLabels, Gauge>,
    daemon_starts: Counter,
    backing_image_copy_failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("corral_manager");
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let volumes = Family::<StateLabels, Gauge>::default();
        let daemon_starts = Counter::default();
        let backing_image_copy_failures = Counter::default();
        r.register(
            "reconciles",
            "Reconcile runs by controller and result",
            reconciles.clone(),
        );
        r.register(
            "http_requests",
            "REST requests by method and status",
            requests.clone(),
        );
        r.register(
            "volumes",
            "Volumes by state (as of the last list)",
            volumes.clone(),
        );
        r.register(
            "daemon_starts",
            "Replica and engine processes started by this manager",
            daemon_starts.clone(),
        );
        r.register(
            "backing_image_copy_failures",
            "Backing-image copies on this node's disks that failed (checksum, missing file, sync or fetch error)",
            backing_image_copy_failures.clone(),
        );
        Self {
            registry: Arc::new(Mutex::new(r)),
            reconciles,
            requests,
            volumes,
            daemon_starts,
            backing_image_copy_failures,
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, controller: &str, ok: bool) {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: if ok { "ok" } else { "error" }.to_owned(),
            })
            .inc();
    }

    pub fn request(&self, method: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                method: method.to_owned(),
                status: status.to_string(),
            })
            .inc();
    }

    pub fn daemon_started(&self) {
        self.daemon_starts.inc();
    }

    pub fn backing_image_copy_failed(&self) {
        self.backing_image_copy_failures.inc();
    }

    pub fn set_volume_counts(&self, counts: &[(&str, i64)]) {
        for (state, n) in counts {
            self.volumes
                .get_or_create(&StateLabels {
                    state: (*state).to_owned(),
                })
                .set(*n);
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(r) = self.registry.lock() {
            let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        }
        out
    }
}
