//! Node-local: runs one `corral-datasource` for every data source of this node until a disk manager took its file
//! (`started`), polls its `GET /v1/file` (10 failed polls in a row → the daemon is restarted), restarts a failed
//! job with backoff unless it was an upload (the user uploads into a new image instead), and stops the daemon once
//! the file is taken or the document is gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::model::{BackingImageDataSource, SourceType, state};
use crate::context::Ctx;
use crate::controller::{Requeue, WorkQueue, feed, run_worker};
use crate::model::ProcessRecord;
use crate::process;
use crate::store::{Event, absent_ok};

pub const BINARY: &str = "corral-datasource";
const POLL: Duration = Duration::from_secs(1);
/// Failed polls of a running daemon before it is restarted.
const MAX_POLL_FAILURES: u32 = 10;

/// What this manager process started: kept to stop the daemon after its document is deleted.
#[derive(Default)]
struct Local {
    daemons: Mutex<HashMap<String, (ProcessRecord, Instant)>>,
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    let me = ctx.cfg.node_id.clone();
    let me2 = me.clone();
    feed::<BackingImageDataSource>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        move |ev| match ev {
            Event::Put(o) if o.data.spec.node_id == me => Some(o.name.clone()),
            Event::Put(_) => None,
            Event::Delete { name, .. } => Some(name.clone()),
        },
        move |o| (o.data.spec.node_id == me2).then(|| o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    let local = Arc::new(Local::default());
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backing-image-data-source", q, c, m, |name| {
            reconcile(ctx.clone(), local.clone(), name)
        })
        .await;
    });
}

/// The part of the data source's `/v1/file` JSON the manager reads (`docs/formats.md`, "Data source").
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileInfo {
    state: String,
    progress: u32,
    size: u64,
    virtual_size: u64,
    current_checksum: String,
    message: String,
}

async fn poll(address: &str) -> anyhow::Result<FileInfo> {
    let resp = reqwest::Client::new()
        .get(format!("http://{address}/v1/file"))
        .timeout(Duration::from_secs(3))
        .send()
        .await?
        .error_for_status()?;
    Ok(resp.json().await?)
}

/// Stops the recorded daemon and any this manager process started for the image.
async fn stop(local: &Local, name: &str, rec: Option<&ProcessRecord>) {
    let started = local.daemons.lock().ok().and_then(|mut m| m.remove(name));
    for p in rec.into_iter().chain(started.as_ref().map(|(p, _)| p)) {
        process::stop(p, BINARY, Duration::from_secs(10)).await;
    }
}

fn restart_delay(attempts: u32) -> Duration {
    Duration::from_millis(1000u64.saturating_mul(1 << attempts.min(5)).min(30_000))
}

async fn reconcile(ctx: Ctx, local: Arc<Local>, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<BackingImageDataSource>(&name).await? else {
        stop(&local, &name, None).await;
        return Ok(None);
    };
    let ds = &obj.data;
    if ds.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    let rec = ds.status.process.clone();
    let alive = rec.as_ref().is_some_and(|p| process::is_alive(p, BINARY));
    if ds.spec.started {
        if alive || rec.is_some() {
            stop(&local, &name, rec.as_ref()).await;
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(&name, |d| {
                        d.status.process = None;
                        d.status.address.clear();
                        true
                    })
                    .await,
            )?;
        }
        return Ok(None);
    }
    if ds.status.generation != ds.spec.generation {
        // Asked to run the source again (every copy failed): a fresh daemon, a fresh count of attempts.
        stop(&local, &name, rec.as_ref()).await;
        let generation = ds.spec.generation;
        absent_ok(
            ctx.db
                .modify::<BackingImageDataSource>(&name, |d| {
                    d.status = super::model::DataSourceStatus {
                        generation,
                        ..Default::default()
                    };
                    true
                })
                .await,
        )?;
        return Ok(Some(Duration::ZERO));
    }
    if alive {
        return monitor(&ctx, &local, &name, ds).await;
    }
    // Not running and not taken.
    let failed = ds.status.state == state::FAILED;
    if rec.is_some() && !failed {
        let message = "the data source daemon exited before a disk manager took the file".to_owned();
        tracing::warn!(image = name, "{message}");
        set_failed(&ctx, &name, &message).await?;
        return Ok(Some(Duration::ZERO));
    }
    if failed && ds.spec.source_type == SourceType::Upload {
        // An upload cannot be repeated by the manager: the user deletes the image and uploads again.
        return Ok(None);
    }
    if failed || ds.status.attempts > 0 {
        let wait = restart_delay(ds.status.attempts);
        let last = local
            .daemons
            .lock()
            .ok()
            .and_then(|m| m.get(&name).map(|(_, at)| *at));
        if let Some(last) = last
            && last.elapsed() < wait
        {
            return Ok(Some(wait - last.elapsed()));
        }
    }
    spawn(&ctx, &local, &name, ds).await?;
    Ok(Some(POLL))
}

