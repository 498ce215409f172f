//! Test support for the manager's tests: a `corral-manager` per node started through the test kit (port 0, ready
//! file), REST calls, the CLI. Waiting, etcd, qemu-io and killing a node's daemons come from `testkit`. Every REST
//! call and CLI run here presents the admin token the first manager wrote to its data directory ([`admin_token`]).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use testkit::{Daemon, DaemonCommand, kill_under};

pub mod tls;
pub mod v2_images;

/// A `corral-manager` process; SIGKILLed on drop together with every daemon under its data directory.
pub struct Manager {
    pub daemon: Daemon,
    /// `http://127.0.0.1:PORT` of its REST API (the port it reported).
    pub url: String,
    pub data_dir: PathBuf,
    pub node_id: String,
}

/// The data directories of the managers this test started: where [`admin_token`] looks.
static DATA_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The admin token the managers of this test share: the one the first of them wrote to its data directory on its
/// first start (`manager::token::BOOTSTRAP_FILE`; the others of a cluster find tokens in the store and write none).
pub fn admin_token() -> Option<String> {
    let dirs = DATA_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    dirs.iter().find_map(|d| {
        std::fs::read_to_string(d.join(manager::token::BOOTSTRAP_FILE))
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
    })
}

/// Remembers `data_dir` as one of this test's managers' (for [`admin_token`]).
pub fn remember_data_dir(data_dir: &Path) {
    let mut dirs = DATA_DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !dirs.iter().any(|d| d == data_dir) {
        dirs.push(data_dir.to_owned());
    }
}

/// The managers this test started, by the base URL of their API: which data directory's token a request to a URL
/// presents ([`admin_token_for`]); a test may run managers of several clusters, each with its own admin token.
static MANAGER_URLS: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

fn remember_manager_url(url: &str, data_dir: &Path) {
    let mut urls = MANAGER_URLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    urls.retain(|(u, _)| u != url);
    urls.push((url.to_owned(), data_dir.to_owned()));
}

/// The admin token for a request to `url`: the one in the data directory of the manager serving it when that
/// manager wrote one (the first of its cluster), else [`admin_token`] (another manager of the same cluster).
pub fn admin_token_for(url: &str) -> Option<String> {
    let dir = MANAGER_URLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .find(|(base, _)| url.starts_with(base.as_str()))
        .map(|(_, d)| d.clone());
    dir.and_then(|d| {
        std::fs::read_to_string(d.join(manager::token::BOOTSTRAP_FILE))
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
    })
    .or_else(admin_token)
}

/// `corral` presenting the admin token (`CORRAL_TOKEN`).
pub fn cli_command() -> Command {
    let mut cmd = Command::new(cli_bin());
    if let Some(t) = admin_token() {
        cmd.env("CORRAL_TOKEN", t);
    }
    cmd
}

/// `corral` presenting the admin token of the manager at `url` ([`admin_token_for`]; `--url` is the caller's).
pub fn cli_command_for(url: &str) -> Command {
    let mut cmd = cli_command();
    if let Some(t) = admin_token_for(url) {
        cmd.env("CORRAL_TOKEN", t);
    }
    cmd
}

/// `curl` presenting the admin token.
pub fn curl_command() -> Command {
    let mut cmd = Command::new("curl");
    if let Some(t) = admin_token() {
        cmd.args(["-H", &format!("authorization: Bearer {t}")]);
    }
    cmd
}

pub fn manager_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corral-manager"))
}

pub fn cli_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corral"))
}

/// The ports a node's `corral-bim` sync receivers lease (every daemon listener is on port 0): a slice per node of
/// this test process, so the managers of one test do not compete; a receiver skips ports another process holds.
pub fn port_range(i: u16) -> (u16, u16) {
    let slot = u16::try_from(std::process::id() % 60).unwrap_or(0);
    let base = 20000 + slot * 200 + i * 50;
    (base, base + 50)
}

impl Manager {
    pub fn start(data_dir: &Path, node_id: &str, store: &str, ports: (u16, u16)) -> Manager {
        Self::start_with_env(data_dir, node_id, store, ports, &[])
    }

    /// [`Manager::start`] with extra environment variables, which the daemons it starts inherit (e.g. a
    /// `CORRAL_BIM_*` flag of every `corral-bim`).
    pub fn start_with_env(
        data_dir: &Path,
        node_id: &str,
        store: &str,
        ports: (u16, u16),
        env: &[(&str, &str)],
    ) -> Manager {
        Self::spawn(
            Self::command(data_dir, node_id, store, ports, env),
            data_dir,
            node_id,
        )
    }

