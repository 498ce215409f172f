//! Rebuild, replica side. The *target* replica (new, in WO mode at the engine) pulls every snapshot file of a
//! source replica through sparse-sync: for each file it binds a receiver, asks a source's sync agent to
//! `FileSend` it, and writes the file's metadata once the data is in place. Files are spread over the sources and
//! a failed file is retried on another source; a receiver keeps its partial file so a retry resumes instead of
//! starting over, and whole files whose recorded checksums match are skipped ("fast rebuild"). The head is never
//! copied: since the engine's rebuild snapshot, every write reaches the target's head directly.
//!
//! Rate: `max_bytes_per_second` bounds the whole rebuild on both paths (the local copy paces itself; a network
//! source is asked to send at that rate). `busy_bytes_per_second` shapes the local copy by foreground IO: while
//! this replica's data protocol serves requests (a rebuilding replica receives every write of the volume) the copy
//! slows to that rate, and speeds up again when IO stops (`ForegroundPace`).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral_disk::sparse::LayoutMode;
use corral_proto::ReplicaAddress;
use corral_proto::engine_generation::EngineGeneration;
use corral_proto::v1::{self, sync_agent_service_client::SyncAgentServiceClient};
use data_protocol::ServerMetrics;
use sparse_sync::receiver::{Receiver, ReceiverConfig};
use sparse_sync::{Pace, Progress};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tracing::{info, warn};

use crate::error::ReplicaError;
use crate::host::ReplicaHost;
use crate::jobs::JobState;
use crate::locks::lock;
use crate::meta::{DiskMeta, remove_if_exists, sync_dir, write_json_atomic};
use crate::names;

/// Attempts per file before the rebuild fails.
pub(crate) const ATTEMPTS: usize = 3;
/// Data-protocol requests per second above which this replica counts as serving foreground IO (the engine's
/// health pings are far below it).
const BUSY_REQUESTS_PER_SECOND: f64 = 50.0;
/// Shortest window the request rate is measured over.
const BUSY_WINDOW: Duration = Duration::from_millis(50);

/// The rate of a rebuild's local copy: `max`, or the lower `busy` while this replica serves foreground IO.
#[derive(Debug)]
struct ForegroundPace {
    requests: Arc<ServerMetrics>,
    max: Option<u64>,
    busy: u64,
    /// When the window began, the request count then, and whether the last full window was busy.
    window: Mutex<(Instant, u64, bool)>,
}

impl ForegroundPace {
    fn new(requests: Arc<ServerMetrics>, max: Option<u64>, busy: u64) -> Self {
        let seen = requests.requests.load(Ordering::Relaxed);
        Self {
            requests,
            max,
            busy,
            window: Mutex::new((Instant::now(), seen, false)),
        }
    }
}

impl Pace for ForegroundPace {
    fn rate(&self) -> Option<u64> {
        let now = Instant::now();
        let seen = self.requests.requests.load(Ordering::Relaxed);
        let mut w = lock(&self.window);
        let elapsed = now.duration_since(w.0);
        if elapsed >= BUSY_WINDOW {
            let per_second = seen.saturating_sub(w.1) as f64 / elapsed.as_secs_f64();
            *w = (now, seen, per_second > BUSY_REQUESTS_PER_SECOND);
        }
        match (w.2, self.max) {
            (true, Some(max)) => Some(max.min(self.busy)),
            (true, None) => Some(self.busy),
            (false, max) => max,
        }
    }
}

/// How fast a rebuild may move data (from its `FilesSyncRequest`), and what counts as foreground IO.
#[derive(Debug, Clone, Default)]
struct RebuildRate {
    max: Option<u64>,
    busy: Option<u64>,
    foreground: Option<Arc<ServerMetrics>>,
}

impl RebuildRate {
    fn pace(&self) -> Option<Arc<dyn Pace>> {
        let (Some(busy), Some(f)) = (self.busy, &self.foreground) else {
            return None;
        };
        Some(Arc::new(ForegroundPace::new(f.clone(), self.max, busy)))
    }
}

