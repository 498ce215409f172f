//! The compose cluster of `docker/cluster.yaml` + `docker/cluster-im.yaml` across real container boundaries: three
//! etcd members and three nodes, each node a `corral-im` container (the data plane: it owns the node's address,
//! its disk volume and every engine and replica process) with a `corral-manager` container in its network
//! namespace (`--instance-manager`), come up from images built locally; a 3-replica volume placed on the three
//! nodes is created and attached through `corral` and written through NBD from the host with `qemu-io` (`nbds://`:
//! the managers' default mutual TLS, presenting node-1's certificate copied out of its volume); then
//!
//! - one node is partitioned (`docker network disconnect` of its IM container, which takes its manager along):
//!   IO continues, its replica goes ERR and is replaced by one rebuilt on another node; reconnected on its address,
//!   the node rejoins with its manager restarted meanwhile (so none of its controllers saw the deletion), and the
//!   manager's orphan sweep, asking its IM for the processes it runs, stops the stale replica process there and
//!   removes its data (both in the node's `orphansRemoved`);
//! - one etcd member stops: the cluster keeps taking changes; two stop: the managers refuse changes with an error
//!   naming the store, and the attached volume keeps serving IO; both restart: changes are taken again.
//! - the node running the engine is killed (its IM and manager containers): once it is seen down, `corral volume
//!   attach --node` on another node (the control plane does not move an engine by itself) serves the volume there
//!   with everything flushed before.
//!
//! Ignored for their length (docker/README.md has the command), each on a cluster of its own, under fio write+verify
//! load through NBD: the managers' rolling upgrade (live: same engine and replica pids), `corral node drain` of a
//! loaded node (the volume's RW replicas sampled through the drain, never below its count), and the data planes'
//! rolling upgrade (each node drained, the engine's volume moved with detach + attach, then its IM and manager
//! containers recreated on other images).
//!
//! Skipped, with the reason printed, when no Docker daemon answers. The project name and its /24 are unique to the
//! run; the project is taken down (containers, networks, volumes) on every exit.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use testkit::docker::{ComposeProject, build_images, docker_unavailable, host_image_tag, run, stdout};

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];
/// The manager container of each node (`manager-N` runs in `node-N`'s network namespace).
const MANAGERS: [&str; 3] = ["manager-1", "manager-2", "manager-3"];

/// The running cluster: the project and the first three octets of its network.
struct Cluster {
    project: ComposeProject,
    net: String,
    /// The storage network's first three octets, when the cluster has one (`docker/cluster-storage.yaml`).
    storage_net: Option<String>,
    /// The manager container `corral` runs in (manager-1 until node-1 is killed).
    cli: std::cell::Cell<&'static str>,
    /// Where [`NBD_CLIENT`] is (node-1's certificate, copied out).
    nbd_client_files: Option<tempfile::TempDir>,
}

impl Cluster {
    /// Brings the cluster up on a /24 of 10.200-249.x.0 picked from the pid and clock; another one when docker
    /// already has an overlapping network (the daemon may be shared). With `storage`, `docker/cluster-storage.yaml`
    /// on top: a storage network of its own (the same first octets, the third one + 128) for the data path.
    fn up(tag: &str, storage: bool) -> Self {
        let seed = std::process::id()
            ^ SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or_default();
        let mut files = vec!["docker/cluster.yaml", "docker/cluster-im.yaml"];
        if storage {
            files.push("docker/cluster-storage.yaml");
        }
        for attempt in 0..5u32 {
            let n = seed.wrapping_add(attempt.wrapping_mul(7919));
            let net = format!("10.{}.{}", 200 + n % 50, (n / 50) % 128);
            let storage_net = storage.then(|| format!("10.{}.{}", 200 + n % 50, (n / 50) % 128 + 128));
            let mut env = vec![
                ("CORRAL_TAG".into(), tag.to_owned()),
                ("CORRAL_ETCD_TAG".into(), host_image_tag()),
                ("CORRAL_NET".into(), net.clone()),
            ];
            if let Some(s) = &storage_net {
                env.push(("CORRAL_STORAGE_NET".into(), s.clone()));
            }
            let project = ComposeProject::new("corralcluster", &files, env);
            let out = project
                .command()
                .args(["up", "-d"])
                .output()
                .expect("spawn compose up");
            if out.status.success() {
                return Self {
                    project,
                    net,
                    storage_net,
                    cli: std::cell::Cell::new("manager-1"),
                    nbd_client_files: None,
                };
            }
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                err.contains("overlaps"),
                "compose up on {net}.0/24 failed:\n{err}"
            );
            eprintln!("{net}.0/24 overlaps a network docker has; trying another");
        }
        panic!("no free /24 found for the cluster network in 5 attempts");
    }

    /// [`Cluster::up`], then waits for its three nodes to be ready; returns them too.
    fn up_ready(tag: &str, storage: bool) -> (Self, Vec<String>) {
        let mut cluster = Self::up(tag, storage);
        let nodes = testkit::wait_for("three ready nodes", Duration::from_secs(90), || {
            cluster.ready_nodes().filter(|n| n.len() == 3)
        });
        cluster.nbd_client();
        (cluster, nodes)
    }

    /// The host's NBD clients present node-1's certificate, issued in its volume at start (tls-1, from the CA in
    /// etcd): copied out of the container, then linked under qemu's file names ([`NBD_CLIENT`]).
    fn nbd_client(&mut self) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let tls = dir.path().join("tls");
        docker(&[
            "cp",
            &format!("{}:/var/lib/corral/tls", self.container("node-1")),
            &tls.display().to_string(),
        ]);
        let client = testkit::tls::nbd_client_dir(&tls, &dir.path().join("nbd"));
        let _ = NBD_CLIENT.set(client);
        self.nbd_client_files = Some(dir);
    }

    /// `vol1` of 256 MiB with `replicas` replicas, attached on node-1: its view once healthy.
    fn attached_vol1(&self, replicas: usize) -> Value {
        let n = replicas.to_string();
        let (ok, text) = self.corral(&["volume", "create", "vol1", "--size", "256Mi", "--replicas", &n]);
        assert!(ok, "volume create: {text}");
        let (ok, text) = self.corral(&["volume", "attach", "vol1", "--node", "node-1"]);
        assert!(ok, "volume attach: {text}");
        testkit::wait_for("vol1 healthy", Duration::from_secs(60), || {
            self.volume("vol1").filter(|v| v["robustness"] == "healthy")
        })
    }

    fn container(&self, service: &str) -> String {
        self.project.container_id(service)
    }

    fn network(&self) -> String {
        format!("{}_cluster", self.project.name())
    }

    /// `corral ARGS...` inside the manager container of [`Cluster::cli`] (the CLI talks REST to that node's
    /// manager): the output, and whether it succeeded.
    fn corral(&self, args: &[&str]) -> (bool, String) {
        let out = self
            .project
            .command()
            .args(["exec", "-T", self.cli.get(), "corral"])
            .args(args)
            .output()
            .expect("spawn compose exec");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// `corral ARGS... --json`, parsed; `None` when the command failed.
    fn corral_json(&self, args: &[&str]) -> Option<Value> {
        let mut argv = args.to_vec();
        argv.push("--json");
        let (ok, text) = self.corral(&argv);
        if !ok {
            return None;
        }
        serde_json::from_str(&text).ok()
    }

    /// Names of the nodes the cluster reports ready.
    fn ready_nodes(&self) -> Option<Vec<String>> {
        let nodes = self.corral_json(&["node", "ls"])?;
        Some(
            nodes
                .as_array()?
                .iter()
                .filter(|n| n["ready"] == true)
                .filter_map(|n| n["name"].as_str().map(str::to_owned))
                .collect(),
        )
    }

    fn volume(&self, name: &str) -> Option<Value> {
        self.corral_json(&["volume", "get", name])
    }
}

