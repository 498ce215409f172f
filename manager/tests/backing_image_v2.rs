//! v2 backing images through the manager (issue 21, seed 001), one node with real daemons: a v1 disk and a v2
//! disk (its `corral-replica serve-lvstore`), images downloaded from a local HTTP server. The first v2 copy is made
//! by the v2 disk's daemon from the `corral-bim` download of the prepared file (pending → in-progress → ready),
//! the v1 file is removed after; the seed's three images (v1 raw, v2 raw, v2 from a qcow2 made by `qemu-img` from
//! the same random image) give three volumes that read back identically over NBD; the copies come back ready from
//! their lvols' xattrs after the disk daemon is SIGKILLed and restarted. Bad input: a v2 image without a v2 disk,
//! a checksum mismatch, the wrong engine for a volume, deleting an image a v2 volume uses. With three v2 disks:
//! copies synced to the other two one at a time, one removed, everything beside the store files wiped while the
//! manager and every disk daemon are down, the copies back from their xattrs and a replica on every disk reading
//! the same bytes alone; `minNumberOfCopies` and cleanup (never below the minimum, never a replica's copy); a sync
//! that keeps failing backs off with its reason in the disk's entry.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::v2_images::*;
use support::*;
use testkit::{nbd_sha256, wait_for};

const IMAGE_SIZE: u64 = 12 << 20;
const VOLUME_SIZE: u64 = 16 << 20;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sha512(path: &Path) -> String {
    run(Command::new("sha512sum").arg(path))
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// One random raw image (random data, a hole, explicitly written zeros; 12 MiB, a whole number of 4 KiB blocks
/// as an lvol is) and its qcow2 made by `qemu-img convert`. Returns (raw, qcow2).
fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::FileExt;
    let raw = dir.join("image.raw");
    let f = std::fs::File::create(&raw).unwrap();
    f.set_len(IMAGE_SIZE).unwrap();
    let mut x: u64 = u64::from(std::process::id()) | 1;
    let mut data = vec![0u8; 5 << 20];
    for b in &mut data {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x.to_le_bytes()[3];
    }
    f.write_all_at(&data[..3 << 20], 0).unwrap();
    f.write_all_at(&vec![0u8; 1 << 20], 4 << 20).unwrap(); // zeros written, not a hole
    f.write_all_at(&data[..(2 << 20) + 4096], 7 << 20).unwrap();
    f.write_all_at(&data[..4096], IMAGE_SIZE - 4096).unwrap();
    let qcow = dir.join("image.qcow2");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    (raw, qcow)
}

/// Waits until the image's first v2 copy is ready; records every first-copy state seen on the way.
fn wait_first_copy(m: &Manager, name: &str, seen: &mut Vec<String>) -> Value {
    wait_for(
        &format!("the first v2 copy of {name} ready"),
        Duration::from_secs(120),
        || {
            let v = image(m, name);
            let st = v["v2FirstCopyStatus"].as_str().unwrap_or_default().to_owned();
            if seen.last() != Some(&st) {
                seen.push(st.clone());
            }
            assert_ne!(st, "failed", "the first v2 copy of {name} failed: {v}");
            (st == "ready" && v["state"] == "ready").then_some(v)
        },
    )
}

