//! The v2 data engine end to end: `corral-replica serve-lvstore` daemons, each one lvstore on a preallocated
//! file hosting several replicas (of different volumes), engines over them, real fio and qemu-io, a daemon
//! SIGKILLed under writes and restarted at the same addresses, `corral-lvstore check` on the disk. And the
//! daemon's bad input: a disk that is not an lvstore, replica names with path tricks.

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Engine, bin};
use corral_proto::ReplicaAddress;
use corral_proto::v1::{self, lvstore_service_client::LvstoreServiceClient};
use data_protocol::{ClientConfig, DataClient};
use testkit::{Daemon, DaemonCommand, qemu_io};
use tonic::transport::Channel;

const SIZE: u64 = 64 << 20;
const BLOCK: u64 = 64 << 10;

fn disk(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    let st = Command::new("fallocate")
        .args(["-l", &(512u64 << 20).to_string()])
        .arg(&p)
        .status()
        .unwrap();
    assert!(st.success());
    p
}

fn lvstore_daemon(disk: &std::path::Path) -> Daemon {
    DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(disk)
        .args(["--listen", "127.0.0.1:0"])
        .spawn()
}

async fn service(d: &Daemon) -> LvstoreServiceClient<Channel> {
    LvstoreServiceClient::connect(d.http_url("control"))
        .await
        .unwrap()
}

async fn add(d: &Daemon, name: &str) -> String {
    service(d)
        .await
        .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
            name: name.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .address
}

fn check(disk: &std::path::Path) -> String {
    let out = Command::new(bin("corral-lvstore"))
        .arg("check")
        .arg(disk)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "corral-lvstore check {}: {text}",
        disk.display()
    );
    text
}

