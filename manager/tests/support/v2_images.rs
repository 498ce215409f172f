//! v2 backing images through a manager's REST API: a node with a v2 disk, an image's view and its v2 copies,
//! waiting for the first v2 copy, the copies a disk daemon holds (asked over its gRPC `LvstoreService`), and a
//! random raw fixture with data, written zeros and holes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use testkit::wait_for;

use super::{Manager, port_range, rest};

/// A random raw image of `len` bytes (a multiple of 1 MiB, at least 8 MiB) at `path`: random data, a 1 MiB range of
/// zeros written (not a hole), holes, and data in the last 4 KiB. Returns its SHA-512.
pub fn raw_fixture(path: &Path, seed: u64, len: u64) -> String {
    use std::os::unix::fs::FileExt;
    assert!(len >= 8 << 20 && len.is_multiple_of(1 << 20), "{len}");
    let f = std::fs::File::create(path).unwrap();
    f.set_len(len).unwrap();
    let mut data = vec![0u8; 3 << 20];
    testkit::TestRng::new(seed).fill(&mut data);
    f.write_all_at(&data, 0).unwrap();
    f.write_all_at(&vec![0u8; 1 << 20], 4 << 20).unwrap();
    f.write_all_at(&data[..(2 << 20) + 4096], 5 << 20).unwrap();
    f.write_all_at(&data[..4096], len - 4096).unwrap();
    f.sync_all().unwrap();
    testkit::sha512_file(path)
}

/// `GET /v1/backingimages/NAME` (must exist).
pub fn image(m: &Manager, name: &str) -> Value {
    let (code, v) = rest("GET", &format!("{}/v1/backingimages/{name}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

/// `POST /v1/backingimages`.
pub fn create_image(m: &Manager, body: &Value) -> (u16, Value) {
    rest("POST", &format!("{}/v1/backingimages", m.url), Some(body))
}

/// The entries of an image view's `disks` of one engine.
pub fn disks_of(v: &Value, engine: &str) -> Vec<Value> {
    v["disks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["dataEngine"] == engine)
        .cloned()
        .collect()
}

/// Waits until image `name` is ready (a v2 image: its first v2 copy ready); fails at once when it failed.
pub fn wait_ready(m: &Manager, name: &str, timeout: Duration) -> Value {
    wait_for(&format!("backing image {name} ready"), timeout, || {
        let v = image(m, name);
        assert!(
            v["state"] != "failed" && v["v2FirstCopyStatus"] != "failed",
            "backing image {name} failed: {v}"
        );
        let v2_ready = v["dataEngine"] == "v1" || v["v2FirstCopyStatus"] == "ready";
        (v["state"] == "ready" && v2_ready).then_some(v)
    })
}

/// The `corral-bim` files of image `name` under a disk directory.
pub fn v1_files(disk: &Path, name: &str) -> Vec<PathBuf> {
    std::fs::read_dir(disk.join("backing-images"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&format!("{name}-")))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The lvstore daemons as `GET /v1/lvstores` shows them.
pub fn lvstore_daemons(m: &Manager) -> Vec<Value> {
    let (code, v) = rest("GET", &format!("{}/v1/lvstores", m.url), None);
    assert_eq!(code, 200, "{v}");
    v.as_array().cloned().unwrap_or_default()
}

/// The copies the disk daemon at `address` holds, asked over its gRPC `LvstoreService`.
pub fn daemon_copies(address: &str) -> Vec<corral_proto::v1::BackingImageV2CopyInfo> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = crate::support::tls::lvstore_client(address).await;
        c.backing_image_list(corral_proto::v1::LvstoreEmpty {})
            .await
            .unwrap()
            .into_inner()
            .backing_images
    })
}

/// A manager `node_id` (data under `dir/<node_id>`, port slice `slot`) with its default (v1) disk and a v2 disk
/// `v2a` of `lvstore_size` bytes at `dir/<node_id>-v2a`, its daemon running; returns the manager and the v2
/// daemon's `LvstoreService` address.
pub fn node_with_a_v2_disk(dir: &Path, node_id: &str, slot: u16, lvstore_size: u64) -> (Manager, String) {
    let m = Manager::start(&dir.join(node_id), node_id, "embedded", port_range(slot));
    let address = add_v2_disk(&m, "v2a", &dir.join(format!("{node_id}-v2a")), lvstore_size);
    (m, address)
}

/// Adds the v2 disk `disk` at `path` with a store of `lvstore_size` bytes to `m`'s own node (through `m`: the
/// store is checked and made on its host); returns its daemon's `LvstoreService` address once it runs.
pub fn add_v2_disk(m: &Manager, disk: &str, path: &Path, lvstore_size: u64) -> String {
    let (code, n) = rest(
        "POST",
        &format!("{}/v1/nodes/{}/disks", m.url, m.node_id),
        Some(
            &json!({"name": disk, "path": path.display().to_string(), "diskEngine": "v2",
            "lvstoreSize": lvstore_size}),
        ),
    );
    assert_eq!(code, 200, "{n}");
    wait_for(
        &format!("the lvstore daemon of {} disk {disk} running", m.node_id),
        Duration::from_secs(60),
        || {
            lvstore_daemon(m, &m.node_id, disk)
                .filter(|d| d["state"] == "running")
                .and_then(|d| d["address"].as_str().map(str::to_owned))
        },
    )
}

/// The daemon of v2 disk `disk` of node `node_id` as `GET /v1/lvstores` shows it (None until the manager made
/// its document).
pub fn lvstore_daemon(m: &Manager, node_id: &str, disk: &str) -> Option<Value> {
    lvstore_daemons(m)
        .into_iter()
        .find(|d| d["nodeId"] == node_id && d["disk"] == disk)
}

/// `POST /v1/volumes` of a one-replica volume of `size` bytes on `image` (None: no backing image).
pub fn create_volume(m: &Manager, name: &str, size: u64, image: Option<&str>, engine: &str) -> (u16, Value) {
    rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(
            &json!({"name": name, "size": size, "numberOfReplicas": 1, "backingImage": image,
            "dataEngine": engine}),
        ),
    )
}
