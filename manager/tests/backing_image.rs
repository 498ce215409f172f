//! Backing images through the manager on one node (embedded store) with real daemons: a compressed qcow2 made by
//! `qemu-img` (data, explicit zeros, holes, an unaligned tail) downloaded from a local HTTP server with its
//! SHA-512 → ready; a 3-replica volume on it reads exactly what `qemu-img convert -O raw` gives (`qemu-img
//! compare` over NBD); writes, a snapshot, detach/attach keep the data; every `corral-bim` stopped and restarted
//! (live upgrade) → the same file (inode) is ready again while the volume serves IO; the same image uploaded
//! through the manager gives the same checksum; bad input is refused or fails with a message. On three managers
//! sharing etcd: copies synced to every replica's disk, minNumberOfCopies kept through cleanup and a node's death,
//! and a node's `corral-bim` SIGKILLed while a sync to it is in progress fails only that copy, which a retry
//! completes.

mod support;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::servers::{Etcd, S3_ENV, S3Server};
use testkit::{qemu_io, wait_for};

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

fn write_at(path: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, offset).unwrap();
}

/// A raw image of 24 MiB + 1234 bytes: pseudo-random data, explicitly written zeros, holes, an unaligned tail;
/// compressed to qcow2. Returns (qcow2 path, the raw that `qemu-img convert -O raw` makes of it).
fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    let raw = dir.join("src.raw");
    let size = (24 << 20) + 1234;
    std::fs::File::create(&raw).unwrap().set_len(size).unwrap();
    let mut x: u32 = 0x1234_5678;
    let mut data = vec![0u8; 3 << 20];
    for b in &mut data {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x.to_le_bytes()[0];
    }
    write_at(&raw, 0, &data[..1 << 20]);
    write_at(&raw, 2 << 20, &vec![0u8; 2 << 20]); // zeros written, not a hole
    write_at(&raw, (9 << 20) + 512, &data[..(1 << 20) + 7]);
    write_at(&raw, size - 1234 - 100, &data[..1334]); // the unaligned tail
    let qcow = dir.join("image.qcow2");
    run(Command::new("qemu-img")
        .args(["convert", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    let expected = dir.join("expected.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&qcow)
        .arg(&expected));
    (qcow, expected)
}

fn sha512(path: &Path) -> String {
    run(Command::new("sha512sum").arg(path))
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

fn image(m: &Manager, name: &str) -> Value {
    let (code, v) = rest("GET", &format!("{}/v1/backingimages/{name}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

fn wait_image(m: &Manager, name: &str, want: &str, timeout: Duration) -> Value {
    wait_for(&format!("backing image {name} {want}"), timeout, || {
        let v = image(m, name);
        (v["state"] == want).then_some(v)
    })
}

fn volume(m: &Manager, name: &str) -> Value {
    let (code, v) = rest("GET", &format!("{}/v1/volumes/{name}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

fn wait_healthy(m: &Manager, name: &str, timeout: Duration) -> Value {
    wait_for(&format!("{name} attached and healthy"), timeout, || {
        let v = volume(m, name);
        (v["state"] == "attached" && v["robustness"] == "healthy").then_some(v)
    })
}

fn unix_endpoint(v: &Value) -> String {
    v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .find_map(|e| e.as_str().filter(|s| s.starts_with("nbd+unix")))
        })
        .expect("unix endpoint")
        .to_owned()
}

/// `qemu-img compare` of the expected raw against the volume over NBD (the volume's tail past the image must read
/// zeros).
fn compare(expected: &Path, uri: &str) {
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(expected)
        .arg(uri)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "volume differs from the image: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pids of running `binary` processes whose command line mentions `dir`.
fn pids_of(binary: &str, dir: &Path) -> Vec<i64> {
    let needle = dir.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i64>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains(binary) && cmd.contains(&needle) && pid_alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// The arguments of process `pid`.
fn cmdline(pid: i64) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The value of `--flag VALUE` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.windows(2).find(|w| w[0] == flag).map(|w| w[1].as_str())
}

/// Every replica of `data_dir` runs on `backing` and was given the image's name and SHA-512 by the manager (what
/// a backup records), not the file's name or another hash.
fn assert_replicas_know_the_image(data_dir: &Path, backing: &Path, image: &str, checksum: &str) {
    let replicas = pids_of("corral-replica", data_dir);
    assert!(
        !replicas.is_empty(),
        "no replica runs under {}",
        data_dir.display()
    );
    for pid in replicas {
        let args = cmdline(pid);
        let file = flag(&args, "--backing-file").and_then(|f| std::fs::canonicalize(f).ok());
        assert_eq!(file, std::fs::canonicalize(backing).ok(), "{args:?}");
        assert_eq!(flag(&args, "--backing-image-name"), Some(image), "{args:?}");
        assert_eq!(
            flag(&args, "--backing-image-checksum"),
            Some(checksum),
            "{args:?}"
        );
    }
}

fn backing_files(data_dir: &Path, name: &str) -> Vec<PathBuf> {
    let root = data_dir.join("disks/default/backing-images");
    std::fs::read_dir(&root)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&format!("{name}-")))
                .map(|e| e.path().join("backing"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_downloaded_qcow2_backs_a_volume_through_io_snapshots_reattach_and_a_live_upgrade() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, expected) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let data_dir = dir.path().join("n1");
    let m = Manager::start(&data_dir, "node-1", "embedded", port_range(0));

    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(&json!({"name": "base", "sourceType": "download",
            "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": checksum})),
    );
    assert_eq!(code, 201, "{v}");
    assert!(
        !v["uuid"].as_str().unwrap().is_empty(),
        "the UUID is stored with the first write: {v}"
    );
    let v = wait_image(&m, "base", "ready", Duration::from_secs(90));
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    let vsize = v["virtualSize"].as_u64().unwrap();
    assert_eq!(vsize, std::fs::metadata(&expected).unwrap().len(), "{v}");
    let files_on_disk = backing_files(&data_dir, "base");
    assert_eq!(files_on_disk.len(), 1, "{files_on_disk:?}");
    let inode = std::fs::metadata(&files_on_disk[0]).unwrap().ino();

    // A volume smaller than the image is refused; one at least as large is served.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "small", "size": 4 << 20, "numberOfReplicas": 1, "backingImage": "base"})),
    );
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("virtual size"), "{v}");
    let size = vsize.div_ceil(4096) * 4096 + (4 << 20);
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vm", "size": size, "numberOfReplicas": 3, "backingImage": "base"})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/base", m.url), None);
    assert_eq!(code, 409, "an image in use is not deleted: {v}");
    assert!(v["message"].as_str().unwrap().contains("vm"), "{v}");

    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&m, "vm", Duration::from_secs(90));
    let uri = unix_endpoint(&v);
    compare(&expected, &uri);

    // Writes over data, zeros, a hole and the tail; a snapshot; the expected image gets the same writes.
    let writes: [(u64, u8, u64); 4] = [
        (512 << 10, 0xa1, 1 << 20),
        (2 << 20, 0xb2, 64 << 10),
        (5 << 20, 0xc3, 4096),
        ((24 << 20) - 4096, 0xd4, 8192),
    ];
    let mut cmds = Vec::new();
    for (off, pat, len) in writes {
        cmds.push(format!("write -P {pat:#x} {off} {len}"));
        let grow = std::fs::metadata(&expected).unwrap().len().max(off + len);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&expected)
            .unwrap()
            .set_len(grow)
            .unwrap();
        write_at(&expected, off, &vec![pat; usize::try_from(len).unwrap()]);
    }
    cmds.push("flush".into());
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok, out) = qemu_io(&uri, &refs);
    assert!(ok, "{out}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/snapshots", m.url),
        Some(&json!({"name": "s1"})),
    );
    assert_eq!(code, 201, "{v}");
    compare(&expected, &uri);
    assert_replicas_know_the_image(&data_dir, &files_on_disk[0], "base", &checksum);

    // Live upgrade: every corral-bim stopped; the restarted one adopts the file (same inode) while IO goes on.
    let bims = pids_of("corral-bim", &data_dir);
    assert_eq!(bims.len(), 1, "one corral-bim per disk: {bims:?}");
    let _ = Command::new("kill")
        .args(["-TERM", &bims[0].to_string()])
        .status();
    wait_for("corral-bim restarted", Duration::from_secs(30), || {
        let now = pids_of("corral-bim", &data_dir);
        (!now.is_empty() && !now.contains(&bims[0])).then_some(())
    });
    let (ok, out) = qemu_io(&uri, &["read -P 0xa1 524288 1048576"]);
    assert!(ok, "IO during the upgrade: {out}");
    let v = wait_image(&m, "base", "ready", Duration::from_secs(60));
    assert_eq!(v["currentChecksum"], checksum.as_str());
    let after = backing_files(&data_dir, "base");
    assert_eq!(after, files_on_disk);
    assert_eq!(
        std::fs::metadata(&after[0]).unwrap().ino(),
        inode,
        "adopted, not copied again"
    );
    compare(&expected, &uri);

    // Through the same flow: the volume's snapshot exported as an image, and a clone of the image.
    for body in [
        json!({"name": "exported", "sourceType": "export-from-volume",
            "parameters": {"volume": "vm", "snapshot": "s1", "exportType": "raw"}}),
        json!({"name": "copy", "sourceType": "clone", "parameters": {"backingImage": "base"}}),
    ] {
        let (code, v) = rest("POST", &format!("{}/v1/backingimages", m.url), Some(&body));
        assert_eq!(code, 201, "{body}: {v}");
    }
    // The export is the volume at s1 flattened over its backing image, as large as the volume.
    let flat = files.join("s1.raw");
    std::fs::copy(&expected, &flat).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&flat)
        .unwrap()
        .set_len(size)
        .unwrap();
    let v = wait_image(&m, "exported", "ready", Duration::from_secs(60));
    assert_eq!(v["currentChecksum"], sha512(&flat).as_str(), "{v}");
    assert_eq!(v["virtualSize"], size, "{v}");
    let v = wait_image(&m, "copy", "ready", Duration::from_secs(60));
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    assert_eq!(backing_files(&data_dir, "copy").len(), 1);

    // Detach and attach: the replicas start on the (re-resolved) backing file again.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/detach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    wait_for("detached", Duration::from_secs(60), || {
        (volume(&m, "vm")["state"] == "detached").then_some(())
    });
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&m, "vm", Duration::from_secs(90));
    compare(&expected, &unix_endpoint(&v));
    assert_replicas_know_the_image(&data_dir, &files_on_disk[0], "base", &checksum);

    // The same image uploaded through the manager (the CLI streams it) has the same checksum.
    let out = cli_command_for(&m.url)
        .args(["--url", &m.url, "backing-image", "create", "up1", "--from-file"])
        .arg(&qcow)
        .args(["--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "ready", "{v}");
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    assert_eq!(v["sourceType"], "upload");

    // An image no volume uses is deleted with its files.
    let old_uuid = v["uuid"].as_str().unwrap().to_owned();
    let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/up1", m.url), None);
    assert_eq!(code, 204, "{v}");
    // Gone for the API at once, and so is its name: a create right away waits for the old files to go.
    let (code, v) = rest("GET", &format!("{}/v1/backingimages/up1", m.url), None);
    assert_eq!(code, 404, "{v}");
    let (_, all) = rest("GET", &format!("{}/v1/backingimages", m.url), None);
    assert!(
        all.as_array()
            .unwrap()
            .iter()
            .any(|b| b["name"] == "up1" && b["state"] == "deleting"),
        "the deleted image's files were still being removed: {all}"
    );
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(&serde_json::json!({"name": "up1", "sourceType": "upload"})),
    );
    assert_eq!(code, 201, "{v}");
    assert_ne!(v["uuid"], old_uuid.as_str(), "{v}");
    assert!(
        backing_files(&data_dir, "up1")
            .iter()
            .all(|p| !p.to_string_lossy().contains(&old_uuid)),
        "the create waited for the deleted image's files"
    );
    let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/up1", m.url), None);
    assert_eq!(code, 204, "{v}");
    wait_for("up1 gone", Duration::from_secs(30), || {
        let (code, _) = rest("GET", &format!("{}/v1/backingimages/up1", m.url), None);
        (code == 404 && backing_files(&data_dir, "up1").is_empty()).then_some(())
    });
}