/// Status of the rebuild into this replica.
#[derive(Debug, Clone, Default)]
pub struct RebuildStatus {
    /// State.
    pub state: JobState,
    /// Error when failed.
    pub error: String,
    /// Sources.
    pub from: Vec<String>,
    /// Files done / total.
    pub files_done: u32,
    /// Files to sync.
    pub files_total: u32,
    /// Allocated bytes to move (sum of the files' allocated sizes).
    pub bytes_total: u64,
}

/// The rebuild job slot of one replica daemon.
#[derive(Debug, Default)]
pub struct RebuildTracker {
    status: Mutex<RebuildStatus>,
    transferred: AtomicU64,
    skipped: AtomicU64,
    done_bytes: AtomicU64,
    /// Of `transferred`, bytes copied from a source's files on this host.
    local: AtomicU64,
    /// The engine generation the job's `FilesSync` carried (0: none), presented on every call to its sources: a
    /// source that accepted a newer engine refuses a stale engine's rebuild.
    generation: AtomicU64,
}

impl RebuildTracker {
    /// Starts a job (refused while one runs): sources and files to sync, counters reset.
    pub(crate) fn begin(
        &self,
        sources: &[ReplicaAddress],
        files: &[v1::DiskInfo],
        generation: u64,
    ) -> Result<(), ReplicaError> {
        let mut s = lock(&self.status);
        if s.state == JobState::InProgress {
            return Err(ReplicaError::FailedPrecondition(
                "a rebuild is already running".into(),
            ));
        }
        *s = RebuildStatus {
            state: JobState::InProgress,
            from: sources.iter().map(ToString::to_string).collect(),
            files_total: u32::try_from(files.len()).unwrap_or(u32::MAX),
            bytes_total: files.iter().map(|f| f.size).sum(),
            ..Default::default()
        };
        self.transferred.store(0, Ordering::Relaxed);
        self.skipped.store(0, Ordering::Relaxed);
        self.done_bytes.store(0, Ordering::Relaxed);
        self.local.store(0, Ordering::Relaxed);
        self.generation.store(generation, Ordering::Relaxed);
        Ok(())
    }

    /// The engine generation presented to the sources of the job.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// One file of `size` allocated bytes is in place.
    pub(crate) fn file_done(&self, size: u64) {
        self.done_bytes.fetch_add(size, Ordering::Relaxed);
        lock(&self.status).files_done += 1;
    }

    /// Ends the job with `result` (cancelled when `cancelled`).
    pub(crate) fn end(&self, result: Result<(), String>, cancelled: bool) {
        let mut s = lock(&self.status);
        match result {
            Ok(()) => s.state = JobState::Complete,
            Err(e) => {
                s.state = if cancelled {
                    JobState::Cancelled
                } else {
                    JobState::Error
                };
                s.error = e;
            }
        }
    }

    /// Current status as the wire message.
    pub fn to_proto(&self) -> v1::JobStatusResponse {
        let s = lock(&self.status).clone();
        let done = self.done_bytes.load(Ordering::Relaxed);
        let progress = match s.state {
            JobState::Complete => 100,
            _ if s.bytes_total == 0 => 0,
            _ => u32::try_from(done.min(s.bytes_total) * 100 / s.bytes_total).unwrap_or(100),
        };
        v1::JobStatusResponse {
            is_running: s.state == JobState::InProgress,
            state: s.state.as_str().into(),
            progress,
            error: s.error,
            bytes_transferred: self.transferred.load(Ordering::Relaxed),
            bytes_skipped: self.skipped.load(Ordering::Relaxed),
            from_addresses: s.from,
            files_done: s.files_done,
            files_total: s.files_total,
            snapshot_name: String::new(),
            bytes_copied_locally: self.local.load(Ordering::Relaxed),
        }
    }
}

pub(crate) fn validate_file(name: &str) -> Result<(), ReplicaError> {
    match names::snapshot_name(name) {
        Some(n) => names::validate_snapshot_name(n),
        None => Err(ReplicaError::InvalidArgument(format!(
            "{name:?} is not a snapshot file name"
        ))),
    }
}

async fn sync_agent(
    source: &ReplicaAddress,
    generation: u64,
) -> Result<SyncAgentServiceClient<InterceptedService<tonic::transport::Channel, EngineGeneration>>, String> {
    corral_proto::grpc::connect_endpoint(&source.sync, corral_proto::grpc::GrpcTimeouts::CONTROL)
        .await
        .map(|ch| SyncAgentServiceClient::with_interceptor(ch, EngineGeneration(generation)))
        .map_err(|e| format!("source replica {source}: {e}"))
}

