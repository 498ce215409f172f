//! Volume clone through the control plane (seed 002), with real manager, engine and replica processes and qemu-io
//! as the NBD client: clone of an attached volume (`vol://`), of a snapshot into a larger volume (`snap://`), of a
//! detached source (attached for the copy and detached again); a clone whose source replica is SIGKILLed while it
//! copies ends failed and is never served; the refusals (smaller, unknown source, attach or delete mid-copy); a
//! clone of a volume on a backing image reads exactly its source (`qemu-img compare`) and runs on the same image.

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;
use testkit::{nbd_sha256, qemu_io, wait_for};

const MIB: u64 = 1 << 20;

fn attach(url: &str, name: &str) -> String {
    let (ok, out, err) = corral(url, &["volume", "attach", name, "--timeout", "90"]);
    assert!(ok, "attach {name}: {out}{err}");
    out.lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .unwrap_or_else(|| panic!("attach {name} prints the NBD URI: {out}"))
        .to_owned()
}

fn detach(url: &str, name: &str) {
    let (ok, out, err) = corral(url, &["volume", "detach", name]);
    assert!(ok, "detach {name}: {out}{err}");
}

fn snapshots(m: &Manager, volume: &str) -> Vec<serde_json::Value> {
    let (code, v) = rest("GET", &format!("{}/v1/volumes/{volume}/snapshots", m.url), None);
    assert_eq!(code, 200, "{v}");
    v.as_array().cloned().unwrap_or_default()
}

fn wait_clone_state(m: &Manager, name: &str, state: &str) -> serde_json::Value {
    wait_for(&format!("clone {name} {state}"), Duration::from_secs(120), || {
        let v = volume(m, name);
        (v["cloneStatus"]["state"] == state).then_some(v)
    })
}