#[test]
fn bad_backing_image_input_is_refused_or_fails_with_a_message_and_leaves_nothing() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, _) = fixture(&files);
    let http = HttpServer::start(&files);
    let data_dir = dir.path().join("n1");
    let m = Manager::start(&data_dir, "node-1", "embedded", port_range(1));
    let create = |body: Value| rest("POST", &format!("{}/v1/backingimages", m.url), Some(&body));

    let refused = [
        (
            json!({"name": "a", "sourceType": "ftp", "parameters": {}}),
            400,
            "sourceType",
        ),
        (
            json!({"name": "a", "sourceType": "download", "parameters": {}}),
            400,
            "url",
        ),
        (
            json!({"name": "a", "sourceType": "download", "parameters": {"url": "file:///etc/passwd"}}),
            400,
            "http",
        ),
        (
            json!({"name": "../a", "sourceType": "download", "parameters": {"url": http.url("image.qcow2")}}),
            400,
            "name",
        ),
        (
            json!({"name": "a", "sourceType": "download", "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": "abc"}),
            400,
            "SHA-512",
        ),
        (
            json!({"name": "a", "sourceType": "clone", "parameters": {"backingImage": "nope"}}),
            409,
            "nope",
        ),
        (
            json!({"name": "a", "sourceType": "export-from-volume", "parameters": {"volume": "nope", "snapshot": "s"}}),
            409,
            "nope",
        ),
    ];
    for (body, want, word) in refused {
        let (code, v) = create(body.clone());
        assert_eq!(code, want, "{body}: {v}");
        assert!(
            v["message"].as_str().unwrap_or_default().contains(word),
            "{body}: {v}"
        );
    }
    let (_, list) = rest("GET", &format!("{}/v1/backingimages", m.url), None);
    assert_eq!(list, json!([]), "nothing half-created");

    // A URL that 404s and a checksum mismatch fail with a message; nothing of them stays in the disk's tmp.
    let (code, v) = create(
        json!({"name": "missing", "sourceType": "download", "parameters": {"url": http.url("nope.qcow2")}}),
    );
    assert_eq!(code, 201, "{v}");
    let wrong = "0".repeat(128);
    let (code, v) = create(json!({"name": "wrongsum", "sourceType": "download",
        "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": wrong}));
    assert_eq!(code, 201, "{v}");
    let (code, v) = create(json!({"name": "wrongsum", "sourceType": "upload"}));
    assert_eq!(code, 409, "a second image of the same name: {v}");
    for (name, word) in [("missing", "404"), ("wrongsum", "checksum")] {
        let v = wait_for(&format!("{name} failed"), Duration::from_secs(60), || {
            let v = image(&m, name);
            v["disks"]
                .as_array()
                .and_then(|d| d.iter().find(|d| d["state"] == "failed"))
                .cloned()
        });
        assert!(
            v["message"].as_str().unwrap().to_lowercase().contains(word),
            "{name}: {v}"
        );
    }

    // An upload of the wrong size is refused and the image failed.
    let (code, v) = create(json!({"name": "up", "sourceType": "upload"}));
    assert_eq!(code, 201, "{v}");
    let real = std::fs::metadata(&qcow).unwrap().len();
    let out = curl_command()
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-F"])
        .arg(format!("file=@{}", qcow.display()))
        .arg(format!(
            "{}/v1/backingimages/up/upload?size={}",
            m.url,
            real + 4096
        ))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.trim_end().ends_with("400"), "{text}");
    wait_for("upload failed", Duration::from_secs(30), || {
        (image(&m, "up")["state"] == "failed").then_some(())
    });

    // Deleting them removes every file.
    for name in ["missing", "wrongsum", "up"] {
        let (code, v) = rest("DELETE", &format!("{}/v1/backingimages/{name}", m.url), None);
        assert_eq!(code, 204, "{v}");
    }
    wait_for("all deleted", Duration::from_secs(30), || {
        let (_, list) = rest("GET", &format!("{}/v1/backingimages", m.url), None);
        (list == json!([])).then_some(())
    });
    let tmp = data_dir.join("disks/default/tmp");
    wait_for("tmp empty", Duration::from_secs(30), || {
        std::fs::read_dir(&tmp)
            .map_or(true, |mut d| d.next().is_none())
            .then_some(())
    });
}