#[test]
fn v1_and_v2_images_of_one_raw_and_its_qcow2_give_volumes_reading_the_same_and_copies_survive_a_daemon_restart()
 {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (raw, qcow) = fixture(&files);
    let (raw_sum, qcow_sum) = (sha512(&raw), sha512(&qcow));
    let http = HttpServer::start(&files);
    let (m, address) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 << 20);
    let v2_disk = dir.path().join("node-1-v2a");
    let default_disk = m.data_dir.join("disks/default");

    for (name, file, sum, engine) in [
        ("img-v1-raw", "image.raw", &raw_sum, "v1"),
        ("img-v2-raw", "image.raw", &raw_sum, "v2"),
        ("img-v2-qcow2", "image.qcow2", &qcow_sum, "v2"),
    ] {
        let (code, v) = create_image(
            &m,
            &json!({"name": name, "sourceType": "download", "parameters": {"url": http.url(file)},
                "expectedChecksum": sum, "dataEngine": engine}),
        );
        assert_eq!(code, 201, "{v}");
        assert_eq!(v["dataEngine"], engine, "{v}");
    }

    // The v2 images: the first copy goes through its states and ends as a snapshot lvol holding the raw data.
    for name in ["img-v2-raw", "img-v2-qcow2"] {
        let mut seen = Vec::new();
        let v = wait_first_copy(&m, name, &mut seen);
        assert!(
            seen.iter()
                .all(|s| ["", "pending", "in-progress", "ready"].contains(&s.as_str())),
            "{name}: {seen:?}"
        );
        // The qcow2 image's copy holds its raw conversion: its SHA-512 is the raw file's.
        assert_eq!(v["currentChecksum"], raw_sum.as_str(), "{name}: {v}");
        assert_eq!(v["virtualSize"], IMAGE_SIZE, "{name}: {v}");
        let copies = disks_of(&v, "v2");
        assert_eq!(copies.len(), 1, "{v}");
        let copy = &copies[0]["v2Copy"];
        assert_eq!(copies[0]["state"], "ready", "{v}");
        assert_eq!(copy["currentChecksum"], raw_sum.as_str(), "{v}");
        assert_eq!(copy["size"], IMAGE_SIZE, "{v}");
        assert_eq!(copy["uuid"], v["uuid"], "{v}");
        assert_eq!(v["v2FirstCopyDisk"], copies[0]["diskUUID"], "{v}");
        // The v1 file it was made from goes.
        wait_for(
            &format!("the v1 file of {name} removed"),
            Duration::from_secs(60),
            || {
                let v = image(&m, name);
                (disks_of(&v, "v1").is_empty()
                    && v1_files(&default_disk, name).is_empty()
                    && v1_files(&v2_disk, name).is_empty())
                .then_some(())
            },
        );
    }
    let held = daemon_copies(&address);
    assert_eq!(held.len(), 2, "{held:?}");
    assert!(
        held.iter().all(|c| c.state == "ready"
            && c.current_checksum == raw_sum
            && c.lvol.starts_with(&format!("bi-{}-disk-", c.name))),
        "{held:?}"
    );
    // The v1 image is made beside them and may still be between its data source and its disk manager.
    let v = wait_for("img-v1-raw ready", Duration::from_secs(60), || {
        let v = image(&m, "img-v1-raw");
        (v["state"] == "ready").then_some(v)
    });
    assert!(disks_of(&v, "v2").is_empty(), "{v}");

    // Three volumes, one per image: each reads the image, then zeros to its end; all three alike.
    for (vol, img, engine) in [
        ("vol-v1", "img-v1-raw", "v1"),
        ("vol-v2", "img-v2-raw", "v2"),
        ("vol-qcow", "img-v2-qcow2", "v2"),
    ] {
        let (code, v) = create_volume(&m, vol, VOLUME_SIZE, Some(img), engine);
        assert_eq!(code, 201, "{v}");
    }
    let mut sums = Vec::new();
    for vol in ["vol-v1", "vol-v2", "vol-qcow"] {
        let uri = attach(&m.url, vol);
        qemu_img_compare(raw.to_str().unwrap(), &uri);
        sums.push(nbd_sha256(&uri));
    }
    assert!(sums.iter().all(|s| *s == sums[0]), "{sums:?}");
    let v = volume(&m, "vol-qcow");
    assert_eq!(v["replicas"][0]["dataEngine"], "v2", "{v}");

    // The disk daemon SIGKILLed (the v2 volumes detached first: a single replica's daemon dying under IO is the
    // v2 engine's test): restarted by the manager, it finds its copies in the lvols' xattrs (nothing downloaded
    // again: the v1 files are gone) and the v2 volumes, attached again, read the same.
    for vol in ["vol-v2", "vol-qcow"] {
        ok(&m.url, &["volume", "detach", vol]);
    }
    let d = lvstore_daemon(&m, "node-1", "v2a").unwrap_or_default();
    let pid = d["pid"].as_i64().unwrap();
    sigkill(pid);
    let d = wait_for("the lvstore daemon restarted", Duration::from_secs(60), || {
        let d = lvstore_daemon(&m, "node-1", "v2a").unwrap_or_default();
        (d["state"] == "running" && d["pid"].as_i64() != Some(pid)).then_some(d)
    });
    let address = d["address"].as_str().unwrap().to_owned();
    let held = daemon_copies(&address);
    assert_eq!(held.len(), 2, "{held:?}");
    assert!(
        held.iter()
            .all(|c| c.state == "ready" && c.current_checksum == raw_sum),
        "{held:?}"
    );
    for name in ["img-v2-raw", "img-v2-qcow2"] {
        wait_for(
            &format!("{name}'s copy ready again"),
            Duration::from_secs(60),
            || {
                let v = image(&m, name);
                let c = disks_of(&v, "v2");
                (c.len() == 1 && c[0]["state"] == "ready" && v["v2FirstCopyStatus"] == "ready").then_some(())
            },
        );
        assert!(v1_files(&default_disk, name).is_empty() && v1_files(&v2_disk, name).is_empty());
    }
    for vol in ["vol-v2", "vol-qcow"] {
        let uri = attach(&m.url, vol);
        assert_eq!(nbd_sha256(&uri), sums[0], "{vol} after the daemon restart");
    }
}

