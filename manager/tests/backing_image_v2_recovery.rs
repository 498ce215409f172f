//! v2 volumes on v2 backing images through failures, and v2 images through the loss of their copies (issue 21,
//! seed 001), with real daemons (managers, `corral-replica serve-lvstore` per v2 disk, engines, etcd):
//! - a v2 volume on a v2 image with the revision counter disabled, its engine SIGKILLed and then every disk
//!   daemon SIGKILLed under a writer, is salvaged each time and reads the image where it was never written and
//!   the flushed writes where it was;
//! - a backup of such a volume records the image by name and SHA-512, and a restore into a new volume lands on
//!   that image and reads like the source;
//! - every v2 copy of an image lost after its v1 file went: a downloaded image is prepared from its source again
//!   and comes back ready with the same SHA-512; an uploaded one fails with a message saying what to do;
//! - three nodes on one etcd: `minNumberOfCopies` copies on distinct nodes before a second disk of a node, and a
//!   dead node's copy made again on another node.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::v2_images::*;
use support::*;
use testkit::{nbd_sha256, qemu_io, wait_for};

const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 12 * MIB;
const VOLUME_SIZE: u64 = 16 * MIB;
const READY: Duration = Duration::from_secs(90);

/// The bytes a volume of `VOLUME_SIZE` on the image `raw` reads after `writes` ((offset, pattern, length); a
/// pattern 0 is a write of zeros): a file at `out` to compare the volume with.
fn expected_file(raw: &Path, out: &Path, writes: &[(u64, u8, u64)]) {
    use std::os::unix::fs::FileExt;
    std::fs::copy(raw, out).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(out).unwrap();
    f.set_len(VOLUME_SIZE).unwrap();
    for (off, p, len) in writes {
        f.write_all_at(&vec![*p; usize::try_from(*len).unwrap()], *off)
            .unwrap();
    }
}

/// Writes (offset, pattern, length) through qemu-io and flushes.
fn write_flushed(uri: &str, writes: &[(u64, u8, u64)]) {
    let mut cmds: Vec<String> = writes
        .iter()
        .map(|(off, p, len)| {
            if *p == 0 {
                format!("write -z {off} {len}")
            } else {
                format!("write -P {p:#x} {off} {len}")
            }
        })
        .collect();
    cmds.push("flush".to_owned());
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, out) = qemu_io(uri, &refs);
    assert!(ok, "{out}");
}

/// A downloaded v2 image `name` of the file `file` served by `http`, checked against `sum`.
fn download_v2_image(m: &Manager, http: &HttpServer, name: &str, file: &str, sum: &str, min_copies: u32) {
    let (code, v) = create_image(
        m,
        &json!({"name": name, "sourceType": "download", "parameters": {"url": http.url(file)},
            "expectedChecksum": sum, "dataEngine": "v2", "minNumberOfCopies": min_copies}),
    );
    assert_eq!(code, 201, "{v}");
}

/// The v2 copies of an image view: disk UUID → (node, state).
fn v2_copies(v: &Value) -> std::collections::BTreeMap<String, (String, String)> {
    disks_of(v, "v2")
        .iter()
        .map(|d| {
            (
                d["diskUUID"].as_str().unwrap_or_default().to_owned(),
                (
                    d["nodeId"].as_str().unwrap_or_default().to_owned(),
                    d["state"].as_str().unwrap_or_default().to_owned(),
                ),
            )
        })
        .collect()
}

/// The nodes of an image's ready v2 copies, one entry per copy.
fn ready_copy_nodes(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v2_copies(v)
        .into_values()
        .filter(|(_, s)| s == "ready")
        .map(|(n, _)| n)
        .collect();
    n.sort();
    n
}

/// Deletes image `name`'s copy from the disk daemon at `address` (`BackingImageDelete`), as a lost lvol. A copy
/// still exposed to feed a sync to another disk is refused by the daemon ("unexpose it first"): the manager
/// unexposes it once the sync is done, so the delete is retried until then (60 s at most).
fn delete_daemon_copy(address: &str, name: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = support::tls::lvstore_client(address).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let res = c
                .backing_image_delete(corral_proto::v1::BackingImageRef {
                    name: name.to_owned(),
                })
                .await;
            match res {
                Ok(_) => return,
                Err(e)
                    if e.code() == tonic::Code::FailedPrecondition
                        && e.message().contains("being sent")
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("delete {name}'s copy on {address}: {e}"),
            }
        }
    });
}

/// The pid of the volume's engine.
fn engine_pid(v: &Value) -> Option<i64> {
    v["engine"]["pid"].as_i64()
}