#[test]
fn clones_of_an_attached_volume_a_snapshot_and_a_detached_volume_read_like_their_sources() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "src", "--size", "64Mi", "--replicas", "2"],
    );
    assert!(ok, "{out}{err}");
    let src_uri = attach(&url, "src");
    let (ok, o) = qemu_io(&src_uri, &["write -P 0x5a 0 4M", "write -P 0x6b 32M 2M", "flush"]);
    assert!(ok, "{o}");
    let (ok, out, err) = corral(&url, &["snapshot", "create", "src", "s1"]);
    assert!(ok, "{out}{err}");
    // A snapshot that was removed is no source (refused in 4 below).
    let (ok, out, err) = corral(&url, &["snapshot", "create", "src", "gone"]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = corral(&url, &["snapshot", "rm", "src", "gone"]);
    assert!(ok, "{out}{err}");
    let (ok, o) = qemu_io(&src_uri, &["write -P 0x77 8M 1M", "flush"]);
    assert!(ok, "{o}");
    let src_sum = nbd_sha256(&src_uri);

    // 1. vol:// of an attached volume, through the CLI (waits with a progress bar, size from the source).
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "c1",
            "--from-volume",
            "src",
            "--replicas",
            "2",
        ],
    );
    assert!(ok, "{out}{err}");
    let v = volume(&m, "c1");
    assert_eq!(v["cloneStatus"]["state"], "completed", "{v}");
    assert_eq!(v["cloneStatus"]["progress"], 100, "{v}");
    assert_eq!(v["dataSource"], "vol://src", "{v}");
    assert_eq!(v["size"], 64 * MIB, "{v}");
    assert_eq!(v["state"], "detached", "the target is detached once cloned: {v}");
    let (ok, out, err) = corral(&url, &["volume", "get", "c1"]);
    assert!(
        ok && out.contains("clone of vol://src (snapshot clone-c1-") && out.contains("): completed 100%"),
        "volume get shows the clone: {out}{err}"
    );
    let s = volume(&m, "src");
    assert!(
        s["state"] == "attached" && s["frontendDisabled"] == false,
        "the source stays as it was: {s}"
    );
    let snap = v["cloneStatus"]["snapshot"].as_str().unwrap().to_owned();
    assert!(
        snap.starts_with("clone-c1-"),
        "the snapshot taken for the clone: {v}"
    );
    let taken = snapshots(&m, "src")
        .into_iter()
        .find(|s| s["name"] == snap.as_str());
    assert!(
        taken.as_ref().is_none_or(|s| s["removed"] == true),
        "the snapshot taken for the clone is removed: {taken:?}"
    );
    let c1_uri = attach(&url, "c1");
    assert_eq!(nbd_sha256(&c1_uri), src_sum, "c1 reads like its source");
    let c1 = volume(&m, "c1");
    assert!(
        c1["replicas"]
            .as_array()
            .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["mode"] == "RW")),
        "both replicas of the clone serve: {c1}"
    );
    detach(&url, "c1");

    // 2. snap:// into a larger volume: the snapshot's data, zeros past the source's end.
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "c2",
            "--from-snapshot",
            "src/s1",
            "--size",
            "96Mi",
            "--replicas",
            "1",
        ],
    );
    assert!(ok, "{out}{err}");
    let v = volume(&m, "c2");
    assert!(
        v["cloneStatus"]["state"] == "completed" && v["size"] == 96 * MIB,
        "{v}"
    );
    let c2_uri = attach(&url, "c2");
    let (ok, o) = qemu_io(
        &c2_uri,
        &[
            "read -P 0x5a 0 4M",
            "read -P 0 8M 1M",
            "read -P 0x6b 32M 2M",
            "read -P 0 64M 32M",
        ],
    );
    assert!(ok, "c2 holds s1's data and zeros beyond: {o}");
    detach(&url, "c2");

    // 3. A detached source is attached (without a frontend) for the copy and detached again.
    detach(&url, "src");
    wait_for("src detached", Duration::from_secs(60), || {
        (volume(&m, "src")["state"] == "detached").then_some(())
    });
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "c3",
            "--from-volume",
            "src",
            "--replicas",
            "1",
        ],
    );
    assert!(ok, "{out}{err}");
    assert_eq!(volume(&m, "c3")["cloneStatus"]["state"], "completed");
    let s = wait_for("src detached again", Duration::from_secs(60), || {
        let s = volume(&m, "src");
        (s["state"] == "detached").then_some(s)
    });
    assert!(s["nodeId"].is_null() && s["disableFrontend"] == false, "{s}");
    let c3_uri = attach(&url, "c3");
    assert_eq!(nbd_sha256(&c3_uri), src_sum, "c3 reads like the detached source");
    detach(&url, "c3");

    // 4. Refusals, each before anything is created (`gone` is the snapshot removed above).
    let names = || -> Vec<String> {
        let (c, v) = rest("GET", &format!("{url}/v1/volumes"), None);
        assert_eq!(c, 200, "{v}");
        v.as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let volumes_before = names();
    for (body, code, words) in [
        (
            json!({"name": "x1", "size": 32 * MIB, "dataSource": "vol://src"}),
            409,
            "smaller",
        ),
        (
            json!({"name": "x2", "size": 64 * MIB, "dataSource": "vol://nope"}),
            404,
            "not found",
        ),
        (
            json!({"name": "x3", "size": 64 * MIB, "dataSource": "snap://src/nope"}),
            404,
            "no snapshot",
        ),
        (
            json!({"name": "x4", "size": 64 * MIB, "dataSource": "file:///etc/passwd"}),
            400,
            "vol://",
        ),
        (
            json!({"name": "x5", "size": 64 * MIB, "dataSource": "snap://src/gone"}),
            404,
            "no snapshot",
        ),
        (
            json!({"name": "x6", "size": 64 * MIB, "dataSource": "vol://src", "numberOfReplicas": 0}),
            400,
            "numberOfReplicas",
        ),
        (
            json!({"name": "x7", "size": 64 * MIB + 1, "dataSource": "vol://src"}),
            400,
            "multiple",
        ),
        (
            json!({"name": "x8", "size": 64 * MIB, "dataSource": "snap://src"}),
            400,
            "VOLUME/SNAPSHOT",
        ),
    ] {
        let (c, e) = rest("POST", &format!("{url}/v1/volumes"), Some(&body));
        assert!(
            c == code && e["message"].as_str().is_some_and(|m| m.contains(words)),
            "{body}: {c} {e}"
        );
        let (c, _) = rest(
            "GET",
            &format!("{url}/v1/volumes/{}", body["name"].as_str().unwrap()),
            None,
        );
        assert_eq!(c, 404, "{body} created nothing");
    }
    assert_eq!(
        names(),
        volumes_before,
        "the refusals left every volume as it was"
    );
}