#[test]
fn bad_v2_backing_image_input_is_refused_or_fails_with_a_message_and_leaves_no_lvol() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (raw, _) = fixture(&files);
    let raw_sum = sha512(&raw);
    let http = HttpServer::start(&files);

    // No v2 disk: a v2 image is refused before anything is made.
    let m = Manager::start(&dir.path().join("n0"), "node-0", "embedded", port_range(1));
    let body = json!({"name": "nodisk", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
        "dataEngine": "v2"});
    let (code, v) = create_image(&m, &body);
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("v2 disk"), "{v}");
    assert_eq!(
        rest("GET", &format!("{}/v1/backingimages/nodisk", m.url), None).0,
        404
    );
    let (code, v) = create_image(
        &m,
        &json!({"name": "x", "sourceType": "download",
        "parameters": {"url": http.url("image.raw")}, "dataEngine": "v3"}),
    );
    assert_eq!(code, 400, "{v}");
    drop(m);

    let (m, address) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 << 20);

    // A checksum that does not match: the image fails with the reason; no lvol is made in the store.
    let wrong = "ab".repeat(64);
    let (code, v) = create_image(
        &m,
        &json!({"name": "wrongsum", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": wrong, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_for("wrongsum failed", Duration::from_secs(90), || {
        let v = image(&m, "wrongsum");
        (v["state"] == "failed").then_some(v)
    });
    assert!(
        v["message"].as_str().unwrap().to_lowercase().contains("checksum"),
        "{v}"
    );
    assert_ne!(v["v2FirstCopyStatus"], "ready", "{v}");
    assert!(daemon_copies(&address).is_empty());

    // A good v2 image; a volume of the wrong engine on it (and a v2 volume on a v1 image) is refused.
    let (code, v) = create_image(
        &m,
        &json!({"name": "good", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": raw_sum, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    let mut seen = Vec::new();
    wait_first_copy(&m, "good", &mut seen);
    let (code, v) = create_volume(&m, "wrong-engine", VOLUME_SIZE, Some("good"), "v1");
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("v2 backing image"), "{v}");
    assert_eq!(
        rest("GET", &format!("{}/v1/volumes/wrong-engine", m.url), None).0,
        404
    );
    let (code, v) = create_image(
        &m,
        &json!({"name": "v1img", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": raw_sum}),
    );
    assert_eq!(code, 201, "{v}");
    wait_for("v1img ready", Duration::from_secs(90), || {
        (image(&m, "v1img")["state"] == "ready").then_some(())
    });
    let (code, v) = create_volume(&m, "wrong-engine", VOLUME_SIZE, Some("v1img"), "v2");
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("v1 backing image"), "{v}");

    // An image a v2 volume uses is not deleted; once the volume is gone, it is, with its lvol.
    let (code, v) = create_volume(&m, "user", VOLUME_SIZE, Some("good"), "v2");
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, "user");
    qemu_img_compare(raw.to_str().unwrap(), &uri);
    let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/good", m.url), None);
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("user"), "{v}");
    assert_eq!(image(&m, "good")["state"], "ready");
    assert!(
        daemon_copies(&address)
            .iter()
            .any(|c| c.name == "good" && c.state == "ready")
    );
    ok(&m.url, &["volume", "detach", "user"]);
    let (code, v) = rest("DELETE", &format!("{}/v1/volumes/user", m.url), None);
    assert!(code == 200 || code == 204, "{v}");
    wait_for("the volume gone", Duration::from_secs(60), || {
        (rest("GET", &format!("{}/v1/volumes/user", m.url), None).0 == 404).then_some(())
    });
    wait_for("the image deletable", Duration::from_secs(60), || {
        let (code, _) = rest("DELETE", &format!("{}/v1/backingimages/good", m.url), None);
        (code == 204).then_some(())
    });
    wait_for("the image and its lvol gone", Duration::from_secs(60), || {
        (rest("GET", &format!("{}/v1/backingimages/good", m.url), None).0 == 404
            && !daemon_copies(&address).iter().any(|c| c.name == "good"))
        .then_some(())
    });
}

/// The `diskUUID` of disk `name` in a node view.
fn find_disk_uuid(node: &Value, name: &str) -> Option<String> {
    node["disks"]
        .as_array()?
        .iter()
        .find(|d| d["name"] == name)
        .and_then(|d| d["diskUUID"].as_str())
        .map(str::to_owned)
}

/// The lvstore daemons as `GET /v1/lvstores` shows them, by disk name.
fn daemons_by_disk(m: &Manager) -> std::collections::BTreeMap<String, Value> {
    lvstore_daemons(m)
        .into_iter()
        .map(|d| (d["disk"].as_str().unwrap_or_default().to_owned(), d))
        .collect()
}

/// The v2 copies of an image view: disk UUID → state.
fn v2_states(v: &Value) -> std::collections::BTreeMap<String, String> {
    disks_of(v, "v2")
        .iter()
        .map(|d| {
            (
                d["diskUUID"].as_str().unwrap_or_default().to_owned(),
                d["state"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A manager with three v2 disks (`v2a`, `v2b`, `v2c`, 256 MiB stores) and their daemons running; returns the
/// disks' UUIDs by name.
fn node_with_three_v2_disks(dir: &Path) -> (Manager, std::collections::BTreeMap<String, String>) {
    let (m, _) = node_with_a_v2_disk(dir, "node-1", 0, 256 << 20);
    for name in ["v2b", "v2c"] {
        add_v2_disk(&m, name, &dir.join(format!("node-1-{name}")), 256 << 20);
    }
    wait_for("three lvstore daemons running", Duration::from_secs(60), || {
        let d = daemons_by_disk(&m);
        (d.len() == 3 && d.values().all(|d| d["state"] == "running")).then_some(())
    });
    let uuids = ["v2a", "v2b", "v2c"]
        .into_iter()
        .map(|n| (n.to_owned(), disk_uuid(&m, n)))
        .collect();
    (m, uuids)
}

/// The `diskUUID` of disk `name` of node-1.
fn disk_uuid(m: &Manager, name: &str) -> String {
    let (code, node) = rest("GET", &format!("{}/v1/nodes/node-1", m.url), None);
    assert_eq!(code, 200, "{node}");
    find_disk_uuid(&node, name).unwrap_or_else(|| panic!("no disk {name} in {node}"))
}

/// The v2 copies of an image view: disk UUID → `lastRefAt` (the cleanup mark; None while retained).
fn v2_marks(v: &Value) -> std::collections::BTreeMap<String, Option<i64>> {
    disks_of(v, "v2")
        .iter()
        .map(|d| {
            (
                d["diskUUID"].as_str().unwrap_or_default().to_owned(),
                d["lastRefAt"].as_i64(),
            )
        })
        .collect()
}

fn create_v2_volume(m: &Manager, name: &str, image: &str, replicas: u32) {
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(
            &json!({"name": name, "size": VOLUME_SIZE, "numberOfReplicas": replicas, "backingImage": image,
            "dataEngine": "v2"}),
        ),
    );
    assert_eq!(code, 201, "{v}");
}

/// Reads every replica of the detached v2 volume `vol` on its own: the replica hosted again by its disk's daemon
/// (`LvstoreReplicaAdd`, at its recorded address), a `corral-engine` over it alone serving NBD on a unix socket,
/// the SHA-256 of everything it serves (nbdsh), the engine stopped and the replica unhosted (its lvols kept).
/// Returns disk name → SHA-256.
fn read_each_replica_alone(m: &Manager, dir: &Path, vol: &str) -> std::collections::BTreeMap<String, String> {
    use corral_proto::v1::{LvstoreReplicaAddRequest, LvstoreReplicaRemoveRequest};
    let v = volume(m, vol);
    let daemons = daemons_by_disk(m);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let counter_disabled = v["revisionCounterDisabled"].as_bool().unwrap_or(false);
    let generation = v["engineGeneration"].as_u64().unwrap_or(0).to_string();
    let mut sums = std::collections::BTreeMap::new();
    for r in v["replicas"].as_array().unwrap() {
        let (name, disk) = (r["name"].as_str().unwrap(), r["disk"].as_str().unwrap());
        let daemon = daemons[disk]["address"].as_str().unwrap().to_owned();
        let address = rt.block_on(async {
            let mut c = support::tls::lvstore_client(&daemon).await;
            c.lvstore_replica_add(LvstoreReplicaAddRequest {
                name: name.to_owned(),
                disable_revision_counter: counter_disabled,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .address
        });
        let socket = dir.join(format!("{name}.sock"));
        let mut cmd = testkit::DaemonCommand::new(testkit::workspace_bin("corral-engine"))
            .label(format!("engine-{name}"))
            // The replica requires the node's certificate.
            .env("CORRAL_TLS_DIR", m.tls_dir())
            .args(["serve", "--volume", vol, "--size", &VOLUME_SIZE.to_string()])
            .args(["--listen", "127.0.0.1:0", "--replica", &address])
            // The last generation the manager handed out: at or above what the replica recorded (it would refuse
            // a lower one), and the manager's next attach is above it.
            .args(["--generation", &generation])
            .arg("--nbd-listen")
            .arg(format!("unix:{}", socket.display()));
        if counter_disabled {
            cmd = cmd.arg("--disable-revision-counter");
        }
        let mut engine = cmd.spawn();
        sums.insert(
            disk.to_owned(),
            nbd_sha256(&format!("nbd+unix:///{vol}?socket={}", socket.display())),
        );
        engine.kill();
        rt.block_on(async {
            let mut c = support::tls::lvstore_client(&daemon).await;
            c.lvstore_replica_remove(LvstoreReplicaRemoveRequest {
                name: name.to_owned(),
                delete_data: false,
            })
            .await
            .unwrap();
        });
    }
    sums
}

#[test]
fn v2_copies_synced_to_more_disks_come_back_ready_from_their_xattrs_after_a_wipe_and_every_daemon_restarting()
{
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (raw, _) = fixture(&files);
    let raw_sum = sha512(&raw);
    let http = HttpServer::start(&files);
    let (mut m, uuids) = node_with_three_v2_disks(dir.path());
    let default_disk = m.data_dir.join("disks/default");

    let (code, v) = create_image(
        &m,
        &json!({"name": "img", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": raw_sum, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_first_copy(&m, "img", &mut Vec::new());
    let first = v["v2FirstCopyDisk"].as_str().unwrap().to_owned();
    let others: Vec<String> = uuids.values().filter(|d| **d != first).cloned().collect();
    assert_eq!(others.len(), 2, "{v}");

    // A v1 disk cannot take a v2 image's copy.
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/backingimages/img/copy", m.url),
        Some(&json!({"disks": ["no-such-disk"]})),
    );
    assert_eq!(code, 409, "{body}");

    // Both other disks added to the spec: each is synced from a ready copy, one at a time.
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/backingimages/img/copy", m.url),
        Some(&json!({ "disks": others })),
    );
    assert_eq!(code, 200, "{body}");
    let mut max_in_flight = 0;
    wait_for("three ready v2 copies", Duration::from_secs(120), || {
        let st = v2_states(&image(&m, "img"));
        let in_flight = st
            .values()
            .filter(|s| *s == "pending" || *s == "in-progress")
            .count();
        max_in_flight = max_in_flight.max(in_flight);
        assert!(!st.values().any(|s| s == "failed"), "{st:?} {}", image(&m, "img"));
        (st.len() == 3 && st.values().all(|s| s == "ready")).then_some(())
    });
    assert!(max_in_flight <= 1, "copies of one image are synced one at a time");
    for d in daemons_by_disk(&m).values() {
        let held = daemon_copies(d["address"].as_str().unwrap());
        assert!(
            held.len() == 1 && held[0].state == "ready" && held[0].current_checksum == raw_sum,
            "{held:?}"
        );
    }

    // One copy removed from the spec: deleted from its disk's store.
    let gone = others[0].clone();
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/backingimages/img/cleanup", m.url),
        Some(&json!({ "disks": [gone] })),
    );
    assert_eq!(code, 200, "{body}");
    wait_for("the removed copy deleted", Duration::from_secs(60), || {
        let st = v2_states(&image(&m, "img"));
        (st.len() == 2 && !st.contains_key(&gone)).then_some(())
    });
    let held: usize = daemons_by_disk(&m)
        .values()
        .map(|d| daemon_copies(d["address"].as_str().unwrap()).len())
        .sum();
    assert_eq!(held, 2);

    // The manager stopped and every disk daemon SIGKILLed; then everything in each disk's directory but the store
    // file is wiped (the daemon's side files: a sync's staging file, a rebuild's scratch, whatever else is there),
    // and the manager started again: it starts every daemon, which finds the copies in the lvols' xattrs alone.
    let before = daemons_by_disk(&m);
    m.kill();
    for d in before.values() {
        let pid = d["pid"].as_i64().unwrap();
        sigkill(pid);
        wait_for("a disk daemon dead", Duration::from_secs(10), || {
            (!pid_alive(pid)).then_some(())
        });
    }
    let mut wiped = Vec::new();
    for name in ["v2a", "v2b", "v2c"] {
        for e in std::fs::read_dir(dir.path().join(format!("node-1-{name}")))
            .unwrap()
            .flatten()
        {
            if e.file_name() == "lvstore.img" {
                continue;
            }
            wiped.push(format!("{name}/{}", e.file_name().to_string_lossy()));
            if e.file_type().unwrap().is_dir() {
                std::fs::remove_dir_all(e.path()).unwrap();
            } else {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        let left: Vec<_> = std::fs::read_dir(dir.path().join(format!("node-1-{name}")))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["lvstore.img"], "{name}");
    }
    eprintln!("wiped beside the stores: {wiped:?}");
    m.restart();
    let after = wait_for("every lvstore daemon restarted", Duration::from_secs(60), || {
        let d = daemons_by_disk(&m);
        (d.len() == 3
            && d.iter()
                .all(|(k, d)| d["state"] == "running" && d["pid"].as_i64() != before[k]["pid"].as_i64()))
        .then_some(d)
    });
    let mut ready = 0;
    for d in after.values() {
        for c in daemon_copies(d["address"].as_str().unwrap()) {
            assert!(c.state == "ready" && c.current_checksum == raw_sum, "{c:?}");
            ready += 1;
        }
    }
    assert_eq!(ready, 2);
    wait_for(
        "the image's two copies ready again",
        Duration::from_secs(60),
        || {
            let st = v2_states(&image(&m, "img"));
            (st.len() == 2 && st.values().all(|s| s == "ready") && !st.contains_key(&gone)).then_some(())
        },
    );
    // Nothing was downloaded again: no v1 file came back.
    assert!(v1_files(&default_disk, "img").is_empty());

    // A v2 volume with a replica on every disk: the disk whose copy was removed gets one again (synced), every
    // replica's head is a clone of its disk's copy, and each replica alone serves the same bytes as the volume.
    create_v2_volume(&m, "vol", "img", 3);
    let uri = attach(&m.url, "vol");
    let v = volume(&m, "vol");
    assert_eq!(replica_disks(&v), ["v2a", "v2b", "v2c"], "{v}");
    qemu_img_compare(raw.to_str().unwrap(), &uri);
    let sum = nbd_sha256(&uri);
    let st = v2_states(&image(&m, "img"));
    assert!(st.len() == 3 && st.values().all(|s| s == "ready"), "{st:?}");
    ok(&m.url, &["volume", "detach", "vol"]);
    wait_for("vol detached", Duration::from_secs(60), || {
        (volume(&m, "vol")["state"] == "detached").then_some(())
    });
    let alone = read_each_replica_alone(&m, dir.path(), "vol");
    assert_eq!(alone.len(), 3, "{alone:?}");
    for (disk, s) in &alone {
        assert_eq!(*s, sum, "the replica on {disk} alone");
    }
}

#[test]
fn v2_copies_reach_min_number_of_copies_and_unused_ones_go_after_the_wait_never_below_it_nor_from_a_replica()
{
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (raw, _) = fixture(&files);
    let raw_sum = sha512(&raw);
    let http = HttpServer::start(&files);
    let (m, uuids) = node_with_three_v2_disks(dir.path());
    let daemons = daemons_by_disk(&m);
    let address_of = |uuid: &str| {
        let (disk, _) = uuids.iter().find(|(_, u)| *u == uuid).unwrap();
        daemons[disk]["address"].as_str().unwrap().to_owned()
    };

    // minNumberOfCopies 2 on one node: a second copy on another disk, and no third; neither is marked (both are
    // needed for the minimum).
    let (code, v) = create_image(
        &m,
        &json!({"name": "img", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": raw_sum, "dataEngine": "v2", "minNumberOfCopies": 2}),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_for("two ready v2 copies", Duration::from_secs(120), || {
        let v = image(&m, "img");
        let st = v2_states(&v);
        assert!(st.len() <= 2, "{st:?}");
        (st.len() == 2 && st.values().all(|s| s == "ready")).then_some(v)
    });
    assert!(v2_marks(&v).values().all(Option::is_none), "{v}");
    let held: Vec<String> = v2_states(&v).into_keys().collect();
    let third = uuids.values().find(|u| !held.contains(u)).unwrap().clone();
    assert!(daemon_copies(&address_of(&third)).is_empty());
    for d in &held {
        let c = daemon_copies(&address_of(d));
        assert!(
            c.len() == 1 && c[0].state == "ready" && c[0].current_checksum == raw_sum,
            "{c:?}"
        );
    }

    // A v2 volume with a replica on every disk: the third disk gets a copy for its replica. Three copies for a
    // minimum of two, but every one is in use: none is marked for cleanup.
    create_v2_volume(&m, "vol", "img", 3);
    let uri = attach(&m.url, "vol");
    qemu_img_compare(raw.to_str().unwrap(), &uri);
    let v = image(&m, "img");
    let st = v2_states(&v);
    assert!(st.len() == 3 && st.values().all(|s| s == "ready"), "{st:?}");
    assert!(
        v2_marks(&v).values().all(Option::is_none),
        "in use, never marked: {v}"
    );

    // The volume gone: one copy is beyond the minimum and is marked (kept for the wait interval, an hour by
    // default); the other two are retained.
    ok(&m.url, &["volume", "detach", "vol"]);
    wait_for("vol detached", Duration::from_secs(60), || {
        (volume(&m, "vol")["state"] == "detached").then_some(())
    });
    let (code, e) = rest("DELETE", &format!("{}/v1/volumes/vol", m.url), None);
    assert_eq!(code, 204, "{e}");
    let marked = wait_for("one copy marked unused", Duration::from_secs(60), || {
        let marks = v2_marks(&image(&m, "img"));
        let marked: Vec<&String> = marks
            .iter()
            .filter(|(_, m)| m.is_some())
            .map(|(d, _)| d)
            .collect();
        (marks.len() == 3 && marked.len() == 1).then(|| marked[0].clone())
    });

    // Wait interval 0: the marked copy goes, from the spec and from its store; two stay, never fewer.
    let (code, v) = rest(
        "PUT",
        &format!("{}/v1/settings/backing-image-cleanup-wait-interval", m.url),
        Some(&json!({"value": "0"})),
    );
    assert_eq!(code, 200, "{v}");
    wait_for("the unused copy removed", Duration::from_secs(60), || {
        let st = v2_states(&image(&m, "img"));
        assert!(st.values().filter(|s| *s == "ready").count() >= 2, "{st:?}");
        (st.len() == 2 && !st.contains_key(&marked) && daemon_copies(&address_of(&marked)).is_empty())
            .then_some(())
    });
    let v = image(&m, "img");
    assert!(v2_marks(&v).values().all(Option::is_none), "{v}");
    for d in v2_states(&v).keys() {
        assert_eq!(daemon_copies(&address_of(d)).len(), 1, "{d}");
    }
}

#[test]
fn a_v2_sync_that_keeps_failing_backs_off_per_disk_with_the_reason_in_the_copy_status() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    // 80 MiB of data: more than a 64 MiB store holds.
    let big = files.join("big.raw");
    run(Command::new("head")
        .args(["-c", &(80u64 << 20).to_string(), "/dev/urandom"])
        .stdout(std::fs::File::create(&big).unwrap()));
    let sum = sha512(&big);
    let http = HttpServer::start(&files);
    let (m, _) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 << 20);
    let (code, v) = create_image(
        &m,
        &json!({"name": "big", "sourceType": "download", "parameters": {"url": http.url("big.raw")},
            "expectedChecksum": sum, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    wait_first_copy(&m, "big", &mut Vec::new());

    // A disk too small for the image: its sync fails, the failed copy is deleted, and the disk's entry says why
    // and when the next attempt comes.
    let tiny_address = add_v2_disk(&m, "tiny", &dir.path().join("node-1-tiny"), 64 << 20);
    let tiny = disk_uuid(&m, "tiny");
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/backingimages/big/copy", m.url),
        Some(&json!({ "disks": [tiny] })),
    );
    assert_eq!(code, 200, "{body}");
    let entry = |v: &Value| {
        disks_of(v, "v2")
            .into_iter()
            .find(|d| d["diskUUID"] == tiny.as_str())
    };
    let failed = wait_for("the sync to tiny failed", Duration::from_secs(120), || {
        let v = image(&m, "big");
        entry(&v).filter(|e| e["state"] == "failed")
    });
    let message = failed["message"].as_str().unwrap().to_owned();
    eprintln!("the failed sync's entry: {failed}");
    assert!(message.contains("next attempt in 30s"), "{failed}");
    assert!(
        message.starts_with("sync failed: ") || message.starts_with("sync from disk "),
        "{failed}"
    );

    // No attempt while the backoff runs (it was every pass, about 2 s): the entry keeps its message, tiny's store
    // holds no copy, and the image stays ready on its first disk.
    let end = std::time::Instant::now() + Duration::from_secs(8);
    while std::time::Instant::now() < end {
        let v = image(&m, "big");
        assert_eq!(v["state"], "ready", "{v}");
        let e = entry(&v).unwrap_or_default();
        assert!(e["state"] == "failed" && e["message"] == message.as_str(), "{e}");
        assert!(daemon_copies(&tiny_address).is_empty());
        std::thread::sleep(Duration::from_millis(500));
    }

    // The disk taken out of the spec: its entry goes with the backoff.
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/backingimages/big/cleanup", m.url),
        Some(&json!({ "disks": [tiny] })),
    );
    assert_eq!(code, 200, "{body}");
    wait_for("tiny's entry gone", Duration::from_secs(30), || {
        entry(&image(&m, "big")).is_none().then_some(())
    });
}
