//! Node-local: runs a `corral-replica` process for every replica document of this node that should run, restarts
//! crashed ones with backoff, stops the ones that should not, and removes a deleted replica's process and data.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::{Requeue, WorkQueue, feed, run_worker};
use crate::context::{Ctx, LocalDaemon};
use crate::model::{DesireState, ProcessState, Replica};
use crate::process;
use crate::store::{Event, absent_ok};

pub const BINARY: &str = "corral-replica";

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    let me = ctx.cfg.node_id.clone();
    let me2 = me.clone();
    feed::<Replica>(
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
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("replica", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

/// Delay before restarting a daemon that crashed `restarts` times.
pub fn restart_backoff(restarts: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << restarts.min(6)).min(30_000))
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<Replica>(&name).await? else {
        // Deleted: stop what we started and remove its data.
        let gone = ctx.replicas.lock().ok().and_then(|mut m| m.remove(&name));
        if let Some(d) = gone {
            if let Some(p) = &d.process {
                process::stop(p, BINARY, Duration::from_secs(10)).await;
            }
            if let Some(path) = d.data_path {
                tracing::info!(replica = name, path = %path.display(), "removing deleted replica's data");
                tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&path).or_else(ignore_missing))
                    .await?
                    .context("remove replica data")?;
            }
        }
        return Ok(None);
    };
    let r = &obj.data;
    if r.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    let alive = r
        .status
        .process
        .as_ref()
        .is_some_and(|p| process::is_alive(p, BINARY));
    if let Ok(mut m) = ctx.replicas.lock() {
        let e = m.entry(name.clone()).or_default();
        e.data_path = Some(PathBuf::from(&r.spec.data_path));
        e.process.clone_from(&r.status.process);
    }
    let should_run = r.spec.desire_state == DesireState::Running && r.spec.failed_at.is_none();
    if !should_run {
        if alive && let Some(p) = &r.status.process {
            process::stop(p, BINARY, Duration::from_secs(10)).await;
        }
        if r.status.state != ProcessState::Stopped || !r.status.address.is_empty() {
            absent_ok(
                ctx.db
                    .modify::<Replica>(&name, |r| {
                        r.status.state = ProcessState::Stopped;
                        r.status.address.clear();
                        true
                    })
                    .await,
            )?;
        }
        return Ok(None);
    }
    if alive {
        if r.status.state != ProcessState::Running {
            let addr = r.status.address.trim_start_matches("tcp://").to_owned();
            if !process::accepts(&addr) {
                return Ok(Some(Duration::from_millis(300)));
            }
            absent_ok(
                ctx.db
                    .modify::<Replica>(&name, |r| {
                        r.status.state = ProcessState::Running;
                        true
                    })
                    .await,
            )?;
        }
        return Ok(None);
    }
    // Not running but should: a first start or a crash.
    let crashed = r.status.process.is_some() && r.status.state != ProcessState::Stopped;
    let restarts = r.status.process.as_ref().map_or(0, |p| p.restarts) + u32::from(crashed);
    if crashed {
        let last = ctx
            .replicas
            .lock()
            .ok()
            .and_then(|m| m.get(&name).and_then(|d| d.last_start));
        let wait = restart_backoff(restarts);
        if let Some(last) = last
            && last.elapsed() < wait
        {
            return Ok(Some(wait - last.elapsed()));
        }
        tracing::warn!(replica = name, restarts, "replica process is gone: restarting");
    }
    let node = ctx.db.must_get::<crate::model::Node>(&ctx.cfg.node_id).await?;
    let disk = node.data.spec.disks.get(&r.spec.disk).with_context(|| {
        format!(
            "disk {} of replica {name} is not on node {}",
            r.spec.disk, ctx.cfg.node_id
        )
    })?;
    corral_daemon::disk::verify_disk(std::path::Path::new(&disk.path), &r.spec.disk_uuid)?;
    let port = crate::ports::daemon_ports(&ctx, r.status.process.as_ref().map(|p| p.port)).await?;
    let mut args = vec![
        "serve".to_owned(),
        "--dir".to_owned(),
        r.spec.data_path.clone(),
        "--listen".to_owned(),
        format!("{}:{port}", ctx.cfg.host),
        "--size".to_owned(),
        r.spec.size.to_string(),
        "--volume".to_owned(),
        r.spec.volume.clone(),
    ];
    if r.spec.revision_counter_disabled {
        args.push("--disable-revision-counter".to_owned());
    }
    match crate::backing_image::replica_backing(&ctx, r).await? {
        None => {}
        Some(crate::backing_image::ReplicaBacking::Ready { path, .. }) => {
            args.extend(["--backing-file".to_owned(), path]);
        }
        Some(crate::backing_image::ReplicaBacking::Waiting(message)) => {
            absent_ok(
                ctx.db
                    .modify::<Replica>(&name, |r| {
                        let c = r.status.message != message;
                        r.status.message.clone_from(&message);
                        c
                    })
                    .await,
            )?;
            return Ok(Some(Duration::from_secs(1)));
        }
    }
    let mut rec = process::spawn(
        &ctx.binary(BINARY),
        &args,
        &ctx.log_path(&format!("replica-{name}")),
        port,
    )?;
    rec.restarts = restarts;
    ctx.metrics.daemon_started();
    tracing::info!(replica = name, pid = rec.pid, port, "started replica");
    if let Ok(mut m) = ctx.replicas.lock() {
        m.insert(
            name.clone(),
            LocalDaemon {
                data_path: Some(PathBuf::from(&r.spec.data_path)),
                process: Some(rec.clone()),
                last_start: Some(Instant::now()),
            },
        );
    }
    let address = format!("tcp://{}:{port}", ctx.cfg.host);
    ctx.db
        .modify::<Replica>(&name, |r| {
            r.status.state = ProcessState::Starting;
            r.status.process = Some(rec.clone());
            r.status.address.clone_from(&address);
            true
        })
        .await?;
    Ok(Some(Duration::from_millis(300)))
}

fn ignore_missing(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}
