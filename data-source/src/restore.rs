//! `restore`: restores one backup (`backup-url` = `TARGET?backup=NAME&volume=VOLUME`, a `file://` or `s3://`
//! target, S3 credentials from `--backup-credentials-file`, else `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` in
//! the environment) into the work file
//! with the backup store's [`FileSink`]: ranges without blocks stay holes, every block is verified against its
//! SHA-256 before it is written. A target that makes no progress for the no-data limit (plus the store's lock
//! wait) fails the job instead of hanging.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backupstore::file::FileSink;
use backupstore::{BackupStore, BackupStoreError, Progress, RestoreOptions};

use crate::error::JobError;
use crate::job::JobContext;

/// How long a cancelled restore may take to stop at its next block before it is abandoned.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// Restores the backup into `work`.
pub async fn run(ds: &JobContext, backup_url: &str, work: &Path) -> Result<(), JobError> {
    let err = |source| JobError::Restore {
        url: backup_url.to_owned(),
        source: Box::new(source),
    };
    let (url, volume, backup) = crate::spec::parse_backup_url(backup_url).map_err(err)?;
    let limit = ds.config().no_data_timeout;
    let cancel = ds.cancel_token().clone();
    let stalled = |what: &str, secs: u64| JobError::RestoreStalled {
        url: backup_url.to_owned(),
        reason: format!("{what} for {secs} s"),
    };
    // Credentials: the file the manager wrote for this daemon, else the AWS_* variables of the environment (the
    // store reads them when the map is empty).
    let credentials = match &ds.config().backup_credentials_file {
        Some(f) => backupstore::target::read_credentials_file(f).map_err(err)?,
        None => BTreeMap::new(),
    };
    let store = BackupStore::open(&url, &credentials).map_err(err)?;
    let cfg = tokio::select! {
        r = tokio::time::timeout(limit, store.backup_config(&volume, &backup)) => {
            r.map_err(|_| stalled("no answer from the backup target", limit.as_secs()))?.map_err(err)?
        }
        () = cancel.cancelled() => return Err(JobError::Cancelled("the data source is shutting down")),
    };
    let size = cfg.size;
    ds.set_size(size);
    tracing::info!(target = %url.target, volume, backup, size, blocks = cfg.blocks.len(), "restoring");
    let sink = Arc::new(FileSink::create(work, size).map_err(|e| JobError::io("creating", work, e))?);
    let opts = RestoreOptions {
        lock_wait: limit,
        ..RestoreOptions::default()
    };
    let progress = Progress::default();
    // Waiting for a conflicting lock shows no progress either: allow for it on top of the no-data limit.
    let stall_limit = limit + opts.lock_wait;
    let restore = store.restore(&volume, &backup, sink.clone(), &opts, &progress);
    tokio::pin!(restore);
    let (mut last, mut last_change) = ((0, 0), Instant::now());
    let mut cancelled_at: Option<Instant> = None;
    let outcome = loop {
        tokio::select! {
            r = &mut restore => break r,
            () = cancel.cancelled(), if cancelled_at.is_none() => {
                // Stops at the next block and releases the store's restore lock.
                progress.cancel();
                cancelled_at = Some(Instant::now());
            }
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                let now = (progress.percent(), progress.bytes());
                ds.set_processed(size * u64::from(now.0) / 100);
                if now != last {
                    (last, last_change) = (now, Instant::now());
                } else if last_change.elapsed() > stall_limit {
                    return Err(stalled("no progress restoring from the backup target", stall_limit.as_secs()));
                }
                if cancelled_at.is_some_and(|t| t.elapsed() > CANCEL_GRACE) {
                    return Err(JobError::Cancelled("the data source is shutting down"));
                }
            }
        }
    };
    let outcome = outcome.map_err(|e| match e {
        BackupStoreError::Cancelled => JobError::Cancelled("the data source is shutting down"),
        other => err(other),
    })?;
    tokio::task::spawn_blocking(move || sink.sync())
        .await
        .map_err(|e| JobError::Task(e.to_string()))?
        .map_err(|e| JobError::io("flushing", work, e))?;
    ds.set_processed(size);
    tracing::info!(
        size,
        blocks = outcome.blocks_written,
        bytes = outcome.bytes_written,
        holes = outcome.zeroed_bytes,
        "backup restored"
    );
    Ok(())
}
