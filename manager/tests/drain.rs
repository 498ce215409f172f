//! Node drain and orphans on a 3-node cluster (managers on one etcd, real daemons): a drain under fio verify load
//! moves the replicas of two volumes to the free node, each rebuilt before the old one goes, never below the replica
//! count; refused with the volumes named when there is no room or an engine runs on the node. A manager SIGKILLed
//! while its replica is replaced and its engine re-attached elsewhere removes both (and the replica's data) when it
//! comes back, reports them, and keeps the replica of a detached volume the store still points at.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{qemu_io, wait_for};

fn get(url: &str, path: &str) -> Value {
    let (code, v) = rest("GET", &format!("{url}{path}"), None);
    assert_eq!(code, 200, "GET {path}: {v}");
    v
}

fn healthy(url: &str, name: &str) -> Value {
    wait_for(&format!("{name} healthy"), Duration::from_secs(120), || {
        let v = get(url, &format!("/v1/volumes/{name}"));
        let n = usize::try_from(v["numberOfReplicas"].as_u64().unwrap_or(0)).unwrap();
        (v["state"] == "attached" && v["robustness"] == "healthy" && rw_replicas(&v) == n).then_some(v)
    })
}

fn create_attached(url: &str, name: &str, replicas: u32, node: &str) -> Value {
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": name, "size": 32 << 20, "numberOfReplicas": replicas})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/{name}/attach"),
        Some(&json!({"nodeId": node})),
    );
    assert_eq!(code, 200, "{v}");
    healthy(url, name)
}

fn endpoint(v: &Value) -> String {
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find(|s| s.starts_with("nbd+unix"))
        .expect("unix endpoint")
        .to_owned()
}

fn set(url: &str, setting: &str, value: &str) {
    let (code, v) = rest(
        "PUT",
        &format!("{url}/v1/settings/{setting}"),
        Some(&json!({"value": value})),
    );
    assert_eq!(code, 200, "{v}");
}