impl Drop for Cluster {
    /// On a failure, the managers' warnings and the replica and engine decisions of every node, in full (the
    /// project's own dump keeps the last lines only), before the project is taken down.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for node in MANAGERS.iter().chain(&NODES) {
            let Ok(out) = self.project.command().args(["logs", "--no-color", node]).output() else {
                continue;
            };
            let text = String::from_utf8_lossy(&out.stdout);
            let kept: Vec<&str> = text
                .lines()
                .filter(|l| {
                    l.contains("WARN")
                        || l.contains("ERROR")
                        || l.contains("replica")
                        || l.contains("engine")
                        || l.contains("leader")
                })
                .collect();
            eprintln!(
                "--- {node}: warnings, replicas, engines, leadership\n{}",
                kept.join("\n")
            );
        }
    }
}

/// (name, node, mode) of each replica of a volume.
fn replicas(v: &Value) -> Vec<(String, String, String)> {
    v["replicas"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| {
                    let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                    (s("name"), s("nodeId"), s("mode"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The volume's NBD TCP endpoint: `nbds://` (the managers' default `--tls auto` makes the engines' TCP frontends
/// TLS-only, client certificate required).
fn nbd_uri(v: &Value) -> String {
    v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .filter_map(Value::as_str)
                .find(|e| e.starts_with("nbds://"))
        })
        .unwrap_or_else(|| panic!("a TCP NBD endpoint with TLS: {v}"))
        .to_owned()
}

/// The NBD client directory the host's qemu-io and fio present ([`Cluster::nbd_client`]), set once per process.
static NBD_CLIENT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

fn nbd_client() -> &'static std::path::Path {
    NBD_CLIENT
        .get()
        .expect("the cluster's NBD client directory (Cluster::up)")
}

/// qemu-io from the host on an `nbds://HOST:PORT/EXPORT` endpoint, presenting a node's certificate.
fn qemu_io_result(uri: &str, ops: &[&str]) -> (bool, String) {
    let (addr, export) = uri
        .strip_prefix("nbds://")
        .and_then(|r| r.split_once('/'))
        .unwrap_or_else(|| panic!("not an nbds:// endpoint: {uri}"));
    let addr = addr.parse().unwrap_or_else(|e| panic!("{uri}: {e}"));
    testkit::qemu_io_tls(addr, export, nbd_client(), ops)
}

fn qemu_io(uri: &str, ops: &[&str]) {
    let (ok, text) = qemu_io_result(uri, ops);
    assert!(ok, "qemu-io {ops:?} on {uri}:\n{text}");
}

fn docker(args: &[&str]) {
    run(Command::new("docker").args(args));
}

/// The entries of a directory inside a service's container (the images have bash, no ls).
fn dir_entries(cluster: &Cluster, service: &str, dir: &str) -> Vec<String> {
    let out = run(cluster.project.command().args([
        "exec",
        "-T",
        service,
        "bash",
        "-c",
        &format!("shopt -s nullglob; for f in {dir}/*; do echo \"${{f##*/}}\"; done"),
    ]));
    stdout(&out).lines().map(str::to_owned).collect()
}

#[test]
fn compose_cluster_serves_a_volume_across_node_partition_and_etcd_member_loss() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED cluster test: {reason}");
        return;
    }
    let started = Instant::now();
    let tag = build_images("debug", &["corral-manager", "corral-im", "corral-etcd"]);

    // 1. Up: three etcd members, three nodes that register themselves.
    let (cluster, nodes) = Cluster::up_ready(&tag, false);
    let net = cluster.net.clone();
    eprintln!("cluster up on {net}.0/24 in {:.0?}: {nodes:?}", started.elapsed());

    // 2. A 3-replica volume, one replica per node, attached on node-1 and written through its NBD TCP endpoint.
    let v = cluster.attached_vol1(3);
    let mut placed: Vec<String> = replicas(&v).into_iter().map(|(_, node, _)| node).collect();
    placed.sort();
    assert_eq!(placed, NODES, "one replica per node: {v}");
    let uri = nbd_uri(&v);
    assert!(
        uri.starts_with(&format!("nbds://{net}.11:")),
        "served on node-1's address: {uri}"
    );
    qemu_io(&uri, &["write -P 0xab 0 16M", "read -P 0xab 0 16M", "flush"]);

    // 3. Partition node-3. IO goes on (a write waits out the replica timeout, then completes on two replicas).
    let (node3_replica, _, _) = replicas(&v)
        .into_iter()
        .find(|(_, node, _)| node == "node-3")
        .expect("a replica on node-3");
    let partitioned = Instant::now();
    docker(&[
        "network",
        "disconnect",
        &cluster.network(),
        &cluster.container("node-3"),
    ]);
    qemu_io(
        &uri,
        &[
            "write -P 0xcd 16M 8M",
            "read -P 0xab 0 16M",
            "read -P 0xcd 16M 8M",
            "flush",
        ],
    );
    eprintln!("IO during the partition took {:.1?}", partitioned.elapsed());
    // Its replica is failed and replaced by one rebuilt elsewhere (soft anti-affinity: on node-1 or node-2).
    let v = testkit::wait_for(
        "node-3's replica replaced and the volume healthy again",
        Duration::from_secs(150),
        || {
            cluster.volume("vol1").filter(|v| {
                let rs = replicas(v);
                v["robustness"] == "healthy"
                    && rs.len() == 3
                    && rs
                        .iter()
                        .all(|(name, node, mode)| mode == "RW" && node != "node-3" && *name != node3_replica)
            })
        },
    );
    eprintln!(
        "rebuilt without node-3 {:.0?} after the partition: {:?}",
        partitioned.elapsed(),
        replicas(&v)
    );
    qemu_io(&uri, &["read -P 0xab 0 16M", "read -P 0xcd 16M 8M"]);

    // Back on its address, node-3 rejoins and removes the replica the cluster replaced. Its manager is restarted
    // meanwhile (the data plane stays: the IM owns it), so no controller of its saw the replica's deletion: only
    // the orphan sweep, asking the IM for what it runs, can find the stale process.
    run(cluster.project.command().args(["stop", "manager-3"]));
    assert!(
        data_plane_pids(&cluster, "node-3")
            .keys()
            .any(|a| a.contains(&node3_replica)),
        "the replaced replica still runs in node-3's IM while its manager is away"
    );
    docker(&[
        "network",
        "connect",
        "--ip",
        &format!("{net}.13"),
        &cluster.network(),
        &cluster.container("node-3"),
    ]);
    run(cluster.project.command().args(["start", "manager-3"]));
    testkit::wait_for("node-3 ready again", Duration::from_secs(60), || {
        cluster.ready_nodes().filter(|n| n.len() == 3)
    });
    testkit::wait_for(
        "node-3 removed the replaced replica's data",
        Duration::from_secs(90),
        || {
            let left = dir_entries(&cluster, "node-3", "/var/lib/corral/disks/default/replicas");
            (!left.contains(&node3_replica)).then_some(())
        },
    );
    // Its replica process ran in node-3's IM container, where the manager's /proc does not reach: the manager
    // asked the IM for its processes and stopped it there.
    let node3 = cluster
        .corral_json(&["node", "get", "node-3"])
        .expect("node get node-3");
    let removed: Vec<(String, String)> = node3["orphansRemoved"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|o| {
                    let s = |k: &str| o[k].as_str().unwrap_or_default().to_owned();
                    (s("kind"), s("name"))
                })
                .collect()
        })
        .unwrap_or_default();
    for kind in ["replica-process", "replica-data"] {
        assert!(
            removed.contains(&(kind.to_owned(), node3_replica.clone())),
            "node-3 reports its {kind} {node3_replica} removed: {node3}"
        );
    }
    let left = data_plane_pids(&cluster, "node-3");
    assert!(
        !left.keys().any(|a| a.contains(&node3_replica)),
        "the stale replica process is gone from node-3's IM: {left:?}"
    );
    let im_processes = dir_entries(&cluster, "node-3", "/var/lib/corral/run");
    assert!(
        !im_processes.contains(&format!("replica-{node3_replica}.ready")),
        "the stale replica's ready file is gone: {im_processes:?}"
    );

    // 4. etcd: one member down, the cluster keeps working.
    run(cluster.project.command().args(["stop", "etcd-1"]));
    let (ok, text) = cluster.corral(&["volume", "create", "vol2", "--size", "64Mi", "--replicas", "3"]);
    assert!(ok, "volume create with one etcd member down: {text}");

    // Two down: no quorum. Changes are refused with an error naming the store; the attached volume serves IO.
    run(cluster.project.command().args(["stop", "etcd-2"]));
    let refused = Instant::now();
    let (ok, text) = cluster.corral(&["volume", "create", "vol3", "--size", "64Mi", "--replicas", "3"]);
    assert!(!ok, "volume create without an etcd quorum succeeded: {text}");
    assert!(
        text.contains("etcd") && text.contains("quorum") && text.contains("503"),
        "the refusal names the store: {text}"
    );
    eprintln!("refused in {:.1?}: {}", refused.elapsed(), text.trim());
    qemu_io(
        &uri,
        &[
            "write -P 0xee 32M 8M",
            "read -P 0xee 32M 8M",
            "read -P 0xab 0 16M",
            "flush",
        ],
    );

    // Both back: changes are taken again, and the volume is still healthy with all its data, on the same
    // replicas (an outage of the store is no reason to replace any).
    let mut before: Vec<String> = replicas(&v).into_iter().map(|(name, _, _)| name).collect();
    before.sort();
    run(cluster.project.command().args(["start", "etcd-1", "etcd-2"]));
    testkit::wait_for(
        "vol4 created once etcd has a quorum again",
        Duration::from_secs(90),
        || {
            cluster
                .corral(&["volume", "create", "vol4", "--size", "64Mi", "--replicas", "3"])
                .0
                .then_some(())
        },
    );
    testkit::wait_for(
        "vol1 healthy after etcd recovered",
        Duration::from_secs(60),
        || cluster.volume("vol1").filter(|v| v["robustness"] == "healthy"),
    );
    let v = cluster.volume("vol1").expect("vol1");
    let mut after: Vec<String> = replicas(&v).into_iter().map(|(name, _, _)| name).collect();
    after.sort();
    assert_eq!(
        after, before,
        "vol1's replicas were replaced after etcd recovered: {v}"
    );
    qemu_io(
        &uri,
        &["read -P 0xab 0 16M", "read -P 0xcd 16M 8M", "read -P 0xee 32M 8M"],
    );

    // 5. Kill the node that runs the engine: node-1's IM container (the engine and a replica) and its manager.
    //    Once the cluster sees node-1 down, `corral volume attach --node node-2` moves the engine there (the control
    //    plane does not do it by itself: it is an operator's or CSI's call); everything flushed reads back there.
    let killed = Instant::now();
    docker(&[
        "kill",
        &cluster.container("manager-1"),
        &cluster.container("node-1"),
    ]);
    cluster.cli.set("manager-2");
    testkit::wait_for("node-1 seen down", Duration::from_secs(90), || {
        cluster
            .ready_nodes()
            .filter(|n| n.len() == 2 && !n.iter().any(|n| n == "node-1"))
    });
    let (ok, text) = cluster.corral(&["volume", "attach", "vol1", "--node", "node-2"]);
    assert!(ok, "volume attach on node-2 after node-1 died: {text}");
    // The engine starts on node-2 over the replicas that answer (not those on node-1).
    let v = testkit::wait_for("vol1 served from node-2", Duration::from_secs(150), || {
        cluster.volume("vol1").filter(|v| {
            v["endpoints"].as_array().is_some_and(|e| {
                e.iter()
                    .any(|e| e.as_str().is_some_and(|e| e.starts_with("nbds://")))
            })
        })
    });
    let uri = nbd_uri(&v);
    assert!(
        uri.starts_with(&format!("nbds://{net}.12:")),
        "served on node-2's address: {uri} ({v})"
    );
    qemu_io(
        &uri,
        &["read -P 0xab 0 16M", "read -P 0xcd 16M 8M", "read -P 0xee 32M 8M"],
    );
    qemu_io(&uri, &["write -P 0x5a 48M 4M", "read -P 0x5a 48M 4M"]);
    eprintln!(
        "vol1 re-attached on node-2 with its data {:.0?} after node-1 was killed",
        killed.elapsed()
    );
    eprintln!("cluster test took {:.0?}", started.elapsed());
}

