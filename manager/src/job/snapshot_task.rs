//! The `snapshot` task of a recurring job on one attached volume, and the snapshot steps the `backup` task shares:
//! the run's snapshot `<job>-<fire time>` labelled with the job, the job's snapshots found by that label, their
//! removal and purge.

use super::model::{JOB_LABEL, JobSpec};
use super::{beyond_retention, snapshot_name};
use crate::context::Ctx;
use crate::volume_engine::VolumeEngine;

/// Takes the run's snapshot, `<job>-<fire time>`, labelled with the job and its labels; returns its name.
pub async fn take_snapshot(
    ctx: &Ctx,
    c: &mut VolumeEngine,
    job: &str,
    spec: &JobSpec,
    fire: i64,
) -> anyhow::Result<String> {
    let name = snapshot_name(job, fire);
    let mut labels = spec.labels.clone();
    labels.insert(JOB_LABEL.to_owned(), job.to_owned());
    c.snapshot_create(ctx, name.clone(), labels.into_iter().collect())
        .await?;
    Ok(name)
}

/// The job's snapshots of the volume behind `c` that are not removed: (name, creation time).
pub async fn job_snapshots(ctx: &Ctx, c: &mut VolumeEngine, job: &str) -> anyhow::Result<Vec<(String, i64)>> {
    Ok(c.snapshots(ctx)
        .await?
        .iter()
        .filter(|s| !s.removed && s.labels.get(JOB_LABEL).is_some_and(|j| j == job))
        .map(|s| {
            let t = chrono::DateTime::parse_from_rfc3339(&s.created).map_or(0, |t| t.timestamp());
            (s.name.clone(), t)
        })
        .collect())
}

/// Removes `old` snapshots and purges (gives the space back); a purge refused while a replica rebuilds is left
/// to the next run. Returns what the result says about it.
pub async fn remove_snapshots(ctx: &Ctx, c: &mut VolumeEngine, old: &[String]) -> anyhow::Result<String> {
    if old.is_empty() {
        return Ok(String::new());
    }
    for s in old {
        c.snapshot_remove(ctx, s.clone()).await?;
    }
    let purged = c.snapshot_purge().await.is_ok();
    Ok(format!(
        "; removed {}{}",
        old.join(", "),
        if purged {
            ""
        } else {
            " (purge deferred: a replica rebuilds)"
        }
    ))
}

/// The snapshot task of one run on one volume: takes the run's snapshot and removes the job's snapshots beyond
/// `retain`.
pub async fn run(
    ctx: &Ctx,
    c: &mut VolumeEngine,
    job: &str,
    spec: &JobSpec,
    fire: i64,
) -> anyhow::Result<String> {
    let name = take_snapshot(ctx, c, job, spec, fire).await?;
    let mine = job_snapshots(ctx, c, job).await?;
    let old = beyond_retention(&mine, spec.retain);
    let removed = remove_snapshots(ctx, c, &old).await?;
    Ok(format!("snapshot {name}{removed}"))
}