    /// Starts `cmd` ([`Manager::command`] with more flags) as the manager of `node_id` on `data_dir`.
    /// The test's own gRPC clients then present its node certificate ([`tls::node_client`]).
    pub fn spawn(cmd: DaemonCommand, data_dir: &Path, node_id: &str) -> Manager {
        let daemon = cmd.spawn();
        remember_manager_url(&daemon.http_url("http"), data_dir);
        let tls = node_tls_dir(data_dir);
        if tls.join("tls.key").exists() {
            tls::use_node(&tls);
        }
        Manager {
            url: daemon.http_url("http"),
            daemon,
            data_dir: data_dir.to_owned(),
            node_id: node_id.to_owned(),
        }
    }

    /// The command [`Manager::start_with_env`] runs, to add flags or to run it another way.
    pub fn command(
        data_dir: &Path,
        node_id: &str,
        store: &str,
        ports: (u16, u16),
        env: &[(&str, &str)],
    ) -> DaemonCommand {
        std::fs::create_dir_all(data_dir).unwrap();
        remember_data_dir(data_dir);
        let bin = manager_bin();
        let mut cmd = DaemonCommand::new(&bin);
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        cmd.label(format!("corral-manager-{node_id}"))
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", "127.0.0.1:0", "--node-id", node_id, "--store", store])
            .arg("--bin-dir")
            .arg(bin.parent().unwrap())
            .args(["--port-range", &format!("{}-{}", ports.0, ports.1)])
            .env("RUST_LOG", "info,manager=debug")
            .env("NO_COLOR", "1")
            .log_to(data_dir.join("manager.log"))
    }

    /// Starts the manager again (after [`Manager::kill`]) on the port it had: clients and the node document keep
    /// its address.
    pub fn restart(&mut self) {
        let listen = self.daemon.addr("http").to_owned();
        let cmd = self.daemon.command().clone().set_flag("--listen", listen);
        self.daemon.restart_with(cmd);
        self.url = self.daemon.http_url("http");
        remember_manager_url(&self.url, &self.data_dir);
    }

    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// SIGKILL the manager and every daemon started for this node.
    pub fn kill_node(&mut self) {
        self.kill();
        kill_under(&self.data_dir);
    }

    /// The node's TLS directory this manager issued (`--tls auto`, the default): see [`node_tls_dir`].
    pub fn tls_dir(&self) -> PathBuf {
        node_tls_dir(&self.data_dir)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("manager.log")).unwrap_or_default()
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.kill_node();
    }
}

/// DATA_DIR/tls, where a manager with `--tls auto` (the default) issues its node's certificate: what a test's own
/// client of the manager's daemons presents — in process ([`tls::node_client`]), a CLI or a daemon started by hand
/// (`CORRAL_TLS_DIR`).
pub fn node_tls_dir(data_dir: &Path) -> PathBuf {
    data_dir.join(manager::pki::NODE_DIR)
}

/// Issues `data_dir`'s node directory from the store's CA before anything serves there (`corral-manager
/// --tls-issue-only`, as a deployment's init step does): for a `corral-im` started before the node's manager.
pub fn issue_node_tls(data_dir: &Path, node_id: &str, store: &str) -> PathBuf {
    std::fs::create_dir_all(data_dir).unwrap();
    let out = Command::new(manager_bin())
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--node-id", node_id, "--store", store, "--tls-issue-only"])
        .env("NO_COLOR", "1")
        .output()
        .expect("corral-manager --tls-issue-only");
    assert!(
        out.status.success(),
        "corral-manager --tls-issue-only: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = node_tls_dir(data_dir);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        dir.canonicalize().unwrap().display().to_string()
    );
    dir
}

/// Blocking JSON REST calls with curl (no runtime needed in the tests), as the admin.
pub fn rest(method: &str, url: &str, body: Option<&serde_json::Value>) -> (u16, serde_json::Value) {
    rest_as(admin_token_for(url).as_deref(), method, url, body)
}

/// [`rest`] presenting `token` (None: no Authorization header).
pub fn rest_as(
    token: Option<&str>,
    method: &str,
    url: &str,
    body: Option<&serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut cmd = Command::new("curl");
    if let Some(t) = token {
        cmd.args(["-H", &format!("authorization: Bearer {t}")]);
    }
    cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", method, url]);
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d", &b.to_string()]);
    }
    let out = cmd.output().expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    let code: u16 = code.trim().parse().unwrap_or(0);
    let v = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    (code, v)
}

pub fn pid_alive(pid: i64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
}

pub fn sigkill(pid: i64) {
    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
}

