//! gRPC `ReplicaBackupService` (served on the sync-agent listener): backup jobs of this replica's snapshots and
//! the restore job into this replica. Each replica restores itself (the engine's CLI asks every RW replica, with
//! the frontend down), so the same path serves a data source or a standby volume without an engine.
//!
//! The service runs over a [`BackupHost`]: a v1 [`ReplicaHost`] (snapshot files, records beside them) or a v2
//! lvol replica (`crate::v2::backup`: snapshot lvols, records in the head's xattrs) — one job code path for both.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backupstore::{
    BackupConfig, BackupMode, BackupStore, BackupStoreError, BackupUrl, Compression, CreateOptions,
    ErrorKind, GcOptions, Progress, RestoreOptions,
};
use corral_proto::v1::{self, replica_backup_service_server::ReplicaBackupService};
use tonic::{Request, Response, Status};
use tracing::{Instrument, error, info, info_span};

use crate::backup::{BackupRecords, ChainEnd, DirRecords, ReplicaSink, RestoreState, SnapshotSource};
use crate::error::ReplicaError;
use crate::host::ReplicaHost;
use crate::locks::lock;
use crate::service::blocking;

/// The one mapping from backup-store errors to gRPC statuses.
pub fn backup_status(e: &BackupStoreError) -> Status {
    let msg = e.to_string();
    match e.kind() {
        ErrorKind::InvalidArgument => Status::invalid_argument(msg),
        ErrorKind::NotFound => Status::not_found(msg),
        ErrorKind::FailedPrecondition => Status::failed_precondition(msg),
        ErrorKind::Corrupt => Status::data_loss(msg),
        ErrorKind::Io => Status::unavailable(msg),
        ErrorKind::Cancelled => Status::cancelled(msg),
    }
}

#[derive(Debug)]
struct BackupJob {
    status: v1::BackupJobStatus,
    progress: Arc<Progress>,
}

#[derive(Debug, Default)]
struct RestoreJob {
    status: v1::RestoreJobStatus,
    progress: Arc<Progress>,
}

/// A snapshot opened for a backup.
pub struct OpenedSource {
    /// What the backup reads.
    pub source: Arc<dyn backupstore::BackupSource>,
    /// Name and checksum of the backing image under the volume, if any; may read the whole image (called on a
    /// blocking thread, only when the request names none).
    pub backing_image: BackingImageProbe,
    /// Holds off purges until dropped (a purge would change the layers the source reads).
    pub guard: Box<dyn Send + Sync>,
}

/// Computes a backing image's name and checksum.
pub type BackingImageProbe =
    Box<dyn FnOnce() -> Result<Option<(String, String)>, ReplicaError> + Send + 'static>;

/// What the backup service needs of the replica it serves (v1 or v2).
pub trait BackupHost: Send + Sync + 'static {
    /// Volume name the replica was started with (may be empty).
    fn volume(&self) -> String;
    /// Opens `snapshot` for a backup, refusing while a purge runs (blocking).
    fn open_source(&self, snapshot: &str) -> Result<OpenedSource, ReplicaError>;
    /// The restore sink into the open replica's head, and the volume size.
    fn sink(&self) -> Result<(Arc<dyn backupstore::RestoreSink>, u64), ReplicaError>;
    /// Makes restored data durable (blocking).
    fn flush(&self) -> Result<(), ReplicaError>;
    /// Where the replica keeps its restore state and chain-end marker.
    fn records(&self) -> Result<Arc<dyn BackupRecords>, ReplicaError>;
}

impl BackupHost for V1Backup {
    fn volume(&self) -> String {
        self.0.volume().to_owned()
    }

    fn open_source(&self, snapshot: &str) -> Result<OpenedSource, ReplicaError> {
        let replica = self.0.replica()?;
        // Counted as running first, so a purge starting now sees the backup; a purge punches or overwrites the
        // files the source reads (a pruned or folded snapshot would be backed up with the wrong data).
        let reading = BackupReading::new(self.0.clone());
        if self.0.jobs.status(crate::service::grpc::PURGE).state == crate::jobs::JobState::InProgress {
            return Err(ReplicaError::FailedPrecondition(
                "a purge is running; back up after it finishes".into(),
            ));
        }
        let source = Arc::new(SnapshotSource::open(&replica, snapshot)?);
        let src = source.clone();
        Ok(OpenedSource {
            source,
            backing_image: Box::new(move || src.backing_image()),
            guard: Box::new(reading),
        })
    }

