//! Issue 39 through the manager: every start of a volume's engine takes a new generation from the store, the
//! replicas record it, a stale engine started by hand with an older generation over the manager's replica cannot
//! write, and the manager's own engine, once fenced by a newer one, is stopped, the event shown, and restarted above
//! it. One node on the embedded store, real replica and engine processes, qemu-io as the NBD client.

mod support;

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{DaemonCommand, qemu_io, wait_for, workspace_bin};

const SIZE: u64 = 16 << 20;

/// The generation a v1 replica recorded (`engine.generation` in its directory; 0: none).
fn recorded_generation(v: &Value) -> u64 {
    let dir = v["replicas"][0]["dataPath"].as_str().expect("replica data path");
    let Ok(text) = std::fs::read_to_string(Path::new(dir).join("engine.generation")) else {
        return 0;
    };
    serde_json::from_str::<Value>(&text).expect("generation record")["generation"]
        .as_u64()
        .expect("generation number")
}

fn attach_healthy(m: &Manager, name: &str) -> Value {
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/{name}/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    wait_healthy(m, name, 1, Duration::from_secs(60))
}

fn detach(m: &Manager, name: &str) {
    let engine_pid = volume(m, name)["engine"]["pid"].as_i64().expect("engine pid");
    let (code, v) = rest("POST", &format!("{}/v1/volumes/{name}/detach", m.url), None);
    assert_eq!(code, 200, "{v}");
    wait_for("detached, engine stopped", Duration::from_secs(30), || {
        (volume(m, name)["state"] == "detached" && !pid_alive(engine_pid)).then_some(())
    });
}

/// A `corral-engine` started by hand over the volume's replica, as an operator (or a stale node) would: with the
/// node's certificate (`tls`, the manager's node directory), which the replica requires.
fn engine_by_hand(dir: &Path, tls: &Path, label: &str, replica: &str, generation: u64) -> DaemonCommand {
    DaemonCommand::new(workspace_bin("corral-engine"))
        .label(label)
        .env("CORRAL_TLS_DIR", tls)
        .args(["serve", "--volume", "vol", "--size", &SIZE.to_string()])
        .args(["--listen", "127.0.0.1:0", "--replica", replica])
        .arg("--nbd-listen")
        .arg(format!("unix:{}", dir.join(format!("{label}.sock")).display()))
        .args(["--generation", &generation.to_string()])
}

#[test]
fn each_attach_takes_a_higher_generation_and_a_stale_engine_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol", "size": SIZE, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["engineGeneration"], 0, "no engine started yet: {v}");

    let v = attach_healthy(&m, "vol");
    let g1 = v["engineGeneration"].as_u64().unwrap();
    assert!(g1 >= 1, "{v}");
    assert_eq!(v["engine"]["generation"], g1, "{v}");
    assert_eq!(
        recorded_generation(&v),
        g1,
        "the replica records the engine's generation"
    );
    let (ok, out) = qemu_io(&unix_endpoint(&v), &["write -P 0x11 0 64k", "flush"]);
    assert!(ok, "{out}");

    detach(&m, "vol");
    assert_eq!(volume(&m, "vol")["engineGeneration"], g1, "kept while detached");
    let v = attach_healthy(&m, "vol");
    let g2 = v["engineGeneration"].as_u64().unwrap();
    assert!(
        g2 > g1,
        "a second attach takes a higher generation: {g2} after {g1}"
    );
    assert_eq!(v["engine"]["generation"], g2, "{v}");
    assert_eq!(recorded_generation(&v), g2);
    let uri = unix_endpoint(&v);
    let replica = v["replicas"][0]["address"].as_str().unwrap().to_owned();

    // The engine of the first attach, started again by hand over the manager's replica: refused, naming both
    // numbers; whatever it serves, it writes nothing.
    let stale = engine_by_hand(dir.path(), &m.tls_dir(), "stale", &replica, g1).try_spawn();
    let wanted = format!("fenced by generation {g2} > {g1}");
    match stale {
        Err(e) => assert!(e.to_string().contains(&wanted), "the stale engine's refusal: {e}"),
        Ok(mut e) => {
            let sock = dir.path().join("stale.sock");
            let (ok, out) = qemu_io(
                &format!("nbd+unix:///vol?socket={}", sock.display()),
                &["write -P 0x33 0 64k", "flush"],
            );
            assert!(!ok, "the stale engine's write was acknowledged: {out}");
            assert!(e.log_text().contains(&wanted), "{}", e.log_text());
            e.kill();
        }
    }
    let (ok, out) = qemu_io(&uri, &["read -P 0x11 0 64k", "write -P 0x22 64k 64k", "flush"]);
    assert!(ok, "the manager's engine keeps serving the volume: {out}");
    assert_eq!(recorded_generation(&volume(&m, "vol")), g2);

    // A newer engine by hand fences the manager's: its next write fails, the manager stops it, says so, and starts
    // the volume's engine again above the generation that fenced it.
    let mut newer = engine_by_hand(dir.path(), &m.tls_dir(), "newer", &replica, g2 + 1).spawn();
    let (ok, out) = qemu_io(&uri, &["write -P 0x44 0 64k", "flush"]);
    assert!(!ok, "the fenced manager's engine acknowledged a write: {out}");
    let fenced = format!("fenced by generation {} > {g2}", g2 + 1);
    wait_for(
        "the manager to stop its fenced engine",
        Duration::from_secs(30),
        || {
            let v = volume(&m, "vol");
            v["engine"]["lastFenced"]
                .as_str()
                .is_some_and(|s| s.contains(&fenced))
                .then_some(())
        },
    );
    newer.kill();
    assert!(
        m.log()
            .contains("engine fenced by a newer generation: stopping it"),
        "the manager logs the fence"
    );
    let v = wait_for("the volume's engine back", Duration::from_secs(60), || {
        let v = volume(&m, "vol");
        (v["state"] == "attached"
            && v["robustness"] == "healthy"
            && v["engine"]["generation"].as_u64().is_some_and(|g| g > g2 + 1))
        .then_some(v)
    });
    assert_eq!(
        recorded_generation(&v),
        v["engine"]["generation"].as_u64().unwrap()
    );
    let (ok, out) = qemu_io(
        &unix_endpoint(&v),
        &["read -P 0x11 0 64k", "read -P 0x22 64k 64k"],
    );
    assert!(ok, "the data before the fence: {out}");

    // Deleting the volume deletes its generation document: a new volume of that name starts from 1.
    detach(&m, "vol");
    let (code, e) = rest("DELETE", &format!("{}/v1/volumes/vol", m.url), None);
    assert_eq!(code, 204, "{e}");
    let replicas = m.data_dir.join("disks/default/replicas");
    wait_for("the volume's replicas removed", Duration::from_secs(30), || {
        std::fs::read_dir(&replicas)
            .map_or(true, |mut d| d.next().is_none())
            .then_some(())
    });
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol", "size": SIZE, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "{v}");
    let v = wait_for("the generation forgotten", Duration::from_secs(30), || {
        let v = volume(&m, "vol");
        (v["engineGeneration"] == 0).then_some(v)
    });
    assert_eq!(v["engineGeneration"], 0);
}
