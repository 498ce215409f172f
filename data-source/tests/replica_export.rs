//! `export-from-volume` from a real `corral-replica`: data written through its data port, a snapshot taken, more
//! writes after it; the data source must receive exactly the snapshot, holes as holes.
//! Needs `target/debug/corral-replica` (`cargo build --workspace --bins`, as the test script does).

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use corral_proto::v1;
use corral_proto::v1::replica_service_client::ReplicaServiceClient;
use data_protocol::{ClientConfig, DataClient};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

fn replica_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("corral-replica");
    assert!(
        p.exists(),
        "{} missing: build it first (cargo build --workspace --bins)",
        p.display()
    );
    p
}

/// Three consecutive free ports (control, data, sync agent).
fn free_ports3() -> u16 {
    for _ in 0..500 {
        let p = free_port();
        if p < 65000 && (0..3).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
    panic!("no 3 consecutive free ports");
}

struct ReplicaProc(Child);

impl Drop for ReplicaProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_from_a_real_replica_receives_exactly_the_snapshot() {
    let rdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let port = free_ports3();
    let mut child = Command::new(replica_bin())
        .args(["serve", "--dir"])
        .arg(rdir.path())
        .args(["--listen", &format!("127.0.0.1:{port}"), "--size", "16M"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while (0..3).any(|i| std::net::TcpStream::connect(("127.0.0.1", port + i)).is_err()) {
        assert!(child.try_wait().unwrap().is_none(), "corral-replica exited");
        assert!(Instant::now() < deadline, "corral-replica not up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _replica = ReplicaProc(child);

    let data = DataClient::connect(&format!("127.0.0.1:{}", port + 1), ClientConfig::default())
        .await
        .unwrap();
    let mut want = vec![0u8; SIZE as usize];
    for (off, len, byte) in [
        (0u64, 64 * 1024usize, 1u8),
        (3 * MIB, MIB as usize, 2),
        (SIZE - 4096, 4096, 3),
    ] {
        let buf = vec![byte; len];
        data.write(off, &buf).await.unwrap();
        want[off as usize..off as usize + len].copy_from_slice(&buf);
    }
    let mut control = ReplicaServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    control
        .replica_snapshot(v1::ReplicaSnapshotRequest {
            name: "s1".into(),
            user_created: true,
            created: String::new(),
            labels: Default::default(),
        })
        .await
        .unwrap();
    // Written after the snapshot: must not be exported.
    data.write(8 * MIB, &[9u8; 8192]).await.unwrap();
    data.close().await;

    let disk = disk();
    let sender = format!("sender-address=127.0.0.1:{}", port + 2);
    let d = disk.path().to_path_buf();
    let want_sum = sha512(&want);
    tokio::task::spawn_blocking(move || {
        let ds = DataSourceProc::start(
            &d,
            "export-from-volume",
            &[
                "--param",
                "snapshot-name=s1",
                "--param",
                &sender,
                "--param",
                "volume-size=16M",
            ],
        );
        let i = ds.expect_ready(&want_sum);
        assert_eq!((i.size, i.virtual_size), (SIZE, SIZE));
        assert!(
            i.real_size < 4 * MIB,
            "holes were written: real size {}",
            i.real_size
        );
    })
    .await
    .unwrap();
}