    fn sink(&self) -> Result<(Arc<dyn backupstore::RestoreSink>, u64), ReplicaError> {
        let replica = self.0.replica()?;
        let size = replica.size();
        Ok((Arc::new(ReplicaSink { replica }), size))
    }

    fn flush(&self) -> Result<(), ReplicaError> {
        self.0.replica()?.flush()
    }

    fn records(&self) -> Result<Arc<dyn BackupRecords>, ReplicaError> {
        Ok(Arc::new(DirRecords(std::path::PathBuf::from(
            self.0.status()?.dir,
        ))))
    }
}

/// Implements `ReplicaBackupService` over one [`BackupHost`].
#[derive(Clone)]
pub struct ReplicaBackupGrpc {
    host: Arc<dyn BackupHost>,
    backups: Arc<Mutex<HashMap<String, BackupJob>>>,
    restore: Arc<Mutex<RestoreJob>>,
}

fn fill_from(s: &mut v1::BackupJobStatus, c: &BackupConfig) {
    s.is_incremental = c.is_incremental;
    s.chain_position = c.chain_position;
    s.full_reason = c
        .full_reason
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    s.full_reason_kind = c
        .full_reason
        .as_ref()
        .map(|r| r.kind().to_owned())
        .unwrap_or_default();
    s.end_of_chain = c.end_of_chain;
    s.base_backup.clone_from(&c.base_backup);
    s.backing_image_name.clone_from(&c.backing_image_name);
    s.backing_image_checksum.clone_from(&c.backing_image_checksum);
    s.diff_from_snapshot.clone_from(&c.diff_from_snapshot);
    s.read_bytes = c.stats.read_bytes;
    s.new_blocks = c.stats.new_blocks;
    s.new_bytes = c.stats.new_bytes;
    s.new_stored_bytes = c.stats.new_stored_bytes;
    s.reuploaded_bytes = c.stats.reuploaded_bytes;
    s.deduplicated_blocks = c.stats.deduplicated_blocks;
}

fn state_of(e: &BackupStoreError) -> &'static str {
    if e.kind() == ErrorKind::Cancelled {
        "cancelled"
    } else {
        "error"
    }
}

/// One backup reading a snapshot, counted in [`ReplicaHost::backups_running`] until dropped.
#[derive(Debug)]
struct BackupReading(Arc<ReplicaHost>);

impl BackupReading {
    fn new(host: Arc<ReplicaHost>) -> Self {
        host.backups_running
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(host)
    }
}

