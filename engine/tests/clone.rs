//! Volume clone and snapshot export end to end: real replica and engine daemons, data written through NBD with
//! qemu-io, the `corral-engine snapshot clone | clone-status | export` CLI, SIGSTOP/SIGKILL of the source.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{DataEngine, Engine, Replica};
use corral_proto::v1;
use testkit::qemu_io;
use testkit::wait_for_async;

const SIZE: u64 = 32 << 20;
const MIB: usize = 1 << 20;

fn ok(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "command failed: {text}");
    text
}

fn fails(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "command succeeded but should not: {text}");
    text
}

/// Allocated bytes of the files of `dir` whose name starts with `prefix`.
fn allocated(dir: &Path, prefix: &str) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.metadata().unwrap().blocks() * 512)
        .sum()
}

/// File names in a replica directory, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "revision.counter" && n != "volume.meta")
        .collect();
    v.sort();
    v
}

async fn replica_get(r: &Replica) -> v1::Replica {
    r.status().await
}

async fn clone_status(e: &Engine) -> v1::VolumeCloneStatusResponse {
    e.client()
        .await
        .snapshot_clone_status(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
}

/// A source volume over `n` replicas with patterns written through NBD, snapshot `s1`, then more writes.
/// Returns the replicas, the engine and the volume's content at `s1`.
async fn source(engine: DataEngine, dir: &Path, n: usize, extra: &[&str]) -> (Vec<Replica>, Engine, Vec<u8>) {
    let rs: Vec<Replica> = (0..n)
        .map(|i| Replica::start_on(engine, &dir.join(format!("src{i}")), extra))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let e = Engine::start(dir, "src", SIZE, &addrs, &[]);
    let (good, out) = qemu_io(
        &e.unix_uri(),
        &[
            "write -P 0xa1 0 4M",
            "write -P 0xb2 20M 2M",
            "write -P 0x3c 31M 4k",
            "flush",
        ],
    );
    assert!(good, "{out}");
    ok(&e.cli(&["snapshot", "create", "s1"]));
    let at_s1 = rs[0].flattened(SIZE).await;
    let (good, out) = qemu_io(
        &e.unix_uri(),
        &["write -P 0xc3 1M 1M", "write -P 0xd4 28M 1M", "flush"],
    );
    assert!(good, "{out}");
    (rs, e, at_s1)
}

fn target(
    engine: DataEngine,
    dir: &Path,
    name: &str,
    n: usize,
    size: u64,
    extra: &[&str],
) -> (Vec<Replica>, Engine) {
    let rs: Vec<Replica> = (0..n)
        .map(|i| Replica::start_on(engine, &dir.join(format!("{name}{i}")), extra))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let e = Engine::start(dir, name, size, &addrs, &[]);
    (rs, e)
}

fn url(e: &Engine) -> String {
    e.url().to_owned()
}

/// `corral-engine --url TGT snapshot clone --detach-frontend --from-engine SRC --snapshot s1 EXTRA...` (the
/// target's frontend is down while it is written).
fn clone_s1(tgt: &Engine, src: &Engine, extra: &[&str]) -> Output {
    let from = url(src);
    let args = [
        &[
            "snapshot",
            "clone",
            "--detach-frontend",
            "--from-engine",
            &from,
            "--snapshot",
            "s1",
        ],
        extra,
    ]
    .concat();
    tgt.cli(&args)
}

/// A replica-level `SnapshotClone` of `s1` from the replica at `from`.
fn clone_s1_from(from: String) -> v1::SnapshotCloneRequest {
    v1::SnapshotCloneRequest {
        from_address: from,
        snapshot_file_name: "s1".into(),
        export_backing_image_if_exist: false,
        max_bytes_per_second: 0,
    }
}

on_both_engines!(
    clone_equals_the_snapshot_not_later_writes_on_every_replica_and_export_writes_the_same_image
);

async fn clone_equals_the_snapshot_not_later_writes_on_every_replica_and_export_writes_the_same_image(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let (srcs, src, at_s1) = source(engine, t.path(), 1, &[]).await;
    let (tgts, tgt) = target(engine, t.path(), "tgt", 2, SIZE, &[]);

    let out = ok(&clone_s1(&tgt, &src, &[]));
    assert!(out.contains("cloned volume-snap-s1.img"), "{out}");
    let st = clone_status(&tgt).await;
    assert_eq!(st.state, "complete");
    assert_eq!(st.progress, 100);
    assert_eq!(st.from_replica_address, srcs[0].address());
    assert_eq!(st.replicas.len(), 2);
    // Source and target share this host: every v1 target replica copied the source's files itself; a v2 source
    // offers no files (its snapshots are lvols), so v2 clones travel over the network.
    for (addr, r) in &st.replicas {
        if engine == DataEngine::V1 {
            assert!(
                r.bytes_copied_locally >= 6 << 20 && r.bytes_copied_locally == r.bytes_transferred,
                "{addr} did not take the local copy path: {r:?}"
            );
        } else {
            assert!(
                r.bytes_copied_locally == 0 && r.bytes_transferred >= 6 << 20,
                "{addr}: {r:?}"
            );
        }
    }

    // Every target replica holds the snapshot's data, not the writes made after it.
    let now = srcs[0].flattened(SIZE).await;
    assert_ne!(now, at_s1, "the later writes changed the source");
    for r in &tgts {
        assert!(
            r.flattened(SIZE).await == at_s1,
            "replica {} differs from s1",
            r.address()
        );
        let g = replica_get(r).await;
        assert_eq!(g.chain, vec!["volume-head-001.img", "volume-snap-s1.img"]);
        // Holes stayed holes: the clone allocates no more than the source snapshot holds.
        let cloned = r.snapshot_allocated("volume-snap-s1.img").await;
        let source = srcs[0].snapshot_allocated("volume-snap-s1.img").await;
        assert!(
            cloned <= source,
            "clone allocates {cloned} bytes, the source snapshot {source}"
        );
        assert!(cloned >= 6 << 20, "clone allocates only {cloned} bytes");
    }
    // Through NBD too.
    let (good, out) = qemu_io(
        &tgt.unix_uri(),
        &["read -P 0xa1 0 4M", "read -P 0xb2 20M 2M", "read -P 0 28M 1M"],
    );
    assert!(good, "{out}");

    // Export of the same snapshot to a raw file: the same image, sparse.
    let raw = t.path().join("s1.raw");
    ok(&src.cli(&[
        "snapshot",
        "export",
        "s1",
        "--to",
        raw.to_str().unwrap(),
        "--format",
        "raw",
    ]));
    assert!(
        std::fs::read(&raw).unwrap() == at_s1,
        "exported image differs from s1"
    );
    assert!(allocated(t.path(), "s1.raw") <= srcs[0].snapshot_allocated("volume-snap-s1.img").await);
    if engine == DataEngine::V1 {
        same_image(&raw, &t.path().join("src0").join("volume-snap-s1.img"));
    }
    // qcow2 (through disk-image): qemu-img reads back the same data and finds the image clean.
    let qcow = t.path().join("s1.qcow2");
    ok(&src.cli(&[
        "snapshot",
        "export",
        "s1",
        "--to",
        qcow.to_str().unwrap(),
        "--format",
        "qcow2",
    ]));
    let check = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&qcow)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let back = t.path().join("s1-back.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&qcow)
        .arg(&back)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(
        std::fs::read(&back).unwrap() == at_s1,
        "qcow2 export differs from s1"
    );
    assert!(
        !t.path().join("s1.qcow2.export-raw").exists(),
        "temporary raw export left behind"
    );
    // An existing file is not overwritten.
    let err = fails(&src.cli(&["snapshot", "export", "s1", "--to", raw.to_str().unwrap()]));
    assert!(err.contains("exists"), "{err}");
}

/// `qemu-img compare` of two raw files.
fn same_image(a: &Path, b: &Path) {
    let cmp = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(a)
        .arg(b)
        .output()
        .unwrap();
    assert!(
        cmp.status.success(),
        "{} vs {}: {}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&cmp.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_copies_locally_on_one_host_and_over_the_network_when_the_target_may_not() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let (srcs, src, at_s1) = source(DataEngine::V1, t.path(), 1, &[]).await;
    let source_snapshot = srcs[0].dir.join("volume-snap-s1.img");
    for (name, extra, local) in [("local", &[][..], true), ("net", &["--no-local-copy"][..], false)] {
        let (tgts, tgt) = target(DataEngine::V1, t.path(), name, 1, SIZE, extra);
        ok(&clone_s1(&tgt, &src, &[]));
        let st = clone_status(&tgt).await;
        let r = st.replicas.values().next().unwrap();
        assert_eq!(r.state, "complete", "{r:?}");
        if local {
            assert!(r.bytes_copied_locally >= 6 << 20, "{name}: {r:?}");
        } else {
            assert_eq!(r.bytes_copied_locally, 0, "{name}: {r:?}");
            assert!(r.bytes_transferred >= 6 << 20, "{name}: {r:?}");
        }
        assert!(
            tgts[0].flattened(SIZE).await == at_s1,
            "{name}: clone differs from s1"
        );
        same_image(&source_snapshot, &tgts[0].dir.join("volume-snap-s1.img"));
        let cloned = allocated(&tgts[0].dir, "volume-snap-s1.img");
        assert!(
            cloned <= allocated(&srcs[0].dir, "volume-snap-s1.img"),
            "{name}: {cloned}"
        );
        let left: Vec<String> = files(&tgts[0].dir)
            .into_iter()
            .filter(|f| f.ends_with(".clone") || f.contains("partial") || f.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{name}: leftovers {left:?}");
    }
}

/// Clone of a volume over a backing image (`format`: raw or qcow2, made by the test with qemu-img).
async fn clone_with_backing_image(format: &str) {
    let t = tempfile::tempdir().unwrap();
    // A backing image with data in the first 8 MiB and at 24 MiB.
    let raw = t.path().join("base.raw");
    let mut base = vec![0u8; usize::try_from(SIZE).unwrap()];
    base[..8 * MIB].fill(0x42);
    base[24 * MIB..25 * MIB].fill(0x24);
    std::fs::write(&raw, &base).unwrap();
    let backing = t.path().join(format!("base.{format}"));
    if format != "raw" {
        let st = Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", format])
            .arg(&raw)
            .arg(&backing)
            .status()
            .unwrap();
        assert!(st.success());
    }
    let b = backing.to_str().unwrap();
    let (_srcs, src, at_s1) = source(DataEngine::V1, t.path(), 1, &["--backing-file", b]).await;
    assert_eq!(
        &at_s1[5 * MIB..5 * MIB + 4],
        &[0x42; 4],
        "backing data visible at s1"
    );
    assert_eq!(&at_s1[24 * MIB..24 * MIB + 4], &[0x24; 4]);

    // Target with the same backing image: only the volume's own data travels.
    let (same, tgt_same) = target(DataEngine::V1, t.path(), "same", 1, SIZE, &["--backing-file", b]);
    ok(&clone_s1(&tgt_same, &src, &[]));
    assert!(same[0].flattened(SIZE).await == at_s1);
    let st = clone_status(&tgt_same).await;
    let sent = st.replicas.values().next().unwrap().bytes_transferred;
    let volume_data = (6 << 20) + 4096;
    assert!(
        sent >= volume_data && sent < volume_data + (1 << 20),
        "sent {sent} bytes for {volume_data} bytes of volume data"
    );

    // Target without a backing image: --export-backing-image brings the backing data along.
    let (bare, tgt_bare) = target(DataEngine::V1, t.path(), "bare", 1, SIZE, &[]);
    ok(&clone_s1(&tgt_bare, &src, &["--export-backing-image"]));
    assert!(bare[0].flattened(SIZE).await == at_s1);
    let st = clone_status(&tgt_bare).await;
    let sent = st.replicas.values().next().unwrap().bytes_transferred;
    assert!(
        sent >= 8 << 20,
        "sent only {sent} bytes although backing data was asked for"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_with_raw_backing_image_sends_only_volume_data_or_includes_the_backing_data_when_asked() {
    clone_with_backing_image("raw").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_with_qcow2_backing_image_sends_only_volume_data_or_includes_the_backing_data_when_asked() {
    clone_with_backing_image("qcow2").await;
}

on_both_engines!(clone_refuses_bad_input_and_leaves_the_target_unchanged);

async fn clone_refuses_bad_input_and_leaves_the_target_unchanged(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let (srcs, src, _) = source(engine, t.path(), 1, &[]).await;
    let (tgts, tgt) = target(engine, t.path(), "tgt", 1, SIZE, &[]);
    let (good, out) = qemu_io(&tgt.unix_uri(), &["write -P 0x99 0 1M", "flush"]);
    assert!(good, "{out}");
    let before = (replica_get(&tgts[0]).await.chain, tgts[0].layout().await);
    let unchanged = async || {
        assert_eq!(
            (replica_get(&tgts[0]).await.chain, tgts[0].layout().await),
            before
        );
        let (good, out) = qemu_io(&tgt.unix_uri(), &["read -P 0x99 0 1M"]);
        assert!(good, "{out}");
    };
    let clone = |snap: &str| {
        tgt.cli(&[
            "snapshot",
            "clone",
            "--detach-frontend",
            "--from-engine",
            &url(&src),
            "--snapshot",
            snap,
        ])
    };

    let err = fails(&clone("nope"));
    assert!(
        err.contains("volume-snap-nope.img") && err.contains("not found"),
        "{err}"
    );
    unchanged().await;
    for head in ["volume-head-001.img", "volume-head"] {
        let err = fails(&clone(head));
        assert!(err.contains("is the volume head"), "{err}");
        unchanged().await;
    }
    let err = fails(&clone("../etc"));
    assert!(err.contains("invalid snapshot name"), "{err}");
    unchanged().await;

    // A source of another size.
    let (_small, small_engine) = target(engine, t.path(), "small", 1, SIZE / 2, &[]);
    let err = fails(&clone_s1(&small_engine, &src, &[]));
    assert!(err.contains("same size"), "{err}");

    // The replica checks the size itself too (a caller that skips the engine).
    let mut sync = tgts[0].sync_agent().await;
    let small_src = Replica::start_on(
        engine,
        &t.path().join("small-src"),
        &["--size", &(SIZE / 2).to_string()],
    );
    let e2 = Engine::start(t.path(), "small-src", SIZE / 2, &[small_src.address()], &[]);
    ok(&e2.cli(&["snapshot", "create", "s1"]));
    let err = sync
        .snapshot_clone(clone_s1_from(small_src.address()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("same size"), "{err:?}");
    unchanged().await;

    // A rebuild running on the target replica (its source frozen, so it stays running).
    let frozen = Replica::start_on(engine, &t.path().join("frozen"), &["--size", &SIZE.to_string()]);
    frozen.signal("-STOP");
    let rebuild_target = Replica::start_on(engine, &t.path().join("rebuilt"), &["--size", &SIZE.to_string()]);
    let mut rsync = rebuild_target.sync_agent().await;
    rsync
        .files_sync(v1::FilesSyncRequest {
            from_addresses: vec![frozen.address()],
            files: vec![v1::DiskInfo {
                name: "volume-snap-x.img".into(),
                ..Default::default()
            }],
            fast_sync: false,
            ..Default::default()
        })
        .await
        .unwrap();
    let err = rsync
        .snapshot_clone(clone_s1_from(srcs[0].address()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("rebuild"), "{err:?}");
    frozen.signal("-CONT");

    // The same name cannot be cloned twice into one replica.
    ok(&clone("s1"));
    let err = fails(&clone("s1"));
    assert!(err.contains("already exists"), "{err}");
}

/// Seed's interrupt test: the clone is slowed by a rate limit so it is provably running, a second clone is
/// refused, the source replica is SIGKILLed once data arrives, the clone fails within the replica timeout and leaves
/// the target as it was; a second clone from the volume's healthy replica completes with identical data.
async fn interrupted_clone(engine: DataEngine, size_mib: usize, rate: &str) {
    let t = tempfile::tempdir().unwrap();
    let size = (size_mib as u64) << 20;
    let mut rs: Vec<Replica> = (0..2)
        .map(|i| Replica::start_on(engine, &t.path().join(format!("src{i}")), &[]))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let src = Engine::start(t.path(), "src", size, &addrs, &[]);
    let half = size_mib / 2;
    let (good, out) = qemu_io(
        &src.unix_uri(),
        &[
            &format!("write -P 0x5a 0 {half}M"),
            &format!("write -P 0x6b {half}M 1M"),
            "flush",
        ],
    );
    assert!(good, "{out}");
    ok(&src.cli(&["snapshot", "create", "s1"]));
    let want = rs[1].flattened(size).await;
    let (tgts, tgt) = target(engine, t.path(), "tgt", 1, size, &[]);
    let before = (replica_get(&tgts[0]).await.chain, tgts[0].layout().await);

    ok(&clone_s1(&tgt, &src, &["--max-rate", rate, "--no-wait"]));
    assert_eq!(clone_status(&tgt).await.state, "in-progress");
    let err = fails(&clone_s1(&tgt, &src, &[]));
    assert!(err.contains("already cloning"), "{err}");
    wait_for_async("clone data arriving", Duration::from_secs(20), async || {
        let s = clone_status(&tgt).await;
        assert_eq!(s.state, "in-progress", "{s:?}");
        (s.progress > 0).then_some(())
    })
    .await;

    rs[0].kill();
    let killed = Instant::now();
    wait_for_async(
        "clone fails after the source is killed",
        Duration::from_secs(20),
        async || (clone_status(&tgt).await.state == "error").then_some(()),
    )
    .await;
    assert!(
        killed.elapsed() < Duration::from_secs(4),
        "clone noticed the dead source only after {:?}",
        killed.elapsed()
    );
    let st = clone_status(&tgt).await;
    assert!(st.error.contains("export from"), "{st:?}");
    assert_eq!(
        (replica_get(&tgts[0]).await.chain, tgts[0].layout().await),
        before
    );

    // The source engine notices its dead replica on the next IO; the clone then comes from the healthy one.
    let _ = qemu_io(&src.unix_uri(), &["write -P 0x01 0 4k", "flush"]);
    wait_for_async("source replica ERR", Duration::from_secs(20), async || {
        src.modes()
            .await
            .iter()
            .any(|(a, m)| *a == rs[0].address() && m == "ERR")
            .then_some(())
    })
    .await;
    ok(&clone_s1(&tgt, &src, &[]));
    assert_eq!(clone_status(&tgt).await.from_replica_address, rs[1].address());
    assert!(tgts[0].flattened(size).await == want, "clone differs from s1");
}

on_both_engines!(killing_the_source_fails_the_clone_leaves_the_target_unchanged_and_a_retry_completes);

async fn killing_the_source_fails_the_clone_leaves_the_target_unchanged_and_a_retry_completes(
    engine: DataEngine,
) {
    interrupted_clone(engine, 64, "16M").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "1 GiB of data: run with --run-ignored"]
async fn killing_the_source_of_a_1_gib_clone_fails_it_and_a_retry_completes() {
    interrupted_clone(DataEngine::V1, 2048, "256M").await;
}

/// Unmounts a test's small tmpfs.
struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_that_completes_on_one_replica_but_not_another_puts_the_other_err() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let (_srcs, src, at_s1) = source(DataEngine::V1, t.path(), 1, &[]).await;
    // The second target replica lives on a 3 MiB disk: the snapshot's ~6 MiB of data cannot land there.
    let small = t.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=3M", "tmpfs"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(st.success(), "mounting a small tmpfs needs root");
    let _mount = Tmpfs(small.clone());
    let big = Replica::start(&t.path().join("tgt0"), &[]);
    let full = Replica::start(&small.join("tgt1"), &[]);
    let tgt = Engine::start(t.path(), "tgt", SIZE, &[big.address(), full.address()], &[]);

    let err = fails(&clone_s1(&tgt, &src, &[]));
    assert!(
        err.contains(&full.address()) || err.to_lowercase().contains("space"),
        "{err}"
    );

    // The replica that completed keeps serving the clone; the one that did not is out of the volume.
    wait_for_async(
        "the incomplete replica goes ERR",
        Duration::from_secs(30),
        async || {
            tgt.client()
                .await
                .replica_list(v1::Empty {})
                .await
                .unwrap()
                .into_inner()
                .replicas
                .iter()
                .any(|r| r.address == full.address() && r.mode == "ERR")
                .then_some(())
        },
    )
    .await;
    let list = tgt
        .client()
        .await
        .replica_list(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    let modes: Vec<(String, String)> = list.iter().map(|r| (r.address.clone(), r.mode.clone())).collect();
    assert!(
        list.iter().any(|r| r.address == big.address() && r.mode == "RW"),
        "{modes:?}"
    );
    assert!(
        big.flattened(SIZE).await == at_s1,
        "the completed replica differs from s1"
    );
    let (good, out) = qemu_io(
        &tgt.unix_uri(),
        &["read -P 0xa1 0 4M", "read -P 0xb2 20M 2M", "read -P 0 28M 1M"],
    );
    assert!(good, "{out}");
}

/// Hashes snapshot `s1` on replica `r` (`SnapshotHash`, then its status until done); returns the status.
async fn hash_s1(r: &Replica, rehash: bool) -> v1::SnapshotHashStatusResponse {
    let mut sa = r.sync_agent().await;
    sa.snapshot_hash(v1::SnapshotHashRequest {
        snapshot_name: "s1".into(),
        rehash,
    })
    .await
    .unwrap();
    wait_for_async("the hash of s1", Duration::from_secs(60), async || {
        let s = sa
            .snapshot_hash_status(v1::SnapshotHashStatusRequest {
                snapshot_name: "s1".into(),
            })
            .await
            .unwrap()
            .into_inner();
        (s.state != "in-progress").then_some(s)
    })
    .await
}

/// `corral-engine snapshot export s1` of `e` to a new raw file `to`.
fn export_s1(e: &Engine, to: &Path) {
    ok(&e.cli(&[
        "snapshot",
        "export",
        "s1",
        "--to",
        to.to_str().unwrap(),
        "--format",
        "raw",
    ]));
}

/// Issue 20: a snapshot clones v1→v2, v2→v1 and v2→v2 (and v1→v1, the peer), bit-exactly: the clone reads as the
/// source's snapshot, its export is the same image as the source's (`qemu-img compare` and `cmp`), it holds no
/// more than the source snapshot does, and the snapshot hashes to the same `sha512-layout` checksum on every
/// replica of either engine (recorded, so a second hash reuses it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_clone_bit_exactly_between_v1_and_v2_in_every_direction_and_hash_the_same() {
    let t = tempfile::tempdir().unwrap();
    let mut sources = Vec::new();
    for engine in [DataEngine::V1, DataEngine::V2] {
        let dir = t.path().join(format!("{engine:?}"));
        std::fs::create_dir_all(&dir).unwrap();
        let (rs, e, at_s1) = source(engine, &dir, 1, &[]).await;
        let raw = t.path().join(format!("{engine:?}-s1.raw"));
        export_s1(&e, &raw);
        assert!(
            std::fs::read(&raw).unwrap() == at_s1,
            "{engine:?}: export differs from s1"
        );
        sources.push((engine, rs, e, at_s1, raw));
    }
    assert!(
        sources[0].3 == sources[1].3,
        "the same writes read differently on v1 and v2"
    );
    let (v1_src, v2_src) = (&sources[0].1[0], &sources[1].1[0]);
    let recorded = hash_s1(v1_src, false).await;
    assert_eq!(recorded.state, "complete", "{recorded:?}");
    assert_eq!(recorded.checksum.len(), 128, "{recorded:?}");
    let v2_hash = hash_s1(v2_src, false).await;
    assert_eq!(
        (v2_hash.state.as_str(), v2_hash.checksum.as_str(), v2_hash.skipped),
        ("complete", recorded.checksum.as_str(), false),
        "{v2_hash:?}"
    );
    // Recorded: hashed again without --rehash, the record is reused; with it, recomputed and still equal.
    let again = hash_s1(v2_src, false).await;
    assert!(again.skipped && again.checksum == recorded.checksum, "{again:?}");
    let rehashed = hash_s1(v2_src, true).await;
    assert!(
        !rehashed.skipped && !rehashed.silently_corrupted && rehashed.checksum == recorded.checksum,
        "{rehashed:?}"
    );

    for (from, to) in [
        (DataEngine::V1, DataEngine::V2),
        (DataEngine::V2, DataEngine::V1),
        (DataEngine::V2, DataEngine::V2),
    ] {
        let what = format!("{from:?}->{to:?}");
        let (_, srcs, src, at_s1, src_raw) = sources.iter().find(|s| s.0 == from).unwrap();
        let (tgts, tgt) = target(to, t.path(), &format!("{from:?}to{to:?}"), 1, SIZE, &[]);
        let out = ok(&clone_s1(&tgt, src, &[]));
        assert!(out.contains("cloned volume-snap-s1.img"), "{what}: {out}");
        let st = clone_status(&tgt).await;
        assert_eq!(st.state, "complete", "{what}: {st:?}");
        let r = &tgts[0];
        assert!(
            r.flattened(SIZE).await == *at_s1,
            "{what}: the clone differs from s1"
        );
        assert_eq!(
            r.status().await.chain,
            vec!["volume-head-001.img", "volume-snap-s1.img"],
            "{what}"
        );
        let cloned = r.snapshot_allocated("volume-snap-s1.img").await;
        let held = srcs[0].snapshot_allocated("volume-snap-s1.img").await;
        assert!(
            cloned >= 6 << 20 && cloned <= held,
            "{what}: clone holds {cloned}, source {held}"
        );
        // The clone's own export is the source's, byte for byte.
        let raw = t.path().join(format!("{what}.raw"));
        export_s1(&tgt, &raw);
        same_image(src_raw, &raw);
        let cmp = Command::new("cmp").arg(src_raw).arg(&raw).output().unwrap();
        assert!(
            cmp.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&cmp.stdout)
        );
        let h = hash_s1(r, false).await;
        assert_eq!(
            (h.state.as_str(), h.checksum.as_str()),
            ("complete", recorded.checksum.as_str()),
            "{what}: {h:?}"
        );
        // The clone is a volume of its own: writes land on it, not on the source.
        let (good, out) = qemu_io(&tgt.unix_uri(), &["write -P 0x77 0 64k", "read -P 0x77 0 64k"]);
        assert!(good, "{what}: {out}");
        assert!(srcs[0].flattened(SIZE).await[..65536] != [0x77; 65536][..]);
    }
}