fn ready_disks(v: &Value) -> Vec<String> {
    v["disks"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter(|d| d["state"] == "ready")
                .map(|d| d["nodeId"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Three managers (`node-0..2`, data in `dir/n0..2`, `env` passed to them and their daemons) sharing one etcd,
/// once every node is ready.
fn cluster(dir: &Path, env: &[(&str, &str)]) -> (Etcd, Vec<Manager>) {
    let etcd = Etcd::start(dir);
    let store = format!("etcd://{}", etcd.endpoint());
    let ms: Vec<Manager> = (0..3u16)
        .map(|i| {
            Manager::start_with_env(
                &dir.join(format!("n{i}")),
                &format!("node-{i}"),
                &store,
                port_range(i),
                env,
            )
        })
        .collect();
    wait_for("3 nodes ready", Duration::from_secs(30), || {
        let (_, v) = rest("GET", &format!("{}/v1/nodes", ms[0].url), None);
        (v.as_array()
            .map_or(0, |a| a.iter().filter(|n| n["ready"] == true).count())
            == 3)
            .then_some(())
    });
    (etcd, ms)
}

#[test]
fn a_cluster_syncs_copies_to_replica_disks_keeps_min_copies_through_cleanup_and_refetches_when_all_fail() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, expected) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let (_etcd, ms) = cluster(dir.path(), &[]);
    let m = &ms[0];
    let (code, v) = rest(
        "PUT",
        &format!("{}/v1/settings/backing-image-cleanup-wait-interval", m.url),
        Some(&json!({"value": "0"})),
    );
    assert_eq!(code, 200, "{v}");

    // minNumberOfCopies = 2: two ready copies on distinct nodes.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(
            &json!({"name": "base", "sourceType": "download", "minNumberOfCopies": 2,
            "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": checksum}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_for("two ready copies", Duration::from_secs(90), || {
        let v = image(m, "base");
        (ready_disks(&v).len() == 2).then_some(v)
    });
    let nodes: std::collections::BTreeSet<String> = ready_disks(&v).into_iter().collect();
    assert_eq!(nodes.len(), 2, "copies on distinct nodes: {v}");
    let vsize = v["virtualSize"].as_u64().unwrap();

    // A volume with a replica on every node: each disk gets the file, the volume reads the image.
    let size = vsize.div_ceil(4096) * 4096;
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vm", "size": size, "numberOfReplicas": 3, "backingImage": "base"})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/attach", m.url),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(m, "vm", Duration::from_secs(120));
    let nodes: std::collections::BTreeSet<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["nodeId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(nodes.len(), 3, "{v}");
    // The image's per-disk status is gathered from each disk manager by the leader's image controller, after the
    // replicas could already use the file: it catches up within a few reconciles.
    wait_for(
        "a synced copy on every replica's disk in the image's status",
        Duration::from_secs(30),
        || {
            let img = image(m, "base");
            (ready_disks(&img).len() == 3).then_some(img)
        },
    );
    for i in 0..3 {
        assert_eq!(
            backing_files(&dir.path().join(format!("n{i}")), "base").len(),
            1,
            "node {i}"
        );
    }
    let uri = unix_endpoint(&v);
    compare(&expected, &uri);
    let node_dirs: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("n{i}"))).collect();
    let ino = |i: usize| {
        let f = backing_files(&node_dirs[i], "base");
        assert_eq!(f.len(), 1, "node {i}: {f:?}");
        std::fs::metadata(&f[0]).unwrap().ino()
    };
    let inodes: Vec<u64> = (0..3).map(ino).collect();

    // Live upgrade: every node's corral-bim stopped at once and started again (as a new version would be). Each
    // adopts its file (same inode: neither synced nor downloaded again) while the volume keeps serving IO.
    let bims: Vec<i64> = node_dirs.iter().flat_map(|d| pids_of("corral-bim", d)).collect();
    assert_eq!(bims.len(), 3, "one corral-bim per disk: {bims:?}");
    for pid in &bims {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    }
    let mut ios = 0u32;
    wait_for("every corral-bim restarted", Duration::from_secs(60), || {
        let (ok, out) = qemu_io(&uri, &["write -P 0x5a 8M 64k", "read -P 0x5a 8M 64k"]);
        assert!(ok, "IO while the disk managers restart: {out}");
        ios += 1;
        let now: Vec<i64> = node_dirs.iter().flat_map(|d| pids_of("corral-bim", d)).collect();
        (now.len() == 3 && now.iter().all(|p| !bims.contains(p))).then_some(())
    });
    write_at(&expected, 8 << 20, &[0x5a; 64 << 10]);
    wait_for("three ready copies again", Duration::from_secs(60), || {
        (ready_disks(&image(m, "base")).len() == 3).then_some(())
    });
    assert_eq!((0..3).map(ino).collect::<Vec<_>>(), inodes, "adopted, not copied");
    assert!(ios > 0);

    // One copy no longer matches its checksum (a byte appended: replicas read nothing past the qcow2's clusters):
    // it fails, is reported, and is synced again from a ready copy into a new file renamed into place; the replica
    // that has the old file open keeps serving.
    let victim = &backing_files(&node_dirs[2], "base")[0];
    std::fs::OpenOptions::new()
        .append(true)
        .open(victim)
        .unwrap()
        .write_all(b"!")
        .unwrap();
    wait_for("the corrupted copy re-synced", Duration::from_secs(90), || {
        let (ok, out) = qemu_io(&uri, &["read -P 0x5a 8M 64k"]);
        assert!(ok, "IO while a copy is re-synced: {out}");
        let f = backing_files(&node_dirs[2], "base");
        let fresh = f.len() == 1 && std::fs::metadata(&f[0]).is_ok_and(|md| md.ino() != inodes[2]);
        (fresh && ready_disks(&image(m, "base")).len() == 3).then_some(())
    });
    assert_eq!(sha512(&backing_files(&node_dirs[2], "base")[0]), checksum);
    assert!(
        ms[2].log().contains("backing image copy failed"),
        "the failure is reported by node-2's manager"
    );
    compare(&expected, &uri);

    // Without the volume, unused copies go at once (wait interval 0), down to the minimum and never below it.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/detach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    wait_for("detached", Duration::from_secs(60), || {
        (volume(m, "vm")["state"] == "detached").then_some(())
    });
    let (code, v) = rest("DELETE", &format!("{}/v1/volumes/vm", m.url), None);
    assert_eq!(code, 204, "{v}");
    wait_for("cleaned up to 2 copies", Duration::from_secs(60), || {
        let v = image(m, "base");
        let ready = ready_disks(&v).len();
        assert!(ready >= 2, "below the minimum: {v}");
        let on_disk: usize = (0..3)
            .map(|i| backing_files(&dir.path().join(format!("n{i}")), "base").len())
            .sum();
        (v["disks"].as_array().unwrap().len() == 2 && ready == 2 && on_disk == 2).then_some(())
    });

    // Every copy corrupted: each fails its check, the download runs again and the image is ready again.
    for i in 0..3 {
        for f in backing_files(&dir.path().join(format!("n{i}")), "base") {
            write_at(&f, 4096, b"corrupted!");
        }
    }
    wait_for("no ready copy left", Duration::from_secs(60), || {
        let v = image(m, "base");
        ready_disks(&v).is_empty().then_some(())
    });
    let v = wait_for("ready again from the source", Duration::from_secs(120), || {
        let v = image(m, "base");
        (ready_disks(&v).len() == 2).then_some(v)
    });
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    let starts: usize = ms
        .iter()
        .map(|m| m.log().matches("started data source").count())
        .sum();
    assert!(starts >= 2, "the data source ran again: {starts} starts");

    // A node holding a copy dies: the copies come back to the minimum on the nodes that are up.
    let mut ms = ms;
    let holders = ready_disks(&v);
    let victim = (1..3)
        .find(|i| holders.contains(&format!("node-{i}")))
        .expect("a copy on node-1 or node-2");
    ms[victim].kill_node();
    let gone = format!("node-{victim}");
    wait_for("two ready copies on live nodes", Duration::from_secs(90), || {
        let v = image(&ms[0], "base");
        let live: Vec<String> = ready_disks(&v).into_iter().filter(|n| *n != gone).collect();
        (live.len() == 2).then_some(())
    });
}