#[test]
fn a_clone_whose_source_replica_is_killed_mid_copy_fails_and_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(1));
    let url = m.url.clone();
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "src", "--size", "96Mi", "--replicas", "1"],
    );
    assert!(ok, "{out}{err}");
    let src_uri = attach(&url, "src");
    let (ok, o) = qemu_io(&src_uri, &["write -P 0x3c 0 64M", "flush"]);
    assert!(ok, "{o}");
    let src_sum = nbd_sha256(&src_uri);
    detach(&url, "src");
    wait_for("src detached", Duration::from_secs(60), || {
        (volume(&m, "src")["state"] == "detached").then_some(())
    });
    // A slow copy (8 MiB/s over 64 MiB of data) so the test sees it running.
    let (ok, out, err) = corral(&url, &["setting", "set", "clone-max-bytes-per-second", "8388608"]);
    assert!(ok, "{out}{err}");

    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "slow",
            "--from-volume",
            "src",
            "--replicas",
            "1",
            "--no-wait",
        ],
    );
    assert!(ok, "{out}{err}");
    let v = wait_for("the copy under way", Duration::from_secs(60), || {
        let v = volume(&m, "slow");
        (v["cloneStatus"]["state"] == "copying" && v["cloneStatus"]["progress"].as_u64() > Some(0))
            .then_some(v)
    });
    let progress = v["cloneStatus"]["progress"].as_u64().unwrap();
    assert!(progress < 100, "{v}");
    let s = volume(&m, "src");
    assert!(
        s["state"] == "attached" && s["frontendDisabled"] == true,
        "the detached source was attached without a frontend for the copy: {s}"
    );

    // While it copies: the target cannot be attached, detached or deleted; the source cannot be detached or deleted.
    let (c, e) = rest("POST", &format!("{url}/v1/volumes/slow/attach"), Some(&json!({})));
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("being cloned"),
        "{c} {e}"
    );
    let (c, e) = rest("POST", &format!("{url}/v1/volumes/slow/detach"), None);
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("being cloned"),
        "{c} {e}"
    );
    let (c, e) = rest("DELETE", &format!("{url}/v1/volumes/slow"), None);
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("being cloned"),
        "{c} {e}"
    );
    let (c, e) = rest("POST", &format!("{url}/v1/volumes/src/detach"), None);
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("attached for the clone"),
        "{c} {e}"
    );
    let (c, e) = rest("DELETE", &format!("{url}/v1/volumes/src"), None);
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("source of the clone"),
        "{c} {e}"
    );

    // SIGKILL the source's replica mid-copy.
    let pid = s["replicas"][0]["pid"].as_i64().expect("source replica pid");
    sigkill(pid);
    let v = wait_clone_state(&m, "slow", "failed");
    assert!(!v["cloneStatus"]["message"].as_str().unwrap().is_empty(), "{v}");
    let v = wait_for("the failed target detached", Duration::from_secs(60), || {
        let v = volume(&m, "slow");
        (v["state"] == "detached").then_some(v)
    });
    assert!(v["nodeId"].is_null(), "{v}");
    let (c, e) = rest("POST", &format!("{url}/v1/volumes/slow/attach"), Some(&json!({})));
    assert!(
        c == 409 && e["message"].as_str().unwrap().contains("failed"),
        "a failed clone is never served: {c} {e}"
    );
    wait_for(
        "the auto-attached source detached again",
        Duration::from_secs(60),
        || (volume(&m, "src")["state"] == "detached").then_some(()),
    );

    // The user's recovery: delete it and clone again (full speed), after the source's replica came back.
    let (c, e) = rest("DELETE", &format!("{url}/v1/volumes/slow"), None);
    assert_eq!(c, 204, "{e}");
    let (ok, out, err) = corral(&url, &["setting", "set", "clone-max-bytes-per-second", "0"]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "again",
            "--from-volume",
            "src",
            "--replicas",
            "1",
        ],
    );
    assert!(ok, "{out}{err}");
    let again = attach(&url, "again");
    assert_eq!(
        nbd_sha256(&again),
        src_sum,
        "the retried clone reads like the source"
    );
    detach(&url, "again");
    let src = attach(&url, "src");
    assert_eq!(nbd_sha256(&src), src_sum, "the source is unchanged");
}

