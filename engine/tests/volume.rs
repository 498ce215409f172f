//! The engine end to end with real replicas and real NBD clients.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{DataEngine, Engine, Replica};
use corral_proto::{ReplicaAddress, v1};
use testkit::qemu_io;
use testkit::{wait_for, wait_for_async};

const SIZE: u64 = 64 << 20;

fn replicas(dir: &std::path::Path, n: usize, extra: &[&str]) -> Vec<Replica> {
    replicas_on(DataEngine::V1, dir, n, extra)
}

fn replicas_on(engine: DataEngine, dir: &std::path::Path, n: usize, extra: &[&str]) -> Vec<Replica> {
    (0..n)
        .map(|i| Replica::start_on(engine, &dir.join(format!("r{i}")), extra))
        .collect()
}

// The same tests against v1 replicas and v2 (lvstore) replicas: `NAME::v1`, `NAME::v2`.
on_both_engines!(
    qemu_clients_read_back_patterns_over_unix_and_tcp_and_convert_equals_what_was_written,
    revert_returns_the_volume_to_the_snapshot,
    a_replica_that_missed_writes_is_err_at_start_with_the_revision_counter,
    nbdinfo_map_shows_holes_where_nothing_was_written,
    replica_killed_under_load_goes_err_io_continues_and_a_new_replica_rebuilds_to_identical_data,
);

fn addrs(rs: &[Replica]) -> Vec<String> {
    rs.iter().map(Replica::address).collect()
}

