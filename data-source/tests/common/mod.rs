//! Test harness: a data-source process (the test kit's daemon: port 0, ready file, killed on drop), a disk directory, and a tiny HTTP file server
//! whose behaviour (Range support, a cut half way, silence) the test chooses.
#![allow(dead_code, clippy::missing_panics_doc, clippy::cast_possible_truncation)]

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use data_source::{FileInfo, FileState};
use sha2::{Digest, Sha512};
use testkit::{Daemon, DaemonCommand, wait_for};

pub const DISK_UUID: &str = "disk-0f6e9a4e";

/// A disk directory with its identity file.
pub fn disk() -> tempfile::TempDir {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    corral_disk::identity::write_disk_config(d.path(), DISK_UUID).unwrap();
    d
}

/// Names of the entries of `<disk>/tmp` (sorted).
pub fn tmp_entries(disk: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(disk.join("tmp"))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub fn sha512_file(path: &Path) -> String {
    use std::io::Read;
    let mut h = Sha512::new();
    let mut f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    hex::encode(h.finalize())
}

pub fn sha512(b: &[u8]) -> String {
    hex::encode(Sha512::digest(b))
}

/// A running `corral-datasource serve` on port 0 (the address comes from its ready file); killed on drop.
pub struct DataSourceProc {
    daemon: Daemon,
    pub addr: SocketAddr,
    pub base: String,
    pub client: reqwest::blocking::Client,
    pub disk: PathBuf,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_corral-datasource")
}

/// Base arguments for `serve` on `disk` (name `img`, uuid `u1`) on any free port.
pub fn serve_args(disk: &Path, source_type: &str) -> Vec<String> {
    [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--disk-path",
        disk.to_str().unwrap(),
        "--disk-uuid",
        DISK_UUID,
        "--name",
        "img",
        "--uuid",
        "u1",
        "--source-type",
        source_type,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

impl DataSourceProc {
    /// Starts a data source with `extra` arguments after the base ones; waits until it reports ready.
    pub fn start(disk: &Path, source_type: &str, extra: &[&str]) -> Self {
        Self::start_with_env(disk, source_type, extra, &[])
    }

    /// [`DataSourceProc::start`] with extra environment variables.
    pub fn start_with_env(disk: &Path, source_type: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = DaemonCommand::new(bin())
            .args(serve_args(disk, source_type))
            .args(extra)
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let daemon = cmd.spawn();
        let addr = daemon.socket_addr("http");
        DataSourceProc {
            daemon,
            addr,
            base: format!("http://{addr}"),
            client: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .unwrap(),
            disk: disk.to_path_buf(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// SIGTERM; the exit status within `grace` (`None`: it had to be killed).
    pub fn terminate(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        self.daemon.terminate(grace)
    }

    /// Starts a `download` source of `url` with `extra` arguments.
    pub fn download(disk: &Path, url: &str, extra: &[&str]) -> Self {
        let param = format!("url={url}");
        let mut args = vec!["--param", param.as_str()];
        args.extend_from_slice(extra);
        Self::start(disk, "download", &args)
    }

    /// Polls until the state is `want`.
    pub fn wait_state(&self, want: FileState) {
        wait_for(&format!("state {want}"), Duration::from_secs(20), || {
            (self.info().state == want).then_some(())
        });
    }

    pub fn info(&self) -> FileInfo {
        self.client
            .get(format!("{}/v1/file", self.base))
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    /// Polls until the state is final (ready-for-transfer, ready or failed) or `limit` passes.
    pub fn wait_final(&self, limit: Duration) -> FileInfo {
        wait_for("a final state", limit, || {
            Some(self.info()).filter(|i| i.state.is_final())
        })
    }

    pub fn post(&self, query: &str) -> reqwest::blocking::Response {
        self.client
            .post(format!("{}/v1/file?{query}", self.base))
            .send()
            .unwrap()
    }

    pub fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.base))
            .send()
            .unwrap()
            .text()
            .unwrap()
    }

    /// Value of a counter/gauge line starting with `name` in /metrics.
    pub fn metric(&self, name: &str) -> u64 {
        let text = self.metrics();
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == name).then(|| v.trim().parse::<f64>().ok())?
            })
            .map_or_else(|| panic!("no metric {name} in\n{text}"), |v| v as u64)
    }

    /// Asserts the ready file has `sha` and returns its info.
    pub fn expect_ready(&self, sha: &str) -> FileInfo {
        let i = self.wait_final(Duration::from_secs(60));
        assert_eq!(i.state, FileState::ReadyForTransfer, "{i:?}");
        assert_eq!(i.progress, 100);
        assert_eq!(i.current_checksum, sha, "{i:?}");
        assert_eq!(sha512_file(Path::new(&i.file_path)), sha);
        assert_eq!(tmp_entries(&self.disk), vec!["img-u1".to_owned()]);
        i
    }
}

/// How the test file server behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServeMode {
    /// Answer `Range: bytes=N-` with 206.
    pub range: bool,
    /// Cut the connection of the first response after this many body bytes.
    pub cut_after: Option<u64>,
    /// With `cut_after`: instead of cutting, keep the connection open and send nothing more (a silently dead
    /// connection).
    pub stall: bool,
    /// Accept, then never answer.
    pub silent: bool,
}

