//! The receiving side of the sync protocol: an axum server for one target file.
//!
//! Data goes to `<target>.sync-partial`; the target name appears (by rename, after `fsync`) only when the sender
//! closes a transfer that had no error, so nobody ever sees a half-written file under the target's name. An
//! existing target becomes the partial file at `open`, which is what delta sync compares against; a partial file
//! left by an interrupted transfer is resumed the same way. The server stops after `close`, after an idle timeout
//! or when cancelled; in the last two cases (a failed transfer) it removes the partial file it worked on, unless
//! told to keep it for a later resume.
//!
//! With [`ReceiverConfig::tls`] the receiver speaks HTTPS under mutual TLS: a peer without a certificate of the
//! cluster CA is refused at the handshake (logged once per address) and never reaches a route.
//!
//! A receiver can instead write into a [`ReceiveSink`] its owner made (a v2 lvol a backing-image sync fills): no
//! partial file, no rename; the sink is new when the transfer opens, so holes stay as they are and every data
//! range is sent, and `close` commits the sink (makes it durable) before it answers.

mod payload;
mod routes;

use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use corral_tls::TcpIncoming;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::wire::{ErrorBody, MAX_BODY, RangeError};

/// Where a receiver writes when it is not a file of its own (see the module doc). It holds nothing when the
/// transfer opens: holes are not punched in it and no checksum of a range is answered, so every data range
/// arrives; writes of one body are staged up to 1 MiB, in offset order, and may come from several threads.
pub trait ReceiveSink: Send + Sync {
    /// Its size in bytes; an `open` for another size is refused.
    fn size(&self) -> u64;
    /// Writes `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes what was written durable; `close` answers only after it.
    fn commit(&self) -> io::Result<()>;
}

impl std::fmt::Debug for dyn ReceiveSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReceiveSink({} bytes)", self.size())
    }
}

/// Settings of one receiver.
#[derive(Clone)]
pub struct ReceiverConfig {
    /// The file being received (with a `sink`, only its name in messages).
    pub target: PathBuf,
    /// Write into this sink instead of the file `target`.
    pub sink: Option<Arc<dyn ReceiveSink>>,
    /// Stop (and clean up) after this long without a request.
    pub idle_timeout: Duration,
    /// Write 4 KiB-aligned ranges with `O_DIRECT` even if the sender does not ask for it.
    pub direct_io: bool,
    /// Keep the partial file of a failed transfer for a later receiver to resume instead of removing it.
    pub keep_partial: bool,
    /// Mutual TLS (`None`: plaintext): a peer must complete the handshake with a certificate of the cluster CA
    /// within [`corral_tls::HANDSHAKE_TIMEOUT`] before any request of it is read (see [`corral_tls::TcpIncoming`]).
    pub tls: Option<Arc<corral_tls::rustls::ServerConfig>>,
}

