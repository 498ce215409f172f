//! Several managers ("nodes": separate data directories and ports) sharing one etcd: bad input refused with 4xx
//! and nothing half-created; a 4-node cluster that loses a replica process and then a whole node; a store outage
//! longer than the node-down timeout that must fail no replica.

mod support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{qemu_io, wait_for};

fn volume(url: &str, name: &str) -> Value {
    let (code, v) = rest("GET", &format!("{url}/v1/volumes/{name}"), None);
    assert_eq!(code, 200, "{v}");
    v
}

fn wait_healthy(url: &str, name: &str, timeout: Duration) -> Value {
    wait_for(&format!("{name} attached and healthy"), timeout, || {
        let v = volume(url, name);
        let n = v["numberOfReplicas"].as_u64().unwrap_or(0);
        let rw = v["replicas"]
            .as_array()
            .map_or(0, |rs| rs.iter().filter(|r| r["mode"] == "RW").count());
        (v["state"] == "attached" && v["robustness"] == "healthy" && rw as u64 == n).then_some(v)
    })
}

fn endpoint(v: &Value) -> String {
    v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .filter_map(Value::as_str)
                .find(|s| s.starts_with("nbd+unix"))
        })
        .expect("unix endpoint")
        .to_owned()
}

fn expect_4xx(method: &str, url: &str, body: Option<&Value>, status: u16, words: &str) {
    let (code, v) = rest(method, url, body);
    assert_eq!(code, status, "{method} {url} {body:?}: {v}");
    let msg = v["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(words),
        "{method} {url}: message {msg:?} lacks {words:?}"
    );
    assert!(v["code"].is_string(), "{v}");
}

