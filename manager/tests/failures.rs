//! Failures on one node: the manager SIGKILLed under fio load (IO goes on, daemons re-adopted, none restarted);
//! every replica SIGKILLed while writing with the revision counter disabled (salvage brings the volume back with
//! every flushed write).

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{qemu_io, wait_for};

fn create_and_attach(m: &Manager, name: &str, body: &Value) -> Value {
    let (code, v) = rest("POST", &format!("{}/v1/volumes", m.url), Some(body));
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/{name}/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    wait_healthy(m, name)
}

fn wait_healthy(m: &Manager, name: &str) -> Value {
    wait_for(
        &format!("{name} attached and healthy"),
        Duration::from_secs(90),
        || {
            let v = volume(m, name);
            let n = v["numberOfReplicas"].as_u64().unwrap_or(0);
            let rw = v["replicas"]
                .as_array()
                .map_or(0, |rs| rs.iter().filter(|r| r["mode"] == "RW").count());
            (v["state"] == "attached" && v["robustness"] == "healthy" && rw as u64 == n).then_some(v)
        },
    )
}

fn endpoint(v: &Value, prefix: &str) -> String {
    v["endpoints"]
        .as_array()
        .and_then(|e| e.iter().filter_map(Value::as_str).find(|s| s.starts_with(prefix)))
        .expect("endpoint")
        .to_owned()
}

fn daemon_pids(v: &Value) -> (i64, Vec<i64>) {
    let e = v["engine"]["pid"].as_i64().expect("engine pid");
    let mut r: Vec<i64> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["pid"].as_i64())
        .collect();
    r.sort_unstable();
    (e, r)
}

#[test]
fn a_manager_sigkill_under_fio_load_interrupts_no_io_and_the_daemons_are_readopted() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let v = create_and_attach(
        &m,
        "load",
        &json!({"name": "load", "size": 32 << 20, "numberOfReplicas": 2}),
    );
    let (engine, replicas) = daemon_pids(&v);
    let uri = endpoint(&v, "nbd+unix");
    let fio = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bs=4k",
        ])
        .args([
            "--iodepth=8",
            "--size=16M",
            "--time_based",
            "--runtime=12",
            "--output-format=terse",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio");
    std::thread::sleep(Duration::from_secs(2));
    m.kill();
    std::thread::sleep(Duration::from_secs(1));
    assert!(pid_alive(engine), "the engine died with the manager");
    m.restart();
    // Give the restarted manager several reconcile rounds: it must adopt, not restart.
    std::thread::sleep(Duration::from_secs(6));
    let out = fio.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio failed across the manager restart: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v = wait_healthy(&m, "load");
    assert_eq!(
        daemon_pids(&v),
        (engine, replicas),
        "daemons were restarted instead of re-adopted"
    );
    assert_eq!(v["engine"]["restarts"], 0);
}

#[test]
fn every_replica_killed_while_writing_without_revision_counter_is_salvaged_with_flushed_writes_intact() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(1));
    let v = create_and_attach(
        &m,
        "salv",
        &json!({"name": "salv", "size": 32 << 20, "numberOfReplicas": 3, "disableRevisionCounter": true}),
    );
    assert_eq!(v["revisionCounterDisabled"], true);
    let (engine, replicas) = daemon_pids(&v);
    let uri = endpoint(&v, "nbd+unix");
    let (ok, out) = qemu_io(&uri, &["write -P 0x5a 0 8M", "flush"]);
    assert!(ok, "{out}");
    // A writer that is still going when every replica dies.
    let mut writer = Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .args([
            "-c",
            "write -P 0x77 8M 16M",
            "-c",
            "write -P 0x78 8M 16M",
            "-c",
            "write -P 0x79 8M 16M",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    for p in &replicas {
        sigkill(*p);
    }
    let _ = writer.wait();
    let v = wait_for("salvaged and healthy", Duration::from_secs(120), || {
        let v = volume(&m, "salv");
        let rw = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["mode"] == "RW")
            .count();
        let e = v["engine"]["pid"].as_i64();
        (v["state"] == "attached"
            && v["robustness"] == "healthy"
            && rw == 3
            && e.is_some()
            && e != Some(engine))
        .then_some(v)
    });
    let (ok, out) = qemu_io(&endpoint(&v, "nbd+unix"), &["read -P 0x5a 0 8M"]);
    assert!(ok, "flushed data lost by the salvage: {out}");
    let log = m.log();
    assert!(
        log.contains("restarting the engine to salvage"),
        "the engine was not restarted with --salvage-requested:\n{log}"
    );
}
