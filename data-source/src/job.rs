//! [`JobContext`]: what every job of a data source (download, export, clone, restore, upload, post-processing)
//! works with — the validated config and source, the [`FileInfo`] record the job reports its state and progress
//! into, the counters exported on `/metrics`, and the cancellation. Jobs depend on this, not on the server
//! ([`crate::service`]) that starts them. It owns the files under `<disk>/tmp/<name>-<uuid>*` until `transfer`;
//! every failure removes them, so a failed job leaves nothing behind.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

use crate::error::{ApiError, ConfigError, JobError};
use crate::info::{FileInfo, FileState, SourceType};
use crate::spec::{DataSourceConfig, SourceSpec};

/// Share of the progress bar the data transfer takes; format conversion and checksumming fill the rest.
pub const TRANSFER_SHARE: u8 = 80;

/// Counters exported on `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes received from the network (downloads, uploads, exports), retries included.
    pub bytes_fetched: AtomicU64,
    /// HTTP requests a download made (1 + retries).
    pub download_attempts: AtomicU64,
    /// Downloads that started again from byte 0 because the server ignored a Range request.
    pub download_restarts: AtomicU64,
    /// Bytes hashed for checksums.
    pub bytes_hashed: AtomicU64,
}

/// The state one data-source job reports into and reads its inputs from.
pub struct JobContext {
    config: DataSourceConfig,
    spec: SourceSpec,
    info: Mutex<FileInfo>,
    /// SHA-512 of the data as received, when the fetch computed it on the way (download, upload).
    received_sha512: Mutex<Option<String>>,
    /// Cancelled on shutdown: the running job stops and fails.
    cancel: CancellationToken,
    pub counters: Counters,
}

impl JobContext {
    /// Validates `config`, checks the disk identity, and prepares `<disk>/tmp` (removing leftovers of an earlier
    /// run for the same image). Bad input is refused before anything on disk changes.
    pub fn new(config: DataSourceConfig, cancel: CancellationToken) -> Result<Self, ConfigError> {
        let spec = config.validate()?;
        corral_disk::identity::verify_disk(&config.disk_path, &config.disk_uuid)?;
        // `filePath` is read by another process: make it absolute.
        let mut config = config;
        config.disk_path = std::fs::canonicalize(&config.disk_path).map_err(|source| ConfigError::Io {
            op: "resolving",
            path: config.disk_path.clone(),
            source,
        })?;
        let tmp = config.tmp_dir();
        std::fs::create_dir_all(&tmp).map_err(|source| ConfigError::Io {
            op: "creating",
            path: tmp.clone(),
            source,
        })?;
        let stale = config.owned_files().map_err(|source| ConfigError::Io {
            op: "listing",
            path: tmp.clone(),
            source,
        })?;
        for path in stale {
            std::fs::remove_file(&path).map_err(|source| ConfigError::Io {
                op: "removing a leftover of an earlier data source",
                path: path.clone(),
                source,
            })?;
            tracing::warn!(path = %path.display(), "removed a leftover of an earlier data source");
        }
        let info = FileInfo {
            name: config.name.clone(),
            uuid: config.uuid.clone(),
            source_type: config.source_type,
            parameters: config.parameters.clone(),
            disk_uuid: config.disk_uuid.clone(),
            file_path: config.file_path().display().to_string(),
            size: 0,
            virtual_size: 0,
            real_size: 0,
            state: FileState::Pending,
            progress: 0,
            processed_size: 0,
            expected_checksum: config.expected_checksum.clone().unwrap_or_default(),
            current_checksum: String::new(),
            message: String::new(),
        };
        Ok(JobContext {
            config,
            spec,
            info: Mutex::new(info),
            received_sha512: Mutex::new(None),
            cancel,
            counters: Counters::default(),
        })
    }

    pub fn config(&self) -> &DataSourceConfig {
        &self.config
    }

    pub fn spec(&self) -> &SourceSpec {
        &self.spec
    }

    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    fn lock(&self) -> MutexGuard<'_, FileInfo> {
        // Plain data: a panic elsewhere does not make it unusable.
        self.info
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A copy of the current record.
    pub fn info(&self) -> FileInfo {
        self.lock().clone()
    }

