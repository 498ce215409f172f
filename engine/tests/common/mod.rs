//! Multi-process harness for engine tests: real `corral-replica` and `corral-engine` daemons on loopback, started
//! through the test kit on port 0 (each reports its ports in its ready file), real NBD clients (qemu-io, qemu-img,
//! nbdinfo). Every process is killed on drop.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use corral_proto::ReplicaAddress;
use corral_proto::v1::{
    self, controller_service_client::ControllerServiceClient, replica_service_client::ReplicaServiceClient,
    sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use testkit::{Daemon, DaemonCommand, workspace_bin};
use tonic::transport::Channel;

/// Path of a workspace binary (built by `cargo build --workspace --bins`).
pub fn bin(name: &str) -> PathBuf {
    if name == "corral-engine" {
        return PathBuf::from(env!("CARGO_BIN_EXE_corral-engine"));
    }
    workspace_bin(name)
}

/// The data engine a test replica runs on: v1 (`corral-replica serve`, a directory of sparse files) or v2
/// (`corral-replica serve-lvstore`, an lvol chain in an lvstore on a preallocated file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataEngine {
    V1,
    V2,
}

/// Bytes of the preallocated file a v2 test replica's lvstore lives on.
pub const V2_DISK_BYTES: u64 = 512 << 20;

/// Runs `$name(DataEngine::V1)` and `$name(DataEngine::V2)` as two tests, `$name::v1` and `$name::v2` (the
/// same test, parameterised over the data engine).
#[macro_export]
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v1() {
                super::$name($crate::common::DataEngine::V1).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v2() {
                super::$name($crate::common::DataEngine::V2).await;
            }
        }
    )*};
}

/// Whether replicas serve the data protocol on a unix socket too, as the manager starts them (the engine then
/// reaches them there): the default. `CORRAL_TEST_REPLICA_DATA=tcp` runs the suites over TCP only, the path
/// of a replica on another node (CONTRIBUTING.md).
pub fn local_data_socket() -> bool {
    std::env::var("CORRAL_TEST_REPLICA_DATA").as_deref() != Ok("tcp")
}

/// Where the replica of `dir` serves the data protocol on a unix socket (beside the directory).
pub fn data_socket(dir: &Path) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push(".data.sock");
    PathBuf::from(s)
}

/// A replica daemon.
pub struct Replica {
    pub daemon: Daemon,
    pub dir: PathBuf,
    /// v2: the replica's name in the lvstore (its listeners are `NAME.control` etc. in the ready file).
    pub lvstore_replica: Option<String>,
}

impl Replica {
    /// Starts `corral-replica serve` on free ports.
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        Self::spawn(dir, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", extra)
    }

    /// Starts a replica on `engine`: v1 as [`start`](Self::start); v2 as a `corral-replica serve-lvstore` daemon
    /// over `dir/disk.img` (preallocated, formatted at first start) hosting one replica `r`. `extra` may hold
    /// `--size N` and `--disable-revision-counter` for v2 (the replica is then created at once), or `--tls-dir DIR`
    /// (the daemon serves under mutual TLS; not with `--size`, whose create call is plaintext).
    pub fn start_on(engine: DataEngine, dir: &Path, extra: &[&str]) -> Self {
        if engine == DataEngine::V1 {
            return Self::start(dir, extra);
        }
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk.img");
        if !disk.exists() {
            let st = Command::new("fallocate")
                .args(["-l", &V2_DISK_BYTES.to_string()])
                .arg(&disk)
                .status()
                .unwrap();
            assert!(st.success(), "fallocate {}", disk.display());
        }
        let mut cmd = DaemonCommand::new(bin("corral-replica"))
            .label("corral-replica-lvstore")
            .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
            .arg(&disk)
            .args(["--listen", "127.0.0.1:0", "--replica", "r"]);
        let tls_dir = extra.iter().position(|a| *a == "--tls-dir").map(|i| extra[i + 1]);
        if let Some(dir) = tls_dir {
            cmd = cmd.args(["--tls-dir", dir]);
        }
        if local_data_socket() {
            // `dir/r.data.sock`, as the manager gives every lvstore daemon a socket directory.
            cmd = cmd.arg("--data-unix-dir").arg(dir);
        }
        let daemon = cmd.spawn();
        let r = Self {
            daemon,
            dir: dir.to_owned(),
            lvstore_replica: Some("r".into()),
        };
        let size = extra
            .iter()
            .position(|a| *a == "--size")
            .map(|i| extra[i + 1].to_owned());
        let disable_rc = extra.contains(&"--disable-revision-counter");
        assert!(
            extra.iter().all(
                |a| ["--size", "--disable-revision-counter", "--tls-dir"].contains(a)
                    || Some(*a) == size.as_deref()
                    || Some(*a) == tls_dir
            ),
            "v2 test replicas take only --size, --disable-revision-counter and --tls-dir: {extra:?}"
        );
        if let Some(size) = size {
            let size = corral_daemon::parse_size(&size).unwrap();
            let addr = r.replica_address();
            std::thread::spawn(move || {
                tokio::runtime::Runtime::new().unwrap().block_on(async move {
                    ReplicaServiceClient::connect(addr.control.grpc_uri())
                        .await
                        .unwrap()
                        .replica_create(v1::ReplicaCreateRequest {
                            size,
                            disable_revision_counter: disable_rc,
                        })
                        .await
                        .unwrap();
                });
            })
            .join()
            .unwrap();
        }
        r
    }

