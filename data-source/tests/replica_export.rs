//! `export-from-volume` from a real `corral-replica`: data written through its data port, a snapshot taken, more
//! writes after it; the data source must receive exactly the snapshot, holes as holes.
//! Needs `target/debug/corral-replica` (`cargo build --workspace --bins`, as the test script does); it runs on
//! port 0 and its endpoints come from its ready file.

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use common::*;
use corral_proto::v1::replica_service_client::ReplicaServiceClient;
use corral_proto::{ReplicaAddress, v1};
use data_protocol::{ClientConfig, DataClient};
use testkit::{DaemonCommand, workspace_bin};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_from_a_real_replica_receives_exactly_the_snapshot() {
    let rdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let replica = DaemonCommand::new(workspace_bin("corral-replica"))
        .label("corral-replica")
        .args(["serve", "--dir"])
        .arg(rdir.path())
        .args(["--listen", "127.0.0.1:0", "--size", "16M"])
        .spawn();
    let address = ReplicaAddress::tcp(
        "127.0.0.1",
        replica.port("control"),
        replica.port("data"),
        replica.port("sync"),
    );

    let data = DataClient::connect(&address.data.to_socket_string(), ClientConfig::default())
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
    let mut control = ReplicaServiceClient::connect(address.control.grpc_uri())
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
    // The data source pulls from the replica's sync endpoint (its SyncAgentService exports the snapshot).
    let sender = format!("sender-address={}", address.sync);
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
