//! Test support: free ports, polling with deadlines, an etcd server started for the test and killed after.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a loopback port")
}

/// Polls `f` every 100 ms until it returns Some, panicking with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A running `etcd` in a temp dir; killed on drop.
pub struct Etcd {
    pub child: Child,
    pub port: u16,
    pub peer: u16,
    pub dir: PathBuf,
}

impl Etcd {
    pub fn start(dir: &Path) -> Etcd {
        let port = free_port();
        let peer = free_port();
        let log = std::fs::File::create(dir.join("etcd.log")).expect("etcd log");
        let url = format!("http://127.0.0.1:{port}");
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd (Debian package etcd-server)");
        let e = Etcd {
            child,
            port,
            peer,
            dir: dir.to_owned(),
        };
        e.wait_ready();
        e
    }

    pub fn wait_ready(&self) {
        let url = format!("http://127.0.0.1:{}/health", self.port);
        wait_for("etcd /health", Duration::from_secs(20), || {
            let out = Command::new("curl").args(["-sf", &url]).output().ok()?;
            String::from_utf8_lossy(&out.stdout)
                .contains("true")
                .then_some(())
        });
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILL and start again on the same data directory and ports.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let url = format!("http://127.0.0.1:{}", self.port);
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("etcd log");
        let peer = self.peer;
        self.child = Command::new("etcd")
            .arg("--data-dir")
            .arg(self.dir.join("etcd"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("restart etcd");
        self.wait_ready();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `corral-manager` process; SIGKILLed on drop together with every daemon under its data directory.
pub struct Manager {
    pub child: Option<Child>,
    pub url: String,
    pub listen: String,
    pub data_dir: PathBuf,
    pub node_id: String,
    pub store: String,
    pub ports: (u16, u16),
}

pub fn manager_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corral-manager"))
}

pub fn cli_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corral"))
}

/// A port range for node `i` of this test process: tests run in parallel processes, each gets its own slice.
pub fn port_range(i: u16) -> (u16, u16) {
    let slot = u16::try_from(std::process::id() % 60).unwrap_or(0);
    let base = 20000 + slot * 200 + i * 50;
    (base, base + 50)
}

impl Manager {
    pub fn start(data_dir: &Path, node_id: &str, store: &str, ports: (u16, u16)) -> Manager {
        let port = free_port();
        let mut m = Manager {
            child: None,
            url: format!("http://127.0.0.1:{port}"),
            listen: format!("127.0.0.1:{port}"),
            data_dir: data_dir.to_owned(),
            node_id: node_id.to_owned(),
            store: store.to_owned(),
            ports,
        };
        m.spawn();
        m
    }

    pub fn spawn(&mut self) {
        std::fs::create_dir_all(&self.data_dir).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data_dir.join("manager.log"))
            .unwrap();
        let bin = manager_bin();
        let child = Command::new(&bin)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args([
                "--listen",
                &self.listen,
                "--node-id",
                &self.node_id,
                "--store",
                &self.store,
            ])
            .arg("--bin-dir")
            .arg(bin.parent().unwrap())
            .args(["--port-range", &format!("{}-{}", self.ports.0, self.ports.1)])
            .env("RUST_LOG", "info,manager=debug")
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start corral-manager");
        self.child = Some(child);
        let url = format!("{}/healthz", self.url);
        wait_for("manager /healthz", Duration::from_secs(30), || {
            let out = Command::new("curl").args(["-sf", &url]).output().ok()?;
            out.status.success().then_some(())
        });
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL the manager and every daemon started for this node.
    pub fn kill_node(&mut self) {
        self.kill();
        kill_under(&self.data_dir);
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

/// SIGKILL every process whose command line mentions `dir`.
pub fn kill_under(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == i32::try_from(std::process::id()).unwrap_or(0) {
            continue;
        }
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

/// Blocking JSON REST calls with curl (no runtime needed in the tests).
pub fn rest(method: &str, url: &str, body: Option<&serde_json::Value>) -> (u16, serde_json::Value) {
    let mut cmd = Command::new("curl");
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

/// qemu-io against an NBD URI; returns (success, output).
pub fn qemu_io(uri: &str, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", uri]);
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = c.output().expect("qemu-io");
    let s = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ok = out.status.success() && !s.contains("failed") && !s.contains("error");
    (ok, s)
}

/// Runs the `corral` CLI against `url`; returns (success, stdout, stderr).
pub fn corral(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(cli_bin())
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
