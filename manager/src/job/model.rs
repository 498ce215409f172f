//! A recurring job (kind `recurring-job`): a task run on a cron schedule over a set of volumes, keeping the newest
//! `retain` of what it made.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::store::Resource;

/// What a run does to each volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Task {
    /// Takes a snapshot labelled with the job; removes the job's snapshots beyond `retain`.
    #[default]
    Snapshot,
    /// Takes a snapshot and backs it up (to the job's target, else the default one); removes the job's backups
    /// beyond `retain`.
    Backup,
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Snapshot => "snapshot",
            Self::Backup => "backup",
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecurringJob {
    pub spec: JobSpec,
    #[serde(default)]
    pub status: JobStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobSpec {
    pub task: Task,
    /// Five-field cron, UTC ([`super::cron`]).
    pub cron: String,
    /// How many of the job's own snapshots (or backups) each volume keeps.
    pub retain: u32,
    /// Volumes worked on at once in a run.
    pub concurrency: u32,
    /// Volumes the job applies to by name.
    #[serde(default)]
    pub volumes: Vec<String>,
    /// Groups the job applies to: every volume whose `jobGroups` names one of them.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Added to every snapshot (and backup) the job makes; `corral.io/recurring-job` is always the job's name.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Unix seconds of creation: a schedule's fire times before it are not runs of this job.
    pub created: i64,
    /// Backup task: the backup target its backups go to (None: `default`). Checked to exist at creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Backup task: the job's own `backup-delta-max` (backups in a chain, its full one included), over the
    /// setting's for the backups it makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_max: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    /// Unix seconds of the last fire time claimed (run or recorded as missed). A fire time is claimed in the
    /// store before its run starts, so a manager restart or a new leader never runs it twice.
    pub last_scheduled: i64,
    /// The last fire time that was not run because no manager was up in time (not caught up, by design).
    #[serde(default)]
    pub last_missed: i64,
    /// Unix seconds of the next fire time, for display.
    #[serde(default)]
    pub next_run: i64,
    /// The last run's outcome per volume: the snapshot or backup made, `skipped: ...` or `failed: ...`.
    #[serde(default)]
    pub last_results: BTreeMap<String, String>,
    /// Unix seconds at which the last run finished (0 while one runs).
    #[serde(default)]
    pub last_finished: i64,
}

impl Resource for RecurringJob {
    const KIND: &'static str = "recurring-job";
}

/// Most snapshots or backups a job keeps per volume.
pub const MAX_RETAIN: u32 = 250;
/// Most volumes a run works on at once.
pub const MAX_CONCURRENCY: u32 = 64;

/// The label every snapshot and backup a job makes carries, valued with the job's name.
pub const JOB_LABEL: &str = "corral.io/recurring-job";
