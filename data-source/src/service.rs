//! [`DataSource`]: the server's one job. It builds the [`JobContext`], runs the fetch for the configured source and
//! then the post-processing on a tracked task (joined at shutdown), and fails the job when either fails.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::error::{ConfigError, JobError};
use crate::info::{FileState, SourceType};
use crate::job::JobContext;
use crate::spec::{DataSourceConfig, SourceSpec};
use crate::{clone, download, export, finish, restore};

/// The data source: its job's context and the task running it.
pub struct DataSource {
    job: JobContext,
    tasks: TaskTracker,
}

impl DataSource {
    /// Validates `config`, checks the disk identity, and prepares `<disk>/tmp` (see [`JobContext::new`]).
    pub fn new(config: DataSourceConfig, cancel: CancellationToken) -> Result<Arc<Self>, ConfigError> {
        Ok(Arc::new(DataSource {
            job: JobContext::new(config, cancel)?,
            tasks: TaskTracker::new(),
        }))
    }

    /// The job's config, state record, counters and cancellation.
    pub fn job(&self) -> &JobContext {
        &self.job
    }

    /// Starts the job (an upload source waits for its upload instead).
    pub fn start(self: &Arc<Self>) {
        if self.job.config().source_type == SourceType::Upload {
            return;
        }
        self.job.set_state(FileState::Starting);
        let this = self.clone();
        self.tasks.spawn(
            async move {
                let r = this.fetch().await;
                this.complete(r).await;
            }
            .instrument(self.job.span()),
        );
    }

    /// Post-processes uploaded data on a tracked task (joined at shutdown).
    pub(crate) fn finish_in_background(self: &Arc<Self>) {
        let this = self.clone();
        self.tasks
            .spawn(async move { this.complete(Ok(())).await }.instrument(self.job.span()));
    }

    /// Waits for the running job to stop (after the cancel token fired).
    pub async fn join(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }

    async fn fetch(&self) -> Result<(), JobError> {
        let job = &self.job;
        let work = job.config().work_path();
        match job.spec() {
            SourceSpec::Download { url } => download::run(job, url, &work).await,
            SourceSpec::ExportFromVolume {
                snapshot_name,
                sender_address,
                volume_size,
                file_type,
            } => {
                export::run(
                    job,
                    snapshot_name,
                    sender_address,
                    *volume_size,
                    *file_type,
                    &work,
                )
                .await
            }
            SourceSpec::Clone {
                backing_image,
                from_lvstore: Some(lvstore),
                size,
                ..
            } => clone::run_from_lvstore(job, backing_image, lvstore, *size, &work).await,
            SourceSpec::Clone {
                backing_image,
                backing_image_uuid,
                from_lvstore: None,
                ..
            } => clone::run(job, backing_image, backing_image_uuid, &work).await,
            SourceSpec::Restore { backup_url } => restore::run(job, backup_url, &work).await,
            SourceSpec::Upload => Err(JobError::Unsupported("an upload source has no fetch step".into())),
        }
    }

    /// After the data is in (or the fetch failed): post-process, or fail and clean up.
    async fn complete(&self, fetched: Result<(), JobError>) {
        let r = match fetched {
            Ok(()) => finish::run(&self.job).await,
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            self.job.fail(&e);
        }
    }
}
