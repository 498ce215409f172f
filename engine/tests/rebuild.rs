//! Rebuild with real daemons: the rate limit reaches both copy paths, several replicas rebuild at once, and the
//! local copy's batching of small extents keeps holes as holes.

mod common;

use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Engine, Replica};
use testkit::qemu_io;
use testkit::wait_for_async;

const SIZE: u64 = 64 << 20;

/// qemu-io commands writing 4 KiB of `pattern`, then leaving a 4 KiB hole, over `len` bytes from `start`.
fn fragmented_writes(start: u64, len: u64, pattern: u8) -> Vec<String> {
    (start..start + len)
        .step_by(8192)
        .map(|off| format!("write -P 0x{pattern:02x} {off} 4k"))
        .collect()
}

/// A volume over one replica holding 8 MiB of 4 KiB data / 4 KiB holes and 8 MiB dense, in snapshot `s1`.
fn volume_with_data(dir: &std::path::Path) -> (Replica, Engine) {
    let src = Replica::start(&dir.join("src"), &[]);
    let e = Engine::start(dir, "vol", SIZE, &[src.address()], &[]);
    let mut cmds = fragmented_writes(0, 16 << 20, 0x5a);
    cmds.push("write -P 0x66 32M 8M".into());
    cmds.push("flush".into());
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, out) = qemu_io(&e.unix_uri(), &cmds);
    assert!(ok, "{out}");
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    (src, e)
}

/// Snapshot files of a replica directory.
fn snapshot_files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|d| d.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.starts_with("volume-snap-") && f.ends_with(".img"))
        .collect();
    v.sort();
    v
}

/// Every snapshot file of `rebuilt` equals the source's byte for byte (`qemu-img compare -s`, strict: a hole and
/// zeros differ in allocation only, so the allocated blocks are compared too: a copy that filled holes with zeros
/// would allocate 4 KiB more per hole).
fn assert_same_snapshot_files(src: &Replica, rebuilt: &Replica) {
    let files = snapshot_files(&src.dir);
    assert!(files.len() >= 2, "{files:?}");
    assert_eq!(files, snapshot_files(&rebuilt.dir));
    for f in &files {
        let (a, b) = (src.dir.join(f), rebuilt.dir.join(f));
        let out = Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&a)
            .arg(&b)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cmp = Command::new("cmp").arg(&a).arg(&b).output().unwrap();
        assert!(cmp.status.success(), "{f} differs");
        let (ba, bb) = (
            std::fs::metadata(&a).unwrap().blocks() * 512,
            std::fs::metadata(&b).unwrap().blocks() * 512,
        );
        // Extent-tree blocks may differ a little; holes turned into data would add megabytes here.
        assert!(
            bb <= ba + (64 << 10),
            "{f}: the rebuilt file allocates {bb} bytes, the source {ba}: holes were filled"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_rebuild_takes_at_least_its_bytes_over_the_rate_on_both_paths() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let (src, e) = volume_with_data(t.path());
    const RATE: u64 = 8 << 20;
    for (name, extra) in [("r-local", &[][..]), ("r-net", &["--no-local-copy"][..])] {
        let fresh = Replica::start(&t.path().join(name), extra);
        let started = Instant::now();
        let out = e.cli(&[
            "replica",
            "add",
            &fresh.address(),
            "--max-rate",
            &RATE.to_string(),
            "--json",
        ]);
        let took = started.elapsed();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let moved = job["bytesTransferred"].as_u64().unwrap_or(0);
        assert!(moved >= 16 << 20, "{name}: {job}");
        let local = job["bytesCopiedLocally"].as_u64().unwrap_or(0);
        assert_eq!(local > 0, extra.is_empty(), "{name}: {job}");
        // Unlimited, 16 MiB copies in well under a second here; at 8 MiB/s it cannot take less than 2 s. The
        // margin allows for the first batch, which goes before any wait.
        let floor = Duration::from_secs_f64(moved as f64 / RATE as f64 * 0.75);
        assert!(
            took >= floor,
            "{name}: {moved} bytes at {RATE} B/s took {took:?}, less than {floor:?}"
        );
        assert_same_snapshot_files(&src, &fresh);
        assert!(e.cli(&["replica", "rm", &fresh.address()]).status.success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_rebuild_at_once_and_both_end_rw_with_the_volumes_data() {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let (src, e) = volume_with_data(t.path());
    let fresh: Vec<Replica> = ["r-a", "r-b"]
        .iter()
        .map(|n| Replica::start(&t.path().join(n), &[]))
        .collect();
    // Slow enough (16 MiB at 4 MiB/s each) that the second starts while the first still runs.
    for r in &fresh {
        let out = e.cli(&["replica", "add", &r.address(), "--no-wait", "--max-rate", "4M"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let modes = e.modes().await;
    let wo = modes.iter().filter(|(_, m)| m == "WO").count();
    assert_eq!(wo, 2, "both new replicas rebuild at once: {modes:?}");
    // Writes during both rebuilds reach both heads.
    let (ok, out) = qemu_io(&e.unix_uri(), &["write -P 0x77 20M 1M", "flush"]);
    assert!(ok, "{out}");
    wait_for_async("both rebuilds to finish", Duration::from_secs(60), async || {
        let modes = e.modes().await;
        if modes.iter().any(|(_, m)| m == "ERR") {
            panic!("a rebuild failed: {modes:?}");
        }
        modes.iter().all(|(_, m)| m == "RW").then_some(())
    })
    .await;
    let expect = src.flattened(SIZE).await;
    assert!(expect[20 << 20..21 << 20].iter().all(|b| *b == 0x77));
    for r in &fresh {
        assert!(
            r.flattened(SIZE).await == expect,
            "{} differs from the source",
            r.address()
        );
        assert_same_snapshot_files(&src, r);
    }
}
