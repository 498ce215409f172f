//! The `backup` task of a recurring job on one attached volume, in seed 004's order:
//!
//! 1. **retention first**: of the job's completed backups of the volume on its target (the job's `target`, else
//!    `default`; found by the
//!    `corral.io/recurring-job` label, never another job's or a manual backup), the newest `retain - 1` stay and
//!    the rest are deleted (blocks another backup uses stay), so that the `backup-max-count` check of the new
//!    backup sees the room retention made (use case 1: limit 7, retain 7, the 8th backup is taken);
//! 2. the run's snapshot, labelled with the job, and a backup of it through the one path `POST /v1/backups` takes
//!    ([`crate::backup::service::request_backup`]: the volume's limit, one backup per volume at a time, the chain
//!    policy `backup-delta-max` — the job's own `deltaMax` over the setting — / `backup-incremental`), driven by
//!    the leader's backup controller;
//! 3. the run waits for it (until the next fire time, at least [`MIN_WAIT`]) and then, as Longhorn does, removes
//!    the job's snapshots except the one its newest completed backup was made from (the next incremental diffs
//!    against it) and one a running backup reads, and purges.
//!
//! A failed step fails this volume's run (recorded in the job's `lastResults`, logged); the next fire time tries
//! again. A backup still running when the wait ends is left to the backup controller; the next run waits up to
//! [`GRACE`] for it (one backup per volume at a time) and cleans its snapshot up.

use std::time::Duration;

use super::GRACE;
use super::model::{JOB_LABEL, JobSpec};
use super::snapshot_task::{job_snapshots, remove_snapshots, take_snapshot};
use crate::backup::model::{Backup, BackupState, DEFAULT_TARGET};
use crate::backup::service::{BackupCreate, remove_backup, request_backup};
use crate::context::Ctx;
use crate::runtime::now;
use crate::store::Object;
use crate::volume_engine::VolumeEngine;

/// How often a run looks at the backup it waits for.
const POLL: Duration = Duration::from_millis(500);
/// The least a run waits for its backup, however close the next fire time is.
pub const MIN_WAIT: Duration = Duration::from_secs(30);

/// The target a job's backups go to.
fn target_of(spec: &JobSpec) -> &str {
    spec.target.as_deref().unwrap_or(DEFAULT_TARGET)
}

/// The job's backups of `volume` on `target` (any state), oldest first.
async fn job_backups(
    ctx: &Ctx,
    job: &str,
    volume: &str,
    target: &str,
) -> anyhow::Result<Vec<Object<Backup>>> {
    let mut out: Vec<Object<Backup>> = ctx
        .db
        .list::<Backup>()
        .await?
        .into_iter()
        .filter(|b| {
            b.data.target == target
                && b.data.volume == volume
                && b.data.labels.get(JOB_LABEL).is_some_and(|j| j == job)
        })
        .collect();
    out.sort_by(|a, b| (&a.data.started, &a.name).cmp(&(&b.data.started, &b.name)));
    Ok(out)
}

/// When `b` started, in microseconds: a job's backups can start within one second (a late run right before the
/// next), and their names are random, so whole seconds would leave retention's order to the names.
fn started(b: &Backup) -> i64 {
    chrono::DateTime::parse_from_rfc3339(&b.started).map_or(0, |t| t.timestamp_micros())
}

/// Which of the job's backups retention deletes before a new one: completed ones beyond the newest
/// `retain - 1`, and failed ones older than the newest completed one (their error was shown by the run that made
/// them). Running ones are never deleted.
pub fn to_delete(backups: &[Backup], retain: u32) -> Vec<String> {
    let completed: Vec<(String, i64)> = backups
        .iter()
        .filter(|b| b.state == BackupState::Completed)
        .map(|b| (b.name.clone(), started(b)))
        .collect();
    let mut out = super::beyond_retention(&completed, retain.saturating_sub(1));
    let newest = completed.iter().map(|(_, t)| *t).max();
    out.extend(
        backups
            .iter()
            .filter(|b| b.state == BackupState::Failed && newest.is_some_and(|n| started(b) < n))
            .map(|b| b.name.clone()),
    );
    out
}