/// Waits until the volume is attached and healthy with `rw` RW replicas on an engine other than `old` that serves
/// (a restarted engine replaces the killed one's socket file only when it starts serving: none in between).
fn wait_salvaged(m: &Manager, name: &str, rw: usize, old: i64) -> Value {
    wait_for(
        &format!("{name} salvaged and healthy"),
        Duration::from_secs(120),
        || {
            let v = volume(m, name);
            (v["state"] == "attached"
                && v["robustness"] == "healthy"
                && rw_replicas(&v) == rw
                && engine_pid(&v).is_some_and(|p| p != old)
                && v["engine"]["state"] == "running")
                .then_some(v)
        },
    )
}

#[test]
fn a_v2_volume_on_a_v2_image_without_revision_counter_is_salvaged_after_its_engine_and_then_every_disk_daemon_die()
 {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 31, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (m, _) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);
    add_v2_disk(&m, "v2b", &dir.path().join("node-1-v2b"), 256 * MIB);
    download_v2_image(&m, &http, "img", "image.raw", &sum, 1);
    wait_ready(&m, "img", READY);

    // Two replicas, one per v2 disk, each head a clone of its disk's copy; no revision counter.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(
            &json!({"name": "salv", "size": VOLUME_SIZE, "numberOfReplicas": 2, "backingImage": "img",
            "dataEngine": "v2", "disableRevisionCounter": true}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["revisionCounterDisabled"], true, "{v}");
    let uri = attach(&m.url, "salv");
    let v = wait_healthy(&m, "salv", 2, Duration::from_secs(90));
    assert_eq!(replica_disks(&v), ["v2a", "v2b"], "{v}");
    // Flushed writes over image data, zeros over image data, and a write past the image's end.
    let mut writes = vec![
        (MIB, 0x5a, 512 << 10),
        (2 * MIB, 0, MIB),
        (6 * MIB, 0x6b, MIB),
        (13 * MIB, 0x7c, MIB),
    ];
    write_flushed(&uri, &writes);
    let expected = dir.path().join("expected.raw");
    expected_file(&raw, &expected, &writes);
    qemu_img_compare(expected.to_str().unwrap(), &uri);

    // The engine SIGKILLed: restarted with --salvage-requested (without a counter it cannot tell a stale replica),
    // it picks the best replica; both come back RW and the volume reads the same.
    let engine = engine_pid(&v).unwrap();
    sigkill(engine);
    let v = wait_salvaged(&m, "salv", 2, engine);
    qemu_img_compare(expected.to_str().unwrap(), &uri);
    let salvaged_starts = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("started engine") && l.contains("engine=\"salv\"") && l.contains("salvage=true")
            })
            .count()
    };
    assert_eq!(
        salvaged_starts(&m.log()),
        1,
        "the engine restarted to salvage once"
    );

    // Every disk daemon SIGKILLed under a writer: every replica goes ERR; the daemons restart and host the replicas
    // again, and the engine is restarted to salvage. What was flushed before is there, the image shows through
    // where nothing was written; the range being written at the kill holds either, and is written again.
    let engine = engine_pid(&v).unwrap();
    let mut writer = Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .args(["-c", "write -P 0x77 8M 2M", "-c", "write -P 0x78 8M 2M"])
        .args(["-c", "write -P 0x79 8M 2M", "-c", "write -P 0x7a 8M 2M"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let daemons = lvstore_daemons(&m);
    assert_eq!(daemons.len(), 2, "{daemons:?}");
    let pids: Vec<i64> = daemons.iter().map(|d| d["pid"].as_i64().unwrap()).collect();
    for p in &pids {
        sigkill(*p);
    }
    let _ = writer.wait();
    wait_for("both disk daemons restarted", Duration::from_secs(60), || {
        let d = lvstore_daemons(&m);
        d.iter()
            .all(|d| d["state"] == "running" && !pids.contains(&d["pid"].as_i64().unwrap_or(0)))
            .then_some(())
    });
    let v = wait_salvaged(&m, "salv", 2, engine);
    assert!(
        m.log().contains("restarting the engine to salvage"),
        "the engine was not restarted because every replica was ERR"
    );
    assert!(salvaged_starts(&m.log()) >= 2, "{}", m.log());
    let uri = unix_endpoint(&v);
    let in_flight = (8 * MIB, 0x11, 2 * MIB);
    write_flushed(&uri, &[in_flight]);
    writes.push(in_flight);
    expected_file(&raw, &expected, &writes);
    qemu_img_compare(expected.to_str().unwrap(), &uri);
}

#[test]
fn a_backup_of_a_v2_volume_on_a_v2_image_records_the_image_and_restores_onto_it() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 37, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (m, _) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);
    let target = dir.path().join("target");
    std::fs::create_dir_all(&target).unwrap();
    ok(
        &m.url,
        &["backup", "target", "set", &format!("file://{}", target.display())],
    );
    download_v2_image(&m, &http, "img", "image.raw", &sum, 1);
    wait_ready(&m, "img", READY);

    let (code, v) = create_volume(&m, "src", VOLUME_SIZE, Some("img"), "v2");
    assert_eq!(code, 201, "{v}");
    let src = attach(&m.url, "src");
    let writes = [
        (512 << 10, 0x5a, 256 << 10),
        (2 * MIB, 0, 2 * MIB),
        (6 * MIB, 0x6b, MIB),
        (13 * MIB, 0x7c, MIB),
    ];
    write_flushed(&src, &writes);
    let expected = dir.path().join("expected.raw");
    expected_file(&raw, &expected, &writes);
    qemu_img_compare(expected.to_str().unwrap(), &src);
    let src_sum = nbd_sha256(&src);

    // The backup records the image by name and SHA-512.
    let b: Value = serde_json::from_str(&ok(&m.url, &["--json", "backup", "create", "src"])).unwrap();
    assert_eq!(b["state"], "completed", "{b}");
    assert_eq!(b["backingImageName"], "img", "{b}");
    // As the image's own checksum reads, and as a v1 volume's backup records it (bare lower-case hex).
    assert_eq!(b["backingImageChecksum"], sum.as_str(), "{b}");
    eprintln!("the backup: {b}");
    let id = b["id"].as_str().unwrap().to_owned();

    // A restore into a new v2 volume, no image named: it lands on the recorded image and reads like the source
    // (the image where the source never wrote, zeros where it wrote zeros over image data).
    ok(
        &m.url,
        &[
            "volume",
            "create",
            "restored",
            "--from-backup",
            &id,
            "--replicas",
            "1",
            "--data-engine",
            "v2",
        ],
    );
    let r = rest("GET", &format!("{}/v1/volumes/restored/restore", m.url), None).1;
    assert_eq!(r["state"], "completed", "{r}");
    let v = volume(&m, "restored");
    assert_eq!(v["backingImage"], "img", "{v}");
    assert_eq!(v["dataEngine"], "v2", "{v}");
    let uri = attach(&m.url, "restored");
    qemu_img_compare(expected.to_str().unwrap(), &uri);
    qemu_img_compare(&src, &uri);
    assert_eq!(nbd_sha256(&uri), src_sum);
}