/// Fencing across a storage network apart from the management one (`docker/cluster-storage.yaml`, issue 39): node-1,
/// serving a 3-replica volume, is cut off from the management network only, so its engine still reaches every
/// replica. Once the cluster sees node-1 down, the volume is attached on node-2 (a new engine generation); fio writes
/// and verifies through the new engine while the old one is made to write a pattern of its own again and again:
/// every one of those writes fails. Healed, the old engine is stopped, the RW replicas' snapshots hash alike (each
/// `corral-replica hash`), node-1's stale replica is gone, and the old engine's pattern is nowhere in the volume.
/// Ignored for its length (a cluster of its own): docker/README.md, fencing.
#[test]
#[ignore = "a compose cluster of its own with a storage network, ~3 min: docker/README.md, fencing"]
fn compose_cluster_fences_the_engine_of_a_node_cut_off_from_the_management_network_only() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED cluster fencing test: {reason}");
        return;
    }
    let started = Instant::now();
    let tag = build_images("debug", &["corral-manager", "corral-im", "corral-etcd"]);
    let (cluster, _) = Cluster::up_ready(&tag, true);
    let (net, storage) = (
        cluster.net.clone(),
        cluster.storage_net.clone().expect("a storage network"),
    );
    let v = cluster.attached_vol1(3);
    let old_uri = nbd_uri(&v);
    assert!(
        old_uri.starts_with(&format!("nbds://{storage}.11:")),
        "served on node-1's storage address: {old_uri}"
    );
    for (name, _, _) in replicas(&v) {
        let r = v["replicas"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["name"] == name.as_str()));
        let address = r.map(|r| r["address"].to_string()).unwrap_or_default();
        assert!(
            address.contains(&format!("{storage}.")),
            "replica {name} on the storage network: {address}"
        );
    }
    qemu_io(&old_uri, &["write -P 0xab 0 16M", "flush"]);
    let (node1_replica, _, _) = replicas(&v)
        .into_iter()
        .find(|(_, node, _)| node == "node-1")
        .expect("a replica on node-1");

    // node-1 off the management network: its manager loses the store, its engine keeps every replica and writes.
    docker(&[
        "network",
        "disconnect",
        &cluster.network(),
        &cluster.container("node-1"),
    ]);
    cluster.cli.set("manager-2");
    testkit::wait_for("node-1 seen down", Duration::from_secs(90), || {
        cluster
            .ready_nodes()
            .filter(|n| n.len() == 2 && !n.iter().any(|n| n == "node-1"))
    });
    qemu_io(&old_uri, &["write -P 0x66 96M 1M", "flush"]);

    // The takeover: a new engine on node-2, over the replicas node-2 and node-3 hold.
    let (ok, text) = cluster.corral(&["volume", "attach", "vol1", "--node", "node-2"]);
    assert!(ok, "volume attach on node-2 while node-1 is cut off: {text}");
    let on_node2 = format!("nbds://{storage}.12:");
    let v = testkit::wait_for("vol1 served from node-2", Duration::from_secs(120), || {
        cluster.volume("vol1").filter(|v| {
            v["endpoints"].as_array().is_some_and(|e| {
                e.iter()
                    .any(|e| e.as_str().is_some_and(|e| e.starts_with(&on_node2)))
            })
        })
    });
    let uri = nbd_uri(&v);
    qemu_io(
        &uri,
        &[
            "read -P 0xab 0 16M",
            "read -P 0x66 96M 1M",
            "write -P 0x22 100M 1M",
            "flush",
        ],
    );
    let mut fio = FioLoad::start(&uri, "fencing");

    // The old engine, still reachable on node-1's storage address, tries its own pattern again and again: refused.
    let mut attempts = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        let (ok, text) = qemu_io_result(&old_uri, &["write -P 0x77 96M 1M", "flush"]);
        assert!(
            !ok,
            "the old engine's write after the takeover succeeded:\n{text}"
        );
        attempts.push(text);
        fio.assert_running("while the old engine tried to write");
    }
    eprintln!(
        "{} writes of the old engine refused, the first:\n{}",
        attempts.len(),
        attempts.first().map_or("", String::as_str).trim()
    );
    let (written, verified) = fio.finish();
    assert!(
        written > 0 && verified > 0,
        "fio through the new engine: {written} written, {verified} verified"
    );

    // Healed: node-1 ready again, its stale engine stopped and its replaced replica's data gone.
    docker(&[
        "network",
        "connect",
        "--ip",
        &format!("{net}.11"),
        &cluster.network(),
        &cluster.container("node-1"),
    ]);
    testkit::wait_for("node-1 ready again", Duration::from_secs(90), || {
        cluster.ready_nodes().filter(|n| n.len() == 3)
    });
    testkit::wait_for(
        "the old engine stopped on node-1",
        Duration::from_secs(90),
        || {
            let left = data_plane_pids(&cluster, "node-1");
            (!left.keys().any(|a| a.contains("corral-engine"))).then_some(())
        },
    );
    testkit::wait_for(
        "node-1 removed its replaced replica's data",
        Duration::from_secs(90),
        || {
            let left = dir_entries(&cluster, "node-1", "/var/lib/corral/disks/default/replicas");
            (!left.contains(&node1_replica)).then_some(())
        },
    );
    // What the old engine wrote before the takeover is there, what it tried after is nowhere.
    qemu_io(&uri, &["read -P 0x66 96M 1M", "read -P 0x22 100M 1M"]);
    let hashes = rw_replica_hashes(&cluster, "vol1");
    eprintln!("snapshot hashes by RW replica: {hashes:?}");
    assert!(hashes.len() >= 2, "at least two RW replicas: {hashes:?}");
    let first = hashes.values().next().cloned().unwrap_or_default();
    assert!(
        hashes.values().all(|h| *h == first),
        "every RW replica holds the same data: {hashes:?}"
    );
    eprintln!("cluster fencing test took {:.0?}", started.elapsed());
}

