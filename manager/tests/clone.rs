//! Volume clone through the control plane (seed 002), with real manager, engine and replica processes and qemu-io
//! as the NBD client: clone of an attached volume (`vol://`), of a snapshot into a larger volume (`snap://`), of a
//! detached source (attached for the copy and detached again); a clone whose source replica is SIGKILLed while it
//! copies ends failed and is never served; the refusals (smaller, unknown source, attach or delete mid-copy).

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
        ok && out.contains("clone of vol://src (snapshot clone-c1): completed 100%"),
        "volume get shows the clone: {out}{err}"
    );
    let s = volume(&m, "src");
    assert!(
        s["state"] == "attached" && s["frontendDisabled"] == false,
        "the source stays as it was: {s}"
    );
    let taken = snapshots(&m, "src").into_iter().find(|s| s["name"] == "clone-c1");
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

    // 4. Refusals, each before anything is created.
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