/// The replica directories of a volume document, one per replica.
fn replica_dirs(v: &serde_json::Value) -> Vec<std::path::PathBuf> {
    v["replicas"]
        .as_array()
        .unwrap_or_else(|| panic!("replicas: {v}"))
        .iter()
        .map(|r| r["dataPath"].as_str().expect("dataPath").into())
        .collect()
}

/// Bytes allocated by every file of a replica directory.
fn allocated_in(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| testkit::allocated_bytes(&p))
        .sum()
}

/// Block `k` of the writer's region: 64 KiB at `WRITE_AT + k × 64 KiB`, filled with `k % 250 + 1`.
const WRITE_AT: u64 = 32 * MIB;
const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 512;

fn block_pattern(k: u64) -> u8 {
    u8::try_from(k % 250 + 1).unwrap()
}

#[test]
fn a_clone_of_a_volume_under_write_load_is_the_source_at_one_instant() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(2));
    let url = m.url.clone();
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "src", "--size", "64Mi", "--replicas", "2"],
    );
    assert!(ok, "{out}{err}");
    let src_uri = attach(&url, "src");
    let (ok, o) = qemu_io(&src_uri, &["write -P 0x5a 0 24M", "flush"]);
    assert!(ok, "{o}");
    // A copy of a few seconds (24 MiB and more at 8 MiB/s), so writes land before, during and after the snapshot.
    let (ok, out, err) = corral(&url, &["setting", "set", "clone-max-bytes-per-second", "8388608"]);
    assert!(ok, "{out}{err}");

    // The writer: one qemu-io per block, in order, each acknowledged before the next starts. Whatever instant the
    // clone's snapshot is taken at, the source then held blocks 0..N written and N.. still zero.
    let written = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (uri, written, stop) = (src_uri.clone(), written.clone(), stop.clone());
        std::thread::spawn(move || {
            for k in 0..BLOCKS {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let cmd = format!("write -P {} {} {BLOCK}", block_pattern(k), WRITE_AT + k * BLOCK);
                let (ok, o) = qemu_io(&uri, &[&cmd]);
                assert!(ok, "{cmd}: {o}");
                written.store(k + 1, Ordering::SeqCst);
            }
        })
    };
    wait_for("the writer under way", Duration::from_secs(60), || {
        (written.load(Ordering::SeqCst) >= 5).then_some(())
    });
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "c",
            "--from-volume",
            "src",
            "--replicas",
            "2",
            "--no-wait",
        ],
    );
    assert!(ok, "{out}{err}");
    let v = wait_for("the copy under way", Duration::from_secs(60), || {
        let v = volume(&m, "c");
        (v["cloneStatus"]["state"] == "copying" && v["cloneStatus"]["progress"].as_u64() > Some(0))
            .then_some(v)
    });
    assert!(v["cloneStatus"]["progress"].as_u64() < Some(100), "{v}");
    let during_copy = written.load(Ordering::SeqCst);
    wait_clone_state(&m, "c", "completed");
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    let total = written.load(Ordering::SeqCst);

    // The clone holds the source at one instant: 24 MiB of 0x5a, then blocks 0..n written and the rest zero.
    let image = dir.path().join("c.raw");
    let c_uri = attach(&url, "c");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &c_uri])
        .arg(&image)
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img convert of the clone");
    let data = std::fs::read(&image).unwrap();
    let block = |k: u64| {
        let at = usize::try_from(WRITE_AT + k * BLOCK).unwrap();
        &data[at..at + usize::try_from(BLOCK).unwrap()]
    };
    let n = (0..BLOCKS).find(|&k| block(k)[0] == 0).unwrap_or(BLOCKS);
    assert!(
        (5..total).contains(&n),
        "the snapshot was taken after 5 writes and before the last ({total}): {n} blocks in the clone"
    );
    assert!(
        total > during_copy && during_copy >= n,
        "writes went on during the copy: {n} in the clone, {during_copy} written when it was seen copying, \
         {total} when it completed"
    );
    let mut expected = vec![0u8; data.len()];
    expected[..usize::try_from(24 * MIB).unwrap()].fill(0x5a);
    for k in 0..n {
        let at = usize::try_from(WRITE_AT + k * BLOCK).unwrap();
        expected[at..at + usize::try_from(BLOCK).unwrap()].fill(block_pattern(k));
    }
    let reference = dir.path().join("expected.raw");
    std::fs::write(&reference, &expected).unwrap();
    drop(data);
    let out = std::process::Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&reference)
        .arg(&c_uri)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the clone (over NBD) equals the source at the snapshot with {n} blocks written: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Both replicas of the clone hold the same data, in no more space than the source's. The attach right after the
    // clone's own engine stopped may find a replica still restarting: it rejoins through a rebuild, so wait for both
    // to be RW before reading their files.
    let c = wait_for("both replicas of the clone RW", Duration::from_secs(60), || {
        let c = volume(&m, "c");
        let replicas = c["replicas"].as_array()?;
        (replicas.len() == 2 && replicas.iter().all(|r| r["mode"] == "RW")).then_some(c)
    });
    let dirs = replica_dirs(&c);
    assert_eq!(dirs.len(), 2, "{c}");
    detach(&url, "c");
    // The clone's snapshot in each replica (an attach under load may also have rebuilt one replica, which adds
    // an empty `volume-snap-rebuild-*` above it: compare the clone's own snapshot).
    let snap_file = |d: &std::path::Path| {
        let mut snaps: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("volume-snap-clone-") && n.ends_with(".img"))
            })
            .collect();
        assert_eq!(snaps.len(), 1, "one clone snapshot in {}: {snaps:?}", d.display());
        snaps.pop().unwrap()
    };
    let sums: Vec<_> = dirs.iter().map(|d| testkit::sha256_file(&snap_file(d))).collect();
    assert_eq!(sums[0], sums[1], "the clone's replicas hold identical data");
    let src_alloc: u64 = replica_dirs(&volume(&m, "src"))
        .iter()
        .map(|d| allocated_in(d))
        .min()
        .unwrap();
    for d in &dirs {
        let a = allocated_in(d);
        assert!(
            a <= src_alloc,
            "a replica of the clone allocates {a} bytes, the source's {src_alloc}: {}",
            d.display()
        );
    }
}