/// A snapshot of `volume` taken now, then every snapshot of it hashed on each RW replica (`corral-replica hash` in the
/// replica's node): replica name -> (snapshot, sha512-sparse) list.
fn rw_replica_hashes(cluster: &Cluster, volume: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let (ok, text) = cluster.corral(&["snapshot", "create", volume, "final"]);
    assert!(ok, "snapshot create: {text}");
    let snaps = cluster
        .corral_json(&["snapshot", "ls", volume])
        .expect("snapshot ls");
    let names: Vec<String> = snaps
        .as_array()
        .expect("snapshots")
        .iter()
        .filter(|s| s["removed"] != true && s["name"] != "volume-head")
        .filter_map(|s| s["name"].as_str().map(str::to_owned))
        .collect();
    assert!(names.iter().any(|n| n == "final"), "{snaps}");
    let v = cluster.volume(volume).expect("volume get");
    let mut out = BTreeMap::new();
    for r in v["replicas"].as_array().expect("replicas") {
        if r["mode"] != "RW" {
            continue;
        }
        let (name, node, address) = (
            r["name"].as_str().unwrap_or_default(),
            r["nodeId"].as_str().unwrap_or_default(),
            r["address"].as_str().unwrap_or_default(),
        );
        let mut sums = Vec::new();
        for snap in &names {
            let out = run(cluster.project.command().args([
                "exec",
                "-T",
                node,
                "corral-replica",
                "--json",
                "hash",
                "--url",
                address,
                snap,
            ]));
            let h: Value = serde_json::from_str(&stdout(&out)).expect("hash JSON");
            let sum = h["checksum"].as_str().unwrap_or_default().to_owned();
            assert!(!sum.is_empty(), "{snap} hashed on {name}: {h}");
            sums.push((snap.clone(), sum));
        }
        out.insert(name.to_owned(), sums);
    }
    out
}

