//! Prometheus `/metrics` and `/healthz` of the engine, gathered at scrape time.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use axum::{Router, extract::State, routing::get};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::{LATENCY_BUCKETS_US, LatencyHistogram};
use crate::replica_client::Mode;
use crate::volume::Volume;

fn histogram(out: &mut String, name: &str, help: &str, vol: &str, h: &LatencyHistogram) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cum = 0;
    for (i, b) in h.buckets.iter().enumerate() {
        cum += b.load(Relaxed);
        let le = LATENCY_BUCKETS_US
            .get(i)
            .map_or_else(|| "+Inf".to_owned(), |us| format!("{}", *us as f64 / 1e6));
        let _ = writeln!(out, "{name}_bucket{{volume=\"{vol}\",le=\"{le}\"}} {cum}");
    }
    let _ = writeln!(
        out,
        "{name}_sum{{volume=\"{vol}\"}} {}",
        h.sum_us.load(Relaxed) as f64 / 1e6
    );
    let _ = writeln!(out, "{name}_count{{volume=\"{vol}\"}} {}", h.count.load(Relaxed));
}

async fn metrics(State(v): State<Arc<Volume>>) -> String {
    use std::fmt::Write;
    let m = &v.metrics;
    let n = &v.name;
    let mut out = String::new();
    for (name, help, val) in [
        (
            "corral_engine_reads_total",
            "Reads completed",
            m.reads.load(Relaxed),
        ),
        (
            "corral_engine_writes_total",
            "Writes completed",
            m.writes.load(Relaxed),
        ),
        (
            "corral_engine_read_bytes_total",
            "Bytes read",
            m.read_bytes.load(Relaxed),
        ),
        (
            "corral_engine_written_bytes_total",
            "Bytes written",
            m.write_bytes.load(Relaxed),
        ),
        ("corral_engine_flushes_total", "Flushes", m.flushes.load(Relaxed)),
        (
            "corral_engine_io_errors_total",
            "IOs failed to the client",
            m.errors.load(Relaxed),
        ),
        (
            "corral_engine_replica_failures_total",
            "Replica failures",
            m.replica_errors.load(Relaxed),
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{volume=\"{n}\"}} {val}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP corral_engine_replicas Replicas by mode\n# TYPE corral_engine_replicas gauge"
    );
    let reps = v.replicas().await;
    for mode in [Mode::Rw, Mode::Wo, Mode::Err] {
        let c = reps.iter().filter(|r| r.mode() == mode).count();
        let _ = writeln!(
            out,
            "corral_engine_replicas{{volume=\"{n}\",mode=\"{}\"}} {c}",
            mode.as_str()
        );
    }
    histogram(
        &mut out,
        "corral_engine_read_latency_seconds",
        "Read latency",
        n,
        &m.read_latency,
    );
    histogram(
        &mut out,
        "corral_engine_write_latency_seconds",
        "Write latency",
        n,
        &m.write_latency,
    );
    out
}

/// Serves `/metrics` and `/healthz` until `cancel`.
pub async fn serve(
    listener: TcpListener,
    volume: Arc<Volume>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(volume);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await?;
    Ok(())
}