/// Waits up to `wait` for no backup of `volume` to run: the one still running then, if any (backup, snapshot).
async fn wait_idle(ctx: &Ctx, volume: &str, wait: Duration) -> anyhow::Result<Option<(String, String)>> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let running = crate::backup::running_on(ctx, volume).await?;
        if running.is_none() || tokio::time::Instant::now() >= deadline {
            return Ok(running);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The backup task of one run on one volume: what it did, or why it failed.
pub async fn run(
    ctx: &Ctx,
    c: &mut VolumeEngine,
    volume: &str,
    job: &str,
    spec: &JobSpec,
    fire: i64,
    next_fire: i64,
) -> anyhow::Result<String> {
    // 1. Retention, before the new backup meets backup-max-count.
    let mine = job_backups(ctx, job, volume, target_of(spec)).await?;
    let data: Vec<Backup> = mine.iter().map(|b| b.data.clone()).collect();
    let mut removed = Vec::new();
    for name in to_delete(&data, spec.retain) {
        let Some(b) = mine.iter().find(|b| b.data.name == name) else {
            continue;
        };
        remove_backup(ctx, &b.name)
            .await
            .map_err(|e| anyhow::anyhow!("retention could not delete backup {name}: {e}"))?;
        tracing::info!(job, volume, backup = name, "retention deleted the job's backup");
        removed.push(name);
    }

    // 2. One backup per volume at a time: a backup still running (the job's last one, or a manual one) is waited
    // for a while before this run gives up.
    if let Some((b, s)) = wait_idle(ctx, volume, GRACE).await? {
        anyhow::bail!("backup {b} of snapshot {s} is still running: one backup per volume at a time");
    }
    let snapshot = take_snapshot(ctx, c, job, spec, fire).await?;
    let mut labels = spec.labels.clone();
    labels.insert(JOB_LABEL.to_owned(), job.to_owned());
    let requested = request_backup(
        ctx,
        &BackupCreate {
            volume: volume.to_owned(),
            snapshot: Some(snapshot.clone()),
            full: false,
            labels,
            target: spec.target.clone(),
            delta_max: spec.delta_max,
            block_size: None,
        },
    )
    .await;
    let outcome = match requested {
        Ok(b) => wait_done(ctx, &b.name, fire, next_fire).await,
        Err(e) => Err(anyhow::anyhow!("snapshot {snapshot}: {e}")),
    };

    // 3. The job's snapshots no backup needs go, whatever the backup's outcome (a refused backup's too).
    let cleaned = clean_snapshots(ctx, c, job, volume, target_of(spec)).await;
    let made = outcome?;
    let mut r = format!("{made} of snapshot {snapshot}");
    if !removed.is_empty() {
        r.push_str(&format!("; deleted backups {}", removed.join(", ")));
    }
    match cleaned {
        Ok(s) => r.push_str(&s.replacen("; removed", "; removed snapshots", 1)),
        Err(e) => r.push_str(&format!("; snapshots not cleaned up: {e:#}")),
    }
    Ok(r)
}

/// Waits for the backup `key` to end, until the next fire time but at least [`MIN_WAIT`]: what it made, or why
/// it failed.
async fn wait_done(ctx: &Ctx, key: &str, fire: i64, next_fire: i64) -> anyhow::Result<String> {
    let min = i64::try_from(MIN_WAIT.as_secs()).unwrap_or(30);
    let until = next_fire.max(fire + min);
    loop {
        let Some(b) = ctx.db.get::<Backup>(key).await? else {
            anyhow::bail!("backup {key} was deleted while it ran");
        };
        let b = b.data;
        match b.state {
            BackupState::Completed => {
                return Ok(if b.is_incremental {
                    format!(
                        "backup {} (incremental, chain position {})",
                        b.name, b.chain_position
                    )
                } else {
                    format!("backup {} (full: {})", b.name, b.full_reason)
                });
            }
            BackupState::Failed => anyhow::bail!("backup {} failed: {}", b.name, b.error),
            BackupState::Pending | BackupState::InProgress if now() >= until => {
                return Ok(format!(
                    "backup {} still {} ({}%) at the next fire time",
                    b.name,
                    b.state.as_str(),
                    b.progress
                ));
            }
            BackupState::Pending | BackupState::InProgress => tokio::time::sleep(POLL).await,
        }
    }
}

/// Removes the job's snapshots of `volume` except the one its newest completed backup was made from and any a
/// running backup reads, and purges.
async fn clean_snapshots(
    ctx: &Ctx,
    c: &mut VolumeEngine,
    job: &str,
    volume: &str,
    target: &str,
) -> anyhow::Result<String> {
    let backups = job_backups(ctx, job, volume, target).await?;
    let mut keep: Vec<String> = backups
        .iter()
        .rev()
        .find(|b| b.data.state == BackupState::Completed)
        .map(|b| b.data.snapshot.clone())
        .into_iter()
        .collect();
    if let Some((_, s)) = crate::backup::running_on(ctx, volume).await? {
        keep.push(s);
    }
    let old: Vec<String> = job_snapshots(ctx, c, job)
        .await?
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !keep.contains(n))
        .collect();
    remove_snapshots(ctx, c, &old).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(name: &str, state: BackupState, minute: u32) -> Backup {
        Backup {
            name: name.to_owned(),
            state,
            started: format!("2026-11-24T10:{minute:02}:00Z"),
            ..Default::default()
        }
    }

    #[test]
    fn retention_before_a_backup_keeps_room_for_it_and_drops_older_failures() {
        let all = [
            b("b1", BackupState::Completed, 1),
            b("b2", BackupState::Failed, 2),
            b("b3", BackupState::Completed, 3),
            b("b4", BackupState::Completed, 4),
            b("b5", BackupState::InProgress, 5),
            b("b6", BackupState::Failed, 6),
        ];
        // retain 2: one completed stays beside the one about to be made; the failure after it stays visible.
        assert_eq!(to_delete(&all, 2), vec!["b3", "b1", "b2"]);
        // retain 1: every completed one goes.
        assert_eq!(to_delete(&all, 1), vec!["b4", "b3", "b1", "b2"]);
        // retain 7 with 3 completed: only the failure older than the newest completed.
        assert_eq!(to_delete(&all, 7), vec!["b2"]);
        // Two started within one second, the older with the name that sorts last: the older goes.
        let mut older = b("zz-older", BackupState::Completed, 1);
        older.started = "2026-11-24T10:01:00.035Z".to_owned();
        let mut newer = b("aa-newer", BackupState::Completed, 1);
        newer.started = "2026-11-24T10:01:00.769Z".to_owned();
        assert_eq!(to_delete(&[older, newer], 2), vec!["zz-older"]);
        // Nothing completed yet: failures stay.
        assert_eq!(
            to_delete(&[b("f", BackupState::Failed, 1)], 1),
            Vec::<String>::new()
        );
    }
}