/// Reads `len` bytes at `off` through a replica's own data endpoint (its lvol chain).
async fn read_replica(address: &str, off: u64, len: usize) -> Vec<u8> {
    let a: ReplicaAddress = address.parse().unwrap();
    let c = DataClient::connect(&a.data.to_socket_string(), ClientConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; len];
    c.read(off, &mut buf).await.unwrap();
    c.close().await;
    buf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_of_two_volumes_on_one_lvstore_survive_a_daemon_sigkill_with_every_flushed_write() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let (disk_a, disk_b) = (disk(t.path(), "a.img"), disk(t.path(), "b.img"));
    let mut da = lvstore_daemon(&disk_a);
    let db = lvstore_daemon(&disk_b);
    // Volume x: one replica on each disk; volume y: one replica on disk a (two volumes share daemon a).
    let (x0, y0, x1) = (
        add(&da, "x-r0").await,
        add(&da, "y-r0").await,
        add(&db, "x-r1").await,
    );
    let ex = Engine::start(t.path(), "x", SIZE, &[x0.clone(), x1.clone()], &[]);
    let mut ey = Engine::start(t.path(), "y", SIZE, std::slice::from_ref(&y0), &[]);

    // fio writes and verifies through the engine (fan-out to both v2 replicas).
    let out = Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", ex.unix_uri()),
            "--rw=randwrite",
            "--bs=4k",
            "--size=8M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("err= 0"), "{text}");
    assert!(qemu_io(&ey.unix_uri(), &["write -P 0x5a 0 4M", "flush"]).0);
    assert!(ex.cli(&["snapshot", "create", "s1"]).status.success());
    let before_snap = read_replica(&x0, 0, 8 << 20).await;

    // Writer on x over the snapshot: distinct 64 KiB blocks, each write + flush; a pair acknowledged is durable.
    let acked = Arc::new(Mutex::new(Vec::<(u64, u8)>::new()));
    let (uri, acked_w) = (ex.unix_uri(), acked.clone());
    let writer = std::thread::spawn(move || {
        for i in 0..200u64 {
            let off = (16 << 20) + i * BLOCK;
            let p = u8::try_from(i % 250 + 1).unwrap();
            let (ok, _) = qemu_io(&uri, &[&format!("write -P 0x{p:02x} {off} {BLOCK}"), "flush"]);
            assert!(
                ok,
                "write at {off} failed: the engine must go on with the other replica"
            );
            acked_w.lock().unwrap().push((off, p));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked.lock().unwrap().len() < 5 {
        assert!(Instant::now() < deadline, "no write got through");
        std::thread::sleep(Duration::from_millis(20));
    }
    let durable = acked.lock().unwrap().clone();
    da.kill(); // SIGKILL, with the writer going
    let after_kill = acked.lock().unwrap().len();
    writer.join().unwrap();
    let total = acked.lock().unwrap().len();
    assert!(
        total > after_kill,
        "the writer was not running when the daemon was killed"
    );
    eprintln!(
        "{} writes acknowledged before the kill, {} in all",
        durable.len(),
        total
    );
    // The killed daemon's store checks clean offline.
    check(&disk_a);

    // Restart: both replicas come back on the ports recorded in their head lvols.
    da.restart();
    let listed = service(&da)
        .await
        .lvstore_replica_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    let addrs: Vec<&str> = listed.iter().map(|r| r.address.as_str()).collect();
    assert_eq!(addrs, [x0.as_str(), y0.as_str()], "{listed:?}");
    // x-r0 holds every write flushed before the kill, the snapshot, and what was under it.
    for &(off, p) in &durable {
        let got = read_replica(&x0, off, usize::try_from(BLOCK).unwrap()).await;
        assert!(got.iter().all(|b| *b == p), "flushed write at {off} lost on x-r0");
    }
    assert!(read_replica(&x0, 0, 8 << 20).await == before_snap);
    // The engine of x kept writing to x-r1: x reads every write.
    for &(off, p) in acked.lock().unwrap().iter() {
        assert!(qemu_io(&ex.unix_uri(), &[&format!("read -P 0x{p:02x} {off} {BLOCK}")]).0);
    }
    // Volume y (its only replica was on the killed daemon) serves its flushed data again after an engine restart.
    ey.kill();
    let ey = Engine::start(t.path(), "y2", SIZE, std::slice::from_ref(&y0), &[]);
    let (ok, out) = qemu_io(&ey.unix_uri(), &["read -P 0x5a 0 4M"]);
    assert!(ok, "{out}");
    drop((ex, ey));
    drop((da, db));
    let text = check(&disk_a);
    assert!(
        text.contains("ok") || text.contains("clean") || !text.is_empty(),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_is_not_an_lvstore_and_names_with_path_tricks_are_refused_and_nothing_changes() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    // Not an lvstore, without --format: refused, the bytes untouched.
    let p = t.path().join("data.img");
    let junk: Vec<u8> = (0..(8u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(&p, &junk).unwrap();
    let out = Command::new(bin("corral-replica"))
        .args(["serve-lvstore", "--listen", "127.0.0.1:0", "--disk"])
        .arg(&p)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served a disk that holds no lvstore");
    assert!(
        err.contains("not an lvstore") && err.contains("--format"),
        "{err}"
    );
    assert!(std::fs::read(&p).unwrap() == junk, "the disk was changed");
    // A missing disk.
    let out = Command::new(bin("corral-replica"))
        .args(["serve-lvstore", "--format", "--listen", "127.0.0.1:0", "--disk"])
        .arg(t.path().join("missing.img"))
        .output()
        .unwrap();
    assert!(!out.status.success());

    // Names with path tricks or dots, over gRPC and on the command line: refused, the store unchanged.
    let d = disk(t.path(), "d.img");
    let daemon = lvstore_daemon(&d);
    add(&daemon, "good").await;
    let mut svc = service(&daemon).await;
    for bad in [
        "",
        "../x",
        "a/b",
        "a.snap.b",
        ".hidden",
        "-rf",
        "a b",
        &"x".repeat(101),
    ] {
        let st = svc
            .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
                name: bad.into(),
                size: 1 << 20,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument, "{bad:?}: {st:?}");
        assert!(st.message().contains("invalid replica name"), "{st:?}");
    }
    // Snapshot names with path tricks, on a hosted replica.
    let good: ReplicaAddress = add(&daemon, "good").await.parse().unwrap();
    let mut ctl =
        corral_proto::v1::replica_service_client::ReplicaServiceClient::connect(good.control.grpc_uri())
            .await
            .unwrap();
    ctl.replica_create(v1::ReplicaCreateRequest {
        size: 4 << 20,
        disable_revision_counter: false,
    })
    .await
    .unwrap();
    for bad in ["../x", "a/b", "..", "-rf"] {
        let st = ctl
            .replica_snapshot(v1::ReplicaSnapshotRequest {
                name: bad.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument, "{bad:?}: {st:?}");
    }
    let listed = svc
        .lvstore_replica_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let s = ctl
        .replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replica
        .unwrap();
    assert_eq!(s.disks.len(), 1, "only the head: {:?}", s.disks);
    drop(daemon);
    let out = Command::new(bin("corral-lvstore"))
        .args(["ls", "--json"])
        .arg(&d)
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{ls}");
    assert!(ls.contains("\"good\"") && !ls.contains("snap"), "{ls}");
    let out = Command::new(bin("corral-replica"))
        .args([
            "serve-lvstore",
            "--listen",
            "127.0.0.1:0",
            "--replica",
            "../etc",
            "--disk",
        ])
        .arg(&d)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("invalid replica name"),
        "{err}"
    );
}

/// A v2 disk daemon started with `--data-unix-dir` (as the manager starts it) serves each hosted replica's data
/// protocol on `DIR/NAME.data.sock` too and reports it in `ReplicaGet`; an engine on its node reaches the replica
/// there (the address's TCP data endpoint leads nowhere here), and removing the replica removes its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_beside_an_lvstore_daemon_reaches_its_replica_over_the_replicas_unix_socket() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let d = disk(t.path(), "d.img");
    let socks = t.path().join("sockets");
    let daemon = DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(&d)
        .args(["--listen", "127.0.0.1:0", "--data-unix-dir"])
        .arg(&socks)
        .spawn();
    let a: ReplicaAddress = add(&daemon, "va").await.parse().unwrap();
    let sock = socks.join("va.data.sock");
    let st = v1::replica_service_client::ReplicaServiceClient::connect(a.control.grpc_uri())
        .await
        .unwrap()
        .replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.data_local_endpoint, format!("unix:{}", sock.display()));
    let mut nowhere = a.clone();
    nowhere.data = corral_proto::Endpoint::tcp("127.0.0.1", testkit::ports::unbound_port());
    let e = Engine::start(t.path(), "va", SIZE, &[nowhere.to_string()], &[]);
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &["write -P 0x5d 4k 64k", "flush", "read -P 0x5d 4k 64k"],
    );
    assert!(ok, "{out}");
    drop(e);
    // The data reached the lvol (read back over the TCP endpoint the daemon does serve).
    assert!(
        read_replica(&a.to_string(), 4096, 64 << 10)
            .await
            .iter()
            .all(|&b| b == 0x5d)
    );

    service(&daemon)
        .await
        .lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
            name: "va".into(),
            delete_data: false,
        })
        .await
        .unwrap();
    assert!(
        !sock.exists(),
        "the socket of a replica no longer served is left behind"
    );
}
