//! The compose cluster of `docker/cluster.yaml` across real container boundaries: three etcd members and three
//! node containers (a corral-manager each, on an address of its own, with its own disk volume) come up from images
//! built locally; a 3-replica volume placed on the three nodes is created and attached through `corral` and written
//! through NBD from the host with `qemu-io`; then
//!
//! - one node is partitioned (`docker network disconnect`): IO continues, its replica goes ERR and is replaced by one
//!   rebuilt on another node; reconnected on its address, the node rejoins and removes the stale replica's data;
//! - one etcd member stops: the cluster keeps taking changes; two stop: the managers refuse changes with an error
//!   naming the store, and the attached volume keeps serving IO; both restart: changes are taken again.
//!
//! Skipped, with the reason printed, when no Docker daemon answers. The project name and its /24 are unique to the
//! run; the project is taken down (containers, networks, volumes) on every exit.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use testkit::docker::{ComposeProject, build_images, docker_unavailable, run, stdout};

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];

/// The running cluster: the project and the first three octets of its network.
struct Cluster {
    project: ComposeProject,
    net: String,
}

impl Cluster {
    /// Brings the cluster up on a /24 of 10.200-249.x.0 picked from the pid and clock; another one when docker
    /// already has an overlapping network (the daemon may be shared).
    fn up(tag: &str) -> Self {
        let seed = std::process::id()
            ^ SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or_default();
        for attempt in 0..5u32 {
            let n = seed.wrapping_add(attempt.wrapping_mul(7919));
            let net = format!("10.{}.{}", 200 + n % 50, (n / 50) % 256);
            let project = ComposeProject::new(
                "corralcluster",
                &["docker/cluster.yaml"],
                vec![
                    ("CORRAL_TAG".into(), tag.to_owned()),
                    ("CORRAL_NET".into(), net.clone()),
                ],
            );
            let out = project
                .command()
                .args(["up", "-d"])
                .output()
                .expect("spawn compose up");
            if out.status.success() {
                return Self { project, net };
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

    fn container(&self, service: &str) -> String {
        self.project.container_id(service)
    }

    fn network(&self) -> String {
        format!("{}_cluster", self.project.name())
    }

    /// `corral ARGS...` inside node-1's container (the CLI talks REST to that node's manager): the output, and
    /// whether it succeeded.
    fn corral(&self, args: &[&str]) -> (bool, String) {
        let out = self
            .project
            .command()
            .args(["exec", "-T", "node-1", "corral"])
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
        for node in NODES {
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

fn qemu_io(uri: &str, ops: &[&str]) {
    let (ok, text) = testkit::qemu_io(uri, ops);
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
    let tag = build_images("debug", &["corral-manager", "corral-etcd"]);

    // 1. Up: three etcd members, three nodes that register themselves.
    let cluster = Cluster::up(&tag);
    let net = cluster.net.clone();
    let nodes = testkit::wait_for("three ready nodes", Duration::from_secs(90), || {
        cluster.ready_nodes().filter(|n| n.len() == 3)
    });
    eprintln!("cluster up on {net}.0/24 in {:.0?}: {nodes:?}", started.elapsed());

    // 2. A 3-replica volume, one replica per node, attached on node-1 and written through its NBD TCP endpoint.
    let (ok, text) = cluster.corral(&["volume", "create", "vol1", "--size", "256Mi", "--replicas", "3"]);
    assert!(ok, "volume create: {text}");
    let (ok, text) = cluster.corral(&["volume", "attach", "vol1", "--node", "node-1"]);
    assert!(ok, "volume attach: {text}");
    let v = testkit::wait_for("vol1 healthy", Duration::from_secs(60), || {
        cluster.volume("vol1").filter(|v| v["robustness"] == "healthy")
    });
    let mut placed: Vec<String> = replicas(&v).into_iter().map(|(_, node, _)| node).collect();
    placed.sort();
    assert_eq!(placed, NODES, "one replica per node: {v}");
    let uri = v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .filter_map(Value::as_str)
                .find(|e| e.starts_with("nbd://"))
        })
        .expect("a TCP NBD endpoint")
        .to_owned();
    assert!(
        uri.starts_with(&format!("nbd://{net}.11:")),
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

    // Back on its address, node-3 rejoins and removes the data of the replica the cluster replaced.
    docker(&[
        "network",
        "connect",
        "--ip",
        &format!("{net}.13"),
        &cluster.network(),
        &cluster.container("node-3"),
    ]);
    testkit::wait_for("node-3 ready again", Duration::from_secs(60), || {
        cluster.ready_nodes().filter(|n| n.len() == 3)
    });
    testkit::wait_for(
        "node-3 removed the replaced replica's data",
        Duration::from_secs(60),
        || {
            let left = dir_entries(&cluster, "node-3", "/var/lib/corral/disks/default/replicas");
            (!left.contains(&node3_replica)).then_some(())
        },
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
    eprintln!("cluster test took {:.0?}", started.elapsed());
}
