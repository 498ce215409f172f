//! Issue 40: `corral-manager --tls auto` keeps the cluster CA in the store and issues its node's certificate into
//! DATA_DIR/tls. One node: the files' modes, a 2-replica volume through the unix NBD socket and through `nbds://`
//! with a `corral-tls nbd-client-dir` made from the node directory, the engine and a replica refusing a plaintext
//! client and clients of another CA, the node directory re-issued at a restart when it holds another CA's
//! certificate, the CA key in no log. Two managers started together on one etcd: one CA, a certificate each, a
//! volume with replicas on both nodes. `--tls auto` is the default; `--tls off` warns.

mod support;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use manager::pki::{CA_NAME, ClusterCaDoc};
use serde_json::json;
use support::tls::{engine_answers, replica_answers};
use support::*;
use testkit::{TestPki, qemu_io, qemu_io_tls, wait_for};

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn auto_manager(data_dir: &Path, node_id: &str, store: &str, slot: u16) -> support::Manager {
    let cmd = Manager::command(data_dir, node_id, store, port_range(slot), &[]).args(["--tls", "auto"]);
    Manager::spawn(cmd, data_dir, node_id)
}

/// The `nbds://HOST:PORT/EXPORT` endpoint of a volume view, as address and export.
fn nbds_endpoint(v: &serde_json::Value) -> (SocketAddr, String) {
    let uri = v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .filter_map(|e| e.as_str())
                .find(|e| e.starts_with("nbds://"))
        })
        .unwrap_or_else(|| panic!("an nbds:// endpoint: {v}"));
    let (addr, export) = uri.trim_start_matches("nbds://").split_once('/').unwrap();
    (addr.parse().unwrap(), export.to_owned())
}

fn create_and_attach(m: &support::Manager, name: &str, body: &serde_json::Value) -> serde_json::Value {
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": name, "size": 32 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = rest("POST", &format!("{}/v1/volumes/{name}/attach", m.url), Some(body));
    assert_eq!(code, 200, "{v}");
    wait_healthy(m, name, 2, Duration::from_secs(90))
}

/// Every log file under `dir` (the manager's and its daemons').
fn logs_under(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "log") {
                out.push((
                    p.clone(),
                    String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned(),
                ));
            }
        }
    }
    out
}

/// The engine's and every replica's gRPC answer the node's certificate and refuse every stranger.
fn check_endpoints(v: &serde_json::Value, node: &Path, strangers: &TestPki) {
    let engine = v["engine"]["address"].as_str().unwrap().to_owned();
    let replicas: Vec<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["address"].as_str().unwrap().to_owned())
        .collect();
    let ours = Some(TestPki::client(node));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        engine_answers(&engine, &ours).await.unwrap();
        for (who, client) in strangers.strangers() {
            assert!(
                engine_answers(&engine, &client).await.is_err(),
                "the engine answered {who}"
            );
        }
        for replica in &replicas {
            replica_answers(replica, &ours).await.unwrap();
            for (who, client) in strangers.strangers() {
                assert!(
                    replica_answers(replica, &client).await.is_err(),
                    "replica {replica} answered {who}"
                );
            }
        }
    });
}

#[test]
fn a_manager_with_auto_tls_issues_its_node_certificate_and_serves_a_volume() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("n1");
    let mut m = auto_manager(&data_dir, "node-1", "embedded", 0);
    let node = data_dir.join("tls");
    assert_eq!(mode(&node), 0o700);
    assert_eq!(mode(&node.join("tls.key")), 0o600);

    let v = create_and_attach(&m, "vol1", &json!({}));
    let (ok, out) = qemu_io(&unix_endpoint(&v), &["write -P 0xab 0 4M", "flush"]);
    assert!(ok, "{out}");
    let (addr, export) = nbds_endpoint(&v);
    let client_dir = testkit::tls::nbd_client_dir(&node, &dir.path().join("nbd-client"));
    let (ok, out) = qemu_io_tls(
        addr,
        &export,
        &client_dir,
        &["read -P 0xab 0 4M", "write -P 0xcd 4M 4M"],
    );
    assert!(ok, "qemu-io over nbds:// with the node's certificate: {out}");
    let (ok, out) = qemu_io(&unix_endpoint(&v), &["read -P 0xcd 4M 4M"]);
    assert!(ok, "{out}");
    let strangers = TestPki::new(dir.path());
    check_endpoints(&v, &node, &strangers);

    // The node directory replaced by another cluster's files: the next start issues it anew from the store's CA.
    m.kill();
    let stranger = strangers.stranger();
    for f in ["ca.crt", "tls.crt", "tls.key"] {
        std::fs::copy(stranger.join(f), node.join(f)).unwrap();
    }
    m.restart();
    assert_ne!(
        std::fs::read_to_string(node.join("ca.crt")).unwrap(),
        std::fs::read_to_string(stranger.join("ca.crt")).unwrap(),
        "re-issued at start: {}",
        m.log()
    );
    let v = volume(&m, "vol1");
    check_endpoints(&v, &node, &strangers);

    m.kill_node();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let doc = rt.block_on(async {
        let store = manager::store::open("embedded", &data_dir).await.unwrap();
        let db = manager::store::Db::new(store);
        db.must_get::<ClusterCaDoc>(CA_NAME).await.unwrap().data
    });
    assert_eq!(
        std::fs::read_to_string(node.join("ca.crt")).unwrap(),
        doc.cert_pem
    );
    assert!(!format!("{doc:?}").contains("PRIVATE"), "Debug shows the key");
    // Each line of the key's base64 on its own: a log may escape the newlines between them.
    let key_lines: Vec<&str> = doc
        .key_pem
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        .collect();
    assert!(!key_lines.is_empty());
    let logs = logs_under(&data_dir);
    assert!(logs.len() >= 3, "the manager's and its daemons' logs: {logs:?}");
    for (path, text) in logs {
        for line in &key_lines {
            assert!(!text.contains(line), "{} holds the CA key", path.display());
        }
    }
}