/// fio jobs that each write 16 MiB at random and verify it (crc32c), one after the other until `stop`.
fn fio_verify_loop(uri: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(usize, Vec<String>)> {
    std::thread::spawn(move || {
        let (mut runs, mut failures) = (0, Vec::new());
        while !stop.load(Ordering::SeqCst) {
            let out = Command::new("fio")
                .args(["--name=drain", "--ioengine=nbd", &format!("--uri={uri}")])
                .args(["--rw=randwrite", "--bs=4k", "--iodepth=4", "--size=16M"])
                .args(["--verify=crc32c", "--verify_fatal=1", "--do_verify=1"])
                // fio writes a verify state file in its working directory: not in the source tree.
                .arg("--verify_state_save=0")
                .current_dir(std::env::temp_dir())
                .output()
                .expect("fio");
            runs += 1;
            if !out.status.success() {
                failures.push(format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        (runs, failures)
    })
}

#[test]
fn drain_rebuilds_two_volumes_on_the_free_node_under_fio_verify_never_below_their_count() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, ms) = start_cluster(dir.path(), 3);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 3);
    set(&url, "replica-soft-anti-affinity", "false");
    // node-2 takes nothing while the volumes are placed: their replicas go on node-0 and node-1.
    let out = ok(&url, &["node", "cordon", "node-2"]);
    assert!(out.contains("scheduling disabled"), "{out}");
    let va = create_attached(&url, "va", 2, "node-0");
    let vb = create_attached(&url, "vb", 2, "node-0");
    let both: BTreeSet<String> = ["node-0".into(), "node-1".into()].into();
    assert_eq!((replica_nodes(&va), replica_nodes(&vb)), (both.clone(), both));
    let (okk, out) = qemu_io(&endpoint(&vb), &["write -P 0xb1 0 8M", "flush"]);
    assert!(okk, "{out}");

    // No room: node-0 holds the volumes already, node-2 is cordoned, anti-affinity is hard. Nothing changes.
    let (code, v) = rest("POST", &format!("{url}/v1/nodes/node-1/drain"), None);
    assert_eq!(code, 409, "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("cannot drain node node-1")
            && msg.contains("va would be left with 1 of 2")
            && msg.contains("vb "),
        "{msg}"
    );
    let (okk, _, err) = corral(&url, &["node", "drain", "node-1"]);
    assert!(!okk && err.contains("va would be left"), "{err}");
    let n1 = get(&url, "/v1/nodes/node-1");
    assert_eq!(
        (n1["allowScheduling"].clone(), n1["drainState"].clone()),
        (json!(true), json!("none"))
    );
    // The engines run on node-0: drain moves replicas, not engines.
    let (code, v) = rest("POST", &format!("{url}/v1/nodes/node-0/drain"), None);
    assert_eq!(code, 409, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("va is attached on node-0"),
        "{v}"
    );

    ok(&url, &["node", "uncordon", "node-2"]);
    let stop = Arc::new(AtomicBool::new(false));
    let fio = fio_verify_loop(endpoint(&va), stop.clone());
    let cli_url = url.clone();
    let drain =
        std::thread::spawn(move || corral(&cli_url, &["node", "drain", "node-1", "--timeout", "300"]));
    // Sample both volumes while the drain runs: never fewer RW replicas than asked for, never degraded; the
    // replacement shows up next to the evicted replica (three at once) before the evicted one goes.
    let (mut min_rw, mut saw_three, mut saw_draining) = (usize::MAX, BTreeSet::new(), false);
    while !drain.is_finished() {
        for name in ["va", "vb"] {
            let v = get(&url, &format!("/v1/volumes/{name}"));
            min_rw = min_rw.min(rw_replicas(&v));
            assert_eq!(v["robustness"], "healthy", "{name} during the drain: {v}");
            if v["replicas"].as_array().unwrap().len() == 3 {
                saw_three.insert(name);
            }
        }
        let n1 = get(&url, "/v1/nodes/node-1");
        saw_draining |= n1["drainState"] == "draining" && n1["replicas"].as_u64().unwrap() > 0;
        std::thread::sleep(Duration::from_millis(150));
    }
    let (okk, out, err) = drain.join().unwrap();
    stop.store(true, Ordering::SeqCst);
    let (runs, failures) = fio.join().unwrap();
    assert!(okk, "corral node drain: {out}{err}");
    assert!(out.contains("drain drained, 0 replica(s)"), "{out}");
    assert!(
        err.contains("draining node-1: 2 replica(s) left"),
        "progress lines: {err}"
    );
    assert!(
        failures.is_empty(),
        "fio verify failed during the drain: {failures:?}"
    );
    assert!(runs >= 1);
    assert_eq!(min_rw, 2, "a volume fell below its 2 RW replicas");
    assert_eq!(
        saw_three.len(),
        2,
        "no replacement seen beside its evicted replica: {saw_three:?}"
    );
    assert!(saw_draining, "node-1 never showed draining with replicas left");

    let moved: BTreeSet<String> = ["node-0".into(), "node-2".into()].into();
    for name in ["va", "vb"] {
        let v = healthy(&url, name);
        assert_eq!(replica_nodes(&v), moved, "{name}: {v}");
    }
    let (okk, out) = qemu_io(&endpoint(&healthy(&url, "vb")), &["read -P 0xb1 0 8M"]);
    assert!(okk, "vb after the drain: {out}");
    let n1 = get(&url, "/v1/nodes/node-1");
    assert_eq!(
        (n1["drainState"].clone(), n1["replicas"].clone()),
        (json!("drained"), json!(0))
    );
    // The evicted replicas' data went with their documents.
    let replicas_dir = ms[1].data_dir.join("disks/default/replicas");
    wait_for("node-1's replica data removed", Duration::from_secs(30), || {
        (std::fs::read_dir(&replicas_dir).map_or(0, Iterator::count) == 0).then_some(())
    });
    let ls = ok(&url, &["node", "ls"]);
    assert!(
        ls.lines().any(|l| l.contains("node-1") && l.contains("drained")),
        "{ls}"
    );
    // Uncordon ends it: schedulable again.
    let out = ok(&url, &["node", "uncordon", "node-1", "--json"]);
    let n1: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (n1["allowScheduling"].clone(), n1["drainState"].clone()),
        (json!(true), json!("none"))
    );
}

