//! One node on the embedded store with real replica and engine processes: create, attach, IO through NBD, a
//! SIGKILLed replica replaced and rebuilt, snapshots, detach and re-attach with the data intact.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{kill_under, qemu_io, wait_for};

fn pids(v: &Value) -> Vec<i64> {
    v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["pid"].as_i64())
        .collect()
}

#[test]
fn a_volume_attaches_serves_nbd_heals_a_killed_replica_and_survives_detach() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol1", "size": 32 << 20, "numberOfReplicas": 3})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["state"], "detached");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vol1/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&m, "vol1", 3, Duration::from_secs(60));
    let uri = unix_endpoint(&v);
    let (ok, out) = qemu_io(&uri, &["write -P 0xab 0 4M", "flush", "read -P 0xab 0 4M"]);
    assert!(ok, "{out}");

    // SIGKILL one replica: the engine puts it ERR at the next write, the manager replaces it and rebuilds.
    let before: Vec<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].to_string())
        .collect();
    let victim = pids(&v)[0];
    sigkill(victim);
    let (ok, out) = qemu_io(&uri, &["write -P 0xcd 4M 4M", "flush"]);
    assert!(ok, "IO must continue with two replicas: {out}");
    let mut saw_degraded = false;
    let v = wait_for("a replacement replica", Duration::from_secs(60), || {
        let v = volume(&m, "vol1");
        saw_degraded |= v["robustness"] == "degraded";
        let names: Vec<String> = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].to_string())
            .collect();
        let rw = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["mode"] == "RW")
            .count();
        (names.iter().any(|n| !before.contains(n)) && rw == 3 && v["robustness"] == "healthy").then_some(v)
    });
    assert!(
        saw_degraded,
        "the volume never reported degraded while a replica was missing"
    );
    assert!(!pids(&v).contains(&victim));
    let (ok, out) = qemu_io(&uri, &["read -P 0xab 0 4M", "read -P 0xcd 4M 4M"]);
    assert!(ok, "data after the rebuild: {out}");

    // Snapshots through the API.
    let (code, s) = rest(
        "POST",
        &format!("{}/v1/volumes/vol1/snapshots", m.url),
        Some(&json!({"name": "s1"})),
    );
    assert_eq!(code, 201, "{s}");
    let (code, list) = rest("GET", &format!("{}/v1/volumes/vol1/snapshots", m.url), None);
    assert_eq!(code, 200, "{list}");
    assert!(
        list.as_array().unwrap().iter().any(|s| s["name"] == "s1"),
        "{list}"
    );

    // Detach stops the engine and the replicas; re-attach serves the same data.
    let engine_pid = v["engine"]["pid"].as_i64().unwrap();
    let (code, _) = rest("POST", &format!("{}/v1/volumes/vol1/detach", m.url), None);
    assert_eq!(code, 200);
    wait_for("detached", Duration::from_secs(30), || {
        (volume(&m, "vol1")["state"] == "detached").then_some(())
    });
    wait_for("daemons stopped", Duration::from_secs(20), || {
        (!pid_alive(engine_pid) && pids(&volume(&m, "vol1")).iter().all(|p| !pid_alive(*p))).then_some(())
    });
    let (code, _) = rest(
        "POST",
        &format!("{}/v1/volumes/vol1/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200);
    let v = wait_healthy(&m, "vol1", 3, Duration::from_secs(60));
    let (ok, out) = qemu_io(&unix_endpoint(&v), &["read -P 0xab 0 4M", "read -P 0xcd 4M 4M"]);
    assert!(ok, "data after re-attach: {out}");
    // Delete refuses an attached volume, then removes everything once detached.
    let (code, e) = rest("DELETE", &format!("{}/v1/volumes/vol1", m.url), None);
    assert_eq!(code, 409, "{e}");
    assert!(e["message"].as_str().unwrap().contains("detach"), "{e}");
    rest("POST", &format!("{}/v1/volumes/vol1/detach", m.url), None);
    wait_for("detached", Duration::from_secs(30), || {
        (volume(&m, "vol1")["state"] == "detached").then_some(())
    });
    let (code, _) = rest("DELETE", &format!("{}/v1/volumes/vol1", m.url), None);
    assert_eq!(code, 204);
    let disk = m.data_dir.join("disks/default/replicas");
    wait_for("replica data removed", Duration::from_secs(30), || {
        std::fs::read_dir(&disk)
            .map_or(true, |mut d| d.next().is_none())
            .then_some(())
    });
}

#[test]
fn the_cli_brings_up_a_node_creates_attaches_and_snapshots_a_volume() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = testkit::ports::unbound_port();
    let url = format!("http://127.0.0.1:{port}");
    // `corral up --detach` returns once the API answers; the manager runs on.
    let listen = format!("127.0.0.1:{port}");
    // The manager `up` starts writes its first admin token into this data dir: the CLI calls below present it.
    remember_data_dir(&data);
    let (ok, out, err) = corral(
        &url,
        &[
            "up",
            "--detach",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            &listen,
        ],
    );
    assert!(ok, "{out}{err}");
    struct KillAll(std::path::PathBuf);
    impl Drop for KillAll {
        fn drop(&mut self) {
            kill_under(&self.0);
        }
    }
    let _guard = KillAll(data.clone());
    let (ok, out, err) = corral(&url, &["node", "ls"]);
    assert!(ok && out.contains("node-1"), "{out}{err}");
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "cli1", "--size", "16Mi", "--replicas", "2"],
    );
    assert!(
        ok && out.contains("cli1") && out.contains("detached"),
        "{out}{err}"
    );
    let (ok, out, err) = corral(&url, &["volume", "attach", "cli1"]);
    assert!(ok, "{out}{err}");
    let uri = out
        .lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .expect("attach prints the NBD URI")
        .to_owned();
    let (ok, o) = qemu_io(&uri, &["write -P 0x42 0 1M", "read -P 0x42 0 1M"]);
    assert!(ok, "{o}");
    let (ok, out, err) = corral(&url, &["volume", "wait-healthy", "cli1", "--timeout", "60"]);
    assert!(ok && out.contains("healthy"), "{out}{err}");
    let (ok, out, err) = corral(&url, &["volume", "get", "cli1", "--json"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "attached");
    assert_eq!(v["replicas"].as_array().unwrap().len(), 2);
    let (ok, out, _) = corral(&url, &["volume", "ls"]);
    assert!(ok && out.contains("cli1") && out.contains("attached"), "{out}");
    let (ok, out, err) = corral(&url, &["snapshot", "create", "cli1", "snap1"]);
    assert!(ok && out.contains("snap1"), "{out}{err}");
    let (ok, out, _) = corral(&url, &["snapshot", "ls", "cli1"]);
    assert!(ok && out.contains("snap1"), "{out}");
    // Revert: data written after the snapshot is gone, the snapshot's data is back.
    let (ok, o) = qemu_io(&uri, &["write -P 0x43 0 1M", "flush"]);
    assert!(ok, "{o}");
    let (ok, out, err) = corral(&url, &["snapshot", "revert", "cli1", "snap1"]);
    assert!(ok, "{out}{err}");
    let (ok, o) = qemu_io(&uri, &["read -P 0x42 0 1M"]);
    assert!(ok, "after revert: {o}");
    // Expand while attached: the new end is writable.
    let (ok, out, err) = corral(&url, &["volume", "expand", "cli1", "--size", "32Mi"]);
    assert!(ok, "{out}{err}");
    let (ok, out, _) = corral(&url, &["volume", "get", "cli1", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(ok && v["size"] == 32 << 20, "{v}");
    let (ok, o) = qemu_io(&uri, &["write -P 0x44 30M 1M", "read -P 0x44 30M 1M"]);
    assert!(ok, "after expand: {o}");
    let (ok, out, err) = corral(&url, &["setting", "set", "replica-timeout", "10"]);
    assert!(ok, "{out}{err}");
    let (ok, out, _) = corral(&url, &["setting", "get", "replica-timeout"]);
    assert!(ok && out.trim() == "10", "{out}");
    let metrics = std::process::Command::new("curl")
        .args(["-sf", &format!("{url}/metrics")])
        .output()
        .unwrap();
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    assert!(metrics.contains("corral_manager_reconciles_total"), "{metrics}");
    assert!(
        metrics.contains("corral_manager_volumes{state=\"attached\"} 1"),
        "{metrics}"
    );
    let (ok, out, err) = corral(&url, &["volume", "detach", "cli1"]);
    assert!(ok && out.contains("detached"), "{out}{err}");
    // Detached, the snapshots the engine showed last are listed from the store.
    let (ok, out, err) = corral(&url, &["snapshot", "ls", "cli1", "--json"]);
    let snaps: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
    assert!(
        ok && snaps
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["name"] == "snap1")),
        "{out}{err}"
    );
}