    /// Name of listener `what` (`control`, `data`, `sync`) of this replica in its daemon's ready file.
    fn listener(&self, what: &str) -> String {
        match &self.lvstore_replica {
            Some(n) => format!("{n}.{what}"),
            None => what.to_owned(),
        }
    }

    /// Starts `corral-replica serve` on free ports, serving the data protocol on TCP only (whatever
    /// `CORRAL_TEST_REPLICA_DATA` says): the engine reaches it as a replica on another node.
    pub fn start_tcp_only(dir: &Path, extra: &[&str]) -> Self {
        Self::spawn_with(dir, ["127.0.0.1:0"; 3], false, extra)
    }

    fn spawn(dir: &Path, control: &str, data: &str, sync: &str, extra: &[&str]) -> Self {
        Self::spawn_with(dir, [control, data, sync], local_data_socket(), extra)
    }

    fn spawn_with(dir: &Path, [control, data, sync]: [&str; 3], unix: bool, extra: &[&str]) -> Self {
        let mut cmd = DaemonCommand::new(bin("corral-replica"))
            .label("corral-replica")
            .args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", control, "--data-listen", data, "--sync-listen", sync]);
        if unix && !extra.contains(&"--data-unix") {
            cmd = cmd.arg("--data-unix").arg(data_socket(dir));
        }
        let daemon = cmd.args(extra).spawn();
        Self {
            daemon,
            dir: dir.to_owned(),
            lvstore_replica: None,
        }
    }

    /// The address the engine takes: the endpoints the replica reported.
    pub fn replica_address(&self) -> ReplicaAddress {
        ReplicaAddress::tcp(
            "127.0.0.1",
            self.daemon.port(&self.listener("control")),
            self.daemon.port(&self.listener("data")),
            self.daemon.port(&self.listener("sync")),
        )
    }

    /// [`replica_address`](Self::replica_address) in its text form, as the engine reports it.
    pub fn address(&self) -> String {
        self.replica_address().to_string()
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Sends `sig` (as `kill` takes it: `-STOP`, `-CONT`) to the daemon.
    pub fn signal(&self, sig: &str) {
        let st = std::process::Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig} {}", self.pid());
    }

    /// `ReplicaService` on the control endpoint.
    pub async fn control(&self) -> ReplicaServiceClient<Channel> {
        ReplicaServiceClient::connect(self.daemon.http_url(&self.listener("control")))
            .await
            .unwrap()
    }

    /// `SyncAgentService` on the sync endpoint.
    pub async fn sync_agent(&self) -> SyncAgentServiceClient<Channel> {
        SyncAgentServiceClient::connect(self.daemon.http_url(&self.listener("sync")))
            .await
            .unwrap()
    }

    /// `ReplicaBackupService` on the sync endpoint.
    pub async fn backup_service(
        &self,
    ) -> corral_proto::v1::replica_backup_service_client::ReplicaBackupServiceClient<Channel> {
        corral_proto::v1::replica_backup_service_client::ReplicaBackupServiceClient::connect(
            self.daemon.http_url(&self.listener("sync")),
        )
        .await
        .unwrap()
    }

