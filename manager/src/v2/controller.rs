//! Node-local: one `corral-replica serve-lvstore` daemon per v2 disk of this node, through the manager's one
//! process supervision ([`Supervisor`]: own process group, log, ready file, port 0 on a first start and the
//! reported port after, restart with backoff, re-adopted after a manager restart). Before a start the disk's
//! store device is prepared ([`crate::data_engine::device::prepare`]: created and formatted on first use, never over foreign
//! data). While a daemon runs, lvols of replicas whose document is gone (deleted while this manager was down)
//! are removed. A daemon whose disk went (or turned v1) is stopped and its document deleted; its store stays.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::model::{LvstoreDaemon, daemon_name};
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::{DiskSpec, Node, ProcessState, Replica};
use crate::process::{Observed, Supervisor};
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::store::{Event, absent_ok};

pub const BINARY: &str = "corral-replica";

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    let me = ctx.cfg.node_id.clone();
    // Everything is one queue entry, this node: a pass looks at each of its (few) v2 disks.
    let (m1, m2) = (me.clone(), me.clone());
    feed::<Node>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(2),
        move |ev| (ev.name() == m1).then(|| m1.clone()),
        move |o| (o.name == m2).then(|| m2.clone()),
    );
    let m3 = me.clone();
    feed::<LvstoreDaemon>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3600),
        move |ev| match ev {
            Event::Put(o) => (o.data.node_id == m3).then(|| m3.clone()),
            Event::Delete { .. } => None,
        },
        |_| None,
    );
    let sup = Arc::new(Supervisor::new(
        BINARY,
        "lvstore",
        &ctx.cfg.processes,
        &ctx.cfg.data_dir,
    ));
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("lvstore", q, c, m, |_| reconcile(ctx.clone(), sup.clone())).await;
    });
}