impl ServeMode {
    /// Answers Range requests.
    pub fn range() -> Self {
        ServeMode {
            range: true,
            ..Default::default()
        }
    }

    /// Accepts, never answers.
    pub fn silent() -> Self {
        ServeMode {
            silent: true,
            ..Default::default()
        }
    }
}

pub struct FileServer {
    pub url: String,
    /// Body bytes sent over all responses.
    pub sent: Arc<AtomicU64>,
    pub requests: Arc<AtomicU64>,
    _shutdown: tokio::sync::oneshot::Sender<()>,
    _thread: std::thread::JoinHandle<()>,
}

struct Served {
    data: Bytes,
    mode: ServeMode,
    cut_done: AtomicBool,
    sent: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

fn range_start(h: &HeaderMap) -> Option<u64> {
    h.get(header::RANGE)?
        .to_str()
        .ok()?
        .strip_prefix("bytes=")?
        .strip_suffix('-')?
        .parse()
        .ok()
}

async fn serve_file(State(s): State<Arc<Served>>, headers: HeaderMap) -> Response {
    s.requests.fetch_add(1, Ordering::Relaxed);
    if s.mode.silent {
        std::future::pending::<()>().await;
    }
    let len = s.data.len() as u64;
    let (status, start) = match range_start(&headers) {
        Some(n) if s.mode.range && n < len => (StatusCode::PARTIAL_CONTENT, n),
        _ => (StatusCode::OK, 0),
    };
    let cut = match s.mode.cut_after {
        Some(c) if !s.cut_done.swap(true, Ordering::Relaxed) => Some(c),
        _ => None,
    };
    let data = s.data.slice(usize::try_from(start).unwrap()..);
    let sent = s.sent.clone();
    let stall = s.mode.stall;
    let stream = futures::stream::unfold((data, 0u64), move |(rest, off)| {
        let sent = sent.clone();
        async move {
            if rest.is_empty() {
                return None;
            }
            if let Some(c) = cut
                && off >= c
            {
                if stall {
                    std::future::pending::<()>().await;
                }
                return Some((Err(std::io::Error::other("cut by the test")), (Bytes::new(), off)));
            }
            let n = rest.len().min(64 << 10);
            let n = cut.map_or(n, |c| n.min(usize::try_from(c - off).unwrap().max(1)));
            let chunk = rest.slice(..n);
            sent.fetch_add(n as u64, Ordering::Relaxed);
            Some((Ok::<_, std::io::Error>(chunk), (rest.slice(n..), off + n as u64)))
        }
    });
    let mut b = Response::builder()
        .status(status)
        .header(header::CONTENT_LENGTH, len - start);
    if status == StatusCode::PARTIAL_CONTENT {
        b = b.header(header::CONTENT_RANGE, format!("bytes {start}-{}/{len}", len - 1));
    }
    if s.mode.range {
        b = b.header(header::ACCEPT_RANGES, "bytes");
    }
    b.body(Body::from_stream(stream)).unwrap()
}

impl FileServer {
    /// Serves `data` at `http://127.0.0.1:P/image` on its own runtime thread.
    pub fn start(data: Vec<u8>, mode: ServeMode) -> Self {
        let listener = StdListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let served = Arc::new(Served {
            data: Bytes::from(data),
            mode,
            cut_done: AtomicBool::new(false),
            sent: sent.clone(),
            requests: requests.clone(),
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let app = axum::Router::new()
                    .route("/image", axum::routing::get(serve_file))
                    .with_state(served);
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        FileServer {
            url: format!("http://{addr}/image"),
            sent,
            requests,
            _shutdown: tx,
            _thread: thread,
        }
    }
}

/// Writes a raw image of `size` bytes with a data pattern in some places and holes elsewhere; returns its bytes.
pub fn raw_image(path: &Path, size: u64) -> Vec<u8> {
    let mut data = vec![0u8; usize::try_from(size).unwrap()];
    let mut x: u32 = 0x1234_5678;
    // Data in every 4th MiB (with a partial block at the end of each), zeros elsewhere.
    for (i, b) in data.iter_mut().enumerate() {
        if (i >> 20) % 4 == 0 && (i & 0xfffff) < (1 << 20) - 1000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = (x >> 24) as u8;
        }
    }
    std::fs::write(path, &data).unwrap();
    data
}

/// A qcow2 image made by qemu-img from a raw image of `size` bytes; returns its bytes.
pub fn qcow2_image(dir: &Path, size: u64) -> Vec<u8> {
    let raw = dir.join("src.raw");
    raw_image(&raw, size);
    let q = dir.join("src.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2"], &[&raw, &q]);
    std::fs::read(q).unwrap()
}

/// Runs `qemu-img ARGS PATHS...` and asserts it succeeds.
pub fn qemu_img(args: &[&str], paths: &[&Path]) {
    let st = Command::new("qemu-img").args(args).args(paths).status().unwrap();
    assert!(st.success(), "qemu-img {args:?} {paths:?}: {st}");
}

/// Allocated bytes of a file.
pub fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}
