//! Cluster-wide (leader only): runs each [`RecurringJob`] at its fire times. A fire time is claimed (written as
//! `lastScheduled`) before its run starts, so a restarted manager or a new leader never runs it twice; a run cut
//! off by a leader change is not repeated. One run per job at a time; a run works on `concurrency` volumes at once.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::cron::Cron;
use super::model::{JobSpec, RecurringJob, Task};
use super::{Decision, decide};
use crate::context::Ctx;
use crate::model::{Engine, ProcessState, Volume};
use crate::runtime::{Requeue, WorkQueue, feed, now, run_worker};
use crate::volume_engine::VolumeEngine;

/// Jobs with a run under way on this leader.
type Running = Arc<Mutex<HashSet<String>>>;

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<RecurringJob>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(30),
        |ev| Some(ev.name().to_owned()),
        |o| Some(o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    let running = Running::default();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("recurring-job", q, c.clone(), m, |name| {
            reconcile(ctx.clone(), running.clone(), c.clone(), name)
        })
        .await;
    });
}

async fn reconcile(
    ctx: Ctx,
    running: Running,
    cancel: CancellationToken,
    name: String,
) -> anyhow::Result<Requeue> {
    let Some(mut job) = ctx.db.get::<RecurringJob>(&name).await? else {
        return Ok(None);
    };
    if running.lock().is_ok_and(|r| r.contains(&name)) {
        return Ok(Some(Duration::from_secs(1)));
    }
    let cron = match Cron::parse(&job.data.spec.cron) {
        Ok(c) => c,
        Err(e) => {
            // The API validates schedules; a record written by something else is left alone.
            tracing::warn!(job = name, error = e, "recurring job has an invalid schedule");
            return Ok(None);
        }
    };
    let t = now();
    match decide(&cron, job.data.status.last_scheduled, job.data.spec.created, t) {
        Decision::Wait(next) => {
            let next = next.unwrap_or(0);
            if job.data.status.next_run != next {
                job.data.status.next_run = next;
                ctx.db.update(&mut job).await?;
            }
            // Wake just after the fire time; the feed's resync covers a clock that jumped.
            Ok((next > 0).then(|| Duration::from_secs(u64::try_from(next - t).unwrap_or(0) + 1)))
        }
        Decision::Missed(fire) => {
            tracing::warn!(
                job = name,
                fire,
                "fire time passed while no manager ran it: not caught up"
            );
            job.data.status.last_scheduled = fire;
            job.data.status.last_missed = fire;
            ctx.db.update(&mut job).await?;
            Ok(Some(Duration::ZERO))
        }
        Decision::Run(fire) => {
            // Claim first: a conflict means someone else wrote the job; the retry reads it again.
            job.data.status.last_scheduled = fire;
            job.data.status.last_finished = 0;
            job.data.status.next_run = cron
                .next(chrono::DateTime::from_timestamp(fire, 0).unwrap_or_default())
                .map_or(0, |n| n.timestamp());
            ctx.db.update(&mut job).await?;
            if let Ok(mut r) = running.lock() {
                r.insert(name.clone());
            }
            let spec = job.data.spec.clone();
            let next_fire = job.data.status.next_run;
            tokio::spawn(async move {
                let span = tracing::info_span!("recurring_job", job = name, task = %spec.task, fire);
                let results = tokio::select! {
                    r = run(&ctx, &name, &spec, fire, next_fire).instrument(span) => r,
                    () = cancel.cancelled() => {
                        if let Ok(mut r) = running.lock() { r.remove(&name); }
                        return;
                    }
                };
                let written = ctx
                    .db
                    .modify::<RecurringJob>(&name, |j| {
                        if j.status.last_scheduled == fire {
                            j.status.last_results = results.clone();
                            j.status.last_finished = now();
                        }
                        true
                    })
                    .await;
                if let Err(e) = written {
                    tracing::warn!(job = name, error = %e, "cannot record the run's results");
                }
                if let Ok(mut r) = running.lock() {
                    r.remove(&name);
                }
            });
            Ok(Some(Duration::from_secs(1)))
        }
    }
}

/// The volumes a job applies to: named ones and members of its groups, sorted, each once.
pub async fn targets(ctx: &Ctx, spec: &JobSpec) -> anyhow::Result<Vec<String>> {
    let mut out: Vec<String> = ctx
        .db
        .list::<Volume>()
        .await?
        .into_iter()
        .filter(|v| {
            spec.volumes.contains(&v.name) || v.data.spec.job_groups.iter().any(|g| spec.groups.contains(g))
        })
        .map(|v| v.name)
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// One run over every target volume, `concurrency` at a time: what each volume got. A failure is logged and
/// recorded; the next fire time tries again.
async fn run(
    ctx: &Ctx,
    job: &str,
    spec: &JobSpec,
    fire: i64,
    next_fire: i64,
) -> std::collections::BTreeMap<String, String> {
    let volumes = match targets(ctx, spec).await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(job, error = %e, "cannot list the job's volumes");
            return std::iter::once(("*".to_owned(), format!("failed: {e:#}"))).collect();
        }
    };
    let width = usize::try_from(spec.concurrency.max(1)).unwrap_or(1);
    futures::stream::iter(volumes)
        .map(|v| async move {
            let r = match attached(ctx, &v).await {
                Ok(Attached::Yes(mut c)) => match spec.task {
                    Task::Snapshot => super::snapshot_task::run(ctx, &mut c, job, spec, fire).await,
                    Task::Backup => {
                        super::backup_task::run(ctx, &mut c, &v, job, spec, fire, next_fire).await
                    }
                },
                Ok(Attached::No(why)) => Ok(format!("skipped: {why}")),
                Err(e) => Err(e),
            };
            match r {
                Ok(r) => {
                    tracing::info!(job, volume = v, result = r, "recurring job ran");
                    (v, r)
                }
                Err(e) => {
                    let r = format!("failed: {e:#}");
                    tracing::warn!(job, volume = v, result = r, "recurring job ran");
                    (v, r)
                }
            }
        })
        .buffer_unordered(width)
        .collect()
        .await
}

/// Whether a run works on a volume.
enum Attached {
    Yes(VolumeEngine),
    /// Why not (shown as `skipped: ...`).
    No(&'static str),
}

/// The engine of `volume` when a run can work on it: a volume that is not attached (or is attached without a
/// frontend for a clone, restore or revert) is skipped.
async fn attached(ctx: &Ctx, volume: &str) -> anyhow::Result<Attached> {
    let Some(v) = ctx.db.get::<Volume>(volume).await? else {
        return Ok(Attached::No("the volume was deleted"));
    };
    if v.data.spec.disable_frontend {
        return Ok(Attached::No("attached in maintenance mode"));
    }
    let engine = ctx
        .db
        .get::<Engine>(volume)
        .await?
        .filter(|e| e.data.status.state == ProcessState::Running && v.data.spec.node_id.is_some());
    let Some(engine) = engine else {
        return Ok(Attached::No("not attached"));
    };
    Ok(Attached::Yes(
        VolumeEngine::connect(&engine)
            .await
            .map_err(|e| anyhow::anyhow!(e))?,
    ))
}
