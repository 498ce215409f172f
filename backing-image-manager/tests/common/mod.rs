//! Harness for the manager's tests: real `corral-bim` daemons on loopback, each on its own disk directory, and a
//! small stand-in for a data source's HTTP API. Every wait polls with a deadline; every process dies on drop.

#![allow(dead_code, clippy::cast_possible_truncation)]

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backing_image_manager::client::BimClient;
use corral_proto::v1;
use sha2::{Digest, Sha512};
use testkit::{Daemon, DaemonCommand, wait_for_async};

/// A plaintext HTTP client (reqwest's own TLS default needs a provider this crate's build lacks:
/// `sparse_sync::reqwest_tls`).
pub fn http() -> reqwest::Client {
    sparse_sync::reqwest_tls(reqwest::Client::builder(), None)
        .build()
        .expect("an HTTP client")
}

/// `GET url` with [`http`].
pub async fn get(url: impl reqwest::IntoUrl) -> reqwest::Result<reqwest::Response> {
    http().get(url).send().await
}

pub const MIB: u64 = 1 << 20;

/// A disk directory with its identity file (under /var/tmp: a real filesystem with holes and FIEMAP).
pub struct Disk {
    pub dir: tempfile::TempDir,
    pub uuid: String,
}

impl Disk {
    pub fn new(uuid: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("bim-disk-")
            .tempdir_in("/var/tmp")
            .unwrap();
        corral_disk::identity::write_disk_config(dir.path(), uuid).unwrap();
        Disk {
            dir,
            uuid: uuid.to_owned(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn image_dir(&self, name: &str, uuid: &str) -> PathBuf {
        self.path().join("backing-images").join(format!("{name}-{uuid}"))
    }

    pub fn backing(&self, name: &str, uuid: &str) -> PathBuf {
        self.image_dir(name, uuid).join("backing")
    }

    /// Entries under `backing-images/` (sorted).
    pub fn image_dirs(&self) -> Vec<String> {
        let mut v: Vec<String> = match fs::read_dir(self.path().join("backing-images")) {
            Ok(rd) => rd
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => Vec::new(),
        };
        v.sort();
        v
    }
}

/// Writes a sparse test image of `size` bytes: 1 MiB of a pattern every other MiB (half holes).
pub fn write_image(path: &Path, size: u64, seed: u8) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut off = 0;
    while off < size {
        let len = MIB.min(size - off);
        let chunk: Vec<u8> = (0..len)
            .map(|i| {
                ((i / 4096) as u8)
                    .wrapping_mul(31)
                    .wrapping_add(seed)
                    .wrapping_add((off / MIB) as u8)
                    | 1
            })
            .collect();
        f.write_all_at(&chunk, off).unwrap();
        off += 2 * MIB;
    }
    f.sync_all().unwrap();
}

pub fn sha512_hex(path: &Path) -> String {
    hex::encode(Sha512::digest(fs::read(path).unwrap()))
}

pub fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).unwrap().blocks() * 512
}

/// A running `corral-bim serve` on port 0 (the addresses come from its ready file); killed on drop.
pub struct Bim {
    daemon: Daemon,
    /// The client config of its `CORRAL_TLS_DIR`: the test's gRPC client presents it.
    tls: Option<Arc<corral_tls::rustls::ClientConfig>>,
}

impl Bim {
    /// Starts a manager on `disk` with a receiver port range of `range_len` ports and waits until it serves.
    ///
    /// The receivers still listen on a range (port 0 receivers are not implemented in the bim), so the range is the
    /// test kit's probe; a port of it taken by another process in between is skipped by the bim, not fatal.
    pub fn start(disk: &Disk, range_len: u16, extra: &[&str]) -> Self {
        Self::start_with_env(disk, range_len, extra, &[])
    }

    /// [`start`](Self::start) with environment variables (`CORRAL_TLS_DIR`).
    pub fn start_with_env(disk: &Disk, range_len: u16, extra: &[&str], envs: &[(&str, &Path)]) -> Self {
        let range = testkit::ports::unbound_port_run(range_len);
        let cmd = DaemonCommand::new(env!("CARGO_BIN_EXE_corral-bim"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--disk-path",
            ])
            .arg(disk.path())
            .args(["--disk-uuid", &disk.uuid])
            .args(["--port-range", &format!("{range}-{}", range + range_len - 1)])
            .args(extra);
        let cmd = envs.iter().fold(cmd, |cmd, (k, v)| cmd.env(k, v));
        // Waiting for the ready file blocks this thread: tell the (multi-thread) runtime.
        let daemon = tokio::task::block_in_place(|| cmd.spawn());
        let tls = envs
            .iter()
            .find(|(k, _)| *k == corral_tls::TLS_DIR_ENV)
            .map(|(_, dir)| testkit::TestPki::client(dir));
        Bim { daemon, tls }
    }

    pub fn log_text(&self) -> String {
        self.daemon.log_text()
    }