#[test]
fn every_v2_copy_lost_after_the_file_went_brings_a_downloaded_image_back_from_its_source_and_fails_an_uploaded_one()
 {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 41, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (m, a) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);
    let b = add_v2_disk(&m, "v2b", &dir.path().join("node-1-v2b"), 256 * MIB);
    let default_disk = m.data_dir.join("disks/default");

    // A downloaded image with two copies, and an uploaded one; their v1 files gone.
    download_v2_image(&m, &http, "img", "image.raw", &sum, 2);
    let v = wait_for("two ready copies of img", READY, || {
        let v = image(&m, "img");
        (ready_copy_nodes(&v).len() == 2).then_some(v)
    });
    assert_eq!(v["currentChecksum"], sum.as_str(), "{v}");
    ok(
        &m.url,
        &[
            "backing-image",
            "create",
            "up",
            "--from-file",
            raw.to_str().unwrap(),
            "--data-engine",
            "v2",
        ],
    );
    wait_ready(&m, "up", READY);
    wait_for("the v1 files removed", Duration::from_secs(60), || {
        (v1_files(&default_disk, "img").is_empty() && v1_files(&default_disk, "up").is_empty()).then_some(())
    });
    let starts = |m: &Manager| m.log().matches("started data source").count();
    let before = starts(&m);

    // Every copy's lvol deleted behind the manager's back.
    for address in [&a, &b] {
        for c in daemon_copies(address) {
            delete_daemon_copy(address, &c.name);
        }
    }

    // The downloaded image is prepared from its source again, its first copy made again from the new file, and
    // its second synced: back to two ready copies with the same SHA-512.
    let mut seen = Vec::new();
    wait_for("img's first copy made again", Duration::from_secs(60), || {
        let v = image(&m, "img");
        (v["v2FirstCopyStatus"] != "ready").then_some(())
    });
    let v = wait_for(
        "img ready again from its source",
        Duration::from_secs(120),
        || {
            let v = image(&m, "img");
            let st = (
                v["v2FirstCopyStatus"].as_str().unwrap_or_default().to_owned(),
                v["state"].as_str().unwrap_or_default().to_owned(),
            );
            if seen.last() != Some(&st) {
                seen.push(st);
            }
            (v["v2FirstCopyStatus"] == "ready" && ready_copy_nodes(&v).len() == 2).then_some(v)
        },
    );
    eprintln!("img's (first copy, state) on the way: {seen:?}");
    assert_eq!(v["currentChecksum"], sum.as_str(), "{v}");
    for address in [&a, &b] {
        let held: Vec<_> = daemon_copies(address)
            .into_iter()
            .filter(|c| c.name == "img")
            .collect();
        assert!(
            held.len() == 1 && held[0].state == "ready" && held[0].current_checksum == sum,
            "{held:?}"
        );
    }
    assert!(starts(&m) > before, "the data source ran again");
    assert!(
        m.log()
            .contains("every v2 copy failed or is gone: preparing the image from its source again"),
        "the re-fetch is logged"
    );
    let (code, v) = create_volume(&m, "vol", VOLUME_SIZE, Some("img"), "v2");
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, "vol");
    qemu_img_compare(raw.to_str().unwrap(), &uri);

    // The uploaded image cannot be fetched again: it fails, says so, and stays failed.
    let v = wait_for("up failed", Duration::from_secs(60), || {
        let v = image(&m, "up");
        (v["state"] == "failed").then_some(v)
    });
    assert_eq!(v["v2FirstCopyStatus"], "failed", "{v}");
    let message = v["message"].as_str().unwrap().to_owned();
    assert!(message.contains("upload it again"), "{v}");
    let end = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < end {
        let v = image(&m, "up");
        assert!(v["state"] == "failed" && v["message"] == message.as_str(), "{v}");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(daemon_copies(&a).iter().all(|c| c.name != "up"));
    assert!(daemon_copies(&b).iter().all(|c| c.name != "up"));
}