impl std::fmt::Debug for ReceiverConfig {
    // The TLS config only as on or off: it holds the key, and daemons log their effective config.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverConfig")
            .field("target", &self.target)
            .field("sink", &self.sink)
            .field("idle_timeout", &self.idle_timeout)
            .field("direct_io", &self.direct_io)
            .field("keep_partial", &self.keep_partial)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl ReceiverConfig {
    /// Defaults: 300 s idle timeout (Longhorn's), buffered IO, partial files of failed transfers removed, the
    /// process's TLS config ([`corral_tls::installed`]; plaintext without one).
    pub fn new(target: impl Into<PathBuf>) -> Self {
        ReceiverConfig {
            target: target.into(),
            idle_timeout: Duration::from_secs(300),
            direct_io: false,
            keep_partial: false,
            sink: None,
            tls: corral_tls::installed().map(|t| t.server.clone()),
        }
    }

    /// A receiver writing into `sink`, named `name` in messages.
    pub fn with_sink(name: impl Into<PathBuf>, sink: Arc<dyn ReceiveSink>) -> Self {
        ReceiverConfig {
            sink: Some(sink),
            ..Self::new(name)
        }
    }
}

/// Path of the partial file of `target`.
pub fn partial_path(target: &Path) -> PathBuf {
    let mut s = target.as_os_str().to_owned();
    s.push(".sync-partial");
    PathBuf::from(s)
}

/// Receiver errors; request-level ones map to one HTTP status each ([`IntoResponse`]).
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// The listening socket could not be bound.
    #[error("binding {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    /// The HTTP server failed.
    #[error("serving HTTP: {0}")]
    Serve(#[source] io::Error),
    /// A range-list body was refused.
    #[error("bad ranges: {0}")]
    BadRange(#[from] RangeError),
    /// A request was malformed otherwise.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// No transfer is open.
    #[error("no transfer is open (send open first)")]
    NoSession,
    /// The request names another session than the open one (a newer open replaced it).
    #[error("session {got:?} is not the open transfer {current}")]
    StaleSession { got: Option<u64>, current: u64 },
    /// An earlier request of this transfer failed; the transfer cannot be committed.
    #[error("transfer failed earlier: {0}")]
    Failed(String),
    /// The receiver's filesystem is full.
    #[error("no space left on the receiver writing {path} at offset {offset}: {source}")]
    NoSpace {
        path: PathBuf,
        offset: u64,
        source: io::Error,
    },
    /// Other IO error on the receiver.
    #[error("{op} {path} at offset {offset}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        source: io::Error,
    },
    /// The target has no valid recorded checksum.
    #[error("no valid recorded checksum for {0}")]
    NotRecorded(PathBuf),
}

impl ReceiveError {
    fn kind(&self) -> (&'static str, StatusCode) {
        match self {
            ReceiveError::BadRange(_) => ("bad-range", StatusCode::BAD_REQUEST),
            ReceiveError::BadRequest(_) => ("bad-request", StatusCode::BAD_REQUEST),
            ReceiveError::NoSession => ("no-session", StatusCode::CONFLICT),
            ReceiveError::StaleSession { .. } => ("stale-session", StatusCode::CONFLICT),
            ReceiveError::Failed(_) => ("failed", StatusCode::CONFLICT),
            ReceiveError::NoSpace { .. } => ("no-space", StatusCode::INSUFFICIENT_STORAGE),
            ReceiveError::NotRecorded(_) => ("not-recorded", StatusCode::NOT_FOUND),
            ReceiveError::Io { .. } | ReceiveError::Bind { .. } | ReceiveError::Serve(_) => {
                ("io", StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    fn io(op: &'static str, path: &Path, offset: u64, source: io::Error) -> Self {
        if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            ReceiveError::NoSpace {
                path: path.to_path_buf(),
                offset,
                source,
            }
        } else {
            ReceiveError::Io {
                op,
                path: path.to_path_buf(),
                offset,
                source,
            }
        }
    }
}

impl IntoResponse for ReceiveError {
    fn into_response(self) -> Response {
        let (kind, status) = self.kind();
        (
            status,
            Json(ErrorBody {
                kind: kind.into(),
                message: self.to_string(),
            }),
        )
            .into_response()
    }
}

/// How a receiver ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReceiveOutcome {
    /// A transfer was closed and the target committed.
    Completed,
    /// The sender closed without opening (whole-file skip): the target was left as it was.
    Unchanged,
    /// No request for the idle timeout.
    IdleTimeout,
    /// Cancelled by its owner.
    Cancelled,
}

/// What a receiver did over its lifetime.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiveSummary {
    pub outcome: ReceiveOutcome,
    /// Data payload bytes received (all sessions, including refused requests' well-formed payloads).
    pub bytes_received: u64,
    /// Data bytes written to the file.
    pub bytes_written: u64,
    /// Bytes whose checksum matched the sender's (not sent).
    pub bytes_matched: u64,
    /// Hole bytes punched.
    pub hole_bytes_punched: u64,
    /// `open` requests served (more than one means a resumed transfer).
    pub opens: u64,
    pub duration_ms: u64,
}

/// A bound receiver, not yet serving.
pub struct Receiver {
    listener: TcpIncoming,
    config: ReceiverConfig,
}

impl Receiver {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)); with `config.tls`, starts
    /// accepting handshakes at once.
    pub async fn bind(addr: SocketAddr, config: ReceiverConfig) -> Result<Self, ReceiveError> {
        let bind_err = |source| ReceiveError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
        let listener = TcpIncoming::new(listener, config.tls.clone()).map_err(bind_err)?;
        Ok(Receiver { listener, config })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// Serves until `close`, the idle timeout, or `cancel`.
    pub async fn run(self, cancel: CancellationToken) -> Result<ReceiveSummary, ReceiveError> {
        let started = Instant::now();
        let shutdown = cancel.child_token();
        let shared = Arc::new(Shared {
            partial: partial_path(&self.config.target),
            config: self.config,
            state: Mutex::new(TransferState::Idle),
            next_session: AtomicU64::new(1),
            last_activity: Mutex::new(Instant::now()),
            inflight: AtomicUsize::new(0),
            counters: Counters::default(),
            outcome: Mutex::new(None),
            touched: Mutex::new(false),
            shutdown: shutdown.clone(),
            permits: tokio::sync::Semaphore::new(MAX_CONCURRENT_REQUESTS),
        });
        let app = Router::new()
            .route("/v1/sync/recorded", get(routes::recorded))
            .route("/v1/sync/open", post(routes::open))
            .route("/v1/sync/holes", post(routes::holes))
            .route("/v1/sync/checksum", post(routes::checksum))
            .route("/v1/sync/data", post(routes::data))
            .route("/v1/sync/close", post(routes::close))
            .layer(middleware::from_fn_with_state(shared.clone(), track_activity))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(shared.clone());

        // Abort-on-drop: dropping `run` must not leave the server or the watchdog running.
        let watchdog = AbortOnDropHandle::new(tokio::spawn(idle_watchdog(shared.clone())));
        let graceful = shutdown.clone();
        let mut server = tokio::spawn(
            axum::serve(self.listener, app)
                .with_graceful_shutdown(async move { graceful.cancelled().await })
                .into_future(),
        );
        let served = tokio::select! {
            r = &mut server => Some(r),
            () = shutdown.cancelled() => None,
        };
        let served = match served {
            Some(r) => r,
            // Let in-flight requests (the close reply) finish, but do not wait forever on a stuck client.
            None => match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    server.abort();
                    Ok(Ok(()))
                }
            },
        };
        shutdown.cancel();
        let _ = watchdog.await;
        let outcome = lock(&shared.outcome).unwrap_or(ReceiveOutcome::Cancelled);
        if !matches!(outcome, ReceiveOutcome::Completed | ReceiveOutcome::Unchanged) {
            shared.clean_up_failed();
        }
        served
            .map_err(|e| ReceiveError::Serve(io::Error::other(e)))?
            .map_err(ReceiveError::Serve)?;
        let c = &shared.counters;
        Ok(ReceiveSummary {
            outcome,
            bytes_received: c.received.load(Ordering::Relaxed),
            bytes_written: c.written.load(Ordering::Relaxed),
            bytes_matched: c.matched.load(Ordering::Relaxed),
            hole_bytes_punched: c.punched.load(Ordering::Relaxed),
            opens: c.opens.load(Ordering::Relaxed),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    written: AtomicU64,
    matched: AtomicU64,
    punched: AtomicU64,
    opens: AtomicU64,
}

struct Shared {
    config: ReceiverConfig,
    partial: PathBuf,
    state: Mutex<TransferState>,
    next_session: AtomicU64,
    last_activity: Mutex<Instant>,
    inflight: AtomicUsize,
    counters: Counters,
    outcome: Mutex<Option<ReceiveOutcome>>,
    /// This server opened a transfer, so a partial file it leaves behind is its own to clean up.
    touched: Mutex<bool>,
    shutdown: CancellationToken,
    /// Bounds requests being served at once, and so the request bodies buffered in memory.
    permits: tokio::sync::Semaphore,
}

/// Requests served at once; more wait in their connection. `holes` and `checksum` bodies (up to `MAX_BODY`) are
/// buffered whole; `data` bodies are written as they arrive.
pub const MAX_CONCURRENT_REQUESTS: usize = 16;

enum TransferState {
    Idle,
    Open(Session),
    /// The session with this id was committed.
    Committed(u64),
}

/// What a transfer writes into.
#[derive(Clone)]
enum Dest {
    /// The partial file, and the same opened with `O_DIRECT` when asked for.
    File {
        file: Arc<File>,
        direct: Option<Arc<File>>,
    },
    Sink(Arc<dyn ReceiveSink>),
}

struct Session {
    id: u64,
    dest: Dest,
    size: u64,
    /// The file was created empty by this open: all holes, so hole requests are no-ops.
    fresh: bool,
    failed: Option<String>,
}

#[derive(Clone)]
struct Handle {
    id: u64,
    dest: Dest,
    size: u64,
    fresh: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    fn session(&self, id: Option<u64>) -> Result<Handle, ReceiveError> {
        match &*lock(&self.state) {
            TransferState::Idle => Err(ReceiveError::NoSession),
            TransferState::Committed(_) => {
                Err(ReceiveError::Failed("the transfer was already committed".into()))
            }
            TransferState::Open(s) if Some(s.id) != id => Err(ReceiveError::StaleSession {
                got: id,
                current: s.id,
            }),
            TransferState::Open(s) => match &s.failed {
                Some(reason) => Err(ReceiveError::Failed(reason.clone())),
                None => Ok(Handle {
                    id: s.id,
                    dest: s.dest.clone(),
                    size: s.size,
                    fresh: s.fresh,
                }),
            },
        }
    }

    /// Marks the session failed so it can never be committed; a full disk also drops the partial file at once.
    fn fail(&self, id: u64, err: &ReceiveError) {
        if let TransferState::Open(s) = &mut *lock(&self.state)
            && s.id == id
            && s.failed.is_none()
        {
            tracing::warn!(session = id, error = %err, "transfer failed");
            s.failed = Some(err.to_string());
            if matches!(err, ReceiveError::NoSpace { .. })
                && !self.config.keep_partial
                && matches!(s.dest, Dest::File { .. })
            {
                let _ = std::fs::remove_file(&self.partial);
            }
        }
    }

    fn clean_up_failed(&self) {
        if *lock(&self.touched) && !self.config.keep_partial {
            match std::fs::remove_file(&self.partial) {
                Ok(()) => {
                    tracing::info!(path = %self.partial.display(), "removed partial file of a failed transfer");
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %self.partial.display(), error = %e, "cannot remove partial file");
                }
            }
        }
    }

    fn finish(&self, outcome: ReceiveOutcome) {
        lock(&self.outcome).get_or_insert(outcome);
        self.shutdown.cancel();
    }
}

struct InflightGuard(Arc<Shared>);
impl Drop for InflightGuard {
    fn drop(&mut self) {
        *lock(&self.0.last_activity) = Instant::now();
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn track_activity(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    s.inflight.fetch_add(1, Ordering::AcqRel);
    *lock(&s.last_activity) = Instant::now();
    let guard = InflightGuard(s);
    let Ok(_permit) = guard.0.permits.acquire().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    next.run(req).await
}

async fn idle_watchdog(s: Arc<Shared>) {
    let tick = (s.config.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::select! {
            () = s.shutdown.cancelled() => return,
            () = tokio::time::sleep(tick) => {}
        }
        let idle = lock(&s.last_activity).elapsed();
        if s.inflight.load(Ordering::Acquire) == 0 && idle >= s.config.idle_timeout {
            tracing::warn!(idle_secs = idle.as_secs(), "receiver idle, shutting down");
            s.finish(ReceiveOutcome::IdleTimeout);
            return;
        }
    }
}