/// Mutual TLS is the default (issue 40): a manager started with no TLS flag issues its node directory, serves the
/// volume's TCP NBD endpoint as `nbds://`, and its engine and replicas answer the node's certificate and refuse a
/// plaintext client and every stranger. `--tls off` (the one plaintext manager here: the explicit opt-out is what
/// is checked) issues nothing, says so in a warning, and its engine answers plaintext.
#[test]
fn a_manager_without_a_tls_flag_runs_its_daemons_under_mutual_tls_and_tls_off_warns() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("n1");
    let m = Manager::start(&data_dir, "node-1", "embedded", port_range(0));
    assert_eq!(mode(&m.tls_dir().join("tls.key")), 0o600);
    let v = create_and_attach(&m, "vol1", &json!({}));
    nbds_endpoint(&v);
    let (ok, out) = qemu_io(
        &unix_endpoint(&v),
        &["write -P 0x1d 0 1M", "flush", "read -P 0x1d 0 1M"],
    );
    assert!(ok, "{out}");
    check_endpoints(&v, &m.tls_dir(), &TestPki::new(dir.path()));
    assert!(!m.log().contains("plaintext"), "{}", m.log());

    let off_dir = dir.path().join("n2");
    let cmd = Manager::command(&off_dir, "node-2", "embedded", port_range(1), &[]).args(["--tls", "off"]);
    let off = Manager::spawn(cmd, &off_dir, "node-2");
    assert!(!off.tls_dir().exists(), "--tls off issued a node directory");
    let log = off.log();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("--tls off without --tls-dir")
            && l.contains("plaintext")),
        "{log}"
    );
    let v = create_and_attach(&off, "vol2", &json!({}));
    let engine = v["engine"]["address"].as_str().unwrap().to_owned();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(engine_answers(&engine, &None))
        .expect("the engine of a --tls off manager answers plaintext");
}

#[test]
fn two_managers_started_together_on_one_etcd_agree_on_one_ca() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = testkit::servers::Etcd::start(dir.path());
    let store = format!("etcd://{}", etcd.endpoint());
    let ms: Vec<support::Manager> = std::thread::scope(|s| {
        let started: Vec<_> = (0..2u16)
            .map(|i| {
                let (d, store) = (dir.path().join(format!("n{i}")), store.clone());
                s.spawn(move || auto_manager(&d, &format!("node-{i}"), &store, i))
            })
            .collect();
        started.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let read = |i: usize, f: &str| std::fs::read_to_string(ms[i].data_dir.join("tls").join(f)).unwrap();
    assert_eq!(read(0, "ca.crt"), read(1, "ca.crt"), "one cluster CA");
    assert_ne!(read(0, "tls.crt"), read(1, "tls.crt"), "a certificate per node");
    wait_nodes_ready(&ms[0], 2);

    let v = create_and_attach(&ms[0], "spread", &json!({"nodeId": "node-0"}));
    assert_eq!(replica_nodes(&v).len(), 2, "a replica on each node: {v}");
    let (ok, out) = qemu_io(
        &unix_endpoint(&v),
        &["write -P 0x5a 0 8M", "flush", "read -P 0x5a 0 8M"],
    );
    assert!(ok, "{out}");
    // A replica of node-1 is dialled by node-0's engine with node-0's certificate; strangers are refused there too.
    let strangers = TestPki::new(dir.path());
    check_endpoints(&v, &ms[0].data_dir.join("tls"), &strangers);
    wait_for("both replicas RW", Duration::from_secs(30), || {
        (rw_replicas(&volume(&ms[0], "spread")) == 2).then_some(())
    });
}

/// The CA rotation of manager/README.md: with the managers stopped, the store's CA deleted; the next start makes a
/// new CA and re-issues the node's directory from it.
#[test]
fn a_new_cluster_ca_reissues_the_node_directory_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("n1");
    let mut m = auto_manager(&data_dir, "node-1", "embedded", 0);
    let ca_file = data_dir.join("tls").join("ca.crt");
    let old = std::fs::read_to_string(&ca_file).unwrap();
    m.kill();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = || async { manager::store::Db::new(manager::store::open("embedded", &data_dir).await.unwrap()) };
    rt.block_on(async {
        let db = db().await;
        assert_eq!(
            db.must_get::<ClusterCaDoc>(CA_NAME).await.unwrap().data.cert_pem,
            old
        );
        db.delete_any::<ClusterCaDoc>(CA_NAME).await.unwrap();
    });
    m.restart();
    let new = std::fs::read_to_string(&ca_file).unwrap();
    assert_ne!(new, old, "the node directory is still the old CA's: {}", m.log());
    m.kill();
    let stored = rt.block_on(async {
        db().await
            .must_get::<ClusterCaDoc>(CA_NAME)
            .await
            .unwrap()
            .data
            .cert_pem
    });
    assert_eq!(new, stored);
}
