//! Test backends and server harnesses shared by the integration tests.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use data_protocol::{
    BackendError, BlockBackend, DataServer, ErrorKind, ServerConfig, ServerMetrics, VolumeInfo,
};
use tokio_util::sync::CancellationToken;

pub const SECTOR: u32 = 512;

/// A volume in memory, with switches for failure injection and a gate that holds requests back.
pub struct MemBackend {
    data: Mutex<Vec<u8>>,
    pub no_space: AtomicBool,
    /// Writes ask the server to drop their connection.
    pub drop_connection_on_write: AtomicBool,
    /// While closed, every request waits inside the backend.
    gate: Gate,
    /// Requests currently inside the backend, and the most seen at once.
    pub inside: AtomicUsize,
    pub max_inside: AtomicUsize,
    /// Reads at this offset (and flushes, with `slow_flush`) wait until `release_slow_read`.
    slow_read_offset: Option<u64>,
    slow_flush: bool,
    slow_gate: Gate,
    pub completed: AtomicUsize,
    pub flushes: AtomicUsize,
    /// What `flush_at_pool` answers.
    pub flush_at_pool: AtomicBool,
}

impl MemBackend {
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(Self::build(size, None))
    }

    /// Reads at `offset` are held in the backend until [`release_slow_read`](Self::release_slow_read).
    pub fn with_slow_read(size: usize, offset: u64) -> Arc<Self> {
        let backend = Self::build(size, Some(offset));
        backend.slow_gate.set(false);
        Arc::new(backend)
    }

    /// Flushes are held in the backend until [`release_slow_read`](Self::release_slow_read).
    pub fn with_slow_flush(size: usize) -> Arc<Self> {
        let mut backend = Self::build(size, None);
        backend.slow_flush = true;
        backend.slow_gate.set(false);
        Arc::new(backend)
    }

    pub fn release_slow_read(&self) {
        self.slow_gate.set(true);
    }

    fn build(size: usize, slow_read_offset: Option<u64>) -> Self {
        Self {
            data: Mutex::new(vec![0; size]),
            no_space: AtomicBool::new(false),
            drop_connection_on_write: AtomicBool::new(false),
            gate: Gate::default(),
            inside: AtomicUsize::new(0),
            max_inside: AtomicUsize::new(0),
            slow_read_offset,
            slow_flush: false,
            slow_gate: Gate::default(),
            completed: AtomicUsize::new(0),
            flushes: AtomicUsize::new(0),
            flush_at_pool: AtomicBool::new(false),
        }
    }

    pub fn close_gate(&self) {
        self.gate.set(false);
    }

    pub fn open_gate(&self) {
        self.gate.set(true);
    }

    /// Puts data in place without going through the protocol.
    pub fn preload(&self, offset: u64, data: &[u8]) {
        let start = usize::try_from(offset).unwrap();
        self.data.lock().unwrap()[start..start + data.len()].copy_from_slice(data);
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.data.lock().unwrap().clone()
    }

    fn enter(&self) -> InsideGuard<'_> {
        let now = self.inside.fetch_add(1, SeqCst) + 1;
        self.max_inside.fetch_max(now, SeqCst);
        self.gate.wait_open();
        InsideGuard(self)
    }

    fn range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, BackendError> {
        let size = self.data.lock().unwrap().len();
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match start.checked_add(len) {
            Some(end) if end <= size => Ok(start..end),
            _ => Err(BackendError::new(
                ErrorKind::OutOfRange,
                format!("{offset}+{len} beyond {size}"),
            )),
        }
    }
}

struct InsideGuard<'a>(&'a MemBackend);

impl Drop for InsideGuard<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, SeqCst);
        self.0.completed.fetch_add(1, SeqCst);
    }
}

impl BlockBackend for MemBackend {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        let size = self.data.lock().unwrap().len() as u64;
        Ok(VolumeInfo {
            size,
            sector_size: SECTOR,
            name: "vol-test".to_owned(),
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let _inside = self.enter();
        if self.slow_read_offset == Some(offset) {
            self.slow_gate.wait_open();
        }
        let r = self.range(offset, buf.len())?;
        buf.copy_from_slice(&self.data.lock().unwrap()[r]);
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError> {
        let _inside = self.enter();
        if self.no_space.load(SeqCst) {
            return Err(BackendError::new(ErrorKind::NoSpace, "disk full"));
        }
        if self.drop_connection_on_write.load(SeqCst) {
            return Err(BackendError::new(ErrorKind::DropConnection, "test drop"));
        }
        let r = self.range(offset, buf.len())?;
        self.data.lock().unwrap()[r].copy_from_slice(buf);
        Ok(())
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.write_zeroes(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        let _inside = self.enter();
        let r = self.range(offset, usize::try_from(len).unwrap())?;
        self.data.lock().unwrap()[r].fill(0);
        Ok(())
    }

    fn flush(&self) -> Result<(), BackendError> {
        let _inside = self.enter();
        if self.slow_flush {
            self.slow_gate.wait_open();
        }
        self.flushes.fetch_add(1, SeqCst);
        Ok(())
    }

    fn flush_at_pool(&self) -> bool {
        self.flush_at_pool.load(SeqCst)
    }
}

#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    fn set(&self, open: bool) {
        *self.closed.lock().unwrap() = !open;
        self.changed.notify_all();
    }

    fn wait_open(&self) {
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.changed.wait(closed).unwrap();
        }
    }
}

/// A server running on the test's runtime.
pub struct TestServer {
    pub addr: String,
    pub metrics: Arc<ServerMetrics>,
    pub cancel: CancellationToken,
    pub task: tokio::task::JoinHandle<()>,
    _dir: Option<tempfile::TempDir>,
}

impl TestServer {
    pub async fn tcp<B: BlockBackend>(backend: Arc<B>, cfg: ServerConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = DataServer::new(backend, cfg).unwrap();
        let metrics = server.metrics();
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        let task = tokio::spawn(async move {
            server.serve_tcp(listener, c).await;
            server.shutdown().await;
        });
        Self {
            addr,
            metrics,
            cancel,
            task,
            _dir: None,
        }
    }

    pub async fn unix(backend: Arc<MemBackend>, cfg: ServerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("replica.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = DataServer::new(backend, cfg).unwrap();
        let metrics = server.metrics();
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        let task = tokio::spawn(async move {
            server.serve_unix(listener, c).await;
            server.shutdown().await;
        });
        Self {
            addr: format!("unix:{}", path.display()),
            metrics,
            cancel,
            task,
            _dir: Some(dir),
        }
    }

    pub async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("server shut down")
            .unwrap();
    }
}

/// A server on its own runtime and thread, so a test can kill it abruptly (like a process dying):
/// shutting the runtime down drops every task and closes every socket without a goodbye.
pub struct KillableServer {
    pub addr: String,
    runtime: Option<tokio::runtime::Runtime>,
}

impl KillableServer {
    pub fn tcp(backend: Arc<MemBackend>, cfg: ServerConfig) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        runtime.spawn(async move {
            let _ = data_protocol::serve_tcp(listener, backend, cfg, CancellationToken::new()).await;
        });
        Self {
            addr,
            runtime: Some(runtime),
        }
    }

    pub fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for KillableServer {
    fn drop(&mut self) {
        self.kill();
    }
}