/// The sources of a `FilesSync`: each a replica address (`docs/formats.md`), whose sync endpoint serves the files.
/// Checks the file names (and parents) of a `FilesSync`.
pub(crate) fn validate_files(files: &[v1::DiskInfo]) -> Result<(), ReplicaError> {
    for f in files {
        validate_file(&f.name)?;
        if !f.parent.is_empty() {
            validate_file(&f.parent)?;
        }
    }
    Ok(())
}

pub(crate) fn parse_sources(addresses: &[String]) -> Result<Vec<ReplicaAddress>, ReplicaError> {
    if addresses.is_empty() {
        return Err(ReplicaError::InvalidArgument(
            "FilesSync needs at least one source".into(),
        ));
    }
    addresses
        .iter()
        .map(|a| {
            a.parse::<ReplicaAddress>()
                .map_err(|e| ReplicaError::InvalidArgument(format!("rebuild source: {e}")))
        })
        .collect()
}

/// Starts a rebuild (FilesSync) into `host`'s replica; returns once stale disks are removed and the job runs.
pub async fn start(
    host: Arc<ReplicaHost>,
    tracker: Arc<RebuildTracker>,
    listen_ip: IpAddr,
    (local_copy, foreground): (bool, Option<Arc<ServerMetrics>>),
    (req, generation): (v1::FilesSyncRequest, u64),
    cancel: CancellationToken,
) -> Result<(), ReplicaError> {
    let sources = parse_sources(&req.from_addresses)?;
    validate_files(&req.files)?;
    tracker.begin(&sources, &req.files, generation)?;
    let replica = host.replica()?;
    let status = replica.status()?;
    let dir = replica.dir().to_owned();
    // Disks the source does not have (a former life of this replica) go first.
    let wanted: std::collections::HashSet<&str> = req.files.iter().map(|f| f.name.as_str()).collect();
    for name in status
        .disks
        .keys()
        .filter(|d| **d != status.head && !wanted.contains(d.as_str()))
    {
        warn!(dir = %dir.display(), disk = %name, "rebuild: removing a disk the source does not have");
        remove_if_exists(&dir.join(names::meta_file(name)))?;
        remove_if_exists(&dir.join(name))?;
        remove_if_exists(&dir.join(names::checksum_file(name)))?;
    }
    sync_dir(&dir)?;
    let rate = RebuildRate {
        max: Some(req.max_bytes_per_second).filter(|r| *r > 0),
        busy: Some(req.busy_bytes_per_second).filter(|r| *r > 0),
        foreground,
    };
    info!(
        dir = %dir.display(),
        files = req.files.len(),
        max_bytes_per_second = req.max_bytes_per_second,
        busy_bytes_per_second = req.busy_bytes_per_second,
        "rebuild starting"
    );
    tokio::spawn(async move {
        let result = run(
            &dir,
            &tracker,
            (listen_ip, local_copy),
            &rate,
            &sources,
            &req,
            &cancel,
        )
        .await;
        match &result {
            Ok(()) => info!(dir = %dir.display(), files = req.files.len(), "rebuild files synced"),
            Err(e) => warn!(dir = %dir.display(), error = %e, "rebuild failed"),
        }
        tracker.end(result, cancel.is_cancelled());
    });
    Ok(())
}

