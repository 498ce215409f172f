//! The instance manager (`corral-im`) owns a node's data-plane daemons, so they outlive the manager: real
//! `corral-im`, `corral-manager`, engine and replica processes, NBD IO through qemu-io while the manager's whole
//! process group is SIGKILLed and a new manager starts on the same data directory, then while the instance manager
//! itself is SIGKILLed and restarted. Also its refusals of bad requests and of a manager/instance-manager API skew,
//! and a manager refusing what an older data plane (a `corral-im` built with `CORRAL_IM_FEATURES=v1`) cannot do.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use corral_proto::v1::{self, instance_service_client::InstanceServiceClient};
use serde_json::{Value, json};
use support::*;
use testkit::{Daemon, DaemonCommand, qemu_io, wait_for, workspace_bin};

fn start_im(data_dir: &Path, env: &[(&str, &str)]) -> Daemon {
    start_im_binary(&workspace_bin("corral-im"), data_dir, env)
}

/// A node's `corral-im` from `binary` as a deployment starts it: on the node directory its manager issues
/// (`--tls auto`, the manager's default; issued first, as an init step does), which this test's own clients then
/// present too.
fn start_node_im(binary: &Path, data_dir: &Path, node_id: &str, store: &str, env: &[(&str, &str)]) -> Daemon {
    let tls = issue_node_tls(data_dir, node_id, store);
    support::tls::use_node(&tls);
    let tls = tls.display().to_string();
    let mut env = env.to_vec();
    env.push(("CORRAL_TLS_DIR", tls.as_str()));
    start_im_binary(binary, data_dir, &env)
}

/// A `corral-im` from `binary` (e.g. an older build), running the workspace's data-plane binaries.
fn start_im_binary(binary: &Path, data_dir: &Path, env: &[(&str, &str)]) -> Daemon {
    std::fs::create_dir_all(data_dir).unwrap();
    let mut cmd = DaemonCommand::new(binary);
    for (k, v) in env {
        cmd = cmd.env(k, v);
    }
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .arg("--data-dir")
    .arg(data_dir)
    .arg("--bin-dir")
    .arg(manager_bin().parent().unwrap())
    .env("NO_COLOR", "1")
    .log_to(data_dir.join("corral-im.log"))
    .spawn()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn im_client(im: &Daemon) -> InstanceServiceClient<tonic::transport::Channel> {
    let ch = corral_proto::grpc::connect_with(
        im.addr("grpc"),
        corral_proto::grpc::GrpcTimeouts::CONTROL,
        support::tls::node_client().as_ref(),
    )
    .await
    .unwrap();
    InstanceServiceClient::new(ch)
}

/// name → (pid, state, listeners) of every process of the instance manager.
fn im_processes(im: &Daemon) -> BTreeMap<String, (i32, i32, BTreeMap<String, String>)> {
    rt().block_on(async {
        let list = im_client(im)
            .await
            .process_list(v1::ProcessListRequest {})
            .await
            .unwrap()
            .into_inner();
        list.processes
            .into_iter()
            .map(|p| (p.name, (p.pid, p.state, p.listen.into_iter().collect())))
            .collect()
    })
}

/// The pids of a volume's engine and replicas.
fn daemon_pids(v: &Value) -> (i64, Vec<i64>) {
    let mut replicas: Vec<i64> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["pid"].as_i64())
        .collect();
    replicas.sort_unstable();
    (v["engine"]["pid"].as_i64().unwrap(), replicas)
}

/// qemu-io rounds in the background, each a fresh NBD connection: write a pattern to one 1 MiB slot, flush, read it
/// back. Records the last pattern of every slot, the rounds done, and every failure.
struct IoLoad {
    stop: Arc<AtomicBool>,
    rounds: Arc<Mutex<Vec<Instant>>>,
    errors: Arc<Mutex<Vec<String>>>,
    written: Arc<Mutex<BTreeMap<u64, u8>>>,
    thread: Option<JoinHandle<()>>,
}

const SLOTS: u64 = 16;

