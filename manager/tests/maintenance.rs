//! Maintenance mode (attach without a frontend) and the revert of a detached volume through it, with real replica
//! and engine processes and qemu-io as the NBD client.

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;
use testkit::{qemu_io, wait_for};

#[test]
fn a_detached_volume_reverts_through_maintenance_mode_and_serves_the_snapshot_data() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let (ok, out, err) = corral(
        &url,
        &["volume", "create", "mv1", "--size", "16Mi", "--replicas", "2"],
    );
    assert!(ok, "{out}{err}");
    let (ok, out, err) = corral(&url, &["volume", "attach", "mv1", "--timeout", "60"]);
    assert!(ok, "{out}{err}");
    let uri = out
        .lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .expect("attach prints the NBD URI")
        .to_owned();
    let (ok, o) = qemu_io(&uri, &["write -P 0x11 0 1M", "write -P 0x12 2M 1M", "flush"]);
    assert!(ok, "{o}");
    let (ok, out, err) = corral(&url, &["snapshot", "create", "mv1", "s1"]);
    assert!(ok, "{out}{err}");
    let (ok, o) = qemu_io(&uri, &["write -P 0x22 0 1M", "write -P 0x23 4M 1M", "flush"]);
    assert!(ok, "{o}");
    let (ok, out, err) = corral(&url, &["volume", "detach", "mv1"]);
    assert!(ok && out.contains("detached"), "{out}{err}");

    // A snapshot the volume never had is refused before anything is attached.
    let (ok, out, err) = corral(&url, &["snapshot", "revert", "mv1", "nope"]);
    assert!(
        !ok && err.contains("no snapshot") && err.contains("404"),
        "{out}{err}"
    );
    assert_eq!(volume(&m, "mv1")["state"], "detached");

    // The revert of the detached volume attaches it without a frontend, reverts, and detaches again.
    let (ok, out, err) = corral(&url, &["snapshot", "revert", "mv1", "s1"]);
    assert!(ok && out.contains("reverted to s1"), "{out}{err}");
    let v = volume(&m, "mv1");
    assert_eq!(v["state"], "detached", "{v}");
    assert!(v["nodeId"].is_null() && v["disableFrontend"] == false, "{v}");
    assert!(
        m.log().contains("attached for maintenance"),
        "the revert never ran through a maintenance attach: {}",
        m.log()
    );

    // Maintenance mode by hand: the engine runs, the state says so, nothing serves IO, a normal attach is refused.
    let (ok, out, err) = corral(
        &url,
        &["volume", "attach", "mv1", "--maintenance", "--timeout", "60"],
    );
    assert!(ok && out.contains("maintenance"), "{out}{err}");
    let v = volume(&m, "mv1");
    assert!(
        v["state"] == "attached" && v["frontendDisabled"] == true && v["endpoints"] == json!([]),
        "{v}"
    );
    assert!(v["engine"]["pid"].as_i64().is_some_and(pid_alive), "{v}");
    let (ok, out, _) = corral(&url, &["volume", "ls"]);
    assert!(ok && out.contains("attached (maintenance)"), "{out}");
    let sock = m.data_dir.join("sockets/mv1.sock");
    assert!(!sock.exists(), "no NBD socket in maintenance mode");
    let (ok, o) = qemu_io(&uri, &["read 0 4k"]);
    assert!(!ok, "IO reached a volume in maintenance mode: {o}");
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/mv1/attach"), Some(&json!({})));
    assert!(
        code == 409 && e["code"] == "conflict" && e["message"].as_str().unwrap().contains("maintenance"),
        "{code} {e}"
    );
    let (ok, out, err) = corral(&url, &["volume", "detach", "mv1"]);
    assert!(ok, "{out}{err}");

    // Attached with a frontend again: the snapshot's data, and nothing written after it.
    let (ok, out, err) = corral(&url, &["volume", "attach", "mv1", "--timeout", "60"]);
    assert!(ok, "{out}{err}");
    let v = volume(&m, "mv1");
    assert_eq!(v["frontendDisabled"], false, "{v}");
    let (ok, o) = qemu_io(
        &unix_endpoint(&v),
        &["read -P 0x11 0 1M", "read -P 0x12 2M 1M", "read -P 0 4M 1M"],
    );
    assert!(ok, "after the revert of the detached volume: {o}");
    wait_for("the volume healthy", Duration::from_secs(60), || {
        (volume(&m, "mv1")["robustness"] == "healthy").then_some(())
    });
}