/// Runs the `corral` CLI against `url`; returns (success, stdout, stderr).
pub fn corral(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = cli_command_for(url)
        .args(["--url", url])
        .args(args)
        .output()
        .expect("corral");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// GET a volume from `m`'s REST API (must exist).
pub fn volume(m: &Manager, name: &str) -> serde_json::Value {
    let (code, v) = rest("GET", &format!("{}/v1/volumes/{name}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

/// The `nbd+unix://` endpoint of a volume document.
pub fn unix_endpoint(v: &serde_json::Value) -> String {
    v["endpoints"]
        .as_array()
        .and_then(|e| {
            e.iter()
                .find(|e| e.as_str().is_some_and(|s| s.starts_with("nbd+unix")))
        })
        .and_then(serde_json::Value::as_str)
        .expect("unix endpoint")
        .to_owned()
}

/// Runs the `corral` CLI against `url` and asserts success; returns stdout.
pub fn ok(url: &str, args: &[&str]) -> String {
    let (ok, out, err) = corral(url, args);
    assert!(ok, "corral {args:?}: {out}{err}");
    out
}

/// `corral volume attach NAME` (waits); returns the `nbd+unix://` URI it prints.
pub fn attach(url: &str, name: &str) -> String {
    let out = ok(url, &["volume", "attach", name, "--timeout", "90"]);
    out.lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .unwrap_or_else(|| panic!("attach {name} prints the NBD URI: {out}"))
        .to_owned()
}

/// `qemu-img compare` of two raw images (files or NBD URIs); a larger side must read zeros past the other's end.
pub fn qemu_img_compare(a: &str, b: &str) {
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", a, b])
        .output()
        .expect("qemu-img");
    assert!(
        out.status.success(),
        "qemu-img compare {a} {b}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `n` managers (`node-0`..) on one etcd, each with its own data directory under `dir`.
pub fn start_cluster(dir: &std::path::Path, n: u16) -> (testkit::servers::Etcd, Vec<Manager>) {
    let etcd = testkit::servers::Etcd::start(dir);
    let store = format!("etcd://{}", etcd.endpoint());
    let ms = (0..n)
        .map(|i| {
            Manager::start(
                &dir.join(format!("n{i}")),
                &format!("node-{i}"),
                &store,
                port_range(i),
            )
        })
        .collect();
    (etcd, ms)
}

/// Waits until `n` nodes report ready through `m`.
pub fn wait_nodes_ready(m: &Manager, n: usize) {
    testkit::wait_for("every node ready", std::time::Duration::from_secs(30), || {
        let (_, v) = rest("GET", &format!("{}/v1/nodes", m.url), None);
        let ready = v
            .as_array()
            .map_or(0, |a| a.iter().filter(|n| n["ready"] == true).count());
        (ready == n).then_some(())
    });
}

/// How many of a volume view's replicas are RW.
pub fn rw_replicas(v: &serde_json::Value) -> usize {
    v["replicas"]
        .as_array()
        .map_or(0, |rs| rs.iter().filter(|r| r["mode"] == "RW").count())
}

/// The nodes a volume view's replicas are on.
pub fn replica_nodes(v: &serde_json::Value) -> std::collections::BTreeSet<String> {
    v["replicas"]
        .as_array()
        .expect("a volume view lists its replicas")
        .iter()
        .map(|r| r["nodeId"].as_str().expect("a replica names its node").to_owned())
        .collect()
}

/// The disks of a volume view's replicas, sorted (one entry per replica).
pub fn replica_disks(v: &serde_json::Value) -> Vec<String> {
    let mut disks: Vec<String> = v["replicas"]
        .as_array()
        .expect("a volume view lists its replicas")
        .iter()
        .map(|r| r["disk"].as_str().expect("a replica names its disk").to_owned())
        .collect();
    disks.sort_unstable();
    disks
}

/// Waits until volume `name` of `m` is attached, healthy and has `replicas` RW replicas; returns its view.
pub fn wait_healthy(
    m: &Manager,
    name: &str,
    replicas: usize,
    timeout: std::time::Duration,
) -> serde_json::Value {
    testkit::wait_for(&format!("{name} attached and healthy"), timeout, || {
        let v = volume(m, name);
        (v["state"] == "attached" && v["robustness"] == "healthy" && rw_replicas(&v) == replicas).then_some(v)
    })
}

/// Python's `http.server` over a directory (no Range support: downloads start from the beginning).
pub struct HttpServer {
    daemon: Daemon,
}

impl HttpServer {
    pub fn start(dir: &Path) -> Self {
        // It cannot report a port it bound: the test kit's probed port, retried when another process took it.
        let daemon = testkit::ports::retry_on_address_in_use(|| {
            let port = testkit::ports::unbound_port();
            DaemonCommand::new("python3")
                .args([
                    "-m",
                    "http.server",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--directory",
                ])
                .arg(dir)
                .listening_on("http", format!("127.0.0.1:{port}"))
                .try_spawn()
        });
        HttpServer { daemon }
    }

    pub fn url(&self, file: &str) -> String {
        format!("{}/{file}", self.daemon.http_url("http"))
    }
}