/// The pid of each engine and replica process running in a node's data-plane (IM) container, by command line,
/// as the host sees them (`docker top`).
fn data_plane_pids(cluster: &Cluster, node: &str) -> BTreeMap<String, String> {
    let out = run(Command::new("docker").args(["top", &cluster.container(node), "-eo", "pid,args"]));
    stdout(&out)
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().split_once(' '))
        .filter(|(_, args)| args.contains("corral-engine") || args.contains("corral-replica"))
        .map(|(pid, args)| (args.trim().to_owned(), pid.to_owned()))
        .collect()
}

/// The manager version each node reports (`corral node ls`), by node; `None` while the CLI's manager is away.
fn manager_versions(cluster: &Cluster) -> Option<BTreeMap<String, (bool, String)>> {
    let nodes = cluster.corral_json(&["node", "ls"])?;
    Some(
        nodes
            .as_array()?
            .iter()
            .map(|n| {
                (
                    n["name"].as_str().unwrap_or_default().to_owned(),
                    (
                        n["ready"] == true,
                        n["managerVersion"].as_str().unwrap_or_default().to_owned(),
                    ),
                )
            })
            .collect(),
    )
}

/// Builds the debug binaries again with `CORRAL_BUILD_VERSION=<version>-upgrade` (read by `corral-manager` and
/// `corral-im` only) and makes `images` of them under the tag suffix `<own>upgrade`; then builds them back (the
/// tests' binaries report the crate version). Returns the image tag and the version the upgraded binaries report.
fn build_upgrade(tag: &str, images: &[&str]) -> (String, String) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let version = format!("{}-upgrade", testkit::docker::workspace_version());
    let build = |env: Option<&str>| {
        let mut c = Command::new(&cargo);
        c.args([
            "build",
            "--workspace",
            "--bins",
            "--locked",
            "--features",
            "replica/fault-injection",
        ])
        .current_dir(testkit::docker::repo_root())
        .env("CARGO_TARGET_DIR", testkit::docker::target_dir());
        match env {
            Some(v) => c.env("CORRAL_BUILD_VERSION", v),
            None => c.env_remove("CORRAL_BUILD_VERSION"),
        };
        run(&mut c);
    };
    build(Some(&version));
    // A target dir of its own for build.sh: the upgraded manager beside the binaries the image carries.
    let stage = tempfile::tempdir().expect("staging dir");
    let debug = stage.path().join("debug");
    std::fs::create_dir_all(&debug).expect("mkdir");
    let from = testkit::docker::target_dir().join("debug");
    for bin in [
        "corral-manager",
        "corral-im",
        "corral",
        "corral-engine",
        "corral-replica",
        "corral-bim",
        "corral-datasource",
    ] {
        std::fs::copy(from.join(bin), debug.join(bin)).expect("copy a binary");
    }
    build(None);
    let suffix = format!(
        "{}upgrade",
        testkit::docker::own_tag_suffix().trim_start_matches('-')
    );
    run(Command::new(testkit::docker::repo_root().join("docker/build.sh"))
        .args(images)
        .env("CARGO_TARGET_DIR", stage.path())
        .env("CORRAL_PROFILE", "debug")
        .env("CORRAL_SKIP_CARGO", "1")
        .env("CORRAL_TAG_SUFFIX", &suffix));
    let upgraded = format!("{}-debug-{suffix}", testkit::docker::workspace_version());
    assert_ne!(upgraded, tag);
    for image in images
        .iter()
        .filter(|i| ["corral-manager", "corral-im"].contains(i))
    {
        let out =
            run(Command::new("docker").args(["run", "--rm", &format!("{image}:{upgraded}"), "--version"]));
        assert_eq!(stdout(&out), format!("{image} {version}"));
    }
    (upgraded, version)
}