async fn reconcile(ctx: Ctx, sup: Arc<Supervisor>) -> anyhow::Result<Requeue> {
    let me = &ctx.cfg.node_id;
    let node = ctx.db.must_get::<Node>(me).await?;
    let v2: BTreeMap<&String, &DiskSpec> = node
        .data
        .spec
        .disks
        .iter()
        .filter(|(_, d)| d.engine.in_lvstore())
        .collect();
    let mut requeue: Requeue = None;
    let mut soonest = |r: Requeue| {
        requeue = match (requeue, r) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    };
    let mut first_err = None;
    for (disk, spec) in &v2 {
        match reconcile_disk(&ctx, &sup, disk, spec).await {
            Ok(r) => soonest(r),
            Err(e) => {
                tracing::warn!(
                    disk = disk.as_str(),
                    error = format!("{e:#}"),
                    "lvstore daemon reconcile failed"
                );
                first_err.get_or_insert(e);
            }
        }
    }
    // Daemons of disks that are gone or no longer v2.
    for d in ctx.db.list::<LvstoreDaemon>().await? {
        if d.data.node_id == *me && !v2.contains_key(&d.data.disk) {
            tracing::info!(daemon = d.name, "disk removed: stopping its lvstore daemon");
            sup.stop(&d.name, d.data.process.as_ref(), Duration::from_secs(10))
                .await;
            ctx.db.delete_any::<LvstoreDaemon>(&d.name).await?;
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(requeue),
    }
}

async fn set(ctx: &Ctx, name: &str, f: impl Fn(&mut LvstoreDaemon) + Send + Sync) -> anyhow::Result<()> {
    absent_ok(
        ctx.db
            .modify::<LvstoreDaemon>(name, |d| {
                let before = d.clone();
                f(d);
                *d != before
            })
            .await,
    )?;
    Ok(())
}

async fn reconcile_disk(ctx: &Ctx, sup: &Supervisor, disk: &str, spec: &DiskSpec) -> anyhow::Result<Requeue> {
    let me = &ctx.cfg.node_id;
    let name = daemon_name(me, disk);
    let device = crate::data_engine::device::device_path(std::path::Path::new(&spec.path));
    let obj = match ctx.db.get::<LvstoreDaemon>(&name).await? {
        Some(o) => o,
        None => {
            ctx.db
                .create(
                    &name,
                    LvstoreDaemon {
                        node_id: me.clone(),
                        disk: disk.to_owned(),
                        device: device.display().to_string(),
                        ..Default::default()
                    },
                )
                .await?
        }
    };
    let d = &obj.data;
    match sup.observe(&name, d.process.as_ref()).await {
        Observed::Ready(listen) => {
            let address = listen
                .get("control")
                .cloned()
                .with_context(|| format!("lvstore daemon {name} reported no control listener: {listen:?}"))?;
            tracing::info!(daemon = name, address, "lvstore daemon ready");
            set(ctx, &name, |d| {
                d.state = ProcessState::Running;
                d.address.clone_from(&address);
                d.message.clear();
                if let Some(p) = &mut d.process {
                    p.listen.clone_from(&listen);
                }
            })
            .await?;
            return Ok(Some(Duration::ZERO));
        }
        Observed::Starting => return Ok(Some(Duration::from_millis(200))),
        Observed::Running => {
            collect_orphans(ctx, &name, disk, &d.address).await?;
            return Ok(None);
        }
        Observed::Down => {}
    }
    // Down: a first start, or a crash (restarted with the manager's backoff).
    let crashed = d.process.is_some() && d.state != ProcessState::Stopped;
    let restarts = d.process.as_ref().map_or(0, |p| p.restarts) + u32::from(crashed);
    if crashed {
        if d.state != ProcessState::Crashed {
            tracing::warn!(daemon = name, restarts, "lvstore daemon is gone: restarting it");
            set(ctx, &name, |d| d.state = ProcessState::Crashed).await?;
        }
        if let Some(wait) = Supervisor::restart_wait(d.process.as_ref(), restarts) {
            return Ok(Some(wait));
        }
    }
    let path = std::path::PathBuf::from(&spec.path);
    let (uuid, size) = (spec.disk_uuid.clone(), spec.lvstore_size);
    let prepared = tokio::task::spawn_blocking(move || {
        corral_disk::identity::verify_disk(&path, &uuid).map_err(|e| e.to_string())?;
        crate::data_engine::device::prepare(&path, size)
    })
    .await?;
    let device = match prepared {
        Ok(dev) => dev,
        Err(message) => {
            // Not a reconcile error: nothing changes until the disk does. Shown on the daemon and the disk.
            set(ctx, &name, |d| {
                d.state = ProcessState::Stopped;
                d.message.clone_from(&message);
            })
            .await?;
            return Ok(Some(Duration::from_secs(5)));
        }
    };
    let port = Supervisor::previous_port(d.process.as_ref(), "control");
    let args = vec![
        "serve-lvstore".to_owned(),
        "--disk".to_owned(),
        device.display().to_string(),
        "--listen".to_owned(),
        format!("{}:{port}", ctx.cfg.storage_host),
        // Each hosted replica's data protocol on a unix socket too, as v1 replicas' `--data-unix`: an engine on
        // this node connects there (replica names are unique, so every daemon of the node shares the directory).
        "--data-unix-dir".to_owned(),
        ctx.cfg.data_dir.join("sockets").join("v2").display().to_string(),
    ];
    let rec = sup.start(&name, args, restarts).await?;
    ctx.metrics.daemon_started();
    tracing::info!(daemon = name, pid = rec.pid, device = %device.display(), "started lvstore daemon");
    set(ctx, &name, |d| {
        d.state = ProcessState::Starting;
        d.process = Some(rec.clone());
        d.device = device.display().to_string();
        d.message.clear();
    })
    .await?;
    Ok(Some(Duration::from_millis(200)))
}

/// Removes from the daemon the replicas (and their lvols) that no replica document claims any more.
async fn collect_orphans(ctx: &Ctx, daemon: &str, disk: &str, address: &str) -> anyhow::Result<()> {
    let me = &ctx.cfg.node_id;
    let hosted = super::replica::client(address)
        .await?
        .lvstore_replica_list(corral_proto::v1::LvstoreEmpty {})
        .await?
        .into_inner()
        .replicas;
    if hosted.is_empty() {
        return Ok(());
    }
    let docs = ctx.db.list::<Replica>().await?;
    for r in hosted {
        let claimed = docs
            .iter()
            .any(|o| o.name == r.name && o.data.spec.node_id == *me && o.data.spec.disk == disk);
        if !claimed {
            tracing::info!(
                daemon,
                replica = r.name,
                "no replica document: removing its lvols"
            );
            super::replica::remove(address, &r.name, true).await?;
        }
    }
    Ok(())
}
