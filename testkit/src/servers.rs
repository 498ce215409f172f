//! Third-party servers tests run for real: an S3 endpoint (`rclone serve s3`) and `etcd`. Neither can report a port
//! it picked, so each gets probed ports ([`crate::ports`]) and is started again on others when one was taken.

use std::path::Path;
use std::time::Duration;

use crate::daemon::{Daemon, DaemonCommand};
use crate::ports::{retry_on_address_in_use, unbound_port};

/// The access key pair of [`S3Server`]: pass as `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.
pub const S3_ENV: [(&str, &str); 2] = [
    ("AWS_ACCESS_KEY_ID", "corral"),
    ("AWS_SECRET_ACCESS_KEY", "corral-secret"),
];

/// `rclone serve s3 DIR` on loopback (a bucket per subdirectory of DIR); killed on drop.
pub struct S3Server {
    pub daemon: Daemon,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl S3Server {
    /// Serves `dir` with rclone's `extra` flags (e.g. `--bwlimit`).
    ///
    /// # Panics
    /// When rclone is missing (`scripts/test.sh` installs it) or does not serve.
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let daemon = retry_on_address_in_use(|| {
            let addr = format!("127.0.0.1:{}", unbound_port());
            DaemonCommand::new("rclone")
                .label("rclone-s3")
                .args(["serve", "s3"])
                .arg(dir)
                .args(["--addr", &addr, "--auth-key", "corral,corral-secret"])
                .args(extra)
                .listening_on("http", &addr)
                .try_spawn()
        });
        Self {
            endpoint: daemon.http_url("http"),
            daemon,
        }
    }
}

/// `rclone serve http DIR` on loopback: plain GETs of the files in DIR, with `Content-Length` (a stand-in for a
/// download URL); killed on drop.
pub struct HttpFileServer {
    pub daemon: Daemon,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl HttpFileServer {
    /// # Panics
    /// When rclone is missing or does not serve.
    pub fn start(dir: &Path) -> Self {
        let daemon = retry_on_address_in_use(|| {
            let addr = format!("127.0.0.1:{}", unbound_port());
            DaemonCommand::new("rclone")
                .label("rclone-http")
                .args(["serve", "http"])
                .arg(dir)
                .args(["--addr", &addr])
                .listening_on("http", &addr)
                .try_spawn()
        });
        Self {
            endpoint: daemon.http_url("http"),
            daemon,
        }
    }
}

/// A single-member `etcd` with its data in a directory; killed on drop.
pub struct Etcd {
    pub daemon: Daemon,
}

impl Etcd {
    /// Starts etcd with its data under `dir/etcd` and waits until it reports healthy.
    ///
    /// # Panics
    /// When etcd is missing (Debian package `etcd-server`) or does not become healthy.
    pub fn start(dir: &Path) -> Self {
        let daemon =
            retry_on_address_in_use(|| Self::command(dir, unbound_port(), unbound_port()).try_spawn());
        let e = Etcd { daemon };
        e.wait_healthy();
        e
    }

    fn command(dir: &Path, client: u16, peer: u16) -> DaemonCommand {
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        DaemonCommand::new("etcd")
            .arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .listening_on("client", format!("127.0.0.1:{client}"))
            .listening_on("peer", format!("127.0.0.1:{peer}"))
    }

    fn wait_healthy(&self) {
        let url = format!("{}/health", self.daemon.http_url("client"));
        crate::poll::wait_for("etcd /health", Duration::from_secs(20), || {
            let out = std::process::Command::new("curl")
                .args(["-sf", &url])
                .output()
                .ok()?;
            String::from_utf8_lossy(&out.stdout)
                .contains("true")
                .then_some(())
        });
    }

    /// `127.0.0.1:PORT` of the client listener.
    pub fn endpoint(&self) -> String {
        self.daemon.addr("client").to_owned()
    }

    /// SIGKILL and start again on the same data directory and ports.
    pub fn restart(&mut self) {
        // The command names its ports explicitly: the restart binds the same ones.
        self.daemon.restart();
        self.wait_healthy();
    }
}
