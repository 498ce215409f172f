//! A v2 backing image from every source type (seed 001's test 2, issue 21 item 7), through the manager's REST API
//! and the `corral` CLI with real daemons (a v1 disk and a v2 disk with its `corral-replica serve-lvstore` per node):
//! an upload; a clone of a v2 image (as v2 and as v1) read from a ready v2 copy through its disk daemon
//! (`BackingImageExpose`) with the download server gone; a snapshot of a v2 volume on a v2 image and of a v1
//! volume exported as v1 and v2 images; a v1 image's backup restored as a v2 image; a v2 image backed up (its
//! copy received through its disk daemon into a staging file, removed after), deleted, and restored from the
//! target in the same cluster and in another one. Each image backs a volume that reads, over NBD, what the image
//! was made from. Bad input: a clone of a v2 image without a ready copy, an export from a volume without a running
//! replica, a backup of a v2 image that is not ready — refused, nothing made.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::v2_images::*;
use support::*;

const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 12 * MIB;
const VOLUME_SIZE: u64 = 16 * MIB;
const READY: Duration = Duration::from_secs(60);

/// `corral --json ARGS…` that must succeed, parsed.
fn json_ok(m: &Manager, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = ok(&m.url, &all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("corral {args:?}: {e}: {out}"))
}

/// A one-replica volume on `image`, attached; compared with `expected` (a raw file, zeros past its end).
fn volume_reads(m: &Manager, vol: &str, image: Option<&str>, engine: &str, expected: &Path) {
    let (code, v) = create_volume(m, vol, VOLUME_SIZE, image, engine);
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, vol);
    qemu_img_compare(expected.to_str().unwrap(), &uri);
}

/// The whole content of the NBD export at `uri`, as a raw file at `out`; returns its SHA-512.
fn read_to_file(uri: &str, out: &Path) -> String {
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", uri])
        .arg(out)
        .status()
        .unwrap();
    assert!(st.success(), "qemu-img convert {uri}");
    testkit::sha512_file(out)
}

/// Writes (offset, pattern, length) through qemu-io and flushes.
fn write(uri: &str, writes: &[(u64, u8, u64)]) {
    let mut cmds: Vec<String> = writes
        .iter()
        .map(|(off, p, len)| format!("write -P {p:#x} {off} {len}"))
        .collect();
    cmds.push("flush".to_owned());
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, out) = testkit::qemu_io(uri, &refs);
    assert!(ok, "{out}");
}

fn snapshot(m: &Manager, vol: &str, name: &str) {
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/{vol}/snapshots", m.url),
        Some(&json!({ "name": name })),
    );
    assert_eq!(code, 201, "{v}");
}

fn names(copies: &[corral_proto::v1::BackingImageV2CopyInfo]) -> Vec<String> {
    let mut n: Vec<String> = copies.iter().map(|c| c.name.clone()).collect();
    n.sort();
    n
}