/// What is SIGKILLed while a clone copies.
#[derive(Debug, Clone, Copy)]
enum Victim {
    SourceReplica,
    TargetReplica,
    TargetEngine,
    SourceEngine,
    Manager,
}

/// Clones a detached source of `data_mib` MiB once per [`Victim`], SIGKILLing it while the copy is seen under
/// way (0 < progress < 100) at `rate` bytes/s. Each clone ends failed (and is refused for IO, then deleted and
/// created again, which completes) or completed; either way the completed clone reads like the source, and the
/// source is unchanged and detached again.
fn clones_survive_sigkill(data_mib: u64, rate: u64, slot: u16) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(slot));
    let url = m.url.clone();
    let size = format!("{}Mi", data_mib + 32);
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "src", "--size", &size, "--replicas", "1"],
    );
    assert!(ok, "{out}{err}");
    let src_uri = attach(&url, "src");
    let (ok, o) = qemu_io(
        &src_uri,
        &[
            &format!("write -P 0x3c 0 {data_mib}M"),
            &format!("write -P 0x4d {}M 1M", data_mib + 8),
            "flush",
        ],
    );
    assert!(ok, "{o}");
    let src_sum = nbd_sha256(&src_uri);
    detach(&url, "src");
    let src_detached = |m: &Manager| {
        wait_for("the source detached", Duration::from_secs(120), || {
            let s = volume(m, "src");
            (s["state"] == "detached").then_some(s)
        })
    };
    src_detached(&m);

    for victim in [
        Victim::SourceReplica,
        Victim::TargetReplica,
        Victim::TargetEngine,
        Victim::SourceEngine,
        Victim::Manager,
    ] {
        let name = format!("{victim:?}").to_lowercase();
        let (ok, out, err) = corral(
            &url,
            &["setting", "set", "clone-max-bytes-per-second", &rate.to_string()],
        );
        assert!(ok, "{out}{err}");
        let (ok, out, err) = corral(
            &url,
            &[
                "volume",
                "create",
                &name,
                "--from-volume",
                "src",
                "--replicas",
                "1",
                "--no-wait",
            ],
        );
        assert!(ok, "{victim:?}: {out}{err}");
        let v = wait_for("the copy under way", Duration::from_secs(120), || {
            let v = volume(&m, &name);
            (v["cloneStatus"]["state"] == "copying" && v["cloneStatus"]["progress"].as_u64() > Some(0))
                .then_some(v)
        });
        let s = volume(&m, "src");
        let pid = match victim {
            Victim::SourceReplica => s["replicas"][0]["pid"].as_i64(),
            Victim::TargetReplica => v["replicas"][0]["pid"].as_i64(),
            Victim::TargetEngine => v["engine"]["pid"].as_i64(),
            Victim::SourceEngine => s["engine"]["pid"].as_i64(),
            Victim::Manager => None,
        };
        // Progress is read again right before the signal: still copying then.
        let now = volume(&m, &name);
        let progress = now["cloneStatus"]["progress"].as_u64().unwrap();
        assert!(
            now["cloneStatus"]["state"] == "copying" && (1..100).contains(&progress),
            "{victim:?}: not copying when killed: {now}"
        );
        match pid {
            Some(pid) => sigkill(pid),
            None => {
                m.kill();
                m.restart();
            }
        }
        let end = wait_for(
            &format!("{victim:?}: the clone ends"),
            Duration::from_secs(300),
            || {
                let v = volume(&m, &name);
                let st = v["cloneStatus"]["state"].as_str().unwrap_or("").to_owned();
                (st == "completed" || st == "failed").then_some(v)
            },
        );
        eprintln!(
            "{victim:?} killed at {progress}%: the clone ended {} ({})",
            end["cloneStatus"]["state"], end["cloneStatus"]["message"]
        );
        let v = wait_for("the target detached", Duration::from_secs(120), || {
            let v = volume(&m, &name);
            (v["state"] == "detached").then_some(v)
        });
        assert!(v["nodeId"].is_null(), "{victim:?}: {v}");
        let s = src_detached(&m);
        assert!(
            s["nodeId"].is_null() && s["disableFrontend"] == false,
            "{victim:?}: the auto-attached source is detached again: {s}"
        );
        if end["cloneStatus"]["state"] == "failed" {
            assert!(
                !end["cloneStatus"]["message"].as_str().unwrap_or("").is_empty(),
                "{end}"
            );
            let (c, e) = rest(
                "POST",
                &format!("{url}/v1/volumes/{name}/attach"),
                Some(&json!({})),
            );
            assert!(
                c == 409 && e["message"].as_str().unwrap_or("").contains("failed"),
                "{victim:?}: a failed clone is never served: {c} {e}"
            );
            // The user's recovery: delete it and create it again (full speed).
            let (c, e) = rest("DELETE", &format!("{url}/v1/volumes/{name}"), None);
            assert_eq!(c, 204, "{victim:?}: {e}");
            let (ok, out, err) = corral(&url, &["setting", "set", "clone-max-bytes-per-second", "0"]);
            assert!(ok, "{out}{err}");
            let (ok, out, err) = corral(
                &url,
                &[
                    "volume",
                    "create",
                    &name,
                    "--from-volume",
                    "src",
                    "--replicas",
                    "1",
                ],
            );
            assert!(ok, "{victim:?}: re-created: {out}{err}");
            src_detached(&m);
        }
        let uri = attach(&url, &name);
        assert_eq!(
            nbd_sha256(&uri),
            src_sum,
            "{victim:?}: the clone reads like the source"
        );
        detach(&url, &name);
    }
    let uri = attach(&url, "src");
    assert_eq!(nbd_sha256(&uri), src_sum, "the source is unchanged");
}