    /// The replica's state (`ReplicaGet`).
    pub async fn status(&self) -> v1::Replica {
        self.control()
            .await
            .replica_get(v1::Empty {})
            .await
            .unwrap()
            .into_inner()
            .replica
            .unwrap()
    }

    /// Reads the whole volume through this replica's data endpoint (its chain flattened).
    pub async fn flattened(&self, size: u64) -> Vec<u8> {
        let c = DataClient::connect(self.daemon.addr(&self.listener("data")), ClientConfig::default())
            .await
            .unwrap();
        let mut out = vec![0u8; usize::try_from(size).unwrap()];
        for (i, chunk) in out.chunks_mut(4 << 20).enumerate() {
            c.read(i as u64 * (4 << 20), chunk).await.unwrap();
        }
        c.close().await;
        out
    }

    /// What an operation that fails must leave as it found: v1, the files of the replica directory; v2, the
    /// files beside the lvstore's disk (a clone's or rebuild's staging directory) and the store's used clusters
    /// (a half-received lvol holds some).
    pub async fn layout(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "revision.counter" && n != "volume.meta")
            .collect();
        v.sort();
        if self.lvstore_replica.is_some() {
            let info = corral_proto::v1::lvstore_service_client::LvstoreServiceClient::connect(
                self.daemon.http_url("control"),
            )
            .await
            .unwrap()
            .lvstore_info(v1::LvstoreEmpty {})
            .await
            .unwrap()
            .into_inner();
            v.push(format!("used clusters: {}", info.used_clusters));
        }
        v
    }

    /// Bytes snapshot `file` holds itself (a v1 file's allocation, a v2 lvol's allocated blocks), as `ReplicaGet`
    /// reports it.
    pub async fn snapshot_allocated(&self, file: &str) -> u64 {
        self.status().await.disks[file].size
    }

    pub fn kill(&mut self) {
        self.daemon.kill();
    }
}

/// An engine daemon.
pub struct Engine {
    pub daemon: Daemon,
    pub socket: PathBuf,
    pub volume: String,
}

impl Engine {
    /// Starts an engine over `replicas`, NBD on a unix socket in `dir` and on TCP; returns once both serve.
    pub fn start(dir: &Path, volume: &str, size: u64, replicas: &[String], extra: &[&str]) -> Self {
        let socket = dir.join(format!("{volume}.sock"));
        let mut cmd = DaemonCommand::new(bin("corral-engine"))
            .label(format!("corral-engine-{volume}"))
            .args(["serve", "--volume", volume, "--size", &size.to_string()])
            .args(["--listen", "127.0.0.1:0"])
            .arg("--nbd-listen")
            .arg(format!("unix:{}", socket.display()))
            .args(["--nbd-listen", "tcp:127.0.0.1:0"])
            .args(["--replica-timeout", "4"])
            .args(extra);
        for r in replicas {
            cmd = cmd.args(["--replica", r]);
        }
        Self {
            daemon: cmd.spawn(),
            socket,
            volume: volume.to_owned(),
        }
    }

    /// Runs `corral-engine serve` expecting it to fail; returns its stderr.
    pub fn start_failing(volume: &str, size: u64, replicas: &[String]) -> String {
        let mut cmd = Command::new(bin("corral-engine"));
        cmd.args(["serve", "--volume", volume, "--size", &size.to_string()])
            .args(["--listen", "127.0.0.1:0"]);
        for r in replicas {
            cmd.args(["--replica", r]);
        }
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "engine started although it should not");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// `HOST:PORT` of the engine's gRPC listener (what `--url` takes).
    pub fn url(&self) -> &str {
        self.daemon.addr("control")
    }

    pub fn unix_uri(&self) -> String {
        format!("nbd+unix:///{}?socket={}", self.volume, self.socket.display())
    }

    pub fn tcp_uri(&self) -> String {
        format!("nbd://{}/{}", self.daemon.addr("nbd"), self.volume)
    }

    pub async fn client(&self) -> ControllerServiceClient<Channel> {
        ControllerServiceClient::connect(self.daemon.http_url("control"))
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
            .args(["--url", self.url()])
            .args(args)
            .output()
            .unwrap()
    }

    pub fn kill(&mut self) {
        self.daemon.kill();
    }
}