#[test]
fn v2_images_uploaded_and_cloned_from_a_v2_image_read_like_the_file_without_downloading_again() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 21, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (m, address) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);

    let (code, v) = create_image(
        &m,
        &json!({"name": "dl", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": sum, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    wait_ready(&m, "dl", READY);
    // Its v1 file goes once the first v2 copy is ready: from then on the copy is the image's only data.
    let disks = [m.data_dir.join("disks/default"), dir.path().join("node-1-v2a")];
    testkit::wait_for("the v1 file of dl removed", READY, || {
        disks.iter().all(|d| v1_files(d, "dl").is_empty()).then_some(())
    });
    // Nothing can be downloaded again from here on.
    drop(http);

    // An upload through the CLI, as a v2 image.
    let v = json_ok(
        &m,
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
    assert!(
        v["state"] == "ready" && v["dataEngine"] == "v2" && v["sourceType"] == "upload",
        "{v}"
    );
    assert_eq!(v["currentChecksum"], sum.as_str(), "{v}");

    // Clones of the v2 image, as v2 and as v1: read from its ready copy through the disk daemon.
    for (name, engine) in [("cl2", "v2"), ("cl1", "v1")] {
        let v = json_ok(
            &m,
            &[
                "backing-image",
                "create",
                name,
                "--source",
                "clone",
                "--backing-image",
                "dl",
                "--data-engine",
                engine,
            ],
        );
        assert!(v["state"] == "ready" && v["dataEngine"] == engine, "{v}");
        assert_eq!(v["currentChecksum"], sum.as_str(), "{name}: {v}");
    }
    let held = daemon_copies(&address);
    assert_eq!(names(&held), ["cl2", "dl", "up"], "{held:?}");
    assert!(
        held.iter()
            .all(|c| c.state == "ready" && c.current_checksum == sum),
        "{held:?}"
    );
    let v = image(&m, "cl1");
    assert!(
        disks_of(&v, "v2").is_empty() && disks_of(&v, "v1").len() == 1,
        "{v}"
    );

    // Each image backs a volume of its engine that reads the file.
    for (vol, img, engine) in [
        ("v-up", "up", "v2"),
        ("v-cl2", "cl2", "v2"),
        ("v-cl1", "cl1", "v1"),
    ] {
        volume_reads(&m, vol, Some(img), engine, &raw);
    }

    // Bad input: a clone of a v2 image without a ready copy (an upload never sent) is refused, nothing made.
    let (code, v) = create_image(
        &m,
        &json!({"name": "pend", "sourceType": "upload", "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = create_image(
        &m,
        &json!({"name": "bad", "sourceType": "clone", "parameters": {"backingImage": "pend"},
            "dataEngine": "v2"}),
    );
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("no ready copy"), "{v}");
    assert_eq!(
        rest("GET", &format!("{}/v1/backingimages/bad", m.url), None).0,
        404
    );
}

#[test]
fn snapshots_of_a_v2_volume_on_a_v2_image_and_of_a_v1_volume_export_as_v1_and_v2_images() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 22, IMAGE_SIZE);
    let http = HttpServer::start(&files);
    let (m, address) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);
    let (code, v) = create_image(
        &m,
        &json!({"name": "base", "sourceType": "download", "parameters": {"url": http.url("image.raw")},
            "expectedChecksum": sum, "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    wait_ready(&m, "base", READY);

    // A v2 volume on the v2 image and a v1 volume: writes over data, written zeros, holes and past the image's
    // end; a snapshot; then a write the snapshot must not show.
    let writes = [
        (MIB, 0xa1, 64 << 10),
        (4 * MIB, 0xb2, 4096),
        (9 * MIB, 0xc3, 8192),
        (14 * MIB, 0xd4, 128 << 10),
    ];
    let mut expected = Vec::new();
    for (vol, image, engine) in [("v2vol", Some("base"), "v2"), ("v1vol", None, "v1")] {
        let (code, v) = create_volume(&m, vol, VOLUME_SIZE, image, engine);
        assert_eq!(code, 201, "{v}");
        let uri = attach(&m.url, vol);
        write(&uri, &writes);
        snapshot(&m, vol, "s1");
        let at_s1 = files.join(format!("{vol}-s1.raw"));
        let s = read_to_file(&uri, &at_s1);
        write(&uri, &[(0, 0xee, 4096)]);
        expected.push((vol, at_s1, s));
    }
    let (v2_at_s1, v2_sum) = (&expected[0].1, &expected[0].2);
    let (v1_at_s1, v1_sum) = (&expected[1].1, &expected[1].2);

    // Exported: the v2 volume's snapshot (flattened over the v2 image) as a v2 and a v1 image, the v1 volume's
    // as a v2 image (through the CLI).
    for (name, vol, engine) in [("exp-v2", "v2vol", "v2"), ("exp-v1", "v2vol", "v1")] {
        let (code, v) = create_image(
            &m,
            &json!({"name": name, "sourceType": "export-from-volume",
                "parameters": {"volume": vol, "snapshot": "s1", "exportType": "raw"}, "dataEngine": engine}),
        );
        assert_eq!(code, 201, "{v}");
    }
    let v = json_ok(
        &m,
        &[
            "backing-image",
            "create",
            "from-v1",
            "--source",
            "export-from-volume",
            "--volume",
            "v1vol",
            "--snapshot",
            "s1",
            "--data-engine",
            "v2",
        ],
    );
    assert_eq!(v["currentChecksum"], v1_sum.as_str(), "{v}");
    for (name, s) in [("exp-v2", v2_sum), ("exp-v1", v2_sum)] {
        let v = wait_ready(&m, name, READY);
        assert_eq!(v["currentChecksum"], s.as_str(), "{name}: {v}");
        assert_eq!(v["virtualSize"], VOLUME_SIZE, "{name}: {v}");
    }
    let held = daemon_copies(&address);
    assert_eq!(names(&held), ["base", "exp-v2", "from-v1"], "{held:?}");

    volume_reads(&m, "on-exp-v2", Some("exp-v2"), "v2", v2_at_s1);
    volume_reads(&m, "on-exp-v1", Some("exp-v1"), "v1", v2_at_s1);
    volume_reads(&m, "on-from-v1", Some("from-v1"), "v2", v1_at_s1);

    // Bad input: a volume without a running replica cannot be exported; nothing is made.
    let (code, v) = create_volume(&m, "idle", VOLUME_SIZE, None, "v2");
    assert_eq!(code, 201, "{v}");
    let (code, v) = create_image(
        &m,
        &json!({"name": "nope", "sourceType": "export-from-volume",
            "parameters": {"volume": "idle", "snapshot": "s1"}, "dataEngine": "v2"}),
    );
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("idle"), "{v}");
    assert_eq!(
        rest("GET", &format!("{}/v1/backingimages/nope", m.url), None).0,
        404
    );
}

fn set_file_target(m: &Manager, target: &Path) {
    std::fs::create_dir_all(target).unwrap();
    ok(
        &m.url,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", target.display()),
            "--poll-interval",
            "1",
        ],
    );
}

/// Files a v2 backup may stage under a disk directory's `tmp`.
fn staged(disk: &Path) -> Vec<String> {
    std::fs::read_dir(disk.join("tmp"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".backup"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_v2_image_backed_up_deleted_and_restored_here_and_in_another_cluster_reads_the_same_as_a_v1_backup_restored_as_v2()
 {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let raw = files.join("image.raw");
    let sum = raw_fixture(&raw, 23, IMAGE_SIZE);
    let target = dir.path().join("target");
    let http = HttpServer::start(&files);
    let (m, address) = node_with_a_v2_disk(dir.path(), "node-1", 0, 256 * MIB);
    set_file_target(&m, &target);
    for (name, engine) in [("img", "v2"), ("v1img", "v1")] {
        let (code, v) = create_image(
            &m,
            &json!({"name": name, "sourceType": "download", "parameters": {"url": http.url("image.raw")},
                "expectedChecksum": sum, "dataEngine": engine}),
        );
        assert_eq!(code, 201, "{v}");
    }
    wait_ready(&m, "img", READY);
    wait_ready(&m, "v1img", READY);
    drop(http);

    // Bad input: a v2 image that is not ready cannot be backed up; nothing is recorded.
    let (code, v) = create_image(
        &m,
        &json!({"name": "pend", "sourceType": "upload", "dataEngine": "v2"}),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest("POST", &format!("{}/v1/backingimages/pend/backup", m.url), None);
    assert_eq!(code, 409, "{v}");
    let (_, all) = rest("GET", &format!("{}/v1/backingimagebackups", m.url), None);
    assert_eq!(all, json!([]), "{all}");

    // Both images backed up (the v2 one read from its copy through the disk daemon).
    let mut urls = Vec::new();
    for name in ["img", "v1img"] {
        let b = json_ok(&m, &["backup", "backing-image", name]);
        assert_eq!(b["state"], "completed", "{b}");
        assert_eq!(b["checksum"], sum.as_str(), "{b}");
        assert_eq!(b["size"], IMAGE_SIZE, "{b}");
        urls.push(b["backupUrl"].as_str().unwrap().to_owned());
    }
    let v2_disk = dir.path().join("node-1-v2a");
    assert!(staged(&v2_disk).is_empty(), "{:?}", staged(&v2_disk));

    // The v1 image's backup restored as a v2 image.
    let v = json_ok(
        &m,
        &[
            "backing-image",
            "create",
            "v1-as-v2",
            "--source",
            "restore",
            "--backup-url",
            &urls[1],
            "--data-engine",
            "v2",
        ],
    );
    assert!(
        v["dataEngine"] == "v2" && v["currentChecksum"] == sum.as_str(),
        "{v}"
    );

    // The v2 image deleted (copy and all), then restored under its name from its backup.
    let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/img", m.url), None);
    assert_eq!(code, 204, "{v}");
    testkit::wait_for("img and its copy gone", READY, || {
        (rest("GET", &format!("{}/v1/backingimages/img", m.url), None).0 == 404
            && !daemon_copies(&address).iter().any(|c| c.name == "img"))
        .then_some(())
    });
    let v = json_ok(
        &m,
        &[
            "backing-image",
            "create",
            "img",
            "--source",
            "restore",
            "--backup-url",
            &urls[0],
            "--expected-checksum",
            &sum,
            "--data-engine",
            "v2",
        ],
    );
    assert!(
        v["dataEngine"] == "v2" && v["currentChecksum"] == sum.as_str(),
        "{v}"
    );
    for (vol, img) in [("on-img", "img"), ("on-v1-as-v2", "v1-as-v2")] {
        volume_reads(&m, vol, Some(img), "v2", &raw);
    }

    // Another cluster (its own store and v2 disk) on the same target restores the v2 image's backup.
    let (m2, address2) = node_with_a_v2_disk(dir.path(), "other-1", 1, 256 * MIB);
    set_file_target(&m2, &target);
    let v = json_ok(
        &m2,
        &[
            "backing-image",
            "create",
            "img",
            "--source",
            "restore",
            "--backup-url",
            &urls[0],
            "--data-engine",
            "v2",
        ],
    );
    assert_eq!(v["currentChecksum"], sum.as_str(), "{v}");
    assert_eq!(names(&daemon_copies(&address2)), ["img"]);
    volume_reads(&m2, "there", Some("img"), "v2", &raw);
}