#[test]
fn clones_interrupted_by_sigkill_fail_or_complete_and_leave_the_source_as_it_was() {
    // 32 MiB at 4 MiB/s: about 8 s of copying per clone.
    clones_survive_sigkill(32, 4 << 20, 3);
}

/// The seed's size: 1 GiB of data (`cargo nextest run -p manager --test clone --run-ignored ignored-only`).
#[test]
#[ignore = "1 GiB per clone: minutes on 2 cores"]
fn clones_of_a_gibibyte_interrupted_by_sigkill_fail_or_complete_and_leave_the_source_as_it_was() {
    clones_survive_sigkill(1024, 64 << 20, 4);
}

#[test]
fn a_clone_whose_source_is_attached_on_another_node_reads_like_its_source() {
    use testkit::servers::Etcd;

    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let store = format!("etcd://{}", etcd.endpoint());
    let ms: Vec<Manager> = (0..2u16)
        .map(|i| {
            Manager::start(
                &dir.path().join(format!("n{i}")),
                &format!("node-{i}"),
                &store,
                port_range(5 + i),
            )
        })
        .collect();
    // The leader's clone controller attaches the target on its own node: the source goes on the other one.
    let leader = wait_for("a leader", Duration::from_secs(60), || {
        ms.iter()
            .position(|m| m.log().contains("leading the cluster-wide controllers"))
    });
    let (lead, other) = (&ms[leader], &ms[1 - leader]);
    wait_for("both nodes ready", Duration::from_secs(60), || {
        let (_, v) = rest("GET", &format!("{}/v1/nodes", lead.url), None);
        let ready = v
            .as_array()
            .map_or(0, |a| a.iter().filter(|n| n["ready"] == true).count());
        (ready == 2).then_some(())
    });
    let (c, v) = rest(
        "POST",
        &format!("{}/v1/volumes", other.url),
        Some(&json!({"name": "src", "size": 32 * MIB, "numberOfReplicas": 1})),
    );
    assert_eq!(c, 201, "{v}");
    // The CLI attaches on the node of the manager it talks to.
    let src_uri = attach(&other.url, "src");
    let v = volume(other, "src");
    assert_eq!(v["currentNodeId"], other.node_id.as_str(), "{v}");
    let (ok, o) = qemu_io(&src_uri, &["write -P 0x2e 0 8M", "write -P 0x71 20M 3M", "flush"]);
    assert!(ok, "{o}");
    let src_sum = nbd_sha256(&src_uri);

    let (ok, out, err) = corral(
        &lead.url,
        &["volume", "create", "c", "--from-volume", "src", "--replicas", "1"],
    );
    assert!(ok, "{out}{err}");
    assert_eq!(volume(lead, "c")["cloneStatus"]["state"], "completed");
    assert!(
        lead.log().contains("clone started volume=c"),
        "the leader ({}) drove the clone: its engine ran there",
        lead.node_id
    );
    assert_eq!(
        volume(lead, "src")["currentNodeId"],
        other.node_id.as_str(),
        "the source stayed on the other node"
    );
    let c_uri = attach(&other.url, "c");
    assert_eq!(nbd_sha256(&c_uri), src_sum, "the clone reads like its source");
    detach(&other.url, "c");
}