async fn run(
    dir: &std::path::Path,
    tracker: &RebuildTracker,
    (listen_ip, local_copy): (IpAddr, bool),
    rate: &RebuildRate,
    sources: &[ReplicaAddress],
    req: &v1::FilesSyncRequest,
    cancel: &CancellationToken,
) -> Result<(), String> {
    for (i, f) in req.files.iter().enumerate() {
        let mut last = String::new();
        let mut ok = false;
        for attempt in 0..ATTEMPTS {
            if cancel.is_cancelled() {
                return Err("cancelled".into());
            }
            let source = &sources[(i + attempt) % sources.len()];
            let local = match local_copy {
                true => copy_local(dir, source, f, req.fast_sync, rate, tracker, cancel).await,
                false => None,
            };
            let synced = match local {
                Some(r) => r,
                None => {
                    let to = (dir, listen_ip);
                    sync_one(to, source, f, (req.fast_sync, rate.max), tracker, cancel).await
                }
            };
            match synced {
                Ok(()) => {
                    ok = true;
                    break;
                }
                Err(e) => {
                    warn!(file = %f.name, source = %source, attempt, error = %e, "rebuild: file sync failed");
                    last = format!("{} from {source}: {e}", f.name);
                    tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
                }
            }
        }
        if !ok {
            return Err(last);
        }
        let meta = DiskMeta {
            name: f.name.clone(),
            parent: f.parent.clone(),
            removed: f.removed,
            user_created: f.user_created,
            created: f.created.clone(),
            labels: f.labels.clone().into_iter().collect(),
        };
        write_json_atomic(dir, &names::meta_file(&f.name), &meta).map_err(|e| e.to_string())?;
        tracker.file_done(f.size);
    }
    Ok(())
}

pub(crate) async fn sync_one(
    (dir, listen_ip): (&std::path::Path, IpAddr),
    source: &ReplicaAddress,
    disk: &v1::DiskInfo,
    (fast, max_rate): (bool, Option<u64>),
    tracker: &RebuildTracker,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let file = disk.name.as_str();
    let mut cfg = ReceiverConfig::new(dir.join(file));
    cfg.keep_partial = true;
    cfg.idle_timeout = Duration::from_secs(120);
    let receiver = Receiver::bind(SocketAddr::new(listen_ip, 0), cfg)
        .await
        .map_err(|e| e.to_string())?;
    let to = receiver.local_addr().to_string();
    let rcancel = cancel.child_token();
    let recv = tokio::spawn(receiver.run(rcancel.clone()));
    let mut client = sync_agent(source, tracker.generation()).await?;
    let sent = client
        .file_send(v1::FileSendRequest {
            file_name: file.to_owned(),
            to_address: to,
            fast_sync: fast,
            max_bytes_per_second: max_rate.unwrap_or(0),
        })
        .await;
    let sent = match sent {
        Ok(r) => r.into_inner(),
        Err(e) => {
            rcancel.cancel();
            let _ = recv.await;
            return Err(format!("FileSend: {}", e.message()));
        }
    };
    let summary = recv
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    tracker.transferred.fetch_add(sent.bytes_sent, Ordering::Relaxed);
    // A whole-file skip moves nothing: the file's allocated size counts as skipped.
    let skipped = if sent.file_skipped {
        sent.data_bytes.max(disk.size)
    } else {
        sent.bytes_skipped
    };
    tracker.skipped.fetch_add(skipped, Ordering::Relaxed);
    info!(
        file,
        %source,
        sent = sent.bytes_sent,
        skipped = sent.bytes_skipped,
        whole_file_skipped = sent.file_skipped,
        written = summary.bytes_written,
        "rebuild: file synced"
    );
    Ok(())
}

/// Copies one snapshot file from a source on this host ([`crate::local_copy`]); `None` when the local path is not
/// available (the caller pulls the file over the network). The end state is the network path's: the file under its
/// name, complete and durable, with the source's recorded checksum recorded beside it; a whole-file skip when both
/// sides record the same checksum and `fast` is asked.
async fn copy_local(
    dir: &std::path::Path,
    source: &ReplicaAddress,
    disk: &v1::DiskInfo,
    fast: bool,
    rate: &RebuildRate,
    tracker: &RebuildTracker,
    cancel: &CancellationToken,
) -> Option<Result<(), String>> {
    let file = disk.name.as_str();
    let ask = v1::LocalFilesRequest {
        snapshot_file_name: file.to_owned(),
        ..Default::default()
    };
    let src = match crate::local_copy::offer(source, ask, tracker.generation()).await {
        Ok(s) => s,
        Err(why) => {
            info!(file, %source, reason = %why, "rebuild: no local copy, pulling over the network");
            return None;
        }
    };
    let target = dir.join(file);
    Some(copy_local_from(src, &target, disk, (fast, rate), tracker, cancel).await)
}