#[test]
fn v2_copies_land_on_distinct_nodes_first_and_a_dead_nodes_copy_is_made_again_on_another_node() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 43, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (_etcd, mut ms) = start_cluster(dir.path(), 3);
    wait_nodes_ready(&ms[0], 3);
    let (code, v) = rest(
        "PUT",
        &format!("{}/v1/settings/node-down-timeout", ms[0].url),
        Some(&json!({"value": "5"})),
    );
    assert_eq!(code, 200, "{v}");
    // node-0 has two v2 disks, the others one each: three copies on four disks must leave one of node-0's out.
    for (i, disk) in [(0, "v2a"), (0, "v2b"), (1, "v2a"), (2, "v2a")] {
        // Under the node's data directory: its daemon dies with the node.
        let path = ms[i].data_dir.join(format!("v2-{disk}"));
        add_v2_disk(&ms[i], disk, &path, 128 * MIB);
    }

    download_v2_image(&ms[0], &http, "img", "image.raw", &sum, 3);
    let v = wait_for("three ready copies", READY, || {
        let v = image(&ms[0], "img");
        assert!(v2_copies(&v).len() <= 3, "{v}");
        (ready_copy_nodes(&v).len() == 3).then_some(v)
    });
    assert_eq!(
        ready_copy_nodes(&v),
        ["node-0", "node-1", "node-2"],
        "one copy per node: {v}"
    );
    assert_eq!(v["currentChecksum"], sum.as_str(), "{v}");

    // node-1 dies with its copy (manager and every daemon SIGKILLed): once it is down, its copy no longer counts,
    // and node-0's other disk gets one, synced from a live copy.
    ms[1].kill_node();
    let v = wait_for(
        "three ready copies on live nodes",
        Duration::from_secs(90),
        || {
            let v = image(&ms[0], "img");
            let live: Vec<String> = ready_copy_nodes(&v)
                .into_iter()
                .filter(|n| n != "node-1")
                .collect();
            (live.len() == 3).then_some(v)
        },
    );
    let live: Vec<String> = ready_copy_nodes(&v)
        .into_iter()
        .filter(|n| n != "node-1")
        .collect();
    assert_eq!(live, ["node-0", "node-0", "node-2"], "{v}");
    for d in lvstore_daemons(&ms[0]) {
        if d["nodeId"] == "node-1" {
            continue;
        }
        let held = daemon_copies(d["address"].as_str().unwrap());
        assert!(
            held.len() == 1 && held[0].state == "ready" && held[0].current_checksum == sum,
            "{d}: {held:?}"
        );
    }
    // A volume on the image on the live nodes reads it.
    let (code, v) = create_volume(&ms[0], "vol", VOLUME_SIZE, Some("img"), "v2");
    assert_eq!(code, 201, "{v}");
    let uri = attach(&ms[0].url, "vol");
    qemu_img_compare(raw.to_str().unwrap(), &uri);
}