    /// The span every log line of this job is in (image name, uuid, source type).
    pub fn span(&self) -> tracing::Span {
        tracing::info_span!(
            "datasource",
            image = %self.config.name,
            uuid = %self.config.uuid,
            source = %self.config.source_type
        )
    }

    pub(crate) fn set_state(&self, state: FileState) {
        let mut i = self.lock();
        if i.state != state {
            tracing::info!(from = %i.state, to = %state, "state");
            i.state = state;
        }
    }

    /// Claims the pending upload source: pending → starting, or the reason it cannot.
    pub(crate) fn claim_upload(&self) -> Result<(), ApiError> {
        let mut i = self.lock();
        if i.source_type != SourceType::Upload {
            return Err(ApiError::WrongSourceType {
                action: "upload".into(),
                source_type: i.source_type.as_str(),
            });
        }
        if i.state != FileState::Pending {
            return Err(ApiError::WrongState {
                action: "upload",
                state: i.state,
                hint: "an upload source takes exactly one upload",
            });
        }
        tracing::info!(from = %i.state, to = %FileState::Starting, "state");
        i.state = FileState::Starting;
        Ok(())
    }

    /// Hands the finished file over: ready-for-transfer → ready.
    pub fn transfer(&self) -> Result<FileInfo, ApiError> {
        let mut i = self.lock();
        if i.state != FileState::ReadyForTransfer {
            return Err(ApiError::WrongState {
                action: "transfer",
                state: i.state,
                hint: "only a file in state ready-for-transfer can be transferred",
            });
        }
        tracing::info!(path = %i.file_path, "file transferred; it is no longer this data source's");
        i.state = FileState::Ready;
        Ok(i.clone())
    }

    /// Records the SHA-512 of the work file as received (saves a pass over it in post-processing).
    pub(crate) fn set_received_checksum(&self, sha512: String) {
        *self
            .received_sha512
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sha512);
    }

    /// The SHA-512 of the work file as received, if the fetch computed it.
    pub(crate) fn received_checksum(&self) -> Option<String> {
        self.received_sha512
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets the known size of the source (0 while unknown).
    pub(crate) fn set_size(&self, size: u64) {
        self.lock().size = size;
    }

    /// Records `processed` bytes of source data received in all; the first moves starting → in-progress.
    pub(crate) fn set_processed(&self, processed: u64) {
        let mut i = self.lock();
        i.processed_size = processed;
        if i.state == FileState::Starting && processed > 0 {
            tracing::info!(from = %i.state, to = %FileState::InProgress, "state");
            i.state = FileState::InProgress;
        }
        if i.size > 0 {
            let pct = u128::from(processed.min(i.size)) * u128::from(TRANSFER_SHARE) / u128::from(i.size);
            i.progress = u8::try_from(pct).unwrap_or(TRANSFER_SHARE);
        }
    }

    /// Sets the progress of a post-processing phase spanning `[from, to)` of the bar.
    pub(crate) fn set_phase_progress(&self, from: u8, to: u8, done: u64, total: u64) {
        let span = u64::from(to.saturating_sub(from));
        let p = (done.min(total) * span).checked_div(total).unwrap_or(0);
        let mut i = self.lock();
        i.state = FileState::InProgress;
        i.progress = from.saturating_add(u8::try_from(p).unwrap_or(0)).min(99);
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut FileInfo)) {
        f(&mut self.lock());
    }

    /// Fails the job: removes every file it made, records the message.
    pub(crate) fn fail(&self, e: &JobError) {
        match self.config.owned_files() {
            Ok(files) => files.iter().for_each(|p| remove_if_exists(p)),
            Err(err) => tracing::warn!(error = %err, "cannot list the files to remove"),
        }
        let mut i = self.lock();
        tracing::error!(error = %e, "data source failed");
        i.state = FileState::Failed;
        i.message = e.to_string();
        i.current_checksum.clear();
    }
}

/// Removes `path`; a missing file is fine, other errors are logged (the job already failed for another reason).
pub(crate) fn remove_if_exists(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
    }
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