#[test]
fn bad_input_is_refused_with_4xx_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, ms) = start_cluster(dir.path(), 2);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 2);

    // The OpenAPI document lists every route the server registers.
    let (code, doc) = rest("GET", &format!("{url}/v1/openapi.json"), None);
    assert_eq!(code, 200);
    for (path, method, _) in manager::server::routes::routes().documented {
        // Each setting is described at its own path: each takes its own kind of value.
        let paths: Vec<String> = if path == "/v1/settings/{setting}" {
            manager::model::SETTINGS
                .iter()
                .map(|s| format!("/v1/settings/{}", s.0))
                .collect()
        } else {
            vec![path.to_owned()]
        };
        for p in paths {
            assert!(
                doc["paths"][&p][method].is_object(),
                "{method} {p} missing from openapi.json"
            );
        }
    }

    let vols = format!("{url}/v1/volumes");
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "v", "size": 1000})),
        400,
        "multiple of 4096",
    );
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "../etc", "size": 4096})),
        400,
        "not a valid name",
    );
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "a/b", "size": 4096})),
        400,
        "not a valid name",
    );
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "v", "size": 4096, "numberOfReplicas": 0})),
        400,
        "numberOfReplicas",
    );
    expect_4xx("GET", &format!("{vols}/nope"), None, 404, "not found");
    expect_4xx(
        "POST",
        &format!("{vols}/nope/attach"),
        Some(&json!({})),
        404,
        "not found",
    );
    expect_4xx(
        "PUT",
        &format!("{url}/v1/settings/replica-soft-anti-affinity"),
        Some(&json!({"value": "maybe"})),
        400,
        "true or false",
    );
    expect_4xx(
        "POST",
        &format!("{url}/v1/nodes/node-0/disks"),
        Some(&json!({"name": "d2", "path": "rel/dir"})),
        400,
        "absolute",
    );
    let (code, _) = rest(
        "PUT",
        &format!("{url}/v1/settings/replica-soft-anti-affinity"),
        Some(&json!({"value": "false"})),
    );
    assert_eq!(code, 200);
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "three", "size": 1 << 20, "numberOfReplicas": 3})),
        409,
        "anti-affinity",
    );
    rest(
        "PUT",
        &format!("{url}/v1/settings/replica-soft-anti-affinity"),
        Some(&json!({"value": "true"})),
    );

    // Attached on one node, an attach to another is refused.
    let (code, v) = rest(
        "POST",
        &vols,
        Some(&json!({"name": "ok", "size": 8 << 20, "numberOfReplicas": 1})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{vols}/ok/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    expect_4xx(
        "POST",
        &format!("{vols}/ok/attach"),
        Some(&json!({"nodeId": "node-1"})),
        409,
        "detach it first",
    );
    expect_4xx(
        "POST",
        &format!("{vols}/ok/attach"),
        Some(&json!({"nodeId": "ghost"})),
        409,
        "no such node",
    );
    expect_4xx(
        "POST",
        &vols,
        Some(&json!({"name": "ok", "size": 8 << 20})),
        409,
        "already exists",
    );
    expect_4xx(
        "POST",
        &format!("{vols}/ok/expand"),
        Some(&json!({"size": 12345})),
        400,
        "multiple of 4096",
    );

    // The CLI reports the same refusals and exits non-zero.
    let cli = |args: &[&str]| {
        let out = cli_command_for(&url)
            .args(["--url", &url])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = cli(&["volume", "create", "bad", "--size", "1000"]);
    assert!(!ok && err.contains("multiple of 4096"), "{err}");
    let (ok, err) = cli(&["volume", "get", "nope"]);
    assert!(!ok && err.contains("not found"), "{err}");
    let (ok, err) = cli(&["volume", "create", "..", "--size", "1Mi"]);
    assert!(!ok && err.contains("not a valid name"), "{err}");

    // Nothing half-created: one volume, and replicas only for it.
    let (_, all) = rest("GET", &vols, None);
    let names: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["ok"]);
    wait_healthy(&url, "ok", Duration::from_secs(60));
    let (_, reps) = rest("GET", &format!("{url}/v1/replicas"), None);
    assert!(
        reps.as_array().unwrap().iter().all(|r| r["volume"] == "ok"),
        "{reps}"
    );
}

#[test]
fn a_four_node_cluster_heals_a_killed_replica_and_survives_losing_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, mut ms) = start_cluster(dir.path(), 4);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 4);
    let (code, _) = rest(
        "PUT",
        &format!("{url}/v1/settings/node-down-timeout"),
        Some(&json!({"value": "6"})),
    );
    assert_eq!(code, 200);
    // Replicas on distinct nodes: a node may hold at most one replica of a volume.
    rest(
        "PUT",
        &format!("{url}/v1/settings/replica-soft-anti-affinity"),
        Some(&json!({"value": "false"})),
    );
    for name in ["va", "vb"] {
        let (code, v) = rest(
            "POST",
            &format!("{url}/v1/volumes"),
            Some(&json!({"name": name, "size": 16 << 20, "numberOfReplicas": 3})),
        );
        assert_eq!(code, 201, "{v}");
    }
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/va/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let va = wait_healthy(&url, "va", Duration::from_secs(90));
    let va_nodes = replica_nodes(&va);
    assert_eq!(va_nodes.len(), 3, "replicas share a node: {va}");
    // The node to lose holds a replica of va and will run vb's engine.
    let victim = va_nodes.iter().find(|n| *n != "node-0").unwrap().clone();
    let vi: usize = victim.trim_start_matches("node-").parse().unwrap();
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vb/attach"),
        Some(&json!({"nodeId": victim})),
    );
    assert_eq!(code, 200, "{v}");
    let vb = wait_healthy(&url, "vb", Duration::from_secs(90));
    let (ok, out) = qemu_io(&endpoint(&va), &["write -P 0xa1 0 4M", "flush"]);
    assert!(ok, "{out}");
    let (ok, out) = qemu_io(&endpoint(&vb), &["write -P 0xb1 0 4M", "flush"]);
    assert!(ok, "{out}");

    // 1. SIGKILL one replica process of va (not the victim's): degraded, replaced, rebuilt, healthy, data intact.
    let r0 = va["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["nodeId"] != victim.as_str())
        .unwrap()
        .clone();
    let r0 = &r0;
    sigkill(r0["pid"].as_i64().unwrap());
    let (ok, out) = qemu_io(&endpoint(&va), &["write -P 0xa2 4M 4M", "flush"]);
    assert!(ok, "{out}");
    let mut saw_degraded = false;
    let va = wait_for("va replaced its killed replica", Duration::from_secs(90), || {
        let v = volume(&url, "va");
        saw_degraded |= v["robustness"] == "degraded";
        let rw = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["mode"] == "RW")
            .count();
        let replaced = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["name"] != r0["name"]);
        (replaced && rw == 3 && v["robustness"] == "healthy").then_some(v)
    });
    assert!(
        saw_degraded,
        "va never reported degraded while a replica was missing"
    );
    let (ok, out) = qemu_io(&endpoint(&va), &["read -P 0xa1 0 4M", "read -P 0xa2 4M 4M"]);
    assert!(ok, "{out}");

    // 2. Lose the victim node entirely (manager and every daemon it started).
    assert!(replica_nodes(&va).contains(&victim));
    ms[vi].kill_node();
    let survivor = if vi == 0 { &ms[1] } else { &ms[0] };
    {
        let v = wait_for(
            "va rebuilt on the remaining nodes",
            Duration::from_secs(120),
            || {
                let v = volume(&survivor.url, "va");
                let ok = v["state"] == "attached"
                    && v["robustness"] == "healthy"
                    && !replica_nodes(&v).contains(&victim)
                    && v["replicas"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|r| r["mode"] == "RW")
                        .count()
                        == 3;
                ok.then_some(v)
            },
        );
        assert_eq!(replica_nodes(&v).len(), 3);
    }
    let va = volume(&survivor.url, "va");
    assert_eq!(va["state"], "attached");
    let (ok, out) = qemu_io(&endpoint(&va), &["read -P 0xa1 0 4M", "read -P 0xa2 4M 4M"]);
    assert!(ok, "va after losing {victim}: {out}");

    // vb's engine died with its node: attach it on a live node; its data is there.
    let target = if vi == 0 { "node-1" } else { "node-0" };
    let v = wait_for("vb attachable elsewhere", Duration::from_secs(60), || {
        let (code, v) = rest(
            "POST",
            &format!("{}/v1/volumes/vb/attach", survivor.url),
            Some(&json!({"nodeId": target})),
        );
        (code == 200).then_some(v)
    });
    assert_eq!(v["nodeId"], target);
    let vb = wait_for("vb attached on the new node", Duration::from_secs(120), || {
        let v = volume(&survivor.url, "vb");
        (v["state"] == "attached"
            && v["currentNodeId"] == target
            && !v["endpoints"].as_array().unwrap().is_empty())
        .then_some(v)
    });
    let (ok, out) = qemu_io(&endpoint(&vb), &["read -P 0xb1 0 4M"]);
    assert!(ok, "vb after moving off {victim}: {out}");
    let vb = wait_healthy(&survivor.url, "vb", Duration::from_secs(120));
    assert!(!replica_nodes(&vb).contains(&victim));
}

