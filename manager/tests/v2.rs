//! The v2 data engine through the manager (issue 20 item 3), one node with real daemons: v2 disks (a
//! `corral-replica serve-lvstore` per disk, supervised by the manager), a v2 volume placed only on them and
//! served over NBD (qemu-io, qemu-img, fio), snapshots, the per-disk daemon SIGKILLed under the attached
//! volume and restarted with the data intact, v1 and v2 volumes written by one fio verify job reading back
//! identically, clones between v1 and v2 volumes, and the refusals: no v2 disk, foreign data where the store
//! goes, an unknown engine. A v2 volume backs up (full, then incremental) and restores into a v1 and a v2 volume.

mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::v2_images::{lvstore_daemon, lvstore_daemons};
use support::*;
use testkit::{nbd_sha256, qemu_io, wait_for};

const SIZE: u64 = 64 << 20;

fn wait_attached(m: &Manager, name: &str, rw: usize) -> Value {
    wait_for(
        &format!("{name} attached with {rw} RW"),
        Duration::from_secs(90),
        || {
            let v = volume(m, name);
            let n = v["replicas"]
                .as_array()
                .map_or(0, |rs| rs.iter().filter(|r| r["mode"] == "RW").count());
            (v["state"] == "attached" && n == rw).then_some(v)
        },
    )
}

/// Names of the replicas the lvstore daemon at `address` hosts, asked over its gRPC LvstoreService.
fn hosted(address: &str) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = support::tls::lvstore_client(address).await;
        c.lvstore_replica_list(corral_proto::v1::LvstoreEmpty {})
            .await
            .unwrap()
            .into_inner()
            .replicas
            .into_iter()
            .map(|r| r.name)
            .collect()
    })
}

