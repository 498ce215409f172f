//! The daemon end to end over its real ports: revision counter on and off, flags, jobs through the sync agent,
//! expansion, and the offline CLI.

mod common;

use std::time::Duration;

use common::Daemon;
use corral_proto::v1;
use testkit::wait_for_async;

const SIZE: u64 = 16 << 20;

async fn replica(d: &Daemon) -> v1::Replica {
    d.control()
        .await
        .replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replica
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revision_counter_counts_writes_and_survives_restart_only_as_far_as_flushed() {
    let t = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(t.path(), Some(SIZE), &[]);
    let data = d.data().await;
    for i in 0..10u64 {
        data.write(i * 4096, &[1u8; 4096]).await.unwrap();
    }
    data.unmap(0, 4096).await.unwrap();
    assert_eq!(replica(&d).await.revision_counter, 11);
    data.flush().await.unwrap();
    data.write(0, &[2u8; 512]).await.unwrap(); // counted, not flushed
    assert_eq!(replica(&d).await.revision_counter, 12);
    d.kill();
    let d = Daemon::start(t.path(), None, &[]);
    let r = replica(&d).await;
    assert_eq!(
        r.revision_counter, 11,
        "the file holds the count as of the last flush"
    );
    assert!(!r.revision_counter_disabled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_revision_counter_keeps_no_file_and_reports_head_mtime_and_allocation() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &["--disable-revision-counter"]);
    let data = d.data().await;
    let before = replica(&d).await;
    data.write(1 << 20, &[3u8; 65536]).await.unwrap();
    data.flush().await.unwrap();
    let after = replica(&d).await;
    assert!(after.revision_counter_disabled);
    assert_eq!(after.revision_counter, 0);
    assert!(!t.path().join("revision.counter").exists());
    assert!(
        after.head_file_size >= 65536,
        "allocated head bytes: {}",
        after.head_file_size
    );
    assert!(after.last_modify_time >= before.last_modify_time);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilding_flag_persists_and_sigterm_closes_cleanly() {
    let t = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(t.path(), Some(SIZE), &[]);
    let mut c = d.control().await;
    let r = c
        .rebuilding_set(v1::RebuildingSetRequest { rebuilding: true })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.replica.unwrap().state, "rebuilding");
    assert!(d.terminate(), "SIGTERM must exit 0");
    let s = replica::inspect(t.path()).unwrap();
    assert!(s.rebuilding && !s.dirty, "{s:?}");
}

async fn wait_purge(d: &Daemon) -> v1::SnapshotPurgeStatusResponse {
    let sa = d.sync_agent().await;
    wait_for_async("the purge to finish", Duration::from_secs(60), async || {
        let s = sa
            .clone()
            .snapshot_purge_status(v1::Empty {})
            .await
            .unwrap()
            .into_inner();
        (!s.is_purging).then_some(s)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_hash_run_as_jobs_while_io_continues() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &[]);
    let data = d.data().await;
    let mut c = d.control().await;
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let i = u64::try_from(i).unwrap();
        data.write(i * 4096, &[u8::try_from(i + 1).unwrap(); 4096])
            .await
            .unwrap();
        data.write(8 << 20, &[u8::try_from(i + 10).unwrap(); 4096])
            .await
            .unwrap();
        c.replica_snapshot(v1::ReplicaSnapshotRequest {
            name: name.into(),
            user_created: true,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    c.disk_mark_as_removed(v1::DiskRequest { name: "a".into() })
        .await
        .unwrap();
    c.disk_mark_as_removed(v1::DiskRequest { name: "c".into() })
        .await
        .unwrap();
    let mut sa = d.sync_agent().await;
    sa.snapshot_purge(v1::Empty {}).await.unwrap();
    // IO during the purge.
    data.write(12 << 20, &[7u8; 4096]).await.unwrap();
    let s = wait_purge(&d).await;
    assert_eq!(
        (s.state.as_str(), s.progress, s.error.as_str()),
        ("complete", 100, "")
    );
    let r = replica(&d).await;
    // a folded into b (b keeps its name), c pruned under the head but kept (removed).
    assert!(!r.disks.contains_key("volume-snap-a.img"));
    assert_eq!(r.disks["volume-snap-b.img"].parent, "");
    assert!(r.disks["volume-snap-c.img"].removed);
    let mut buf = vec![0u8; 4096];
    for (off, want) in [(0u64, 1u8), (4096, 2), (8192, 3), (8 << 20, 12), (12 << 20, 7)] {
        data.read(off, &mut buf).await.unwrap();
        assert!(buf.iter().all(|&b| b == want), "offset {off}");
    }

    sa.snapshot_hash(v1::SnapshotHashRequest {
        snapshot_name: "b".into(),
        rehash: false,
    })
    .await
    .unwrap();
    let h = wait_for_async("the hash of b", Duration::from_secs(60), async || {
        let h = sa
            .clone()
            .snapshot_hash_status(v1::SnapshotHashStatusRequest {
                snapshot_name: "b".into(),
            })
            .await
            .unwrap()
            .into_inner();
        (h.state != "in-progress").then_some(h)
    })
    .await;
    assert_eq!(h.state, "complete", "{h:?}");
    assert_eq!(h.checksum.len(), 128);
    assert!(t.path().join("volume-snap-b.img.checksum").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expansion_grows_the_volume_and_keeps_data() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &[]);
    let data = d.data().await;
    data.write(SIZE - 4096, &[4u8; 4096]).await.unwrap();
    let r = d
        .control()
        .await
        .replica_expand(v1::ReplicaExpandRequest { size: 2 * SIZE })
        .await
        .unwrap()
        .into_inner()
        .replica
        .unwrap();
    assert_eq!(r.size, 2 * SIZE);
    assert!(
        r.disks
            .contains_key(&format!("volume-snap-expand-{}.img", 2 * SIZE))
    );
    let fresh = d.data().await;
    assert_eq!(fresh.info().size, 2 * SIZE);
    let mut buf = vec![0u8; 8192];
    fresh.read(SIZE - 4096, &mut buf).await.unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 4) && buf[4096..].iter().all(|&b| b == 0));
    let st = d
        .control()
        .await
        .replica_expand(v1::ReplicaExpandRequest { size: SIZE })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
}

#[test]
fn offline_info_prints_json_with_chain_and_flags() {
    let t = tempfile::tempdir().unwrap();
    {
        let r = replica::Replica::create(t.path(), SIZE, &replica::ReplicaOptions::default()).unwrap();
        r.snapshot(&replica::SnapshotRequest {
            name: "s1".into(),
            user_created: true,
            ..Default::default()
        })
        .unwrap();
    }
    let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_corral-replica"))
        .args(["info", "--json", "--dir"])
        .arg(t.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["size"], SIZE);
    assert_eq!(
        v["chain"],
        serde_json::json!(["volume-head-001.img", "volume-snap-s1.img"])
    );
    assert_eq!(v["dirty"], true, "never closed cleanly");
    let bad = assert_cmd::Command::new(env!("CARGO_BIN_EXE_corral-replica"))
        .args(["info", "--dir", "/nonexistent/corral"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnamed_data_and_sync_listeners_get_free_ports_reported_in_the_ready_file_and_replica_get() {
    let tmp = tempfile::tempdir().unwrap();
    // Only the control and metrics listeners are named (port 0): data and sync default to free ports of their
    // own, never the control port plus one or two.
    let d = Daemon::start(
        &tmp.path().join("r"),
        Some(SIZE),
        &["--metrics-listen", "127.0.0.1:0"],
    );
    let addrs: Vec<std::net::SocketAddr> = ["control", "data", "sync", "metrics"]
        .iter()
        .map(|n| d.proc.socket_addr(n))
        .collect();
    let ports: std::collections::BTreeSet<u16> = addrs.iter().map(std::net::SocketAddr::port).collect();
    assert!(!ports.contains(&0) && ports.len() == 4, "{addrs:?}");
    // The control endpoint answers gRPC and reports the other two endpoints as the ready file does.
    let r = d
        .control()
        .await
        .replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.replica.unwrap().size, SIZE);
    assert_eq!(r.data_endpoint, addrs[1].to_string());
    assert_eq!(r.sync_endpoint, addrs[2].to_string());
    // Each reported address is the live listener.
    d.data().await.close().await;
    d.sync_agent()
        .await
        .snapshot_purge_status(v1::Empty {})
        .await
        .unwrap();
    std::net::TcpStream::connect(addrs[3]).unwrap();
}
