//! Status of the replica's long-running jobs (purge, snapshot hash): state, progress, error, cancellation.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use serde::Serialize;

use crate::locks::lock;

/// State of a job, serialised as in the API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    /// Never ran.
    #[default]
    None,
    /// Running.
    InProgress,
    /// Finished successfully.
    Complete,
    /// Failed; see the error.
    Error,
    /// Cancelled by request.
    Cancelled,
}

impl JobState {
    /// The API string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::InProgress => "in-progress",
            Self::Complete => "complete",
            Self::Error => "error",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Progress and cancellation handle shared between a job and its observers.
#[derive(Debug, Default)]
pub struct JobControl {
    progress: AtomicU32,
    cancelled: AtomicBool,
}

impl JobControl {
    /// Records progress in percent (clamped to 100).
    pub fn set_progress(&self, pct: u32) {
        self.progress.store(pct.min(100), Ordering::Relaxed);
    }

    /// Progress in percent.
    pub fn progress(&self) -> u32 {
        self.progress.load(Ordering::Relaxed)
    }

    /// Asks the job to stop at its next check.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Was cancellation requested?
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// Snapshot of a job's status.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    /// State.
    pub state: JobState,
    /// Percent.
    pub progress: u32,
    /// Error text when failed.
    pub error: String,
    /// Result checksum (hash jobs).
    pub checksum: String,
    /// Silent corruption detected (hash jobs).
    pub silently_corrupted: bool,
    /// The recorded checksum was reused (hash jobs).
    pub skipped: bool,
}

#[derive(Debug, Default)]
struct Entry {
    status: JobStatus,
    control: Arc<JobControl>,
}

/// Jobs of one replica, by key (`purge`, `hash/<snapshot file>`).
#[derive(Debug, Default)]
pub struct JobTable {
    jobs: Mutex<HashMap<String, Entry>>,
}

impl JobTable {
    /// Registers a new run of `key`; refuses while one is in progress.
    pub fn start(&self, key: &str) -> Option<Arc<JobControl>> {
        let mut jobs = lock(&self.jobs);
        if jobs
            .get(key)
            .is_some_and(|e| e.status.state == JobState::InProgress)
        {
            return None;
        }
        let control = Arc::new(JobControl::default());
        jobs.insert(
            key.to_owned(),
            Entry {
                status: JobStatus {
                    state: JobState::InProgress,
                    ..Default::default()
                },
                control: control.clone(),
            },
        );
        Some(control)
    }

    /// Records the end of a run.
    pub fn finish(&self, key: &str, status: JobStatus) {
        if let Some(e) = lock(&self.jobs).get_mut(key) {
            e.status = JobStatus {
                progress: if status.state == JobState::Complete {
                    100
                } else {
                    e.control.progress()
                },
                ..status
            };
        }
    }

    /// Current status (`None` state when never run).
    pub fn status(&self, key: &str) -> JobStatus {
        lock(&self.jobs).get(key).map_or_else(JobStatus::default, |e| {
            let mut s = e.status.clone();
            if s.state == JobState::InProgress {
                s.progress = e.control.progress();
            }
            s
        })
    }

    /// Requests cancellation of a running job; false when none runs.
    pub fn cancel(&self, key: &str) -> bool {
        match lock(&self.jobs).get(key) {
            Some(e) if e.status.state == JobState::InProgress => {
                e.control.cancel();
                true
            }
            _ => false,
        }
    }
}