impl Drop for BackupReading {
    fn drop(&mut self) {
        self.0
            .backups_running
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The v1 replica of a [`ReplicaHost`] as a [`BackupHost`].
#[derive(Debug)]
struct V1Backup(Arc<ReplicaHost>);

/// The backing image named in a request: both fields or neither, checked and recorded as a replica started with
/// them records them ([`BackingImageId`]: the checksum as bare lower-case hex).
fn backing_image_given(name: &str, checksum: &str) -> Result<Option<(String, String)>, Status> {
    match (name.is_empty(), checksum.is_empty()) {
        (true, true) => Ok(None),
        (false, false) => {
            let id = crate::backing::BackingImageId::new(name, checksum)?;
            Ok(Some((id.name, id.checksum)))
        }
        _ => Err(Status::invalid_argument(
            "backing_image_name and backing_image_checksum go together",
        )),
    }
}

fn credential_map(c: &HashMap<String, String>) -> BTreeMap<String, String> {
    c.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

impl ReplicaBackupGrpc {
    /// The service for the v1 replica of `host`.
    pub fn new(host: Arc<ReplicaHost>) -> Self {
        Self::over(Arc::new(V1Backup(host)))
    }

    /// The service for any [`BackupHost`] (the v2 daemon's replicas).
    pub fn over(host: Arc<dyn BackupHost>) -> Self {
        Self {
            host,
            backups: Arc::default(),
            restore: Arc::default(),
        }
    }

    fn restoring(&self) -> bool {
        lock(&self.restore).status.state == "in-progress"
    }

    fn backing_up(&self) -> bool {
        lock(&self.backups)
            .values()
            .any(|j| j.status.state == "in-progress")
    }
}

#[tonic::async_trait]
impl ReplicaBackupService for ReplicaBackupGrpc {
    async fn backup_create(
        &self,
        req: Request<v1::BackupCreateRequest>,
    ) -> Result<Response<v1::BackupCreateResponse>, Status> {
        let r = req.into_inner();
        if self.restoring() {
            return Err(Status::failed_precondition(
                "a restore into this replica is in progress",
            ));
        }
        let url = BackupUrl::parse(&r.target).map_err(|e| backup_status(&e))?;
        let volume = match (&url.volume, r.volume.as_str(), self.host.volume()) {
            (Some(v), _, _) => v.clone(),
            (None, v, _) if !v.is_empty() => v.to_owned(),
            (None, _, v) if !v.is_empty() => v,
            _ => return Err(Status::invalid_argument("no backup volume name: pass volume")),
        };
        let name = if r.backup_name.is_empty() {
            format!("backup-{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
        } else {
            r.backup_name.clone()
        };
        backupstore::validate_name("volume", &volume).map_err(|e| backup_status(&e))?;
        backupstore::validate_name("backup", &name).map_err(|e| backup_status(&e))?;
        let mode: BackupMode = r.mode.parse().map_err(Status::invalid_argument)?;
        let compression = match r.compression.as_str() {
            "" => None,
            c => Some(c.parse::<Compression>().map_err(Status::invalid_argument)?),
        };
        let store = BackupStore::open(
            &url,
            &r.credentials
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
        .map_err(|e| backup_status(&e))?;
        let (host, snapshot) = (self.host.clone(), r.snapshot.clone());
        let opened = blocking(move || host.open_source(&snapshot)).await?;
        let host = self.host.clone();
        let records = blocking(move || host.records()).await?;
        let backup_url = store.backup_url(&volume, &name);
        {
            let mut jobs = lock(&self.backups);
            if jobs.get(&name).is_some_and(|j| j.status.state == "in-progress") {
                return Err(Status::already_exists(format!("backup {name} is in progress")));
            }
            jobs.insert(
                name.clone(),
                BackupJob {
                    status: v1::BackupJobStatus {
                        backup_name: name.clone(),
                        url: backup_url.clone(),
                        snapshot: r.snapshot.clone(),
                        state: "in-progress".into(),
                        ..Default::default()
                    },
                    progress: Arc::default(),
                },
            );
        }
        let progress = lock(&self.backups)[&name].progress.clone();
        let given_backing = backing_image_given(&r.backing_image_name, &r.backing_image_checksum)?;
        let mut opts = CreateOptions {
            volume: volume.clone(),
            name: name.clone(),
            mode,
            incremental: !r.incremental_disabled,
            max_count: (r.max_count > 0).then_some(r.max_count),
            labels: r.labels.into_iter().collect::<BTreeMap<_, _>>(),
            retain: (r.retain > 0).then_some(r.retain),
            block_size: (r.block_size > 0).then_some(r.block_size),
            compression,
            max_upload_rate: r.max_upload_rate,
            ..Default::default()
        };
        if r.delta_max > 0 {
            opts.delta_max = r.delta_max;
        }
        if r.concurrency > 0 {
            opts.concurrency = r.concurrency as usize;
        }
        if r.gc_margin_seconds > 0 {
            opts.gc = GcOptions {
                margin: Duration::from_secs(r.gc_margin_seconds),
                ..GcOptions::default()
            };
        }
        let jobs = self.backups.clone();
        let span = info_span!("backup", backup = %name, volume = %volume, snapshot = %r.snapshot);
        tokio::spawn(
            async move {
                let OpenedSource {
                    source,
                    backing_image,
                    guard: _reading,
                } = opened;
                let result = async {
                    opts.backing_image = match given_backing {
                        Some(b) => Some(b),
                        None => tokio::task::spawn_blocking(backing_image)
                            .await
                            .map_err(|e| BackupStoreError::FailedPrecondition(e.to_string()))?
                            .map_err(|e| BackupStoreError::FailedPrecondition(e.to_string()))?,
                    };
                    store.create_backup(source, &opts, &progress).await
                }
                .await;
                let mut jobs = lock(&jobs);
                let Some(job) = jobs.get_mut(&opts.name) else {
                    return;
                };
                match result {
                    Ok(c) => {
                        // A full backup started a new chain: a restore marker no longer applies.
                        if !c.is_incremental
                            && let Err(e) = ChainEnd::clear(records.as_ref())
                        {
                            error!(error = %e, "clearing the backup chain-end marker failed");
                        }
                        fill_from(&mut job.status, &c);
                        job.status.state = "complete".into();
                        job.status.progress = 100;
                        info!("backup complete");
                    }
                    Err(e) => {
                        error!(error = %e, "backup failed");
                        job.status.state = state_of(&e).into();
                        job.status.error = e.to_string();
                        job.status.progress = progress.percent();
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(v1::BackupCreateResponse {
            backup_name: name,
            url: backup_url,
        }))
    }

    async fn backup_status(
        &self,
        req: Request<v1::BackupJobRef>,
    ) -> Result<Response<v1::BackupJobStatus>, Status> {
        let name = req.into_inner().backup_name;
        let jobs = lock(&self.backups);
        let job = jobs
            .get(&name)
            .ok_or_else(|| Status::not_found(format!("no backup job {name} on this replica")))?;
        let mut s = job.status.clone();
        if s.state == "in-progress" {
            s.progress = job.progress.percent();
        }
        Ok(Response::new(s))
    }

    async fn backup_cancel(
        &self,
        req: Request<v1::BackupJobRef>,
    ) -> Result<Response<v1::BackupJobStatus>, Status> {
        let name = req.into_inner().backup_name.clone();
        if let Some(j) = lock(&self.backups).get(&name) {
            j.progress.cancel();
        }
        self.backup_status(Request::new(v1::BackupJobRef { backup_name: name }))
            .await
    }

    async fn backup_restore(
        &self,
        req: Request<v1::BackupRestoreRequest>,
    ) -> Result<Response<v1::RestoreJobStatus>, Status> {
        let r = req.into_inner();
        let url = BackupUrl::parse(&r.url).map_err(|e| backup_status(&e))?;
        let volume = url.require_volume().map_err(|e| backup_status(&e))?.to_owned();
        let backup = url.require_backup().map_err(|e| backup_status(&e))?.to_owned();
        if self.backing_up() {
            return Err(Status::failed_precondition(
                "a backup of this replica is in progress",
            ));
        }
        let store = BackupStore::open(
            &url,
            &r.credentials
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
        .map_err(|e| backup_status(&e))?;
        let (sink, size) = self.host.sink()?;
        let cfg = store
            .backup_config(&volume, &backup)
            .await
            .map_err(|e| backup_status(&e))?;
        if cfg.size > size {
            return Err(Status::failed_precondition(format!(
                "backup {backup} is {} bytes, larger than this volume ({size} bytes): expand the volume first",
                cfg.size,
            )));
        }
        let host = self.host.clone();
        let records = blocking(move || host.records()).await?;
        let rec = records.clone();
        let state = blocking(move || RestoreState::load(rec.as_ref())).await?;
        let since = (r.incremental && state.volume == volume && !state.last_restored.is_empty())
            .then(|| state.last_restored.clone());
        let progress = Arc::new(Progress::default());
        {
            let mut job = lock(&self.restore);
            if job.status.state == "in-progress" {
                return Err(Status::failed_precondition("a restore is already in progress"));
            }
            *job = RestoreJob {
                status: v1::RestoreJobStatus {
                    state: "in-progress".into(),
                    backup_url: r.url.clone(),
                    last_restored: state.last_restored.clone(),
                    incremental: since.is_some(),
                    ..Default::default()
                },
                progress: progress.clone(),
            };
        }
        let opts = RestoreOptions {
            concurrency: if r.concurrency > 0 {
                r.concurrency as usize
            } else {
                8
            },
            since,
            ..Default::default()
        };
        let job = self.restore.clone();
        let host = self.host.clone();
        let span = info_span!("restore", backup = %backup, volume = %volume);
        tokio::spawn(
            async move {
                // Forget the last restored backup before the data changes: after a failed or killed restore the
                // volume holds a mix, and an incremental from the old base would skip blocks this one changed.
                let (d, v) = (records.clone(), volume.clone());
                let end = ChainEnd {
                    reason: format!("backup {backup} of volume {volume} was restored into the volume"),
                    at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                };
                // The restore changes the data under the last backed-up snapshot's descendants (zeroed ranges can
                // become holes no layer diff shows): the next backup must be full. Set before the first write.
                let cleared = tokio::task::spawn_blocking(move || {
                    end.save(d.as_ref())?;
                    RestoreState {
                        volume: v,
                        ..Default::default()
                    }
                    .save(d.as_ref())
                })
                .await
                .map_err(|e| BackupStoreError::FailedPrecondition(e.to_string()))
                .and_then(|r| r.map_err(|e| BackupStoreError::FailedPrecondition(e.to_string())));
                let result = match cleared {
                    Ok(()) => store.restore(&volume, &backup, sink, &opts, &progress).await,
                    Err(e) => Err(e),
                };
                let saved = match &result {
                    Ok(_) => {
                        let st = RestoreState {
                            volume: volume.clone(),
                            last_restored: backup.clone(),
                            url: r.url.clone(),
                        };
                        tokio::task::spawn_blocking(move || {
                            host.flush()?;
                            st.save(records.as_ref())
                        })
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|x| x.map_err(|e| e.to_string()))
                    }
                    Err(_) => Ok(()),
                };
                let mut job = lock(&job);
                match (result, saved) {
                    (Ok(o), Ok(())) => {
                        info!(
                            blocks = o.blocks_written,
                            bytes = o.bytes_written,
                            "restore complete"
                        );
                        job.status.state = "complete".into();
                        job.status.progress = 100;
                        job.status.last_restored = backup;
                        job.status.incremental = o.incremental;
                        job.status.blocks_written = o.blocks_written;
                        job.status.bytes_written = o.bytes_written;
                        job.status.zeroed_bytes = o.zeroed_bytes;
                    }
                    (Err(e), _) => {
                        error!(error = %e, "restore failed");
                        job.status.state = state_of(&e).into();
                        job.status.error = e.to_string();
                    }
                    (Ok(_), Err(e)) => {
                        error!(error = %e, "restore: flushing or recording the state failed");
                        job.status.state = "error".into();
                        job.status.error = e;
                    }
                }
            }
            .instrument(span),
        );
        self.restore_status(Request::new(v1::RestoreStatusRequest {}))
            .await
    }

    async fn backup_chain_end(
        &self,
        req: Request<v1::BackupChainEndRequest>,
    ) -> Result<Response<v1::BackupChainEndResponse>, Status> {
        let r = req.into_inner();
        if r.reason.is_empty() {
            return Err(Status::invalid_argument("a chain end needs a reason"));
        }
        let host = self.host.clone();
        let end = ChainEnd {
            reason: r.reason.clone(),
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        };
        blocking(move || end.save(host.records()?.as_ref())).await?;
        let mut out = v1::BackupChainEndResponse::default();
        if !r.target.is_empty() {
            let url = BackupUrl::parse(&r.target).map_err(|e| backup_status(&e))?;
            let volume = match (&url.volume, r.volume.as_str(), self.host.volume()) {
                (Some(v), _, _) => v.clone(),
                (None, v, _) if !v.is_empty() => v.to_owned(),
                (None, _, v) if !v.is_empty() => v,
                _ => return Err(Status::invalid_argument("no backup volume name: pass volume")),
            };
            let store =
                BackupStore::open(&url, &credential_map(&r.credentials)).map_err(|e| backup_status(&e))?;
            out.marked_backup = store
                .end_chain(&volume, &r.reason)
                .await
                .map_err(|e| backup_status(&e))?
                .unwrap_or_default();
        }
        info!(reason = %r.reason, marked = %out.marked_backup, "backup chain ended");
        Ok(Response::new(out))
    }

    async fn restore_status(
        &self,
        _req: Request<v1::RestoreStatusRequest>,
    ) -> Result<Response<v1::RestoreJobStatus>, Status> {
        let job = lock(&self.restore);
        let mut s = job.status.clone();
        if s.state.is_empty() {
            s.state = "none".into();
            if let Ok(st) = self.host.records().and_then(|r| RestoreState::load(r.as_ref())) {
                s.last_restored = st.last_restored;
                s.backup_url = st.url;
            }
        } else if s.state == "in-progress" {
            s.progress = job.progress.percent();
        }
        Ok(Response::new(s))
    }
}