#[test]
fn a_refetch_whose_source_now_serves_other_data_fails_and_leaves_the_base_and_the_volume_alone() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, expected) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let data_dir = dir.path().join("n1");
    let m = Manager::start(&data_dir, "node-1", "embedded", port_range(0));

    // No expected checksum: the first download's is recorded.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(&json!({"name": "base", "sourceType": "download",
            "parameters": {"url": http.url("image.qcow2")}})),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_image(&m, "base", "ready", Duration::from_secs(90));
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    let size = v["virtualSize"].as_u64().unwrap().div_ceil(4096) * 4096;
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vm", "size": size, "numberOfReplicas": 1, "backingImage": "base"})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vm/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let uri = unix_endpoint(&wait_healthy(&m, "vm", Duration::from_secs(90)));
    compare(&expected, &uri);

    // The URL now serves other data; the only copy fails its check (a byte appended: the replica reads nothing
    // past the qcow2's clusters), so the image is downloaded again.
    let other = files.join("other.raw");
    std::fs::write(&other, vec![0x77u8; 4 << 20]).unwrap();
    let other_sum = sha512(&other);
    std::fs::copy(&other, &qcow).unwrap();
    let copy = &backing_files(&data_dir, "base")[0];
    std::fs::OpenOptions::new()
        .append(true)
        .open(copy)
        .unwrap()
        .write_all(b"!")
        .unwrap();
    let v = wait_for("the refetch refused", Duration::from_secs(120), || {
        let v = image(&m, "base");
        assert_eq!(v["currentChecksum"], checksum.as_str(), "the base changed: {v}");
        let msg = v["message"].as_str().unwrap_or_default();
        msg.contains("checksum mismatch").then_some(v)
    });
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains(&checksum) && msg.contains(&other_sum),
        "the message names both checksums: {v}"
    );
    assert!(ready_disks(&v).is_empty(), "{v}");
    let kept: Vec<PathBuf> = backing_files(&data_dir, "base")
        .into_iter()
        .filter(|f| f.exists() && sha512(f) == other_sum)
        .collect();
    assert!(kept.is_empty(), "a file of the other data is kept: {kept:?}");
    compare(&expected, &uri);
    assert_eq!(volume(&m, "vm")["robustness"], "healthy");
}

