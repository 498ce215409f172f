//! The v2 disk daemon's Prometheus metrics (`serve-lvstore --metrics-listen`) scraped from the real daemon: per
//! hosted replica its data-protocol counters and IO latency histograms, for the disk its lvstore's space,
//! lvols, snapshots and journal commits, each moving with the IO and snapshots a client makes.

mod common;

use common::http;
use corral_proto::ReplicaAddress;
use corral_proto::v1::{self, replica_service_client::ReplicaServiceClient};
use data_protocol::{ClientConfig, DataClient};
use testkit::{Daemon, DaemonCommand};

const SIZE: u64 = 16 << 20;

fn lvstore_daemon(dir: &std::path::Path) -> Daemon {
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(256 << 20).unwrap();
    DaemonCommand::new(env!("CARGO_BIN_EXE_corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(&disk)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .spawn()
}

/// `corral-replica lvstore --url … add NAME --size …` (the CLI), returning the replica's address.
fn add(d: &Daemon, name: &str) -> ReplicaAddress {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral-replica"))
        .args(["--json", "lvstore", "--url", d.addr("control"), "add", name])
        .args(["--size", &SIZE.to_string(), "--disable-revision-counter"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    r["address"].as_str().unwrap().parse().unwrap()
}

/// The value of the sample `series` (name with its labels, as exposed) in a scrape.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

async fn scrape(d: &Daemon) -> String {
    let (status, body) = http(d.addr("metrics"), "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lvstore_daemon_metrics_count_each_replicas_io_and_the_stores_space_snapshots_and_commits() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let d = lvstore_daemon(t.path());
    let (a, _b) = (add(&d, "m-a"), add(&d, "m-b"));
    let before = scrape(&d).await;
    assert_eq!(sample(&before, "corral_lvstore_lvols"), 2.0);
    assert_eq!(sample(&before, "corral_lvstore_snapshots"), 0.0);
    assert_eq!(sample(&before, "corral_replica_open{replica=\"m-b\"}"), 1.0);
    let used0 = sample(&before, "corral_lvstore_clusters_used");
    let free0 = sample(&before, "corral_lvstore_clusters_free");
    let commits0 = sample(&before, "corral_lvstore_journal_commits_total");

    // 8 writes of 64 KiB (8 clusters), a flush, 2 reads on replica m-a; nothing on m-b.
    let c = DataClient::connect(&a.data.to_socket_string(), ClientConfig::default())
        .await
        .unwrap();
    for i in 0..8u64 {
        c.write(i * (64 << 10), &[7u8; 64 << 10]).await.unwrap();
    }
    c.flush().await.unwrap();
    let mut buf = vec![0u8; 4096];
    c.read(0, &mut buf).await.unwrap();
    c.read(4096, &mut buf).await.unwrap();
    c.close().await;
    let mut ctl = ReplicaServiceClient::connect(format!("http://{}", a.control.to_socket_string()))
        .await
        .unwrap();
    ctl.replica_snapshot(v1::ReplicaSnapshotRequest {
        name: "s1".into(),
        user_created: true,
        ..Default::default()
    })
    .await
    .unwrap();

    let after = scrape(&d).await;
    let of = |name: &str, r: &str| sample(&after, &format!("corral_{name}{{replica=\"{r}\"}}"));
    assert_eq!(of("replica_data_written_bytes_total", "m-a"), 524_288.0);
    assert_eq!(of("replica_data_read_bytes_total", "m-a"), 8192.0);
    assert_eq!(of("replica_data_written_bytes_total", "m-b"), 0.0);
    assert_eq!(of("replica_write_latency_seconds_count", "m-a"), 8.0);
    assert_eq!(of("replica_read_latency_seconds_count", "m-a"), 2.0);
    assert!(of("replica_flush_latency_seconds_count", "m-a") >= 1.0);
    assert_eq!(of("replica_write_latency_seconds_count", "m-b"), 0.0);
    assert!(of("replica_write_latency_seconds_sum", "m-a") > 0.0);
    assert_eq!(
        sample(
            &after,
            "corral_replica_write_latency_seconds_bucket{le=\"+Inf\",replica=\"m-a\"}"
        ),
        8.0
    );
    assert_eq!(sample(&after, "corral_lvstore_snapshots"), 1.0);
    assert_eq!(sample(&after, "corral_lvstore_lvols"), 2.0);
    assert_eq!(
        sample(&after, "corral_lvstore_clusters_used") - used0,
        8.0,
        "8 clusters of 64 KiB taken by the writes"
    );
    assert_eq!(sample(&after, "corral_lvstore_clusters_free"), free0 - 8.0);
    assert!(sample(&after, "corral_lvstore_journal_commits_total") > commits0);
}
