//! Issue 40: a manager started with `--tls-dir` runs its node's daemons under mutual TLS. A volume of two replicas
//! attaches (the manager's gRPC clients, the engine's towards the replicas: all over TLS), qemu-io writes and reads
//! through it, a SIGKILLed replica is replaced and rebuilt (replica to replica over TLS); the engine's and a
//! replica's gRPC endpoints refuse a plaintext client and answer one with the node's certificate, and every daemon
//! the manager started was given the directory as `CORRAL_TLS_DIR`; the engine's TCP NBD endpoint is advertised as
//! `nbds://` and served to libnbd with the node's certificate.

mod support;

use std::sync::Arc;
use std::time::Duration;

use corral_tls::{ClusterCa, LeafRequest, SubjectAltName, TlsDir};
use serde_json::json;
use support::tls::{engine_answers, replica_answers};
use support::*;
use testkit::{qemu_io, wait_for};

/// `CORRAL_TLS_DIR` in the environment of process `pid`.
fn tls_env(pid: i64) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    env.split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix("CORRAL_TLS_DIR=").map(str::to_owned))
}

#[test]
fn a_manager_with_a_tls_dir_runs_its_volumes_daemons_under_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ClusterCa::generate("cluster", 30).unwrap();
    let node = dir.path().join("tls");
    ca.issue(&LeafRequest::new(
        "node-1",
        vec![SubjectAltName::Ip("127.0.0.1".parse().unwrap())],
        30,
    ))
    .unwrap()
    .write(&node)
    .unwrap();
    let data_dir = dir.path().join("n1");
    let cmd = Manager::command(&data_dir, "node-1", "embedded", port_range(0), &[])
        .arg("--tls-dir")
        .arg(&node);
    let m = Manager::spawn(cmd, &data_dir, "node-1");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol1", "size": 32 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes/vol1/attach", m.url),
        Some(&json!({})),
    );
    assert_eq!(code, 200, "{v}");
    let v = wait_healthy(&m, "vol1", 2, Duration::from_secs(60));
    let uri = unix_endpoint(&v);
    let (ok, out) = qemu_io(&uri, &["write -P 0xab 0 4M", "flush", "read -P 0xab 0 4M"]);
    assert!(ok, "{out}");
    // The TCP endpoint is advertised as nbds:// (TLS-only), and libnbd reads it with the node's certificate.
    let nbds = v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .filter_map(|e| e.as_str())
                .find(|e| e.starts_with("nbds://"))
        })
        .unwrap_or_else(|| panic!("an nbds:// endpoint: {v}"))
        .to_owned();
    let client_dir = dir.path().join("nbd-client");
    TlsDir::load(&node)
        .unwrap()
        .link_nbd_client_dir(&client_dir)
        .unwrap();
    let info = std::process::Command::new("nbdinfo")
        .arg(format!("{nbds}?tls-certificates={}", client_dir.display()))
        .output()
        .unwrap();
    assert!(
        info.status.success() && String::from_utf8_lossy(&info.stdout).contains("size: 33554432"),
        "nbdinfo {nbds}: {}",
        String::from_utf8_lossy(&info.stderr)
    );

    let node_str = node.canonicalize().unwrap().display().to_string();
    let engine_pid = v["engine"]["pid"].as_i64().expect("engine pid");
    assert_eq!(tls_env(engine_pid).as_deref(), Some(node_str.as_str()));
    for r in v["replicas"].as_array().unwrap() {
        assert_eq!(
            tls_env(r["pid"].as_i64().unwrap()).as_deref(),
            Some(node_str.as_str())
        );
    }
    let client = Arc::new(TlsDir::load(&node).unwrap().client_config().unwrap());
    let engine = v["engine"]["address"].as_str().unwrap().to_owned();
    let replica = v["replicas"][0]["address"].as_str().unwrap().to_owned();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        engine_answers(&engine, &Some(client.clone())).await.unwrap();
        replica_answers(&replica, &Some(client.clone())).await.unwrap();
        assert!(
            engine_answers(&engine, &None).await.is_err(),
            "the engine answered plaintext"
        );
        assert!(
            replica_answers(&replica, &None).await.is_err(),
            "a replica answered plaintext"
        );
    });

    // A SIGKILLed replica: the manager replaces it, the new one rebuilds from the other over TLS.
    let victim = v["replicas"][0]["pid"].as_i64().unwrap();
    sigkill(victim);
    let (ok, out) = qemu_io(&uri, &["write -P 0xcd 4M 4M", "flush"]);
    assert!(ok, "IO continues on one replica: {out}");
    wait_for("a rebuilt replacement", Duration::from_secs(60), || {
        let v = volume(&m, "vol1");
        let pids: Vec<i64> = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["mode"] == "RW")
            .filter_map(|r| r["pid"].as_i64())
            .collect();
        (pids.len() == 2 && !pids.contains(&victim)).then_some(())
    });
    let (ok, out) = qemu_io(&uri, &["read -P 0xab 0 4M", "read -P 0xcd 4M 4M"]);
    assert!(ok, "data after the rebuild: {out}");
}