impl IoLoad {
    fn start(uri: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let written = Arc::new(Mutex::new(BTreeMap::new()));
        let (s, r, e, w) = (stop.clone(), rounds.clone(), errors.clone(), written.clone());
        let thread = std::thread::spawn(move || {
            let mut i: u64 = 0;
            while !s.load(Ordering::Relaxed) {
                let slot = i % SLOTS;
                let pattern = u8::try_from(i % 250).unwrap() + 1;
                let off = slot << 20;
                let (ok, out) = qemu_io(
                    &uri,
                    &[
                        &format!("write -P {pattern} {off} 1M"),
                        "flush",
                        &format!("read -P {pattern} {off} 1M"),
                    ],
                );
                if ok {
                    w.lock().unwrap().insert(slot, pattern);
                    r.lock().unwrap().push(Instant::now());
                } else {
                    e.lock().unwrap().push(format!("round {i}: {out}"));
                }
                i += 1;
            }
        });
        Self {
            stop,
            rounds,
            errors,
            written,
            thread: Some(thread),
        }
    }

    fn rounds(&self) -> usize {
        self.rounds.lock().unwrap().len()
    }

    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }

    /// Waits until `n` more rounds completed than now.
    fn wait_rounds(&self, n: usize, what: &str) {
        let from = self.rounds();
        wait_for(what, Duration::from_secs(60), || {
            assert_eq!(self.errors(), Vec::<String>::new(), "IO failed");
            (self.rounds() >= from + n).then_some(())
        });
    }

    fn finish(mut self) -> (usize, Vec<String>, BTreeMap<u64, u8>) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        (self.rounds(), self.errors(), self.written.lock().unwrap().clone())
    }
}