async fn set_failed(ctx: &Ctx, name: &str, message: &str) -> anyhow::Result<()> {
    absent_ok(
        ctx.db
            .modify::<BackingImageDataSource>(name, |d| {
                d.status.state = state::FAILED.to_owned();
                d.status.message = message.to_owned();
                d.status.address.clear();
                true
            })
            .await,
    )?;
    Ok(())
}

async fn monitor(
    ctx: &Ctx,
    local: &Local,
    name: &str,
    ds: &BackingImageDataSource,
) -> anyhow::Result<Requeue> {
    match poll(&ds.status.address).await {
        Ok(info) => {
            if info.state == state::FAILED && ds.spec.source_type.refetchable() {
                tracing::warn!(
                    image = name,
                    message = info.message,
                    "data source failed: restarting it"
                );
                stop(local, name, ds.status.process.as_ref()).await;
                if let Ok(mut m) = local.daemons.lock() {
                    // Keeps the start time for the backoff.
                    if let Some(p) = &ds.status.process {
                        m.insert(name.to_owned(), (p.clone(), Instant::now()));
                    }
                }
            }
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(name, |d| {
                        let before = d.status.clone();
                        d.status.state.clone_from(&info.state);
                        d.status.progress = info.progress;
                        d.status.size = info.size;
                        d.status.virtual_size = info.virtual_size;
                        d.status.current_checksum.clone_from(&info.current_checksum);
                        d.status.message.clone_from(&info.message);
                        d.status.poll_failures = 0;
                        d.status != before
                    })
                    .await,
            )?;
        }
        Err(e) => {
            let failures = ds.status.poll_failures + 1;
            tracing::debug!(image = name, failures, error = %e, "data source poll failed");
            if failures >= MAX_POLL_FAILURES {
                tracing::warn!(image = name, "data source does not answer: restarting it");
                stop(local, name, ds.status.process.as_ref()).await;
            }
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(name, |d| {
                        d.status.poll_failures = if failures >= MAX_POLL_FAILURES {
                            0
                        } else {
                            failures
                        };
                        if failures >= MAX_POLL_FAILURES {
                            d.status.process = None;
                            d.status.message =
                                format!("data source did not answer {MAX_POLL_FAILURES} polls: {e}");
                        }
                        true
                    })
                    .await,
            )?;
        }
    }
    Ok(Some(POLL))
}

async fn spawn(ctx: &Ctx, local: &Local, name: &str, ds: &BackingImageDataSource) -> anyhow::Result<()> {
    corral_daemon::disk::verify_disk(std::path::Path::new(&ds.spec.disk_path), &ds.spec.disk_uuid)?;
    let port = crate::ports::allocate(ctx, 1).await?;
    let mut args = vec![
        "serve".to_owned(),
        "--listen".to_owned(),
        format!("{}:{port}", ctx.cfg.host),
        "--disk-path".to_owned(),
        ds.spec.disk_path.clone(),
        "--disk-uuid".to_owned(),
        ds.spec.disk_uuid.clone(),
        "--name".to_owned(),
        name.to_owned(),
        "--uuid".to_owned(),
        ds.spec.uuid.clone(),
        "--source-type".to_owned(),
        ds.spec.source_type.as_str().to_owned(),
        "--receiver-ip".to_owned(),
        ctx.cfg.host.clone(),
    ];
    for (k, v) in &ds.spec.parameters {
        args.push("--param".to_owned());
        args.push(format!("{k}={v}"));
    }
    if !ds.spec.expected_checksum.is_empty() {
        args.push("--expected-checksum".to_owned());
        args.push(ds.spec.expected_checksum.clone());
    }
    let rec = process::spawn(
        &ctx.binary(BINARY),
        &args,
        &ctx.log_path(&format!("datasource-{name}")),
        port,
    )?;
    ctx.metrics.daemon_started();
    tracing::info!(image = name, pid = rec.pid, port, "started data source");
    if let Ok(mut m) = local.daemons.lock() {
        m.insert(name.to_owned(), (rec.clone(), Instant::now()));
    }
    let address = format!("{}:{port}", ctx.cfg.host);
    absent_ok(
        ctx.db
            .modify::<BackingImageDataSource>(name, |d| {
                d.status.process = Some(rec.clone());
                d.status.address.clone_from(&address);
                d.status.state = state::STARTING.to_owned();
                d.status.message.clear();
                d.status.poll_failures = 0;
                d.status.attempts += 1;
                true
            })
            .await,
    )?;
    Ok(())
}