/// The fio verify job both engines run: 4 KiB random writes of an offset pattern over the first 16 MiB (the
/// data depends only on the offset, so two volumes written by it hold the same bytes), then verified.
fn fio_verify(uri: &str) {
    let out = Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--iodepth=16",
            "--randseed=20",
            "--verify=pattern",
            "--verify_pattern=%o",
            "--do_verify=1",
            "--verify_state_save=0",
        ])
        .output()
        .expect("fio");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("err= 0"),
        "fio on {uri}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn v2_volumes_live_on_v2_disks_survive_a_killed_lvstore_daemon_and_read_back_like_v1() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let node = "node-1";

    // No v2 disk yet: a v2 volume cannot be placed, and nothing is created.
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": "early", "size": SIZE, "numberOfReplicas": 1, "dataEngine": "v2"})),
    );
    assert_eq!(code, 409, "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("no schedulable v2 disk"),
        "{e}"
    );
    assert_eq!(rest("GET", &format!("{url}/v1/volumes/early"), None).0, 404);

    // Bad input: an unknown engine; a directory whose store file holds foreign data (left untouched).
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/nodes/{node}/disks"),
        Some(
            &json!({"name": "bad", "path": dir.path().join("bad").display().to_string(), "diskEngine": "v3"}),
        ),
    );
    assert_eq!(code, 400, "{e}");
    let (fine, _, err) = corral(
        &url,
        &["node", "disk-add", node, "bad", "/tmp/x", "--disk-engine", "v3"],
    );
    assert!(!fine && err.contains("v3") && err.contains("v1 or v2"), "{err}");
    let foreign = dir.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("lvstore.img"), vec![0x33u8; 1 << 20]).unwrap();
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/nodes/{node}/disks"),
        Some(&json!({"name": "foreign", "path": foreign.display().to_string(), "diskEngine": "v2"})),
    );
    assert_eq!(code, 409, "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("not an lvstore and not empty"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(foreign.join("lvstore.img")).unwrap(),
        vec![0x33u8; 1 << 20]
    );
    let (_, n) = rest("GET", &format!("{url}/v1/nodes/{node}"), None);
    assert_eq!(n["disks"].as_array().unwrap().len(), 1, "{n}");
    let (code, e) = rest(
        "PUT",
        &format!("{url}/v1/settings/default-data-engine"),
        Some(&json!({"value": "v9"})),
    );
    assert_eq!(code, 400, "{e}");

    // Two v2 disks (CLI and REST): the manager creates each store file, formats it and runs its daemon.
    let (d1, d2) = (dir.path().join("v2a"), dir.path().join("v2b"));
    ok(
        &url,
        &[
            "node",
            "disk-add",
            node,
            "v2a",
            d1.to_str().unwrap(),
            "--disk-engine",
            "v2",
            "--lvstore-size",
            "256M",
        ],
    );
    let (code, n) = rest(
        "POST",
        &format!("{url}/v1/nodes/{node}/disks"),
        Some(
            &json!({"name": "v2b", "path": d2.display().to_string(), "diskEngine": "v2", "lvstoreSize": 256 << 20}),
        ),
    );
    assert_eq!(code, 200, "{n}");
    let daemons = wait_for("both lvstore daemons running", Duration::from_secs(60), || {
        let ds = lvstore_daemons(&m);
        (ds.len() == 2 && ds.iter().all(|d| d["state"] == "running")).then_some(ds)
    });
    assert_eq!(
        std::fs::metadata(d1.join("lvstore.img")).unwrap().len(),
        256 << 20
    );
    let out = ok(&url, &["lvstore", "ls"]);
    assert!(out.contains("v2a") && out.contains("running"), "{out}");
    // What a v2 disk has free is its store's free clusters, as its daemon reports them (not the store's size).
    let free_before = wait_for(
        "v2a's free space from its daemon",
        Duration::from_secs(30),
        || {
            let (max, free) = disk_space(&url, node, "v2a");
            (free < max).then_some(free)
        },
    );

    // A v2 volume (CLI) and a v1 volume: replicas only on disks of their engine.
    ok(
        &url,
        &[
            "volume",
            "create",
            "vtwo",
            "--size",
            "64M",
            "--replicas",
            "2",
            "--data-engine",
            "v2",
        ],
    );
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": "vone", "size": SIZE, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["dataEngine"], "v1");
    let uri2 = attach(&url, "vtwo");
    let uri1 = attach(&url, "vone");
    let v2 = wait_attached(&m, "vtwo", 2);
    let v1 = wait_attached(&m, "vone", 2);
    assert_eq!(v2["dataEngine"], "v2");
    assert_eq!(replica_disks(&v2), ["v2a", "v2b"], "{v2}");
    assert!(
        v2["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["dataEngine"] == "v2")
    );
    assert!(
        v1["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["disk"] == "default"),
        "a v1 replica on a v2 disk: {v1}"
    );
    for d in &daemons {
        let names = hosted(d["address"].as_str().unwrap());
        assert_eq!(names.len(), 1, "{d}: {names:?}");
        assert!(names[0].starts_with("vtwo-r-"), "{names:?}");
    }

    // One fio verify job on both volumes; they read back identically (qemu-img compare over NBD).
    fio_verify(&uri1);
    fio_verify(&uri2);
    let free_after = wait_for(
        "v2a's free space down by what fio wrote",
        Duration::from_secs(30),
        || {
            let (_, free) = disk_space(&url, node, "v2a");
            (free + (16 << 20) <= free_before).then_some(free)
        },
    );
    let out = ok(&url, &["node", "ls"]);
    assert!(
        out.contains(&corral_daemon::human_bytes(free_after)),
        "corral node ls shows v2a's free space: {out}"
    );
    qemu_img_compare(&uri1, &uri2);

    // qemu-io on v2, a snapshot, writes over it.
    let (okk, out) = qemu_io(&uri2, &["write -P 0xab 32M 4M", "flush", "read -P 0xab 32M 4M"]);
    assert!(okk, "{out}");
    let (code, s) = rest(
        "POST",
        &format!("{url}/v1/volumes/vtwo/snapshots"),
        Some(&json!({"name": "s1"})),
    );
    assert_eq!(code, 201, "{s}");
    let (okk, out) = qemu_io(&uri2, &["write -P 0xcd 34M 1M", "flush"]);
    assert!(okk, "{out}");
    let (_, list) = rest("GET", &format!("{url}/v1/volumes/vtwo/snapshots"), None);
    assert!(
        list.as_array().unwrap().iter().any(|s| s["name"] == "s1"),
        "{list}"
    );

    // SIGKILL the daemon of disk v2a under the attached volume: IO goes on with the other replica, the manager
    // restarts the daemon (it serves the store again) and the data is intact.
    let victim = lvstore_daemon(&m, "node-1", "v2a").unwrap();
    let pid = victim["pid"].as_i64().unwrap();
    sigkill(pid);
    let (okk, out) = qemu_io(&uri2, &["write -P 0xef 40M 1M", "flush"]);
    assert!(okk, "IO must go on with the v2 replica on v2b: {out}");
    let back = wait_for(
        "the killed lvstore daemon restarted",
        Duration::from_secs(60),
        || {
            lvstore_daemon(&m, "node-1", "v2a")
                .filter(|d| d["state"] == "running" && d["pid"].as_i64() != Some(pid))
        },
    );
    assert!(back["restarts"].as_u64().unwrap() >= 1, "{back}");
    assert!(!pid_alive(pid));
    let (okk, out) = qemu_io(
        &uri2,
        &[
            "read -P 0xab 32M 2M",
            "read -P 0xcd 34M 1M",
            "read -P 0xab 35M 1M",
            "read -P 0xef 40M 1M",
        ],
    );
    assert!(okk, "data after the daemon restart: {out}");
    // The engine found the replica on v2a ERR at that write: it is failed, its lvols are removed from the restarted
    // daemon, and a replacement is placed on a v2 disk and rebuilt from the v2 replica on v2b (snapshot lvols
    // sent over the sync protocol, the head reparented over them).
    let v = wait_for(
        "the failed v2 replica replaced and rebuilt",
        Duration::from_secs(120),
        || {
            let v = volume(&m, "vtwo");
            let rs = v["replicas"].as_array().unwrap();
            (v["robustness"] == "healthy"
                && rs.len() == 2
                && rs.iter().all(|r| r["mode"] == "RW")
                && rs.iter().any(|r| r["disk"] == "v2a"))
            .then_some(v)
        },
    );
    let rebuilt = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["disk"] == "v2a")
        .unwrap()["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let on_v2a = hosted(back["address"].as_str().unwrap());
    assert!(
        on_v2a.iter().any(|n| n.contains(&rebuilt)),
        "the rebuilt replica {rebuilt} is hosted by v2a's daemon: {on_v2a:?}"
    );
    let (okk, out) = qemu_io(
        &uri2,
        &[
            "read -P 0xab 32M 2M",
            "read -P 0xcd 34M 1M",
            "read -P 0xab 35M 1M",
            "read -P 0xef 40M 1M",
        ],
    );
    assert!(okk, "data after the rebuild: {out}");
    let (_, list) = rest("GET", &format!("{url}/v1/volumes/vtwo/snapshots"), None);
    assert!(
        list.as_array().unwrap().iter().any(|s| s["name"] == "s1"),
        "the snapshot survives the rebuild: {list}"
    );

    // Delete: detached, the volume's replicas and lvols go from the daemons.
    ok(&url, &["volume", "detach", "vtwo"]);
    wait_for("vtwo detached", Duration::from_secs(30), || {
        (volume(&m, "vtwo")["state"] == "detached").then_some(())
    });
    let (code, e) = rest("DELETE", &format!("{url}/v1/volumes/vtwo"), None);
    assert_eq!(code, 204, "{e}");
    wait_for(
        "the v2 replicas removed from both daemons",
        Duration::from_secs(30),
        || {
            lvstore_daemons(&m)
                .iter()
                .all(|d| d["state"] == "running" && hosted(d["address"].as_str().unwrap()).is_empty())
                .then_some(())
        },
    );
}

/// (storageMaximum, storageAvailable) of `disk` on `node`, as the REST API reports them.
fn disk_space(url: &str, node: &str, disk: &str) -> (u64, u64) {
    let (_, n) = rest("GET", &format!("{url}/v1/nodes/{node}"), None);
    let d = n["disks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == disk)
        .unwrap_or_else(|| panic!("no disk {disk}: {n}"));
    (
        d["storageMaximum"].as_u64().unwrap(),
        d["storageAvailable"].as_u64().unwrap(),
    )
}

/// `corral --json backup create VOLUME` (waits): its JSON.
fn backup(url: &str, volume: &str) -> Value {
    serde_json::from_str(&ok(url, &["--json", "backup", "create", volume])).unwrap()
}

#[test]
fn a_v2_volume_backs_up_incrementally_and_restores_into_a_v1_and_a_v2_volume() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let disk = dir.path().join("v2a");
    ok(
        &url,
        &[
            "node",
            "disk-add",
            "node-1",
            "v2a",
            disk.to_str().unwrap(),
            "--disk-engine",
            "v2",
            "--lvstore-size",
            "256M",
        ],
    );
    wait_for("the lvstore daemon running", Duration::from_secs(60), || {
        lvstore_daemon(&m, "node-1", "v2a").filter(|d| d["state"] == "running")
    });
    let target = dir.path().join("target");
    std::fs::create_dir(&target).unwrap();
    ok(
        &url,
        &["backup", "target", "set", &format!("file://{}", target.display())],
    );
    ok(
        &url,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "32Mi",
            "--replicas",
            "1",
            "--data-engine",
            "v2",
        ],
    );
    let src = attach(&url, "src");
    let (okk, out) = qemu_io(&src, &["write -P 0x5a 0 4M", "write -P 0x6b 20M 2M", "flush"]);
    assert!(okk, "{out}");
    let b1 = backup(&url, "src");
    assert_eq!(b1["state"], "completed", "{b1}");
    assert_eq!(b1["isIncremental"], false, "{b1}");
    let (okk, out) = qemu_io(&src, &["write -P 0x77 8M 1M", "write -z 20M 1M", "flush"]);
    assert!(okk, "{out}");
    let sum = nbd_sha256(&src);
    let b2 = backup(&url, "src");
    assert_eq!(b2["state"], "completed", "{b2}");
    assert_eq!(b2["isIncremental"], true, "{b2}");
    assert!(
        b2["readBytes"].as_u64().unwrap() < b1["readBytes"].as_u64().unwrap(),
        "the incremental reads only the changed blocks: {b1} {b2}"
    );
    let id = b2["id"].as_str().unwrap().to_owned();

    // Into a v1 volume and into a v2 volume: both read like the source.
    for (name, engine) in [("r1", "v1"), ("r2", "v2")] {
        ok(
            &url,
            &[
                "volume",
                "create",
                name,
                "--from-backup",
                &id,
                "--replicas",
                "1",
                "--data-engine",
                engine,
            ],
        );
        let r = rest("GET", &format!("{url}/v1/volumes/{name}/restore"), None).1;
        assert_eq!(r["state"], "completed", "{name}: {r}");
        let v = volume(&m, name);
        assert_eq!(v["dataEngine"], engine, "{v}");
        let uri = attach(&url, name);
        assert_eq!(nbd_sha256(&uri), sum, "{name} ({engine}) reads like the source");
        qemu_img_compare(&uri, &src);
    }
}

