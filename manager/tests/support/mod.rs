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