/// A volume detached while a drain rebuilds its replacement has no engine to finish through: the drain waits, and
/// says so in the node's view (`drainBlocked`, shown by `corral node drain`) instead of hanging silently; the
/// evicted replica keeps the data. Attached again (here on node-0), its replacement is rebuilt and the drain ends.
#[test]
fn a_volume_detached_mid_drain_holds_the_drain_named_until_it_is_attached_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, ms) = start_cluster(dir.path(), 3);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 3);
    set(&url, "replica-soft-anti-affinity", "false");
    ok(&url, &["node", "cordon", "node-2"]);
    let v = create_attached(&url, "vd", 2, "node-0");
    let both: BTreeSet<String> = ["node-0".into(), "node-1".into()].into();
    assert_eq!(replica_nodes(&v), both);
    let (okk, out) = qemu_io(&endpoint(&v), &["write -P 0xd1 0 16M", "flush"]);
    assert!(okk, "{out}");
    // The replacement's rebuild moves 16 MiB at 1 MiB/s: it is still running when the volume is detached.
    set(&url, "rebuild-max-bytes-per-second", "1048576");
    ok(&url, &["node", "uncordon", "node-2"]);
    ok(&url, &["node", "drain", "node-1", "--no-wait"]);
    let placed = wait_for("the replacement placed", Duration::from_secs(60), || {
        let v = get(&url, "/v1/volumes/vd");
        (v["replicas"].as_array().unwrap().len() == 3).then_some(v)
    });
    assert_eq!(rw_replicas(&placed), 2, "the replacement is not RW yet: {placed}");
    ok(&url, &["volume", "detach", "vd"]);
    let n1 = wait_for("the drain shown blocked", Duration::from_secs(60), || {
        let n1 = get(&url, "/v1/nodes/node-1");
        (n1["drainBlocked"].as_array().is_some_and(|b| !b.is_empty())).then_some(n1)
    });
    assert_eq!(n1["drainState"], "draining", "{n1}");
    assert_eq!(
        n1["replicas"], 1,
        "the evicted replica stays while it cannot move: {n1}"
    );
    let why = n1["drainBlocked"][0].as_str().unwrap();
    assert!(
        why.contains("volume vd is detached") && why.contains("attached"),
        "{why}"
    );
    // Still blocked a while later: nothing moves a detached volume's replica.
    std::thread::sleep(Duration::from_secs(3));
    let n1 = get(&url, "/v1/nodes/node-1");
    assert_eq!(
        (n1["drainState"].clone(), n1["replicas"].clone()),
        (json!("draining"), json!(1))
    );

    set(&url, "rebuild-max-bytes-per-second", "0");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vd/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    wait_for("node-1 drained", Duration::from_secs(120), || {
        let n1 = get(&url, "/v1/nodes/node-1");
        (n1["drainState"] == "drained").then_some(())
    });
    let n1 = get(&url, "/v1/nodes/node-1");
    assert!(n1.get("drainBlocked").is_none(), "{n1}");
    let v = healthy(&url, "vd");
    let moved: BTreeSet<String> = ["node-0".into(), "node-2".into()].into();
    assert_eq!(replica_nodes(&v), moved, "{v}");
    let (okk, out) = qemu_io(&endpoint(&v), &["read -P 0xd1 0 16M"]);
    assert!(okk, "vd after the drain: {out}");
}