/// Rolling upgrade of the compose cluster's managers while fio writes and verifies through NBD: each node's
/// `manager-N` container is replaced, one at a time, by an image of another version; the version shows in
/// `corral node ls`, fio sees no error, and no engine or replica process was restarted (same pids, seen from the
/// host). Ignored for its length (it builds a second manager binary): see docker/README.md.
#[test]
#[ignore = "builds a second corral-manager and runs ~4 min: docker/README.md, rolling upgrade"]
fn compose_cluster_managers_upgrade_one_at_a_time_without_interrupting_io() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED cluster upgrade test: {reason}");
        return;
    }
    let started = Instant::now();
    let tag = build_images("debug", &["corral-manager", "corral-im", "corral-etcd"]);
    let (upgraded_tag, upgraded_version) = build_upgrade(&tag, &["corral-manager"]);
    let (cluster, _) = Cluster::up_ready(&tag, false);
    let v = cluster.attached_vol1(3);
    let uri = nbd_uri(&v);
    let old_version = manager_versions(&cluster).expect("node ls")["node-1"].1.clone();
    assert_ne!(old_version, upgraded_version);
    let pids_before: Vec<_> = NODES.iter().map(|n| data_plane_pids(&cluster, n)).collect();
    assert!(
        pids_before[0].keys().any(|a| a.contains("corral-engine"))
            && pids_before.iter().all(|p| !p.is_empty()),
        "an engine on node-1 and a replica on every node: {pids_before:?}"
    );

    let mut fio = FioLoad::start(&uri, "upgrade");

    for (i, (node, manager)) in NODES.iter().zip(MANAGERS).enumerate() {
        let replaced = Instant::now();
        run(cluster.project.command().env("CORRAL_TAG", &upgraded_tag).args([
            "up",
            "-d",
            "--no-deps",
            manager,
        ]));
        testkit::wait_for(
            &format!("{node} ready with manager {upgraded_version}"),
            Duration::from_secs(120),
            || {
                manager_versions(&cluster).filter(|m| {
                    m.get(*node)
                        .is_some_and(|(ready, v)| *ready && *v == upgraded_version)
                })
            },
        );
        fio.assert_running(&format!("while {manager} was replaced"));
        eprintln!(
            "{manager} upgraded in {:.1?} ({} of 3)",
            replaced.elapsed(),
            i + 1
        );
    }
    let versions = manager_versions(&cluster).expect("node ls");
    assert!(
        versions
            .values()
            .all(|(ready, v)| *ready && *v == upgraded_version),
        "every node ready on {upgraded_version}: {versions:?}"
    );
    let pids_after: Vec<_> = NODES.iter().map(|n| data_plane_pids(&cluster, n)).collect();
    assert_eq!(
        pids_after, pids_before,
        "no engine or replica process was restarted"
    );

    let (written, verified) = fio.finish();
    eprintln!("upgrade test took {:.0?}", started.elapsed());
    assert!(
        written > 64 << 20 && verified > 32 << 20,
        "fio wrote and verified through the whole upgrade: {written} bytes written, {verified} verified"
    );
    let v = cluster.volume("vol1").expect("vol1");
    assert_eq!(v["robustness"], "healthy", "{v}");
}

impl Drop for FioLoad {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.proxy.kill();
        let _ = self.proxy.wait();
    }
}

/// fio through NBD from the host: random 64 KiB writes over the first 64 MiB, each block verified (crc32c) as it is
/// read back behind the writes; the first verify failure ends it. Runs until [`FioLoad::finish`].
struct FioLoad {
    child: std::process::Child,
    /// nbdkit: the TLS client fio's NBD connection goes through (killed on drop).
    proxy: std::process::Child,
    out: tempfile::NamedTempFile,
    /// fio leaves its verify state file in its working directory: a temporary one.
    _dir: tempfile::TempDir,
}

impl FioLoad {
    fn start(uri: &str, name: &str) -> Self {
        let out = tempfile::NamedTempFile::new().expect("fio output file");
        let dir = tempfile::tempdir().expect("fio working dir");
        let (addr, export) = uri
            .strip_prefix("nbds://")
            .and_then(|r| r.split_once('/'))
            .and_then(|(a, e)| Some((a.rsplit_once(':')?, e)))
            .unwrap_or_else(|| panic!("not an nbds:// endpoint: {uri}"));
        // fio's libnbd takes no certificate directory from a URI (local file access is refused there), so nbdkit's
        // nbd plugin is the TLS client, presenting node-1's certificate, and fio reaches it on a unix socket.
        let socket = dir.path().join("nbd.sock");
        let tls = nbd_client().display().to_string();
        let proxy = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&socket)
            .args([
                "nbd",
                &format!("hostname={}", addr.0),
                &format!("port={}", addr.1),
                &format!("export={export}"),
                "tls=require",
                &format!("tls-certificates={tls}"),
            ])
            .spawn()
            .expect("spawn nbdkit (apt-get install nbdkit)");
        testkit::wait_for("nbdkit's socket", Duration::from_secs(10), || {
            socket.exists().then_some(())
        });
        let child = Command::new("fio")
            .args([
                &format!("--name={name}"),
                "--ioengine=nbd",
                &format!("--uri=nbd+unix:///?socket={}", socket.display()),
                "--rw=randwrite",
                "--bs=64k",
                "--size=64M",
                "--iodepth=4",
                "--verify=crc32c",
                "--verify_backlog=64",
                "--verify_fatal=1",
                "--loops=100000",
                "--runtime=900",
                "--output-format=json",
                &format!("--output={}", out.path().display()),
            ])
            .current_dir(dir.path())
            .spawn()
            .expect("spawn fio");
        Self {
            child,
            proxy,
            out,
            _dir: dir,
        }
    }

    /// Fails the test, with fio's report, when fio has already ended (an IO or verify error ends it early).
    fn assert_running(&mut self, when: &str) {
        assert!(
            self.child.try_wait().expect("fio status").is_none(),
            "fio ended {when}: {}",
            std::fs::read_to_string(self.out.path()).unwrap_or_default()
        );
    }

    /// Stops fio (SIGINT ends its jobs cleanly, and fio then exits 128 whatever happened before), asserts its
    /// report has no error, and returns the bytes it wrote and the bytes it read back and verified.
    fn finish(mut self) -> (u64, u64) {
        self.assert_running("before it was stopped");
        run(Command::new("kill").args(["-INT", &self.child.id().to_string()]));
        let status = self.child.wait().expect("wait fio");
        let report = std::fs::read_to_string(self.out.path()).expect("fio report");
        let json_start = report.find('{').unwrap_or(0);
        let r: Value =
            serde_json::from_str(&report[json_start..]).unwrap_or_else(|e| panic!("fio JSON: {e}\n{report}"));
        let job = &r["jobs"][0];
        let written = job["write"]["io_bytes"].as_u64().unwrap_or_default();
        let verified = job["read"]["io_bytes"].as_u64().unwrap_or_default();
        eprintln!(
            "fio: {status}, error {}, {} MiB written, {} MiB read back and verified",
            job["error"],
            written >> 20,
            verified >> 20,
        );
        assert_eq!(job["error"], 0, "fio reported an IO or verify error: {report}");
        (written, verified)
    }
}