    /// The gRPC address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.daemon.addr("grpc").to_owned()
    }

    pub fn http(&self) -> String {
        self.daemon.http_url("http")
    }

    pub async fn client(&self) -> BimClient {
        let timeouts = corral_proto::grpc::GrpcTimeouts::CONTROL;
        let ch = corral_proto::grpc::connect_with(&self.addr(), timeouts, self.tls.as_ref()).await;
        BimClient::new(ch.unwrap())
    }

    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self) {
        let st = self.daemon.terminate(Duration::from_secs(20));
        assert!(
            st.is_some_and(|s| s.success()),
            "corral-bim did not exit cleanly on SIGTERM ({st:?}): {}",
            self.log_text()
        );
    }

    /// Kills the daemon (unless it already exited) and starts it again: same disk, same ports as before.
    pub fn restart(&mut self) {
        let cmd = self
            .daemon
            .command()
            .clone()
            .set_flag("--listen", self.addr())
            .set_flag("--http-listen", self.daemon.addr("http"));
        tokio::task::block_in_place(|| self.daemon.restart_with(cmd));
    }

    pub async fn get(&self, name: &str) -> Result<v1::BimImage, tonic::Status> {
        self.client()
            .await
            .get(v1::BimImageRef {
                name: name.to_owned(),
                uuid: String::new(),
            })
            .await
            .map(tonic::Response::into_inner)
    }

    /// Waits until `name` reports `state`, failing early on an unexpected final state.
    pub async fn wait_state(&self, name: &str, state: &str, secs: u64) -> v1::BimImage {
        wait_for_async(
            &format!("{name} to be {state}"),
            Duration::from_secs(secs),
            async || {
                let img = self.get(name).await.ok()?;
                let st = img.status.clone().unwrap_or_default();
                assert!(
                    !(st.state == "failed" && state == "ready"),
                    "{name} failed: {}\n{}",
                    st.message,
                    self.log_text()
                );
                (st.state == state).then_some(img)
            },
        )
        .await
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let text = get(format!("{}/metrics", self.http()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
            .unwrap_or_else(|| panic!("metric {name} missing in {text}"))
    }
}

pub fn spec(name: &str, uuid: &str, size: u64, checksum: &str) -> Option<v1::BimImageSpec> {
    Some(v1::BimImageSpec {
        name: name.to_owned(),
        uuid: uuid.to_owned(),
        size,
        checksum: checksum.to_owned(),
    })
}

pub fn state(img: &v1::BimImage) -> String {
    img.status.clone().unwrap_or_default().state
}

/// Puts an image file at its place on `disk` (uuid `u1`) and has `bim` adopt it with a Fetch without data source.
pub async fn place_and_fetch(bim: &Bim, disk: &Disk, name: &str, size: u64, seed: u8) -> String {
    let path = disk.backing(name, "u1");
    write_image(&path, size, seed);
    let sum = sha512_hex(&path);
    bim.client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec(name, "u1", size, &sum),
            data_source_address: String::new(),
        })
        .await
        .unwrap();
    bim.wait_state(name, "ready", 30).await;
    sum
}

/// A stand-in for a data source's HTTP API (`GET /v1/file`, `POST /v1/file?action=transfer`) serving a fixed JSON
/// document; counts transfers.
pub struct FakeDataSource {
    pub addr: String,
    pub transfers: Arc<Mutex<u32>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeDataSource {
    pub async fn start(info: serde_json::Value) -> Self {
        use axum::routing::get;
        let transfers = Arc::new(Mutex::new(0));
        let t = transfers.clone();
        let info = Arc::new(Mutex::new(info));
        let i2 = info.clone();
        let app = axum::Router::new().route(
            "/v1/file",
            get(move || {
                let info = info.clone();
                async move { axum::Json(info.lock().unwrap().clone()) }
            })
            .post(move || {
                let (t, info) = (t.clone(), i2.clone());
                async move {
                    *t.lock().unwrap() += 1;
                    info.lock().unwrap()["state"] = "ready".into();
                    axum::Json(info.lock().unwrap().clone())
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            axum::serve(l, app).await.unwrap();
        });
        FakeDataSource {
            addr,
            transfers,
            task,
        }
    }

    /// The JSON a data source reports for a finished file at `<disk>/tmp/<name>-<uuid>`.
    pub fn ready_info(disk: &Disk, name: &str, uuid: &str) -> serde_json::Value {
        let path = disk.path().join("tmp").join(format!("{name}-{uuid}"));
        let size = fs::metadata(&path).unwrap().len();
        serde_json::json!({
            "name": name, "uuid": uuid, "sourceType": "download", "parameters": {},
            "diskUUID": disk.uuid, "filePath": path.to_str().unwrap(), "size": size, "virtualSize": size,
            "realSize": allocated(&path), "state": "ready-for-transfer", "progress": 100, "processedSize": size,
            "expectedChecksum": "", "currentChecksum": sha512_hex(&path), "message": ""
        })
    }
}

impl Drop for FakeDataSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP listener that accepts and never answers (a sync receiver that hangs).
pub fn black_hole() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}
