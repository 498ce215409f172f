//! `/metrics` of the instance manager: processes by state, and the creates that replaced a stopped or failed
//! process (restarts).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::table::ProcessTable;

pub fn metrics(table: Arc<ProcessTable>) -> corral_daemon::metrics::Metrics {
    let mut registry = Registry::with_prefix("corral_im");
    let processes = Family::<Vec<(String, String)>, Gauge>::default();
    registry.register(
        "processes",
        "Processes owned by this instance manager, by state",
        processes.clone(),
    );
    let restarts = Counter::<u64, AtomicU64>::default();
    registry.register(
        "process_restarts",
        "Processes created again under the name of a stopped or failed one",
        restarts.clone(),
    );
    corral_daemon::metrics::Metrics::new(registry).refresh_with(move || {
        let f = table.figures();
        for (state, n) in f.by_state {
            processes
                .get_or_create(&vec![("state".to_owned(), state.to_owned())])
                .set(n);
        }
        let seen = restarts.get();
        restarts.inc_by(f.restarts.saturating_sub(seen));
        async {}
    })
}