/// `corral node drain` on a node holding a replica of a volume under fio write load with verify: the drain of the
/// engine's node is refused; the other node's replica is rebuilt elsewhere before it is removed, with the volume's
/// RW replicas sampled all along the drain (never fewer than its count), fio sees no error, and a pattern written
/// before reads back. Ignored for its length (a cluster of its own, ~2 min): docker/README.md, node drain.
#[test]
#[ignore = "a compose cluster of its own, ~2 min: docker/README.md, node drain"]
fn compose_cluster_drains_a_node_under_write_load_without_dropping_below_the_replica_count() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED cluster drain test: {reason}");
        return;
    }
    let started = Instant::now();
    let tag = build_images("debug", &["corral-manager", "corral-im", "corral-etcd"]);
    let (cluster, _) = Cluster::up_ready(&tag, false);

    // A 2-replica volume attached on node-1: one of its replicas is on node-2 or node-3 (anti-affinity), the node
    // to drain; the third node is where that replica can go.
    let v = cluster.attached_vol1(2);
    let before = replicas(&v);
    let drained = before
        .iter()
        .map(|(_, node, _)| node.clone())
        .find(|n| n != "node-1")
        .unwrap_or_else(|| panic!("a replica away from node-1: {v}"));
    let uri = nbd_uri(&v);
    // A pattern beyond fio's 64 MiB, to read back once the replicas moved.
    qemu_io(&uri, &["write -P 0x7e 192M 16M", "flush"]);

    // The engine's node cannot be drained (drain moves replicas, not engines): refused, nothing written.
    let (ok, text) = cluster.corral(&["node", "drain", "node-1", "--no-wait"]);
    assert!(
        !ok && text.contains("vol1 is attached on node-1"),
        "drain of the engine's node refused naming the volume: {text}"
    );
    let n1 = cluster
        .corral_json(&["node", "get", "node-1"])
        .expect("node get node-1");
    assert_eq!(n1["drainState"], "none", "{n1}");

    let mut fio = FioLoad::start(&uri, "drain");
    drain_sampled(&cluster, &drained, "vol1", 2, &mut fio);
    let (written, verified) = fio.finish();
    assert!(
        written > 0 && verified > 0,
        "fio wrote and verified during the drain: {written} bytes written, {verified} verified"
    );
    qemu_io(&uri, &["read -P 0x7e 192M 16M"]);
    eprintln!("drain test took {:.0?}", started.elapsed());
}