#[test]
fn a_returning_manager_removes_its_replaced_replica_and_moved_engine_but_keeps_what_the_store_uses() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, mut ms) = start_cluster(dir.path(), 3);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 3);
    set(&url, "replica-soft-anti-affinity", "false");
    set(&url, "node-down-timeout", "6");
    // va (attached on node-0) and vb (then detached) get a replica on node-1; vc runs its engine on node-1 with
    // its replicas on node-0 and node-2.
    ok(&url, &["node", "cordon", "node-2"]);
    let va = create_attached(&url, "va", 2, "node-0");
    let vb = create_attached(&url, "vb", 2, "node-0");
    let (okk, out) = qemu_io(&endpoint(&vb), &["write -P 0xb2 0 4M", "flush"]);
    assert!(okk, "{out}");
    ok(&url, &["volume", "detach", "vb"]);
    ok(&url, &["node", "uncordon", "node-2"]);
    ok(&url, &["node", "cordon", "node-1"]);
    let vc = create_attached(&url, "vc", 2, "node-1");
    ok(&url, &["node", "uncordon", "node-1"]);
    assert!(!replica_nodes(&vc).contains("node-1"), "{vc}");
    let on_node1 = |v: &Value| {
        v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["nodeId"] == "node-1")
            .cloned()
            .unwrap()
    };
    let stale = on_node1(&va);
    let stale_name = stale["name"].as_str().unwrap().to_owned();
    let stale_pid = stale["pid"].as_i64().unwrap();
    let stale_path = stale["dataPath"].as_str().unwrap().to_owned();
    let kept = on_node1(&get(&url, "/v1/volumes/vb"));
    let kept_path = kept["dataPath"].as_str().unwrap().to_owned();
    let engine_pid = vc["engine"]["pid"].as_i64().unwrap();

    // node-1's manager dies; its daemons keep running. va's replica there is replaced, vc attached on node-0.
    ms[1].kill();
    let va = wait_for("va's node-1 replica replaced", Duration::from_secs(120), || {
        let v = get(&url, "/v1/volumes/va");
        (!replica_nodes(&v).contains("node-1") && rw_replicas(&v) == 2 && v["robustness"] == "healthy")
            .then_some(v)
    });
    let (okk, out) = qemu_io(&endpoint(&va), &["write -P 0xa2 0 4M", "flush"]);
    assert!(okk, "{out}");
    wait_for("vc attachable on node-0", Duration::from_secs(60), || {
        let (code, _) = rest(
            "POST",
            &format!("{url}/v1/volumes/vc/attach"),
            Some(&json!({"nodeId": "node-0"})),
        );
        (code == 200).then_some(())
    });
    let vc = wait_for("vc attached on node-0", Duration::from_secs(120), || {
        let v = get(&url, "/v1/volumes/vc");
        (v["state"] == "attached" && v["currentNodeId"] == "node-0").then_some(v)
    });
    assert_ne!(vc["engine"]["pid"].as_i64(), Some(engine_pid));
    // The orphans exist: nobody stopped them while node-1's manager was away.
    assert!(pid_alive(stale_pid) && pid_alive(engine_pid));
    assert!(Path::new(&stale_path).is_dir());

    ms[1].restart();
    let removed = wait_for("node-1 reports its orphans", Duration::from_secs(90), || {
        let n = get(&url, "/v1/nodes/node-1");
        let r = n["orphansRemoved"].as_array().cloned().unwrap_or_default();
        let has = |kind: &str, name: &str| r.iter().any(|o| o["kind"] == kind && o["name"] == name);
        (has("replica-process", &stale_name)
            && has("replica-data", &stale_name)
            && has("engine-process", "vc"))
        .then_some(r)
    });
    assert_eq!(removed.len(), 3, "only the three orphans: {removed:?}");
    assert!(!pid_alive(stale_pid), "the stale replica process still runs");
    assert!(!pid_alive(engine_pid), "the moved engine still runs on node-1");
    assert!(!Path::new(&stale_path).exists(), "{stale_path} is still there");
    assert!(
        ms[1].log().contains("removed orphan"),
        "no warn line in node-1's log"
    );
    let shown = ok(&url, &["node", "get", "node-1"]);
    assert!(
        shown.contains("orphansRemoved") && shown.contains(&stale_name),
        "{shown}"
    );
    // What the store still points at stays: vb's replica on node-1, which serves vb again.
    assert!(Path::new(&kept_path).is_dir(), "{kept_path} was removed");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vb/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let vb = healthy(&url, "vb");
    assert!(replica_nodes(&vb).contains("node-1"), "{vb}");
    let (okk, out) = qemu_io(&endpoint(&vb), &["read -P 0xb2 0 4M"]);
    assert!(okk, "vb after node-1 came back: {out}");
    let (okk, out) = qemu_io(&endpoint(&vc), &["read -P 0 0 4M"]);
    assert!(okk, "vc on node-0: {out}");
}
