//! Multi-process harness for engine tests: real `corral-replica` and `corral-engine` daemons on loopback, real
//! NBD clients (qemu-io, qemu-img, nbdinfo). Every wait polls with a deadline; every process is killed on drop.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use corral_proto::v1::{self, controller_service_client::ControllerServiceClient};
use data_protocol::{ClientConfig, DataClient};

/// Path of a workspace binary (built by `cargo test --workspace` / nextest, or `cargo build --bins`).
pub fn bin(name: &str) -> PathBuf {
    if name == "corral-engine" {
        return PathBuf::from(env!("CARGO_BIN_EXE_corral-engine"));
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        p.exists(),
        "{} missing: build it first (cargo build --workspace --bins)",
        p.display()
    );
    p
}

/// A free port (or, with `n` > 1, `n` consecutive free ports) on 127.0.0.1.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..500 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        drop(l);
        if p > 65000 {
            continue;
        }
        if (0..n).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
    panic!("no {n} consecutive free ports");
}

fn wait_port(port: u16, what: &str, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited before it served: {st}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} not ready on port {port} within 30 s");
}

/// A replica daemon.
pub struct Replica {
    pub child: Child,
    pub port: u16,
    pub dir: PathBuf,
}

impl Replica {
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        Self::start_on(dir, free_ports(3), extra)
    }

    pub fn start_on(dir: &Path, port: u16, extra: &[&str]) -> Self {
        let mut child = Command::new(bin("corral-replica"))
            .args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        for p in [port, port + 1, port + 2] {
            wait_port(p, "corral-replica", &mut child);
        }
        Self {
            child,
            port,
            dir: dir.to_owned(),
        }
    }

    pub fn address(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// Reads the whole volume through this replica's data port (its chain flattened).
    pub async fn flattened(&self, size: u64) -> Vec<u8> {
        let c = DataClient::connect(&format!("127.0.0.1:{}", self.port + 1), ClientConfig::default())
            .await
            .unwrap();
        let mut out = vec![0u8; usize::try_from(size).unwrap()];
        for (i, chunk) in out.chunks_mut(4 << 20).enumerate() {
            c.read(i as u64 * (4 << 20), chunk).await.unwrap();
        }
        c.close().await;
        out
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An engine daemon.
pub struct Engine {
    pub child: Child,
    pub port: u16,
    pub nbd_port: u16,
    pub socket: PathBuf,
    pub volume: String,
    pub log: PathBuf,
}

impl Engine {
    /// Starts an engine over `replicas`, NBD on a unix socket in `dir` and on TCP; waits until both serve.
    pub fn start(dir: &Path, volume: &str, size: u64, replicas: &[String], extra: &[&str]) -> Self {
        let (port, nbd_port) = (free_ports(1), free_ports(1));
        let socket = dir.join(format!("{volume}.sock"));
        let log = dir.join(format!("engine-{port}.log"));
        let mut cmd = Command::new(bin("corral-engine"));
        cmd.args(["serve", "--volume", volume, "--size", &size.to_string()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--nbd-listen")
            .arg(format!("unix:{}", socket.display()))
            .args(["--nbd-listen", &format!("tcp:127.0.0.1:{nbd_port}")])
            .args(["--replica-timeout", "4"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for r in replicas {
            cmd.args(["--replica", r]);
        }
        let mut child = cmd.spawn().unwrap();
        wait_port(port, "corral-engine", &mut child);
        wait_port(nbd_port, "corral-engine NBD", &mut child);
        Self {
            child,
            port,
            nbd_port,
            socket,
            volume: volume.to_owned(),
            log,
        }
    }

    /// Runs `corral-engine serve` expecting it to fail; returns its stderr.
    pub fn start_failing(volume: &str, size: u64, replicas: &[String]) -> String {
        let mut cmd = Command::new(bin("corral-engine"));
        cmd.args([
            "serve",
            "--volume",
            volume,
            "--size",
            &size.to_string(),
            "--listen",
            &format!("127.0.0.1:{}", free_ports(1)),
        ]);
        for r in replicas {
            cmd.args(["--replica", r]);
        }
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "engine started although it should not");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    pub fn unix_uri(&self) -> String {
        format!("nbd+unix:///{}?socket={}", self.volume, self.socket.display())
    }

    pub fn tcp_uri(&self) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.nbd_port, self.volume)
    }

    pub async fn client(&self) -> ControllerServiceClient<tonic::transport::Channel> {
        ControllerServiceClient::connect(format!("http://127.0.0.1:{}", self.port))
            .await
            .unwrap()
    }

    pub async fn modes(&self) -> Vec<(String, String)> {
        let r = self
            .client()
            .await
            .replica_list(v1::Empty {})
            .await
            .unwrap()
            .into_inner();
        r.replicas.into_iter().map(|x| (x.address, x.mode)).collect()
    }

    /// The corral-engine CLI against this engine.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin("corral-engine"))
            .args(["--url", &format!("127.0.0.1:{}", self.port)])
            .args(args)
            .output()
            .unwrap()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs qemu-io with `-c` commands against `uri`; returns (success, stdout+stderr).
pub fn qemu_io(uri: &str, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", uri]);
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = c.output().expect("qemu-io (apt-get install qemu-utils)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io exits 0 even for some failed commands; a verification failure prints this.
    let ok =
        out.status.success() && !text.contains("Pattern verification failed") && !text.contains("failed:");
    (ok, text)
}

/// Polls `f` until it returns true or the deadline passes.
pub async fn eventually(what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {secs} s");
}