/// The volume's replicas' data engines and disks.
fn placement(v: &Value) -> Vec<(String, String)> {
    v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["dataEngine"].as_str().unwrap_or_default().to_owned(),
                r["disk"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Issue 20: clones between the engines through the control plane. A v2 volume clones into a v1 volume (CLI
/// `--from-volume`) and its snapshot into a v2 volume (REST `snap://`), the v1 clone back into a v2 volume; each
/// clone completes, is placed on disks of its own engine and reads exactly as its source (`qemu-img compare` over
/// NBD and a checksum of the whole device).
#[test]
fn v2_volumes_clone_into_v1_and_v2_volumes_and_a_v1_volume_into_a_v2_one() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(1));
    let url = m.url.clone();
    let disk = dir.path().join("v2a");
    ok(
        &url,
        &[
            "node",
            "disk-add",
            "node-1",
            "v2a",
            disk.to_str().unwrap(),
            "--disk-engine",
            "v2",
            "--lvstore-size",
            "256M",
        ],
    );
    wait_for("the lvstore daemon running", Duration::from_secs(60), || {
        lvstore_daemon(&m, "node-1", "v2a").filter(|d| d["state"] == "running")
    });
    ok(
        &url,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "64M",
            "--replicas",
            "1",
            "--data-engine",
            "v2",
        ],
    );
    let src_uri = attach(&url, "src");
    let (okk, out) = qemu_io(
        &src_uri,
        &[
            "write -P 0x5a 0 4M",
            "write -P 0x6b 32M 2M",
            "write -P 0x7c 63M 4k",
            "flush",
        ],
    );
    assert!(okk, "{out}");
    let (code, s) = rest(
        "POST",
        &format!("{url}/v1/volumes/src/snapshots"),
        Some(&json!({"name": "s1"})),
    );
    assert_eq!(code, 201, "{s}");
    let at_s1 = nbd_sha256(&src_uri);
    let (okk, out) = qemu_io(&src_uri, &["write -P 0x8d 8M 1M", "flush"]);
    assert!(okk, "{out}");
    let src_now = nbd_sha256(&src_uri);
    assert_ne!(src_now, at_s1);

    // v2 -> v1, through the CLI (waits for the clone; size from the source).
    ok(
        &url,
        &[
            "volume",
            "create",
            "c1",
            "--from-volume",
            "src",
            "--replicas",
            "1",
            "--data-engine",
            "v1",
        ],
    );
    let c1 = volume(&m, "c1");
    assert_eq!(
        (c1["cloneStatus"]["state"].as_str(), c1["dataEngine"].as_str()),
        (Some("completed"), Some("v1")),
        "{c1}"
    );
    let c1_uri = attach(&url, "c1");
    assert_eq!(nbd_sha256(&c1_uri), src_now, "c1 reads like its v2 source");
    qemu_img_compare(&c1_uri, &src_uri);
    let c1 = wait_attached(&m, "c1", 1);
    assert_eq!(placement(&c1), [("v1".to_owned(), "default".to_owned())], "{c1}");

    // v2 snapshot -> v2, over REST.
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(
            &json!({"name": "c2", "size": SIZE, "numberOfReplicas": 1, "dataSource": "snap://src/s1",
            "dataEngine": "v2"}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    wait_for("c2 cloned", Duration::from_secs(120), || {
        let v = volume(&m, "c2");
        assert_ne!(v["cloneStatus"]["state"], "failed", "{v}");
        (v["cloneStatus"]["state"] == "completed").then_some(v)
    });
    let c2_uri = attach(&url, "c2");
    assert_eq!(nbd_sha256(&c2_uri), at_s1, "c2 reads like s1 of its v2 source");
    let c2 = wait_attached(&m, "c2", 1);
    assert_eq!(placement(&c2), [("v2".to_owned(), "v2a".to_owned())], "{c2}");

    // v1 -> v2: the v1 clone cloned back into a v2 volume.
    ok(
        &url,
        &[
            "volume",
            "create",
            "c3",
            "--from-volume",
            "c1",
            "--replicas",
            "1",
            "--data-engine",
            "v2",
        ],
    );
    assert_eq!(volume(&m, "c3")["cloneStatus"]["state"], "completed");
    let c3_uri = attach(&url, "c3");
    qemu_img_compare(&c3_uri, &c1_uri);
    assert_eq!(nbd_sha256(&c3_uri), src_now, "c3 reads like its v1 source");
    let c3 = wait_attached(&m, "c3", 1);
    assert_eq!(placement(&c3), [("v2".to_owned(), "v2a".to_owned())], "{c3}");
    // The clones are volumes of their own: a write to one changes no other.
    let (okk, out) = qemu_io(&c3_uri, &["write -P 0x11 0 64k", "flush"]);
    assert!(okk, "{out}");
    assert_eq!(nbd_sha256(&c1_uri), src_now);
    assert_eq!(nbd_sha256(&src_uri), src_now);
}