/// The arguments of process `pid`.
fn cmdline(pid: i64) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/cmdline: {e}"))
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// `qemu-img compare` of a raw file with a volume over NBD: identical contents, or the test fails with the first
/// offset that differs.
fn assert_reads(expected: &std::path::Path, uri: &str, what: &str) {
    let out = std::process::Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(expected)
        .arg(uri)
        .output()
        .expect("run qemu-img compare");
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_clone_of_a_volume_on_a_backing_image_reads_like_its_source_and_runs_on_the_image() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    // The image: 24 MiB with pseudo-random data, explicitly written zeros and holes, uploaded as a compressed
    // qcow2 (the manager keeps it as the image's file; replicas read it under their own writes).
    let raw = dir.path().join("base.raw");
    let image_size = 24 * MIB;
    let f = std::fs::File::create(&raw).unwrap();
    f.set_len(image_size).unwrap();
    let mut x: u32 = 0x9e37_79b9;
    let data: Vec<u8> = (0..5 * MIB)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x.to_le_bytes()[0]
        })
        .collect();
    let mib = usize::try_from(MIB).unwrap();
    f.write_all_at(&data[..4 * mib], 0).unwrap();
    f.write_all_at(&vec![0; 2 * mib], 4 * MIB).unwrap();
    f.write_all_at(&data[..mib], 10 * MIB + 512).unwrap();
    f.write_all_at(&data[..64 << 10], image_size - (64 << 10))
        .unwrap();
    drop(f);
    let qcow = dir.path().join("base.qcow2");
    let out = std::process::Command::new("qemu-img")
        .args(["convert", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(8));
    let url = m.url.clone();
    let (ok, out, err) = corral(
        &url,
        &[
            "backing-image",
            "create",
            "base",
            "--from-file",
            qcow.to_str().unwrap(),
        ],
    );
    assert!(ok, "{out}{err}");
    wait_for("image base ready", Duration::from_secs(90), || {
        let (c, v) = rest("GET", &format!("{url}/v1/backingimages/base"), None);
        (c == 200 && v["state"] == "ready").then_some(())
    });

    // The source: 32 MiB over the 24 MiB image, two replicas; writes over image data, written zeros, a hole and
    // past the image's end. The expected contents get the same writes.
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "32Mi",
            "--replicas",
            "2",
            "--backing-image",
            "base",
        ],
    );
    assert!(ok, "{out}{err}");
    let src_uri = attach(&url, "src");
    let expected = dir.path().join("expected.raw");
    std::fs::copy(&raw, &expected).unwrap();
    let e = std::fs::OpenOptions::new().write(true).open(&expected).unwrap();
    e.set_len(32 * MIB).unwrap();
    let writes: [(u64, u8, u64); 4] = [
        (MIB, 0xa1, 2 * MIB),
        (5 * MIB, 0xb2, 64 << 10),
        (16 * MIB, 0xc3, MIB),
        (30 * MIB, 0xd4, MIB),
    ];
    let mut cmds = Vec::new();
    for (off, pat, len) in writes {
        cmds.push(format!("write -P {pat:#x} {off} {len}"));
        e.write_all_at(&vec![pat; usize::try_from(len).unwrap()], off)
            .unwrap();
    }
    drop(e);
    cmds.push("flush".into());
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, o) = qemu_io(&src_uri, &cmds);
    assert!(ok, "{o}");
    assert_reads(&expected, &src_uri, "the source reads its image under its writes");

    // vol:// of the attached source, through the CLI (waits until completed).
    let (ok, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "c1",
            "--from-volume",
            "src",
            "--replicas",
            "2",
        ],
    );
    assert!(ok, "{out}{err}");
    let v = volume(&m, "c1");
    assert_eq!(v["cloneStatus"]["state"], "completed", "{v}");
    let c1_uri = attach(&url, "c1");
    assert_reads(&expected, &c1_uri, "the clone reads exactly its source");
    assert_reads(&expected, &src_uri, "the source is unchanged");

    // Its replicas run on the image (the manager hands them the image's file and name), and the clone copied
    // the source's own writes, not the image: no replica of it holds more than the source's largest.
    let c1 = wait_for("c1's replicas both RW", Duration::from_secs(90), || {
        let v = volume(&m, "c1");
        v["replicas"]
            .as_array()
            .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["mode"] == "RW" && r["pid"].is_i64()))
            .then_some(v)
    });
    for r in c1["replicas"].as_array().unwrap() {
        let args = cmdline(r["pid"].as_i64().unwrap());
        let flag = |f: &str| args.windows(2).find(|w| w[0] == f).map(|w| w[1].clone());
        assert_eq!(flag("--backing-image-name").as_deref(), Some("base"), "{args:?}");
        assert!(
            flag("--backing-file").is_some_and(|f| f.contains("backing-images/base-")),
            "{args:?}"
        );
    }
    let src_most = replica_dirs(&volume(&m, "src"))
        .iter()
        .map(|d| allocated_in(d))
        .max()
        .unwrap();
    for d in replica_dirs(&c1) {
        let a = allocated_in(&d);
        assert!(
            a <= src_most + MIB,
            "{} holds {a} bytes, the source's largest replica {src_most}",
            d.display()
        );
    }

    // The clone's spec names the image: with the source gone, the image is still in use by the clone.
    detach(&url, "c1");
    detach(&url, "src");
    wait_for("src detached", Duration::from_secs(60), || {
        (volume(&m, "src")["state"] == "detached").then_some(())
    });
    let (ok, out, err) = corral(&url, &["volume", "rm", "src"]);
    assert!(ok, "{out}{err}");
    let (code, e) = rest("DELETE", &format!("{url}/v1/backingimages/base"), None);
    assert!(
        code == 409
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("c1") && !m.contains("src")),
        "{code} {e}"
    );
}