impl Drop for IoLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[test]
fn daemons_on_the_instance_manager_survive_a_sigkilled_manager_and_a_sigkilled_instance_manager() {
    let dir = tempfile::tempdir().unwrap();
    // The manager and the instance manager share the node's data directory at the same path, as the containers do.
    let node_dir = dir.path().join("n1");
    let mut im = start_node_im(&workspace_bin("corral-im"), &node_dir, "node-1", "embedded", &[]);
    let im_url = format!("http://{}", im.addr("grpc"));
    let command = Manager::command(&node_dir, "node-1", "embedded", port_range(0), &[])
        .args(["--instance-manager", &im_url])
        .own_process_group();
    let daemon = command.clone().spawn();
    let mut m = Manager {
        url: daemon.http_url("http"),
        daemon,
        data_dir: node_dir.clone(),
        node_id: "node-1".into(),
    };

    // The node records its instance manager and both versions.
    let nodes = ok(&m.url, &["node", "ls"]);
    let version = env!("CARGO_PKG_VERSION");
    wait_for(
        "the node shows its instance manager",
        Duration::from_secs(30),
        || {
            let (code, n) = rest("GET", &format!("{}/v1/nodes/node-1", m.url), None);
            (code == 200 && n["instanceManager"] == im_url.as_str() && n["managerVersion"] == version)
                .then_some(())
        },
    );
    let nodes = if nodes.contains(&im_url) {
        nodes
    } else {
        ok(&m.url, &["node", "ls"])
    };
    assert!(
        nodes.contains(&im_url) && nodes.contains(&format!("{version} (API v1)")),
        "{nodes}"
    );

    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol1", "size": 32 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, "vol1");
    let v = wait_healthy(&m, "vol1", 2, Duration::from_secs(90));
    let (engine_pid, replica_pids) = daemon_pids(&v);
    // They are the instance manager's processes, not the manager's children.
    let procs = im_processes(&im);
    let im_pids: Vec<i64> = procs.values().map(|p| i64::from(p.0)).collect();
    assert!(im_pids.contains(&engine_pid), "{procs:?} vs engine {engine_pid}");
    for p in &replica_pids {
        assert!(im_pids.contains(p), "{procs:?} vs replica {p}");
    }
    let running = i32::from(v1::InstanceProcessState::Running);
    assert!(procs.values().all(|p| p.1 == running), "{procs:?}");

    let load = IoLoad::start(uri.clone());
    load.wait_rounds(3, "IO running before the kill");

    // SIGKILL the manager's whole process group while IO runs.
    let pgid = i32::try_from(m.daemon.pid()).unwrap();
    let in_flight = load.rounds();
    let status = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .status()
        .unwrap();
    assert!(status.success());
    wait_for("the manager gone", Duration::from_secs(10), || {
        (!pid_alive(i64::from(pgid))).then_some(())
    });
    m.kill(); // reaps it
    assert!(load.rounds() > 0 && load.errors().is_empty());
    // No manager at all: IO goes on.
    load.wait_rounds(3, "IO while no manager runs");
    assert!(load.rounds() >= in_flight + 3);
    assert!(pid_alive(engine_pid) && replica_pids.iter().all(|p| pid_alive(*p)));

    // A new manager on the same data directory and instance manager adopts everything: same pids, no restart.
    let listen = command.clone().set_flag("--listen", m.daemon.addr("http"));
    m.daemon.restart_with(listen);
    m.url = m.daemon.http_url("http");
    load.wait_rounds(3, "IO after the new manager started");
    let v = wait_healthy(&m, "vol1", 2, Duration::from_secs(60));
    assert_eq!(
        daemon_pids(&v),
        (engine_pid, replica_pids.clone()),
        "a daemon was restarted"
    );

    // SIGKILL the instance manager: its children live on; restarted, it re-adopts them with their listeners.
    let before = im_processes(&im);
    let im_addr = im.addr("grpc").to_owned();
    im.kill();
    load.wait_rounds(3, "IO while no instance manager runs");
    let cmd = im.command().clone().set_flag("--listen", &im_addr);
    im.restart_with(cmd);
    let after = im_processes(&im);
    assert_eq!(
        before, after,
        "the instance manager did not re-adopt its processes as they were"
    );
    let metrics = reqwest_get(&format!("http://{}/metrics", im.addr("metrics")));
    assert!(
        metrics.contains(&format!(
            "corral_im_processes{{state=\"running\"}} {}",
            after.len()
        )),
        "{metrics}"
    );
    load.wait_rounds(3, "IO after the instance manager restarted");
    // The manager keeps using the restarted instance manager: a detach stops the daemons through it.
    let v = wait_healthy(&m, "vol1", 2, Duration::from_secs(60));
    assert_eq!(daemon_pids(&v), (engine_pid, replica_pids.clone()));

    let (rounds, errors, written) = load.finish();
    eprintln!(
        "qemu-io rounds: {rounds} in all, {in_flight} before the manager's SIGKILL, {} errors",
        errors.len()
    );
    assert!(errors.is_empty(), "IO errors: {errors:?}");
    assert!(rounds >= 15, "{rounds} rounds");
    // Every slot holds the last pattern written to it.
    let cmds: Vec<String> = written
        .iter()
        .map(|(slot, p)| format!("read -P {p} {} 1M", slot << 20))
        .collect();
    let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let (ok_read, out) = qemu_io(&uri, &refs);
    assert!(ok_read, "data after the restarts: {out}");

    let (code, _) = rest("POST", &format!("{}/v1/volumes/vol1/detach", m.url), None);
    assert_eq!(code, 200);
    wait_for(
        "the instance manager stopped the daemons",
        Duration::from_secs(60),
        || (!pid_alive(engine_pid) && replica_pids.iter().all(|p| !pid_alive(*p))).then_some(()),
    );
}