/// The per-disk states of an image: disk UUID → (state, progress).
fn disk_states(v: &Value) -> std::collections::BTreeMap<String, (String, u64)> {
    v["disks"]
        .as_array()
        .map(|d| {
            d.iter()
                .map(|d| {
                    (
                        d["diskUUID"].as_str().unwrap_or_default().to_owned(),
                        (
                            d["state"].as_str().unwrap_or_default().to_owned(),
                            d["progress"].as_u64().unwrap_or(0),
                        ),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn one_ready_copy_feeds_at_most_three_syncs_and_a_killed_receiver_fails_only_its_copy() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, _) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let data_dir = dir.path().join("n1");
    // Sends are slowed (every corral-bim inherits the flag) so that syncs overlap and can be interrupted.
    let m = Manager::start_with_env(
        &data_dir,
        "node-1",
        "embedded",
        port_range(2),
        &[("CORRAL_BIM_SEND_MAX_RATE", "512K")],
    );
    for i in 1..5 {
        let path = dir.path().join(format!("disk{i}"));
        std::fs::create_dir_all(&path).unwrap();
        // The node document is updated by its heartbeat too: a stale write is refused and made again.
        wait_for("disk added", Duration::from_secs(30), || {
            let (code, v) = rest(
                "POST",
                &format!("{}/v1/nodes/node-1/disks", m.url),
                Some(&json!({"name": format!("d{i}"), "path": path})),
            );
            assert!(code == 200 || code == 409, "{v}");
            (code == 200).then_some(())
        });
    }

    // Five copies on five disks of one node: the first is downloaded, the other four are synced.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(
            &json!({"name": "base", "sourceType": "download", "minNumberOfCopies": 5,
            "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": checksum}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    let syncing = |st: &str| st == "starting" || st == "in-progress";
    let mut most_from_one = 0;
    let mut victim: Option<(String, u64)> = None;
    let mut interrupted_others: Vec<String> = Vec::new();
    let mut failed_elsewhere = Vec::new();
    wait_for("five ready copies", Duration::from_secs(180), || {
        let v = image(&m, "base");
        let disks = disk_states(&v);
        let ready = disks.values().filter(|(s, _)| s == "ready").count();
        let active: Vec<(&String, u64)> = disks
            .iter()
            .filter(|(_, (s, _))| syncing(s))
            .map(|(d, (_, p))| (d, *p))
            .collect();
        if ready == 1 {
            // One ready copy is the only source: what is being made is synced from it.
            assert!(active.len() <= 3, "one copy feeds more than 3 syncs: {v}");
            most_from_one = most_from_one.max(active.len());
        }
        for (d, (s, _)) in &disks {
            if s == "failed" && victim.as_ref().is_none_or(|(vd, _)| vd != d) {
                failed_elsewhere.push(format!("{d}: {v}"));
            }
        }
        // Once three syncs have run at once from the one source, SIGKILL the corral-bim receiving one of the syncs
        // still running mid-copy (at the poll that saw three at once, none may have reported progress yet).
        if victim.is_none()
            && most_from_one == 3
            && let Some((d, p)) = active.iter().find(|(_, p)| *p > 0 && *p < 100)
        {
            let pids = pids_of("corral-bim", Path::new(d.as_str()));
            assert_eq!(pids.len(), 1, "the corral-bim of disk {d}: {pids:?}");
            sigkill(pids[0]);
            victim = Some(((*d).clone(), *p));
            interrupted_others = active
                .iter()
                .filter(|(o, _)| o != d)
                .map(|(o, _)| (*o).clone())
                .collect();
        }
        (ready == 5).then_some(())
    });
    assert_eq!(
        most_from_one, 3,
        "three syncs ran at once from the one ready copy"
    );
    let (victim, progress) = victim.expect("a sync was interrupted");
    assert!(progress > 0 && progress < 100, "interrupted at {progress}%");
    assert!(
        failed_elsewhere.is_empty(),
        "only the killed receiver's copy fails: {failed_elsewhere:?}"
    );
    // The interrupted copy was made by a second sync after its corral-bim came back; the others by one each.
    let syncs_on = |disk: &str| {
        std::fs::read_to_string(data_dir.join(format!("logs/bim-bim-{disk}.log")))
            .unwrap_or_default()
            .matches("sync started")
            .count()
    };
    assert!(
        syncs_on(&victim) >= 2,
        "the killed receiver's copy was synced again"
    );
    for d in &interrupted_others {
        assert_eq!(syncs_on(d), 1, "disk {d} synced once, undisturbed");
    }
    let copies: usize = std::iter::once(data_dir.join("disks/default"))
        .chain((1..5).map(|i| dir.path().join(format!("disk{i}"))))
        .map(|d| {
            let f = d.join("backing-images");
            std::fs::read_dir(f).map_or(0, |rd| {
                rd.flatten()
                    .filter(|e| e.path().join("backing").is_file())
                    .inspect(|e| assert_eq!(sha512(&e.path().join("backing")), checksum))
                    .count()
            })
        })
        .sum();
    assert_eq!(copies, 5);
}

#[test]
fn a_cluster_sync_whose_receiving_corral_bim_is_sigkilled_fails_only_that_copy_and_a_retry_completes() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, _) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let node_dirs: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("n{i}"))).collect();
    // Sends are slowed (every node's corral-bim inherits the flag) so that a sync between nodes can be interrupted:
    // the 2.4 MB image takes ~19 s, against a status that trails the daemons by up to two reconciles (2 s each,
    // longer under load; at 512K both syncs were over before the status showed either in progress).
    let (_etcd, ms) = cluster(dir.path(), &[("CORRAL_BIM_SEND_MAX_RATE", "128K")]);
    let m = &ms[0];

    // Three copies, one per node: the first is downloaded, the other two are synced to the other nodes from it.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(
            &json!({"name": "base", "sourceType": "download", "minNumberOfCopies": 3,
            "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": checksum}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    let node_of = |v: &Value, disk: &str| {
        v["disks"]
            .as_array()
            .and_then(|d| d.iter().find(|d| d["diskUUID"] == disk))
            .and_then(|d| d["nodeId"].as_str())
            .and_then(|n| n.strip_prefix("node-"))
            .and_then(|n| n.parse::<usize>().ok())
            .expect("the disk's node")
    };
    // SIGKILL the corral-bim of a node while a sync to its disk is under way (0 < progress < 100).
    let mut victim: Option<(String, usize, u64, i64)> = None;
    let mut others: Vec<(String, usize)> = Vec::new();
    let mut failed_elsewhere = Vec::new();
    wait_for("three ready copies", Duration::from_secs(180), || {
        let v = image(m, "base");
        let disks = disk_states(&v);
        for (d, (s, _)) in &disks {
            if s == "failed" && victim.as_ref().is_none_or(|(vd, ..)| vd != d) {
                failed_elsewhere.push(format!("{d}: {v}"));
            }
        }
        let ready = disks.values().filter(|(s, _)| s == "ready").count();
        assert!(
            victim.is_some() || ready < 3,
            "both syncs finished before either was seen in progress (the status lags a sync by up to two \
             reconciles; the send rate makes a sync last longer than that): {v}"
        );
        // Once a copy is ready, what is in progress is a sync from it (before, it is the first copy's fetch). The
        // status is gathered a reconcile late: a sync seen below 70 % is still running when the signal lands.
        if victim.is_none()
            && ready >= 1
            && let Some((d, (_, p))) = disks
                .iter()
                .find(|(_, (s, p))| s == "in-progress" && *p > 0 && *p < 70)
        {
            let node = node_of(&v, d);
            let pids = pids_of("corral-bim", &node_dirs[node]);
            assert_eq!(pids.len(), 1, "node-{node} runs one corral-bim: {pids:?}");
            sigkill(pids[0]);
            victim = Some((d.clone(), node, *p, pids[0]));
            others = disks
                .keys()
                .filter(|o| *o != d)
                .map(|o| (o.clone(), node_of(&v, o)))
                .collect();
        }
        (victim.is_some() && ready == 3).then_some(v)
    });
    let (victim, node, progress, pid) = victim.expect("a sync was interrupted");
    assert!(progress > 0 && progress < 100, "interrupted at {progress}%");
    assert!(
        failed_elsewhere.is_empty(),
        "only the killed receiver's copy fails: {failed_elsewhere:?}"
    );
    let now = pids_of("corral-bim", &node_dirs[node]);
    assert!(
        now.len() == 1 && now[0] != pid,
        "node-{node}'s corral-bim was started again: {now:?}"
    );
    let bim_log = |node: usize, disk: &str| {
        std::fs::read_to_string(node_dirs[node].join(format!("logs/bim-bim-{disk}.log"))).unwrap_or_default()
    };
    assert!(
        bim_log(node, &victim).matches("sync started").count() >= 2,
        "the killed receiver's copy was synced again"
    );
    // The other two copies (the downloaded one and the other sync) were made once, undisturbed.
    assert_eq!(others.len(), 2, "{others:?}");
    assert!(
        others.iter().all(|(_, n)| *n != node),
        "one copy per node: {others:?}"
    );
    let synced_once = others
        .iter()
        .filter(|(d, n)| bim_log(*n, d).matches("sync started").count() == 1)
        .count();
    assert_eq!(synced_once, 1, "the other sync ran once: {others:?}");
    for d in &node_dirs {
        let f = backing_files(d, "base");
        assert_eq!(f.len(), 1, "{}: {f:?}", d.display());
        assert_eq!(sha512(&f[0]), checksum, "{}", f[0].display());
    }
}

/// `corral` with the S3 key pair in its environment (for `--credentials-from-env`).
fn corral_with_s3_keys(url: &str, args: &[&str]) -> String {
    let out = cli_command_for(url)
        .args(["--url", url])
        .args(args)
        .envs(S3_ENV)
        .output()
        .expect("corral");
    assert!(
        out.status.success(),
        "corral {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_backup_made_by_the_manager_on_s3_restores_into_a_backing_image_with_the_targets_credentials() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bucket")).unwrap();
    let s3 = S3Server::start(&s3_dir, &[]);
    let data_dir = dir.path().join("n1");
    // The manager (and so every daemon it starts) has no S3 keys in its environment: the restore gets the
    // target's credentials from the manager.
    let m = Manager::start(&data_dir, "node-1", "embedded", port_range(3));
    corral_with_s3_keys(
        &m.url,
        &[
            "backup",
            "target",
            "set",
            "s3://bucket/pre",
            "--endpoint",
            &s3.endpoint,
            "--credentials-from-env",
        ],
    );

    // A volume with data, explicit zeros, holes and an unaligned write, backed up by the manager.
    let size: u64 = 24 << 20;
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "src", "size": size, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/src/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let uri = unix_endpoint(&wait_healthy(&m, "src", Duration::from_secs(90)));
    let (ok, out) = qemu_io(
        &uri,
        &[
            "write -P 0xa1 0 1M",
            "write -P 0 3M 2M",
            "write -P 0xb2 9437696 1049607",
            "write -P 0xc3 25161728 4096",
            "flush",
        ],
    );
    assert!(ok, "{out}");
    let expected = dir.path().join("src.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &uri])
        .arg(&expected));
    assert_eq!(std::fs::metadata(&expected).unwrap().len(), size);
    let checksum = sha512(&expected);
    let b: Value = serde_json::from_str(&corral_with_s3_keys(
        &m.url,
        &["--json", "backup", "create", "src"],
    ))
    .unwrap();
    assert_eq!(b["state"], "completed", "{b}");
    let name = b["name"].as_str().unwrap();
    // The backup store's URL of that backup: the target's URL with its endpoint, the backup and its volume.
    let backup_url = format!(
        "s3://bucket/pre?endpoint={}&backup={name}&volume=src",
        s3.endpoint
    );
    // The backup shows it (REST and `backup get`): what `--source restore` takes.
    assert_eq!(b["url"], backup_url.as_str(), "{b}");
    let shown = corral_with_s3_keys(&m.url, &["backup", "get", name]);
    assert!(shown.contains(&backup_url), "{shown}");

    // A URL that names no backup is refused and leaves nothing.
    let create = |body: Value| rest("POST", &format!("{}/v1/backingimages", m.url), Some(&body));
    let (code, v) = create(json!({"name": "bad", "sourceType": "restore",
        "parameters": {"backupURL": format!("s3://bucket/pre?endpoint={}&volume=src", s3.endpoint)}}));
    assert_eq!(code, 409, "{v}");
    assert!(v["message"].as_str().unwrap().contains("backup=NAME"), "{v}");
    let (code, _) = rest("GET", &format!("{}/v1/backingimages/bad", m.url), None);
    assert_eq!(code, 404);

    // The restore through the CLI: the image is the volume as backed up, holes and all.
    let out = cli_command_for(&m.url)
        .args(["--url", &m.url, "--json", "backing-image", "create", "restored"])
        .args(["--source", "restore", "--backup-url", &backup_url])
        .args(["--expected-checksum", &checksum, "--timeout", "120"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v = wait_image(&m, "restored", "ready", Duration::from_secs(120));
    assert_eq!(v["sourceType"], "restore", "{v}");
    assert_eq!(v["currentChecksum"], checksum.as_str(), "{v}");
    assert_eq!(v["virtualSize"], size, "{v}");
    let f = backing_files(&data_dir, "restored");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(sha512(&f[0]), checksum);
    let allocated = std::fs::metadata(&f[0]).unwrap().blocks() * 512;
    assert!(
        allocated < size / 2,
        "the holes stay holes: {allocated} bytes allocated of {size}"
    );

    // The credentials went to the data source in a file that is gone with it, and into no log.
    wait_for("the data source stopped", Duration::from_secs(30), || {
        pids_of("corral-datasource", &data_dir).is_empty().then_some(())
    });
    let run_dir = data_dir.join("run");
    let left: Vec<_> = std::fs::read_dir(&run_dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".credentials"))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "credentials left in {}: {left:?}",
        run_dir.display()
    );
    for log in std::fs::read_dir(data_dir.join("logs")).unwrap().flatten() {
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        assert!(
            !text.contains(S3_ENV[1].1),
            "{} holds the S3 secret",
            log.path().display()
        );
    }
    assert!(
        !m.log().contains(S3_ENV[1].1),
        "the manager's log holds the S3 secret"
    );

    // A backup the target does not hold: the image fails with the store's message.
    let (code, v) = create(json!({"name": "nope", "sourceType": "restore",
        "parameters": {"backupURL": format!("s3://bucket/pre?endpoint={}&backup=nope&volume=src", s3.endpoint)}}));
    assert_eq!(code, 201, "{v}");
    let v = wait_for("nope failed", Duration::from_secs(60), || {
        let v = image(&m, "nope");
        v["disks"]
            .as_array()
            .and_then(|d| d.iter().find(|d| d["state"] == "failed"))
            .cloned()
    });
    assert!(v["message"].as_str().unwrap().contains("nope"), "{v}");
}

/// A v1 image's copies serve v1 replicas, which live on v1 disks only. On a node with its default v1 disk and a v2
/// disk, the first copy lands on the v1 disk and `minNumberOfCopies: 2` adds no copy in the v2 disk's directory
/// (HA used to count the v2 disk as a candidate and sync a file there that nothing can use).
#[test]
fn a_v1_image_keeps_its_copies_on_v1_disks_beside_a_v2_disk() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, _) = fixture(&files);
    let http = HttpServer::start(&files);
    let (m, _) = v2_images::node_with_a_v2_disk(dir.path(), "node-1", 0, 64 << 20);
    let v2_dir = dir.path().join("node-1-v2a");
    let (code, v) = v2_images::create_image(
        &m,
        &json!({"name": "base", "sourceType": "download", "minNumberOfCopies": 2,
        "parameters": {"url": http.url("image.qcow2")}, "expectedChecksum": sha512(&qcow)}),
    );
    assert_eq!(code, 201, "{v}");
    wait_image(&m, "base", "ready", Duration::from_secs(60));
    let (code, node) = rest("GET", &format!("{}/v1/nodes/node-1", m.url), None);
    assert_eq!(code, 200, "{node}");
    let v2_uuid = node["disks"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["name"] == "v2a"))
        .and_then(|d| d["diskUUID"].as_str())
        .unwrap_or_else(|| panic!("no disk v2a in {node}"))
        .to_owned();
    // HA runs on every reconcile of a ready image (resynced every 2 s): watch several passes.
    let until = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < until {
        let v = image(&m, "base");
        let disks = v["disks"].as_array().unwrap();
        assert!(
            !disks.is_empty() && disks.iter().all(|d| d["diskUUID"] != v2_uuid.as_str()),
            "a v1 image's copies stay on the v1 disk, not on v2 disk {v2_uuid}: {v}"
        );
        assert_eq!(v2_images::v1_files(&v2_dir, "base"), Vec::<PathBuf>::new());
        std::thread::sleep(Duration::from_millis(300));
    }
}