/// Seen in the compose cluster test: once etcd had a quorum again after an outage longer than the node-down
/// timeout, every node's heartbeat was that old at once; the new leader's failure detector took all three nodes
/// for down and failed every replica of the attached volume, the volume controller deleted them (their data with
/// them) and scheduled three empty ones, and the engine, restarted on those, served zeros.
#[test]
fn a_store_outage_longer_than_the_node_down_timeout_fails_no_replica_and_loses_no_data() {
    let dir = tempfile::tempdir().unwrap();
    let (etcd, ms) = start_cluster(dir.path(), 3);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 3);
    let (code, v) = rest(
        "PUT",
        &format!("{url}/v1/settings/node-down-timeout"),
        Some(&json!({"value": "4"})),
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": "vo", "size": 16 << 20, "numberOfReplicas": 3})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vo/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&url, "vo", Duration::from_secs(90));
    let names = |v: &Value| -> BTreeSet<String> {
        v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let before = names(&v);
    let uri = endpoint(&v);
    let (ok, out) = qemu_io(&uri, &["write -P 0xa1 0 4M", "flush"]);
    assert!(ok, "{out}");

    // The store goes away (requests hang, as without a quorum) for longer than the node-down timeout: the
    // managers' own requests time out (10 s) meanwhile, and the attached volume keeps serving IO.
    let pid = etcd.daemon.pid().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let (code, v) = rest("GET", &format!("{url}/v1/volumes/vo"), None);
    assert!(
        code == 503
            && v["message"]
                .as_str()
                .is_some_and(|m| m.contains("etcd did not answer")),
        "the store was away, yet: {code} {v}"
    );
    let (ok, out) = qemu_io(&uri, &["write -P 0xa2 4M 4M", "flush"]);
    assert!(ok, "IO during the store outage: {out}");
    assert!(
        Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );

    // Back: the nodes write their heartbeats again, and for well over the timeout no replica is failed.
    wait_nodes_ready(&ms[0], 3);
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(15) {
        let (code, v) = rest("GET", &format!("{url}/v1/volumes/vo"), None);
        assert_eq!(code, 200, "{v}");
        assert_eq!(
            names(&v),
            before,
            "a replica was replaced after the store came back: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let v = wait_healthy(&url, "vo", Duration::from_secs(30));
    assert_eq!(names(&v), before, "{v}");
    let (ok, out) = qemu_io(&endpoint(&v), &["read -P 0xa1 0 4M", "read -P 0xa2 4M 4M"]);
    assert!(ok, "data after the store outage: {out}");
}

/// `data` through the `base64` tool (etcd's JSON gateway speaks base64 keys and values).
fn base64(data: &[u8], decode: bool) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("base64")
        .args(if decode { &["-d"][..] } else { &["-w0"][..] })
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("base64");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

/// Sets `spec.failedAt` of replica documents `names` straight in etcd, in one transaction (as a controller bug
/// would, all at once).
fn fail_in_store(etcd: &str, names: &BTreeSet<String>) {
    let puts: Vec<Value> = names
        .iter()
        .map(|name| {
            let key = String::from_utf8(base64(format!("/corral/replica/{name}").as_bytes(), false)).unwrap();
            // etcd's JSON gateway takes no Corral token (it refuses any Authorization it did not issue).
            let (code, v) = rest_as(
                None,
                "POST",
                &format!("http://{etcd}/v3/kv/range"),
                Some(&json!({"key": key})),
            );
            assert_eq!(code, 200, "{v}");
            let value = v["kvs"][0]["value"].as_str().expect("the replica document");
            let mut doc: Value = serde_json::from_slice(&base64(value.as_bytes(), true)).unwrap();
            doc["spec"]["failedAt"] = json!(1_764_028_800);
            let value = String::from_utf8(base64(doc.to_string().as_bytes(), false)).unwrap();
            json!({"requestPut": {"key": key, "value": value}})
        })
        .collect();
    let (code, v) = rest_as(
        None,
        "POST",
        &format!("http://{etcd}/v3/kv/txn"),
        Some(&json!({"success": puts})),
    );
    assert_eq!(code, 200, "{v}");
}

#[test]
fn replicas_holding_the_last_copies_of_the_data_are_never_deleted_and_a_salvage_brings_them_back() {
    let dir = tempfile::tempdir().unwrap();
    let (etcd, ms) = start_cluster(dir.path(), 2);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 2);
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": "vl", "size": 16 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vl/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&url, "vl", Duration::from_secs(90));
    let names: BTreeSet<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    let (ok, out) = qemu_io(&endpoint(&v), &["write -P 0xc7 0 8M", "flush"]);
    assert!(ok, "{out}");

    // Every replica holding the data is failed at once (as the store outage read as every node down did).
    fail_in_store(&etcd.endpoint(), &names);
    let v = wait_for("the volume faulted", Duration::from_secs(30), || {
        let v = volume(&url, "vl");
        (v["robustness"] == "faulted"
            && v["message"]
                .as_str()
                .is_some_and(|m| m.contains("kept for a salvage"))
            && v["endpoints"].as_array().is_some_and(Vec::is_empty))
        .then_some(v)
    });
    // Nothing deleted, nothing new scheduled: watched for several reconcile rounds.
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(8) {
        let v = volume(&url, "vl");
        let now: BTreeSet<String> = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(now, names, "the last copies were replaced: {v}");
        assert!(
            v["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["failed"] == true),
            "{v}"
        );
        std::thread::sleep(Duration::from_millis(400));
    }
    assert!(v["engine"].is_null() || v["engine"]["state"] != "running", "{v}");

    // The salvage brings the same replicas back, with the data.
    let (ok, out, err) = corral(&url, &["volume", "salvage", "vl"]);
    assert!(ok, "{out}{err}");
    let v = wait_healthy(&url, "vl", Duration::from_secs(60));
    let after: BTreeSet<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(after, names, "{v}");
    let (ok, out) = qemu_io(&endpoint(&v), &["read -P 0xc7 0 8M"]);
    assert!(ok, "data after the salvage: {out}");
}

#[test]
fn two_lost_replicas_rebuild_at_once_and_the_volume_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, ms) = start_cluster(dir.path(), 3);
    let url = ms[0].url.clone();
    wait_nodes_ready(&ms[0], 3);
    // Slow rebuilds, so that two running at once can be seen.
    let (code, v) = rest(
        "PUT",
        &format!("{url}/v1/settings/rebuild-max-bytes-per-second"),
        Some(&json!({"value": (4u64 << 20).to_string()})),
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(&json!({"name": "vr", "size": 32 << 20, "numberOfReplicas": 3})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{url}/v1/volumes/vr/attach"),
        Some(&json!({"nodeId": "node-0"})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&url, "vr", Duration::from_secs(90));
    let (ok, out) = qemu_io(&endpoint(&v), &["write -P 0x5e 0 24M", "flush"]);
    assert!(ok, "{out}");

    // Two of the three replicas die.
    let victims: Vec<i64> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["nodeId"] != "node-0")
        .map(|r| r["pid"].as_i64().expect("replica pid"))
        .collect();
    assert_eq!(victims.len(), 2, "{v}");
    for pid in &victims {
        sigkill(*pid);
    }
    // Both come back through rebuilds that run at the same time (4 MiB/s each: seconds, not instants).
    let both = wait_for("two replicas rebuilding at once", Duration::from_secs(60), || {
        let v = volume(&url, "vr");
        let wo = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["mode"] == "WO")
            .count();
        (wo == 2).then_some(v)
    });
    assert_eq!(rw_replicas(&both), 1, "{both}");
    // Writes during the rebuilds reach the rebuilding replicas too.
    let (ok, out) = qemu_io(&endpoint(&both), &["write -P 0x5f 24M 4M", "flush"]);
    assert!(ok, "{out}");
    let v = wait_healthy(&url, "vr", Duration::from_secs(90));
    // A replica rebuilt beside another holds the data alone: kill the other two, wait until the engine serves from
    // it alone (the only RW replica), and read everything back through it.
    let survivor = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["nodeId"] != "node-0")
        .and_then(|r| r["name"].as_str())
        .expect("a rebuilt replica")
        .to_owned();
    for r in v["replicas"].as_array().unwrap() {
        if r["name"] != survivor.as_str() {
            sigkill(r["pid"].as_i64().expect("replica pid"));
        }
    }
    let alone = wait_for(
        &format!("{survivor} the only RW replica"),
        Duration::from_secs(60),
        || {
            let v = volume(&url, "vr");
            let rw: Vec<&Value> = v["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r["mode"] == "RW")
                .collect();
            (rw.len() == 1 && rw[0]["name"] == survivor.as_str()).then_some(v.clone())
        },
    );
    let (ok, out) = qemu_io(&endpoint(&alone), &["read -P 0x5e 0 24M", "read -P 0x5f 24M 4M"]);
    assert!(ok, "data on rebuilt replica {survivor} alone: {out}");
    wait_healthy(&url, "vr", Duration::from_secs(120));
}