fn reqwest_get(url: &str) -> String {
    let out = std::process::Command::new("curl")
        .args(["-sf", url])
        .output()
        .unwrap();
    assert!(out.status.success(), "GET {url}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_instance_manager_refuses_bad_requests_and_runs_and_stops_a_replica() {
    let dir = tempfile::tempdir().unwrap();
    let im = start_im(&dir.path().join("im"), &[]);
    let replica_dir = dir.path().join("r1");
    rt().block_on(async {
        let mut c = im_client(&im).await;
        let create = |name: &str, binary: &str| v1::ProcessCreateRequest {
            name: name.into(),
            kind: "replica".into(),
            binary: binary.into(),
            args: [
                "serve",
                "--dir",
                replica_dir.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--data-listen",
                "127.0.0.1:0",
                "--sync-listen",
                "127.0.0.1:0",
                "--size",
                "4194304",
                "--volume",
                "v",
            ]
            .map(String::from)
            .to_vec(),
            env: Default::default(),
        };
        for binary in ["sh", "/bin/sh", "../corral-replica", "corral-manager"] {
            let e = c.process_create(create("r1", binary)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{binary}: {e:?}");
            assert!(e.message().contains("not a data-plane binary"), "{e:?}");
        }
        for name in ["../r1", "a/b", "..", ".r1", ""] {
            let e = c
                .process_create(create(name, "corral-replica"))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name:?}: {e:?}");
            assert!(e.message().contains("process name"), "{e:?}");
        }
        let mut own_ready = create("r1", "corral-replica");
        own_ready.args.extend(["--ready-file".into(), "/tmp/x".into()]);
        let e = c.process_create(own_ready).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);

        let p = c
            .process_create(create("r1", "corral-replica"))
            .await
            .unwrap()
            .into_inner();
        assert!(p.pid > 0);
        let e = c
            .process_create(create("r1", "corral-replica"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
        assert!(e.message().contains("delete it first"), "{e:?}");
        let running = testkit::wait_for_async("the replica running", Duration::from_secs(60), async || {
            let p = c
                .process_get(v1::ProcessGetRequest { name: "r1".into() })
                .await
                .unwrap()
                .into_inner();
            (p.state == i32::from(v1::InstanceProcessState::Running)).then_some(p)
        })
        .await;
        assert!(running.listen.contains_key("control"), "{running:?}");
        std::net::TcpStream::connect(&running.listen["control"]).unwrap();
        let log = c
            .process_log(v1::ProcessLogRequest {
                name: "r1".into(),
                lines: 5,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!log.lines.is_empty() && log.lines.len() <= 5, "{log:?}");
        let e = c
            .process_get(v1::ProcessGetRequest { name: "nope".into() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);

        let gone = c
            .process_delete(v1::ProcessDeleteRequest {
                name: "r1".into(),
                grace_ms: 5000,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(gone.deleted);
        assert!(!pid_alive(i64::from(p.pid)));
        assert!(
            c.process_list(v1::ProcessListRequest {})
                .await
                .unwrap()
                .into_inner()
                .processes
                .is_empty()
        );
    });
    // The debug CLI.
    let out = std::process::Command::new(workspace_bin("corral-im"))
        .args(["version", "--url", im.addr("grpc")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("instance API v1"), "{text}");
}

#[test]
fn a_manager_refuses_an_instance_manager_speaking_an_older_api() {
    let dir = tempfile::tempdir().unwrap();
    let node_dir = dir.path().join("n1");
    let im = start_node_im(
        &workspace_bin("corral-im"),
        &node_dir,
        "node-1",
        "embedded",
        &[("CORRAL_IM_API_VERSION", "0")],
    );
    let err = Manager::command(&node_dir, "node-1", "embedded", port_range(0), &[])
        .args(["--instance-manager", &format!("http://{}", im.addr("grpc"))])
        .try_spawn()
        .expect_err("a manager on an instance manager too old for it");
    let text = err.to_string();
    assert!(
        text.contains("speaks instance API v0")
            && text.contains("needs v1")
            && text.contains("Upgrade the node's instance manager"),
        "{text}"
    );
}

/// Builds `corral-im` as an older data plane — `CORRAL_IM_FEATURES=v1`, version `<crate>-v1only` — into a target
/// dir of its own (`<target>/im-v1only`, only `-p instance-manager`: the workspace's `corral-im`, which other tests
/// run meanwhile, is left alone). Returns the binary and the version it reports.
fn build_v1_only_im() -> (std::path::PathBuf, String) {
    let version = format!("{}-v1only", env!("CARGO_PKG_VERSION"));
    let target = testkit::docker::target_dir().join("im-v1only");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let started = Instant::now();
    testkit::docker::run(
        std::process::Command::new(cargo)
            .args([
                "build",
                "--locked",
                "-p",
                "instance-manager",
                "--bin",
                "corral-im",
            ])
            // This workspace (the manager's parent directory), whichever checkout the test kit was built from.
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap())
            .env("CARGO_TARGET_DIR", &target)
            .env("CORRAL_IM_FEATURES", "v1")
            .env("CORRAL_BUILD_VERSION", &version),
    );
    eprintln!("v1-only corral-im built in {:?}", started.elapsed());
    (target.join("debug").join("corral-im"), version)
}

#[test]
fn a_manager_refuses_what_an_older_data_plane_cannot_run_and_runs_a_v1_volume_there() {
    let (old_im_bin, old_version) = build_v1_only_im();
    let dir = tempfile::tempdir().unwrap();
    let etcd = testkit::servers::Etcd::start(dir.path());
    let store = format!("etcd://{}", etcd.endpoint());
    // node-0: the current data plane; node-1: the older one. Each manager on its node's instance manager.
    let im0 = start_node_im(
        &workspace_bin("corral-im"),
        &dir.path().join("n0"),
        "node-0",
        &store,
        &[],
    );
    let im1 = start_node_im(&old_im_bin, &dir.path().join("n1"), "node-1", &store, &[]);
    let managers: Vec<Manager> = [&im0, &im1]
        .iter()
        .enumerate()
        .map(|(i, im)| {
            let i = u16::try_from(i).unwrap();
            let node_dir = dir.path().join(format!("n{i}"));
            let daemon = Manager::command(&node_dir, &format!("node-{i}"), &store, port_range(i), &[])
                .args(["--instance-manager", &format!("http://{}", im.addr("grpc"))])
                .spawn();
            Manager {
                url: daemon.http_url("http"),
                daemon,
                data_dir: node_dir,
                node_id: format!("node-{i}"),
            }
        })
        .collect();
    let m0 = &managers[0];
    wait_nodes_ready(m0, 2);

    // Each node records its data plane's version and features; `corral node ls` shows them.
    wait_for(
        "node-1 reports its v1-only data plane",
        Duration::from_secs(30),
        || {
            let (_, n) = rest("GET", &format!("{}/v1/nodes/node-1", m0.url), None);
            (n["dataPlaneVersion"] == old_version.as_str() && n["dataPlaneFeatures"] == json!(["v1"]))
                .then_some(())
        },
    );
    let (_, n0) = rest("GET", &format!("{}/v1/nodes/node-0", m0.url), None);
    assert_eq!(
        n0["dataPlaneFeatures"],
        json!(corral_proto::data_plane::ALL),
        "{n0}"
    );
    let ls = ok(&m0.url, &["node", "ls"]);
    assert!(ls.contains(&format!("{old_version} (v1)")), "{ls}");

    // The older instance manager itself refuses a process its build cannot run.
    let refused = rt().block_on(async {
        im_client(&im1)
            .await
            .process_create(v1::ProcessCreateRequest {
                name: "lvstore-x".into(),
                kind: "lvstore".into(),
                binary: "corral-replica".into(),
                args: vec!["serve-lvstore".into()],
                env: Default::default(),
            })
            .await
            .expect_err("a v1-only data plane starting a v2 lvstore")
    });
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("missing v2"), "{refused:?}");

    // Two replicas without a revision counter need two nodes that support it (replicas on distinct nodes):
    // refused, naming node-1, its data plane's version and the missing feature; nothing is created.
    let (code, body) = rest(
        "PUT",
        &format!("{}/v1/settings/replica-soft-anti-affinity", m0.url),
        Some(&json!({"value": "false"})),
    );
    assert_eq!(code, 200, "{body}");
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/volumes", m0.url),
        Some(
            &json!({"name": "norc", "size": 16 << 20, "numberOfReplicas": 2, "disableRevisionCounter": true}),
        ),
    );
    let msg = body.to_string();
    assert_eq!(code, 409, "{body}");
    assert!(
        msg.contains("node node-1")
            && msg.contains(&old_version)
            && msg.contains("lacks disable-revision-counter"),
        "{msg}"
    );
    let (code, _) = rest("GET", &format!("{}/v1/volumes/norc", m0.url), None);
    assert_eq!(code, 404, "a refused volume was half-created");

    // One such replica fits on node-0: placement skips node-1 for it. The engine cannot go on node-1 either.
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/volumes", m0.url),
        Some(
            &json!({"name": "norc", "size": 16 << 20, "numberOfReplicas": 1, "disableRevisionCounter": true}),
        ),
    );
    assert_eq!(code, 201, "{body}");
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/volumes/norc/attach", m0.url),
        Some(&json!({"nodeId": "node-1"})),
    );
    let msg = body.to_string();
    assert_eq!(code, 409, "{body}");
    assert!(
        msg.contains("node node-1") && msg.contains(&old_version) && msg.contains("disable-revision-counter"),
        "{msg}"
    );
    let v = volume(m0, "norc");
    assert!(v["nodeId"].is_null() && v["state"] == "detached", "{v}");
    attach(&m0.url, "norc");
    let v = wait_healthy(m0, "norc", 1, Duration::from_secs(90));
    assert_eq!(replica_nodes(&v), ["node-0".to_owned()].into(), "{v}");

    // A plain v1 volume runs on the older data plane: its engine and a replica in node-1's instance manager.
    let (code, body) = rest(
        "POST",
        &format!("{}/v1/volumes", m0.url),
        Some(&json!({"name": "plain", "size": 16 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{body}");
    let uri = attach(&managers[1].url, "plain");
    let v = wait_healthy(&managers[1], "plain", 2, Duration::from_secs(90));
    let (engine_pid, _) = daemon_pids(&v);
    let pids: Vec<i64> = im_processes(&im1).values().map(|p| i64::from(p.0)).collect();
    assert!(
        pids.contains(&engine_pid),
        "engine {engine_pid} not in the v1-only instance manager: {pids:?}"
    );
    let (written, out) = qemu_io(&uri, &["write -P 7 0 1M", "flush", "read -P 7 0 1M"]);
    assert!(written, "IO through the older data plane: {out}");
    drop(managers);
}

/// `--tls auto` with an instance manager (issue 40): the manager's first start writes the node's directory
/// `<data-dir>/tls`; a `corral-im` given that directory (`CORRAL_TLS_DIR`, the shared data directory) runs the
/// volume's daemons under it: qemu-io through the engine, the instance manager and the engine refuse a plaintext
/// client and answer the node's certificate, and every daemon got the directory.
#[test]
fn an_instance_manager_on_the_nodes_auto_tls_directory_runs_a_volume_under_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let node_dir = dir.path().join("n1");
    let auto = |extra: &[&str]| {
        Manager::command(&node_dir, "node-1", "embedded", port_range(0), &[])
            .args(["--tls", "auto"])
            .args(extra)
    };
    let mut first = Manager::spawn(auto(&[]), &node_dir, "node-1");
    first.kill();
    let tls = node_dir.join("tls");
    let tls_str = tls.display().to_string();
    let im = start_im(&node_dir, &[("CORRAL_TLS_DIR", tls_str.as_str())]);
    let im_url = format!("http://{}", im.addr("grpc"));
    let m = Manager::spawn(auto(&["--instance-manager", &im_url]), &node_dir, "node-1");

    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "vol1", "size": 32 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, "vol1");
    let v = wait_healthy(&m, "vol1", 2, Duration::from_secs(90));
    let (ok, out) = qemu_io(&uri, &["write -P 0x3c 0 4M", "flush", "read -P 0x3c 0 4M"]);
    assert!(ok, "{out}");
    let (engine_pid, replica_pids) = daemon_pids(&v);
    for pid in std::iter::once(engine_pid).chain(replica_pids) {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let want = format!("CORRAL_TLS_DIR={tls_str}");
        assert!(
            env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()),
            "daemon {pid} lacks {want}"
        );
    }
    let ours = Some(testkit::TestPki::client(&tls));
    let engine = v["engine"]["address"].as_str().unwrap().to_owned();
    let im_addr = im.addr("grpc").to_owned();
    rt().block_on(async {
        support::tls::engine_answers(&engine, &ours).await.unwrap();
        assert!(
            support::tls::engine_answers(&engine, &None).await.is_err(),
            "the engine answered plaintext"
        );
        let call = |tls: support::tls::Client| {
            let im_addr = im_addr.clone();
            async move {
                let ch = corral_proto::grpc::connect_with(
                    &im_addr,
                    corral_proto::grpc::GrpcTimeouts::CONTROL,
                    tls.as_ref(),
                )
                .await
                .map_err(|e| e.to_string())?;
                InstanceServiceClient::new(ch)
                    .process_list(v1::ProcessListRequest {})
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        call(ours.clone()).await.unwrap();
        assert!(
            call(None).await.is_err(),
            "the instance manager answered plaintext"
        );
    });
}