async fn qemu_clients_read_back_patterns_over_unix_and_tcp_and_convert_equals_what_was_written(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let rs = replicas_on(engine, t.path(), 2, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &[
            "write -P 0xab 0 1M",
            "write -P 0x5c 8M 64k",
            "read -P 0xab 0 1M",
            "flush",
        ],
    );
    assert!(ok, "{out}");
    let (ok, out) = qemu_io(
        &e.tcp_uri(),
        &[
            "read -P 0x5c 8M 64k",
            "write -P 0x77 1536 512",
            "read -P 0x77 1536 512",
        ],
    );
    assert!(ok, "{out}");
    // A wrong pattern is detected (the check can fail).
    let (ok, _) = qemu_io(&e.tcp_uri(), &["read -P 0x00 0 4k"]);
    assert!(!ok, "reading 0xab as 0x00 must fail");

    // qemu-img convert of the export equals a local file built the same way.
    let expected = t.path().join("expected.raw");
    let mut want = vec![0u8; usize::try_from(SIZE).unwrap()];
    want[..1 << 20].fill(0xab);
    want[8 << 20..(8 << 20) + (64 << 10)].fill(0x5c);
    want[1536..2048].fill(0x77);
    std::fs::write(&expected, &want).unwrap();
    let exported = t.path().join("export.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &e.unix_uri()])
        .arg(&exported)
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(std::fs::read(&exported).unwrap(), want);
    let cmp = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", &e.tcp_uri()])
        .arg(&expected)
        .output()
        .unwrap();
    assert!(cmp.status.success(), "{}", String::from_utf8_lossy(&cmp.stdout));
    // Every replica holds the same data.
    for r in &rs {
        assert!(r.flattened(SIZE).await == want, "replica {} differs", r.address());
    }
}

async fn replica_killed_under_load_goes_err_io_continues_and_a_new_replica_rebuilds_to_identical_data(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let mut rs = replicas_on(engine, t.path(), 3, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x01 0 8M"]).0);
    assert!(e.cli(&["snapshot", "create", "base"]).status.success());
    // A write load in the background while replica 2 is killed.
    let uri = e.unix_uri();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let done_w = done.clone();
    let load = std::thread::spawn(move || {
        let mut failures = Vec::new();
        for i in 0..40u64 {
            done_w.store(i, std::sync::atomic::Ordering::Release);
            let off = (i % 32) * (1 << 20);
            let (ok, out) = qemu_io(
                &uri,
                &[&format!("write -P 0x{:02x} {off} 1M", 0x10 + i % 64), "flush"],
            );
            if !ok {
                failures.push(out);
            }
        }
        failures
    });
    // Kill the replica once the load is under way (a few writes in), not after a guessed delay.
    wait_for("the write load to start", Duration::from_secs(30), || {
        (done.load(std::sync::atomic::Ordering::Acquire) >= 3).then_some(())
    });
    rs[2].kill();
    let failures = load.join().unwrap();
    assert!(
        failures.is_empty(),
        "IO failed while one replica died: {failures:?}"
    );
    let dead = rs[2].address();
    wait_for_async("killed replica ERR", Duration::from_secs(20), async || {
        e.modes()
            .await
            .iter()
            .any(|(a, m)| *a == dead && m == "ERR")
            .then_some(())
    })
    .await;

    // Add a fresh replica: it rebuilds to RW.
    let fresh = Replica::start_on(engine, &t.path().join("r-new"), &[]);
    let out = e.cli(&["replica", "add", &fresh.address()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let modes = e.modes().await;
    assert!(
        modes.iter().any(|(a, m)| *a == fresh.address() && m == "RW"),
        "{modes:?}"
    );
    assert!(e.cli(&["replica", "rm", &dead]).status.success());

    // The three live replicas hold identical data, equal to what the volume reads.
    let mut via_nbd = vec![0u8; usize::try_from(SIZE).unwrap()];
    let exported = t.path().join("export.raw");
    assert!(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw", &e.unix_uri()])
            .arg(&exported)
            .status()
            .unwrap()
            .success()
    );
    via_nbd.copy_from_slice(&std::fs::read(&exported).unwrap());
    for r in [&rs[0], &rs[1], &fresh] {
        assert!(
            r.flattened(SIZE).await == via_nbd,
            "replica {} differs from the volume",
            r.address()
        );
    }
    // Writes after the rebuild reach the new replica too.
    assert!(qemu_io(&e.unix_uri(), &["write -P 0xee 60M 1M", "flush"]).0);
    let after = fresh.flattened(SIZE).await;
    assert!(after[60 << 20..61 << 20].iter().all(|&b| b == 0xee));
}

/// A v2 replica rebuilds from v1 replicas and a v1 replica from a v2 one (the same `FilesSync`/`FileSend` calls
/// and sparse-sync transfer), keeping a snapshot chain with an expand in it; every step reads back identical data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilds_cross_engines_v1_to_v2_and_v2_to_v1() {
    let t = tempfile::tempdir().unwrap();
    let mut v1r = Replica::start(&t.path().join("v1a"), &[]);
    let small = SIZE / 2;
    let e = Engine::start(t.path(), "vol", small, &[v1r.address()], &[]);
    assert!(
        qemu_io(
            &e.unix_uri(),
            &["write -P 0x11 0 4M", "write -P 0x12 20M 64k", "flush"]
        )
        .0
    );
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    let out = e.cli(&["expand", "--size", &SIZE.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        qemu_io(
            &e.unix_uri(),
            &["write -P 0x13 1M 4k", "write -P 0x14 24M 4k", "flush"]
        )
        .0
    );
    assert!(e.cli(&["snapshot", "create", "s2"]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x15 2M 8k", "flush"]).0);
    let size = SIZE;
    let want = v1r.flattened(size).await;

    // v1 -> v2.
    let v2r = Replica::start_on(DataEngine::V2, &t.path().join("v2a"), &[]);
    let out = e.cli(&["replica", "add", &v2r.address()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        e.modes()
            .await
            .iter()
            .any(|(a, m)| *a == v2r.address() && m == "RW")
    );
    assert!(v2r.flattened(size).await == want, "v2 rebuilt from v1 differs");
    let tree = |r: &v1::Replica| {
        let mut t: Vec<(String, String)> = r
            .disks
            .values()
            .filter(|d| d.name != r.head)
            .map(|d| (d.name.clone(), d.parent.clone()))
            .collect();
        t.sort();
        t
    };
    let (a, b) = (v1r.status().await, v2r.status().await);
    assert_eq!(tree(&a), tree(&b));
    assert!(
        tree(&a).len() >= 3,
        "s1, s2 and the rebuild snapshot: {:?}",
        tree(&a)
    );

    // Drop the v1 replica; v2 -> v1 into a fresh one.
    let old = v1r.address();
    v1r.kill();
    wait_for_async("killed v1 replica ERR", Duration::from_secs(20), async || {
        e.modes()
            .await
            .iter()
            .any(|(a, m)| *a == old && m == "ERR")
            .then_some(())
    })
    .await;
    assert!(e.cli(&["replica", "rm", &old]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x16 3M 4k", "flush"]).0);
    let want = v2r.flattened(size).await;
    let v1b = Replica::start(&t.path().join("v1b"), &[]);
    let out = e.cli(&["replica", "add", &v1b.address()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        e.modes()
            .await
            .iter()
            .any(|(a, m)| *a == v1b.address() && m == "RW")
    );
    assert!(v1b.flattened(size).await == want, "v1 rebuilt from v2 differs");
    assert_eq!(tree(&v1b.status().await), tree(&v2r.status().await));
}

async fn revert_returns_the_volume_to_the_snapshot(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let rs = replicas_on(engine, t.path(), 2, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    assert!(qemu_io(&e.unix_uri(), &["write -P 0xaa 0 2M"]).0);
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0xbb 1M 2M", "read -P 0xbb 1M 2M"]).0);
    let out = e.cli(&["snapshot", "revert", "s1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ok, text) = qemu_io(&e.unix_uri(), &["read -P 0xaa 0 2M", "read -P 0x00 2M 1M"]);
    assert!(ok, "{text}");
    // The NBD TCP port (port 0 at start) stays the engine's while the frontend is down, so no other process can
    // take it in between and the frontend comes back where clients and the ready file expect it.
    let mut c = e.client().await;
    c.frontend_shutdown(v1::Empty {}).await.unwrap();
    let nbd = e.daemon.addr("nbd");
    assert!(
        std::net::TcpListener::bind(nbd).is_err(),
        "{nbd} was released while the frontend was down"
    );
    c.frontend_start(v1::Empty {}).await.unwrap();
    let (ok, text) = qemu_io(&e.tcp_uri(), &["read -P 0xaa 0 2M"]);
    assert!(ok, "{text}");
    // Revert with the frontend up is refused by the API.
    let st = e
        .client()
        .await
        .snapshot_revert(v1::SnapshotName { name: "s1".into() })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition);
}

async fn a_replica_that_missed_writes_is_err_at_start_with_the_revision_counter(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let rs = replicas_on(engine, t.path(), 2, &[]);
    {
        let mut e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
        assert!(qemu_io(&e.unix_uri(), &["write -P 0x01 0 64k", "flush"]).0);
        e.kill();
    }
    {
        // Only replica 0: it gets writes replica 1 misses.
        let mut e = Engine::start(t.path(), "vol", SIZE, &[rs[0].address()], &[]);
        assert!(qemu_io(&e.unix_uri(), &["write -P 0x02 0 64k", "flush"]).0);
        e.kill();
    }
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    let list = e
        .client()
        .await
        .replica_list(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    let lagging = list.iter().find(|x| x.address == rs[1].address()).unwrap();
    assert_eq!(lagging.mode, "ERR");
    assert!(lagging.error.contains("revision counter"), "{}", lagging.error);
    assert!(
        qemu_io(&e.unix_uri(), &["read -P 0x02 0 64k"]).0,
        "the volume serves the newer data"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_replicas_are_refused_with_clear_errors_and_nothing_is_written() {
    let t = tempfile::tempdir().unwrap();
    // The old single-port form is refused before anything is contacted, saying what is missing.
    let err = Engine::start_failing("vol", SIZE, &["tcp://127.0.0.1:9502".to_owned()]);
    assert!(err.contains("data and sync endpoints are missing"), "{err}");
    // Endpoints that are not a replica (a plain TCP listener), ones nobody listens on, and a replica of another
    // size.
    let not_replica = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = not_replica.local_addr().unwrap().port();
    let bogus = ReplicaAddress::tcp("127.0.0.1", p, p, p).to_string();
    let nobody = testkit::ports::unbound_port();
    let closed = ReplicaAddress::tcp("127.0.0.1", nobody, nobody, nobody).to_string();
    let other = Replica::start(&t.path().join("other"), &["--size", "32M"]);
    let err = Engine::start_failing("vol", SIZE, &[bogus.clone(), closed.clone(), other.address()]);
    assert!(err.contains("not a reachable Corral replica"), "{err}");
    assert!(
        err.contains("size 33554432 differs from the volume size 67108864"),
        "{err}"
    );
    assert!(err.contains("no healthy replica"), "{err}");
    // The other-size replica was not touched.
    let s = replica_status(&other).await;
    assert_eq!((s.size, s.revision_counter, s.head_file_size), (32 << 20, 0, 0));
    // With one good replica the engine starts and lists the bad ones as ERR with their reason.
    let good = Replica::start(&t.path().join("good"), &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &[good.address(), other.address()], &[]);
    let list = e
        .client()
        .await
        .replica_list(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    assert!(
        list.iter()
            .any(|x| x.address == other.address() && x.mode == "ERR" && x.error.contains("differs")),
        "{list:?}"
    );
    // Requests past the end: an error to the client, the connection stays usable.
    let (ok, text) = qemu_io(
        &e.unix_uri(),
        &["read 64M 4k", "write -P 0x42 0 4k", "read -P 0x42 0 4k"],
    );
    assert!(!ok && text.contains("read failed"), "{text}");
    assert!(text.contains("wrote 4096/4096"), "{text}");
}

async fn replica_status(r: &Replica) -> v1::Replica {
    r.status().await
}

async fn nbdinfo_map_shows_holes_where_nothing_was_written(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let rs = replicas_on(engine, t.path(), 2, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x01 0 1M"]).0);
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x02 8M 64k"]).0);
    let out = Command::new("nbdinfo")
        .args(["--map", &e.unix_uri()])
        .output()
        .expect("nbdinfo (apt-get install libnbd-bin)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // Lines: offset length type description.
    let map: Vec<(u64, u64, bool)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.parse().ok()?,
                f.get(1)?.parse().ok()?,
                f.get(3)?.contains("hole"),
            ))
        })
        .collect();
    let mib = 1u64 << 20;
    assert_eq!(
        map,
        vec![
            (0, mib, false),
            (mib, 7 * mib, true),
            (8 * mib, 64 << 10, false),
            (8 * mib + (64 << 10), SIZE - 8 * mib - (64 << 10), true)
        ],
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_adding_a_replica_skips_snapshot_files_whose_recorded_checksums_match() {
    let t = tempfile::tempdir().unwrap();
    let rs = replicas(t.path(), 2, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x61 0 16M", "flush"]).0);
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    // Record the snapshot's checksum on both replicas (what a periodic hash job does): given the whole address,
    // or only the control endpoint (the CLI then asks the replica for its sync endpoint).
    for url in [rs[0].address(), rs[1].daemon.addr("control").to_owned()] {
        let out = Command::new(common::bin("corral-replica"))
            .args(["hash", "--url", &url, "s1"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    // Replica 1 leaves and comes back: its s1 is identical and recorded, so only newer data moves.
    assert!(e.cli(&["replica", "rm", &rs[1].address()]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x62 32M 1M", "flush"]).0);
    let out = e.cli(&["replica", "add", &rs[1].address(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (sent, skipped) = (
        job["bytesTransferred"].as_u64().unwrap(),
        job["bytesSkipped"].as_u64().unwrap(),
    );
    assert!(skipped >= 16 << 20, "s1 (16 MiB) must be skipped whole: {job}");
    assert!(sent <= 2 << 20, "only the data written since may move: {job}");
    let want = rs[0].flattened(SIZE).await;
    assert!(
        rs[1].flattened(SIZE).await == want,
        "the re-added replica differs"
    );
}

/// Issue 16 item 4: a replica that serves the data protocol on a unix socket (as the manager starts every replica)
/// is reached there by an engine on its node; its address keeps naming the TCP endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_beside_a_replica_reaches_it_over_its_unix_socket_and_falls_back_to_tcp_without_one() {
    let t = tempfile::tempdir().unwrap();
    let sock = t.path().join("r0.sock");
    let r = Replica::start(&t.path().join("r0"), &["--data-unix", sock.to_str().unwrap()]);
    let st = r
        .control()
        .await
        .replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.data_local_endpoint, format!("unix:{}", sock.display()));
    // The address's TCP data endpoint leads nowhere: IO works only through the unix socket.
    let mut nowhere: ReplicaAddress = r.replica_address();
    nowhere.data = corral_proto::Endpoint::tcp("127.0.0.1", testkit::ports::unbound_port());
    let e = Engine::start(t.path(), "vol", SIZE, &[nowhere.to_string()], &[]);
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &["write -P 0x3c 4k 64k", "flush", "read -P 0x3c 4k 64k"],
    );
    assert!(ok, "{out}");
    assert_eq!(e.modes().await, vec![(nowhere.to_string(), "RW".to_owned())]);
    drop(e);

    // Without the socket file (the replica on another node), the engine takes the TCP endpoint and reads the
    // same data; given the dead TCP endpoint now, it cannot start (the check above can fail).
    std::fs::remove_file(&sock).unwrap();
    let err = Engine::start_failing("vol", SIZE, &[nowhere.to_string()]);
    assert!(err.contains("data endpoint"), "{err}");
    let t2 = tempfile::tempdir().unwrap();
    let e = Engine::start(t2.path(), "vol", SIZE, &[r.address()], &[]);
    let (ok, out) = qemu_io(&e.unix_uri(), &["read -P 0x3c 4k 64k"]);
    assert!(ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_copies_the_source_files_locally_on_one_host_and_over_the_network_when_told_not_to() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let rs = replicas(t.path(), 1, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    assert!(
        qemu_io(
            &e.unix_uri(),
            &["write -P 0x41 0 8M", "write -P 0x42 40M 4M", "flush"]
        )
        .0
    );
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x43 4M 2M", "flush"]).0);
    for (name, extra, local) in [
        ("r-local", &[][..], true),
        ("r-net", &["--no-local-copy"][..], false),
    ] {
        let fresh = Replica::start(&t.path().join(name), extra);
        let out = e.cli(&["replica", "add", &fresh.address(), "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let (sent, local_bytes) = (
            job["bytesTransferred"].as_u64().unwrap_or(0),
            job["bytesCopiedLocally"].as_u64().unwrap_or(0),
        );
        assert!(sent >= 14 << 20, "{name}: {job}");
        if local {
            assert_eq!(local_bytes, sent, "{name} did not copy locally: {job}");
        } else {
            assert_eq!(
                local_bytes, 0,
                "{name} copied locally although told not to: {job}"
            );
        }
        let modes = e.modes().await;
        assert!(
            modes.iter().any(|(a, m)| *a == fresh.address() && m == "RW"),
            "{modes:?}"
        );
        assert!(
            fresh.flattened(SIZE).await == rs[0].flattened(SIZE).await,
            "{name} differs from the source"
        );
        let snap = std::fs::read_dir(&rs[0].dir)
            .unwrap()
            .map(|d| d.unwrap().file_name().into_string().unwrap())
            .filter(|f| f.starts_with("volume-snap-") && f.ends_with(".img"))
            .collect::<Vec<_>>();
        assert!(snap.len() >= 2, "{snap:?}");
        for f in &snap {
            let cmp = Command::new("cmp")
                .arg(rs[0].dir.join(f))
                .arg(fresh.dir.join(f))
                .output()
                .unwrap();
            assert!(
                cmp.status.success(),
                "{name}: {f} differs: {}",
                String::from_utf8_lossy(&cmp.stdout)
            );
        }
        assert!(e.cli(&["replica", "rm", &fresh.address()]).status.success());
    }
}

/// Context switches (voluntary + involuntary) of the threads of `pid` whose name is `name` (`/proc/PID/task`).
fn thread_switches(pid: u32, name: &str) -> (usize, u64) {
    let mut threads = 0;
    let mut switches = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() != name {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue;
        };
        threads += 1;
        switches += status
            .lines()
            .filter(|l| {
                l.starts_with("voluntary_ctxt_switches:") || l.starts_with("nonvoluntary_ctxt_switches:")
            })
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    (threads, switches)
}

/// The data path runs on the engine's `engine-io` thread (engine/src/io_runtime.rs), not on the control runtime's
/// workers: qd1 writes, each waiting for the replica, put the IO thread to sleep and wake it once per IO at least,
/// while the workers (gRPC, metrics, the connection watcher) stay nearly idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_io_runs_on_the_engine_io_thread_not_on_the_control_runtime() {
    const WRITES: u64 = 256;
    let t = tempfile::tempdir().unwrap();
    let rs = replicas(t.path(), 1, &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &addrs(&rs), &[]);
    let pid = e.daemon.pid();
    // One IO first: every connection is up before counting.
    let (ok, out) = qemu_io(&e.unix_uri(), &["write -P 0x01 0 4k"]);
    assert!(ok, "{out}");
    let (io_threads, io_before) = thread_switches(pid, "engine-io");
    assert_eq!(io_threads, 1, "the engine has one engine-io thread");
    let (_, workers_before) = thread_switches(pid, "tokio-rt-worker");

    let cmds: Vec<String> = (0..WRITES)
        .map(|i| format!("write -P 0x5a {} 4k", i * 8192))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, out) = qemu_io(&e.unix_uri(), &cmds);
    assert!(ok, "{out}");
    let (_, io_after) = thread_switches(pid, "engine-io");
    let (_, workers_after) = thread_switches(pid, "tokio-rt-worker");
    let io = io_after - io_before;
    let workers = workers_after - workers_before;
    eprintln!("context switches over {WRITES} qd1 writes: engine-io {io}, control workers {workers}");
    assert!(
        io >= WRITES / 2,
        "engine-io switched {io} times for {WRITES} qd1 writes: the IO is not on it"
    );
    assert!(
        workers * 4 < io,
        "the control runtime's workers switched {workers} times against engine-io's {io}: IO runs on them"
    );
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &["read -P 0x5a 8192 4k", "read -P 0x5a 2088960 4k"],
    );
    assert!(ok, "{out}");
}