async fn copy_local_from(
    mut src: crate::local_copy::LocalSource,
    target: &std::path::Path,
    disk: &v1::DiskInfo,
    (fast, rate): (bool, &RebuildRate),
    tracker: &RebuildTracker,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let recorded = src.recorded_checksum().map(str::to_owned);
    let ours = sparse_sync::record::read_valid(target)
        .ok()
        .flatten()
        .map(|c| format!("{}:{}", c.method, c.checksum));
    if fast && recorded.is_some() && recorded == ours {
        src.confirm()?;
        tracker.skipped.fetch_add(disk.size, Ordering::Relaxed);
        info!(file = %disk.name, "rebuild: recorded checksums match, file skipped");
        return Ok(());
    }
    let (_, f) = src.files.first().ok_or("no file listed")?;
    let content = corral_disk::sparse::FileContent::from_file(
        f.try_clone().map_err(|e| e.to_string())?,
        &src.dir.join(&disk.name),
        LayoutMode::SeekData,
    )
    .map_err(|e| e.to_string())?;
    let summary = src
        .copy(
            Arc::new(content),
            (target.to_owned(), corral_disk::durable::temp_path(target)),
            (rate.max, rate.pace()),
            Arc::new(Progress::new()),
            cancel,
        )
        .await?;
    src.confirm()?;
    // What a network receive leaves too: the sender's record beside the file (with the new file's ctime), and no
    // partial file of an earlier attempt.
    let _ = sparse_sync::record::remove_record(target);
    if let Some(text) = recorded
        && let Some((method, checksum)) = text.split_once(':')
    {
        let sum = sparse_sync::FileChecksum {
            method: method.to_owned(),
            checksum: checksum.to_owned(),
        };
        sparse_sync::record::write_record(target, &sum).map_err(|e| e.to_string())?;
    }
    let _ = remove_if_exists(&sparse_sync::receiver::partial_path(target));
    let data = summary.local.data_bytes;
    tracker.transferred.fetch_add(data, Ordering::Relaxed);
    tracker.local.fetch_add(data, Ordering::Relaxed);
    info!(
        file = %disk.name, data, by_kernel = summary.kernel_bytes, "rebuild: file copied from the source's files on this host"
    );
    Ok(())
}

/// Source side: sends one snapshot file of `host`'s replica to a receiver.
pub async fn file_send(
    host: &ReplicaHost,
    req: &v1::FileSendRequest,
) -> Result<v1::FileSendResponse, ReplicaError> {
    validate_file(&req.file_name)?;
    let replica = host.replica()?;
    let path = replica.dir().join(&req.file_name);
    if !replica.status()?.disks.contains_key(&req.file_name) {
        return Err(ReplicaError::NotFound(format!("snapshot {}", req.file_name)));
    }
    let p = path.clone();
    let content =
        tokio::task::spawn_blocking(move || corral_disk::sparse::FileContent::open(&p, LayoutMode::SeekData))
            .await
            .map_err(|e| ReplicaError::InvalidArgument(e.to_string()))?
            .map_err(|e| ReplicaError::io("open", &path, e))?;
    let recorded = sparse_sync::record::read_valid(&path).ok().flatten();
    send_snapshot(Arc::new(content), recorded, req).await
}

/// Sends one snapshot's content (a v1 file or a v2 snapshot lvol) as `req` asks: its receiver, fast sync
/// (`recorded`: the file's checksum record, if any), the rebuild's rate limit.
pub(crate) async fn send_snapshot(
    content: Arc<dyn corral_disk::sparse::SparseRead>,
    recorded: Option<sparse_sync::FileChecksum>,
    req: &v1::FileSendRequest,
) -> Result<v1::FileSendResponse, ReplicaError> {
    let opts = sparse_sync::SendOptions {
        fast: req.fast_sync,
        recorded,
        max_rate: Some(req.max_bytes_per_second).filter(|r| *r > 0),
        ..Default::default()
    };
    let s = sparse_sync::send(
        content,
        &req.to_address,
        &opts,
        &Progress::new(),
        &CancellationToken::new(),
    )
    .await
    .map_err(|e| {
        ReplicaError::FailedPrecondition(format!("send {} to {}: {e}", req.file_name, req.to_address))
    })?;
    Ok(v1::FileSendResponse {
        file_skipped: s.file_skipped,
        bytes_sent: s.bytes_sent,
        bytes_skipped: s.bytes_skipped,
        data_bytes: s.data_bytes,
    })
}
