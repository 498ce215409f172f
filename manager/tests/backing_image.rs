//! Backing images through the manager on one node (embedded store) with real daemons: a compressed qcow2 made by
//! `qemu-img` (data, explicit zeros, holes, an unaligned tail) downloaded from a local HTTP server with its
//! SHA-512 → ready; a 3-replica volume on it reads exactly what `qemu-img convert -O raw` gives (`qemu-img
//! compare` over NBD); writes, a snapshot, detach/attach keep the data; every `corral-bim` stopped and restarted
//! (live upgrade) → the same file (inode) is ready again while the volume serves IO; the same image uploaded
//! through the manager gives the same checksum; bad input is refused or fails with a message.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::servers::Etcd;
use testkit::{Daemon, DaemonCommand, qemu_io, wait_for};

/// Python's `http.server` over a directory (no Range support: downloads start from the beginning).
struct HttpServer {
    daemon: Daemon,
}

impl HttpServer {
    fn start(dir: &Path) -> Self {
        // It cannot report a port it bound: the test kit's probed port, retried when another process took it.
        let daemon = testkit::ports::retry_on_address_in_use(|| {
            let port = testkit::ports::unbound_port();
            DaemonCommand::new("python3")
                .args([
                    "-m",
                    "http.server",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--directory",
                ])
                .arg(dir)
                .listening_on("http", format!("127.0.0.1:{port}"))
                .try_spawn()
        });
        HttpServer { daemon }
    }

    fn url(&self, file: &str) -> String {
        format!("{}/{file}", self.daemon.http_url("http"))
    }
}

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

    // The same image uploaded through the manager (the CLI streams it) has the same checksum.
    let out = Command::new(cli_bin())
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
    let out = Command::new("curl")
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

#[test]
fn a_cluster_syncs_copies_to_replica_disks_keeps_min_copies_through_cleanup_and_refetches_when_all_fail() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (qcow, expected) = fixture(&files);
    let checksum = sha512(&qcow);
    let http = HttpServer::start(&files);
    let etcd = Etcd::start(dir.path());
    let store = format!("etcd://{}", etcd.endpoint());
    let ms: Vec<Manager> = (0..3)
        .map(|i| {
            Manager::start(
                &dir.path().join(format!("n{i}")),
                &format!("node-{i}"),
                &store,
                port_range(i),
            )
        })
        .collect();
    let m = &ms[0];
    wait_for("3 nodes ready", Duration::from_secs(30), || {
        let (_, v) = rest("GET", &format!("{}/v1/nodes", m.url), None);
        (v.as_array()
            .map_or(0, |a| a.iter().filter(|n| n["ready"] == true).count())
            == 3)
            .then_some(())
    });
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
    compare(&expected, &unix_endpoint(&v));

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