/// `corral node drain NODE` while `fio` loads `volume`, sampling the volume's replicas until the CLI returns: never
/// fewer RW replicas than `count` (the replacement seen beside them is reported when a sample caught it). Then NODE
/// is drained with no replica left, and the volume healthy on `count` RW replicas elsewhere.
fn drain_sampled(cluster: &Cluster, node: &str, volume: &str, count: usize, fio: &mut FioLoad) {
    let started = Instant::now();
    let mut drain = cluster
        .project
        .command()
        .args([
            "exec",
            "-T",
            cluster.cli.get(),
            "corral",
            "node",
            "drain",
            node,
            "--timeout",
            "300",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn corral node drain");
    let mut samples = 0;
    let mut most = 0;
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(330);
    while drain.try_wait().expect("drain status").is_none() {
        assert!(
            Instant::now() < deadline,
            "the drain of {node} did not end in 330 s"
        );
        if let Some(v) = cluster.volume(volume) {
            let rs = replicas(&v);
            let rw = rs.iter().filter(|(_, _, mode)| mode == "RW").count();
            assert!(
                rw >= count,
                "{volume} fell below its {count} RW replicas during the drain of {node}: {rs:?}"
            );
            samples += 1;
            most = most.max(rs.len());
            let nodes: Vec<String> = rs.iter().map(|(_, n, m)| format!("{n}:{m}")).collect();
            if seen.last() != Some(&nodes) {
                seen.push(nodes);
            }
        }
        fio.assert_running(&format!("during the drain of {node}"));
    }
    let out = drain.wait_with_output().expect("drain output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "corral node drain {node}: {text}");
    eprintln!(
        "{node} drained in {:.1?}, {samples} samples of {volume}'s replicas, up to {most} at once: {seen:?}\n{}",
        started.elapsed(),
        text.trim()
    );
    // Whether the replacement was caught beside the old replica depends on a sample landing during its rebuild:
    // each sample is a `docker exec` (seconds under load), so it is reported, not asserted. The order itself is
    // `node::drain::evict`'s (table-tested) and `manager::drain` sees it at 150 ms sampling; what holds whatever
    // the timing is asserted above: never fewer than `count` RW replicas.
    if most <= count {
        eprintln!("no sample fell inside the replacement's rebuild on {node}: {seen:?}");
    }
    let n = cluster.corral_json(&["node", "get", node]).expect("node get");
    assert!(
        n["drainState"] == "drained" && n["replicas"] == 0,
        "{node} drained, no replica left: {n}"
    );
    let v = cluster.volume(volume).expect("volume get");
    let after = replicas(&v);
    assert!(
        v["robustness"] == "healthy"
            && after.len() == count
            && after.iter().all(|(_, n, m)| m == "RW" && n != node),
        "{volume} healthy on {count} RW replicas off {node}: {v}"
    );
}

/// The image a container runs, as docker names it (`corral-im:TAG`).
fn container_image(cluster: &Cluster, service: &str) -> String {
    let out =
        run(Command::new("docker").args(["inspect", "-f", "{{.Config.Image}}", &cluster.container(service)]));
    stdout(&out).trim().to_owned()
}

/// Rolling upgrade of the compose cluster's data planes under fio write+verify load, as docker/README.md
/// ("Rolling upgrade") documents it (not live): a 2-replica volume attached on node-1; node-2, then node-3, each
/// drained under load (replicas sampled: never below 2 RW), checked empty of engines and replicas, then `node-N` and `manager-N`
/// recreated on images of another version (shown by `corral node get`) and uncordoned; then node-1, which runs the engine: fio is stopped (error 0),
/// the volume detached and attached on node-2 (the documented IO pause), fio restarted there, node-1 drained and
/// replaced the same way. No fio error in either run, a pattern written first reads back at the end, every node
/// ready on the new images. Ignored for its length: docker/README.md, rolling upgrade.
#[test]
#[ignore = "builds a second image set and runs ~3 min: docker/README.md, rolling upgrade"]
fn compose_cluster_data_planes_upgrade_one_node_at_a_time_after_a_drain() {
    if let Some(reason) = docker_unavailable() {
        eprintln!("SKIPPED cluster data-plane upgrade test: {reason}");
        return;
    }
    let started = Instant::now();
    let tag = build_images("debug", &["corral-manager", "corral-im", "corral-etcd"]);
    // The images to upgrade to: the manager and the instance manager built as another version.
    let (new_tag, new_version) = build_upgrade(&tag, &["corral-manager", "corral-im"]);

    let (cluster, _) = Cluster::up_ready(&tag, false);
    let net = cluster.net.clone();
    let v = cluster.attached_vol1(2);
    let uri = nbd_uri(&v);
    qemu_io(&uri, &["write -P 0x7e 192M 16M", "flush"]);

    let upgrade = |node: &str, manager: &str, fio: &mut FioLoad| {
        let replaced = Instant::now();
        drain_sampled(&cluster, node, "vol1", 2, fio);
        let left = data_plane_pids(&cluster, node);
        assert!(
            left.is_empty(),
            "drained {node} still runs engines or replicas: {left:?}"
        );
        run(cluster.project.command().env("CORRAL_TAG", &new_tag).args([
            "up",
            "-d",
            "--no-deps",
            "--force-recreate",
            node,
            manager,
        ]));
        let (ok, text) = cluster.corral(&["node", "uncordon", node]);
        assert!(ok, "uncordon {node}: {text}");
        let n = testkit::wait_for(
            &format!("{node} ready again on its new data plane"),
            Duration::from_secs(120),
            || {
                cluster.corral_json(&["node", "get", node]).filter(|n| {
                    n["ready"] == true
                        && n["allowScheduling"] == true
                        && n["dataPlaneVersion"] == new_version.as_str()
                        && n["managerVersion"] == new_version.as_str()
                })
            },
        );
        assert_eq!(container_image(&cluster, node), format!("corral-im:{new_tag}"));
        assert_eq!(
            container_image(&cluster, manager),
            format!("corral-manager:{new_tag}")
        );
        fio.assert_running(&format!("while {node} was replaced"));
        eprintln!(
            "{node} drained and replaced in {:.1?}: instance manager {} {}",
            replaced.elapsed(),
            n["instanceManager"],
            n["instanceManagerVersion"]
        );
    };

    // node-2 and node-3 hold replicas, not the engine: drained under load, then replaced.
    let mut fio = FioLoad::start(&uri, "dataplane");
    upgrade("node-2", "manager-2", &mut fio);
    upgrade("node-3", "manager-3", &mut fio);
    let (written, verified) = fio.finish();
    assert!(
        written > 0 && verified > 0,
        "fio ran: {written} written, {verified} verified"
    );

    // node-1 runs the engine: the volume moves to node-2 (detach, attach: its IO pauses, fio is restarted there).
    let moved = Instant::now();
    let (ok, text) = cluster.corral(&["volume", "detach", "vol1"]);
    assert!(ok, "volume detach: {text}");
    testkit::wait_for("vol1 detached", Duration::from_secs(60), || {
        cluster.volume("vol1").filter(|v| v["state"] == "detached")
    });
    let (ok, text) = cluster.corral(&["volume", "attach", "vol1", "--node", "node-2"]);
    assert!(ok, "volume attach on node-2: {text}");
    let on_node2 = format!("nbds://{net}.12:");
    let v = testkit::wait_for("vol1 healthy on node-2", Duration::from_secs(90), || {
        cluster.volume("vol1").filter(|v| {
            v["robustness"] == "healthy"
                && v["endpoints"].as_array().is_some_and(|e| {
                    e.iter()
                        .any(|e| e.as_str().is_some_and(|e| e.starts_with(&on_node2)))
                })
        })
    });
    eprintln!("vol1 moved to node-2 in {:.1?}", moved.elapsed());
    let uri = nbd_uri(&v);
    qemu_io(&uri, &["read -P 0x7e 192M 16M"]);
    let mut fio = FioLoad::start(&uri, "dataplane-node1");
    upgrade("node-1", "manager-1", &mut fio);
    let (written, verified) = fio.finish();
    assert!(
        written > 0 && verified > 0,
        "fio ran: {written} written, {verified} verified"
    );
    qemu_io(&uri, &["read -P 0x7e 192M 16M"]);

    let nodes = cluster.corral_json(&["node", "ls"]).expect("node ls");
    for n in nodes.as_array().expect("nodes") {
        assert!(
            n["ready"] == true && n["dataPlaneVersion"] == new_version.as_str(),
            "every node ready on data plane {new_version} after the upgrade: {nodes}"
        );
        eprintln!(
            "{}: manager {}, instance manager {} (data plane {})",
            n["name"], n["managerVersion"], n["instanceManagerVersion"], n["dataPlaneVersion"]
        );
    }
    for node in NODES {
        assert_eq!(container_image(&cluster, node), format!("corral-im:{new_tag}"));
    }
    eprintln!("data-plane upgrade test took {:.0?}", started.elapsed());
}
