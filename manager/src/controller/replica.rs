//! Node-local: runs a `corral-replica` process for every replica document of this node that should run, restarts
//! crashed ones with backoff, stops the ones that should not, and removes a deleted replica's process and data.
//! A v2 replica has no process of its own: it is hosted by its disk's lvstore daemon ([`crate::v2::replica`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::{DesireState, ProcessState, Replica};
use crate::process::{Observed, Supervisor};
use crate::runtime::{Requeue, WorkQueue, feed_node_local, run_worker};
use crate::store::absent_ok;

pub const BINARY: &str = "corral-replica";

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed_node_local::<Replica>(
        ctx,
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        |r: &Replica| r.spec.node_id.as_str(),
    );
    let local = Arc::new(Local {
        sup: Supervisor::new(BINARY, "replica", &ctx.cfg.processes, &ctx.cfg.data_dir),
        data_paths: Mutex::default(),
        v2: crate::v2::replica::Hosted::default(),
    });
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("replica", q, c, m, |name| {
            reconcile(ctx.clone(), local.clone(), name)
        })
        .await;
    });
}

/// This manager process's replicas: their daemons, and where their data lives (removed after the document).
struct Local {
    sup: Supervisor,
    data_paths: Mutex<HashMap<String, (PathBuf, Option<crate::model::ProcessRecord>)>>,
    v2: crate::v2::replica::Hosted,
}

async fn reconcile(ctx: Ctx, local: Arc<Local>, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<Replica>(&name).await? else {
        // Deleted: stop what we started and remove its data.
        if crate::v2::replica::deleted(&ctx, &local.v2, &name).await? {
            return Ok(None);
        }
        let gone = local.data_paths.lock().ok().and_then(|mut m| m.remove(&name));
        let (path, rec) = gone.map_or((None, None), |(p, r)| (Some(p), r));
        local.sup.stop(&name, rec.as_ref(), Duration::from_secs(10)).await;
        // A SIGKILLed replica leaves its socket file behind.
        if let Some(sock) = data_socket(&ctx.cfg.data_dir, &name) {
            let _ = std::fs::remove_file(sock);
        }
        if let Some(path) = path {
            tracing::info!(replica = name, path = %path.display(), "removing deleted replica's data");
            tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&path).or_else(ignore_missing))
                .await?
                .context("remove replica data")?;
        }
        return Ok(None);
    };
    let r = &obj.data;
    if r.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    if r.spec.data_engine.in_lvstore() {
        return crate::v2::replica::reconcile(
            &ctx,
            &local.v2,
            &name,
            r,
            crate::backing_image::v2_replica_backing(&ctx, r),
        )
        .await;
    }
    if let Ok(mut m) = local.data_paths.lock() {
        m.insert(
            name.clone(),
            (PathBuf::from(&r.spec.data_path), r.status.process.clone()),
        );
    }
    let observed = local.sup.observe(&name, r.status.process.as_ref()).await;
    let alive = observed != Observed::Down;
    if let Observed::Ready(listen) = observed {
        record_ready(&ctx, &name, listen).await?;
        return Ok(Some(Duration::ZERO));
    }
    let should_run = r.spec.desire_state == DesireState::Running && r.spec.failed_at.is_none();
    if !should_run {
        // The document says Stopped before the process is stopped: an engine started meanwhile (a re-attach right
        // after a detach) waits for this replica to run again rather than being handed an address about to vanish.
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
        if alive && let Some(p) = &r.status.process {
            local.sup.stop(&name, Some(p), Duration::from_secs(10)).await;
        }
        return Ok(None);
    }
    if alive {
        // Running once it reported ready (every listener bound and serving).
        return Ok((observed == Observed::Starting).then_some(Duration::from_millis(200)));
    }
    // Not running but should: a first start or a crash.
    let crashed = r.status.process.is_some() && r.status.state != ProcessState::Stopped;
    let restarts = r.status.process.as_ref().map_or(0, |p| p.restarts) + u32::from(crashed);
    if crashed {
        if let Some(wait) = Supervisor::restart_wait(r.status.process.as_ref(), restarts) {
            return Ok(Some(wait));
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
    corral_disk::identity::verify_disk(std::path::Path::new(&disk.path), &r.spec.disk_uuid)?;
    // Its previous ports when it reported them (the engine keeps the replica's address), else port 0.
    let prev = r.status.process.as_ref();
    let host = &ctx.cfg.storage_host;
    let listen = |name| format!("{host}:{}", Supervisor::previous_port(prev, name));
    let mut args = vec![
        "serve".to_owned(),
        "--dir".to_owned(),
        r.spec.data_path.clone(),
        "--listen".to_owned(),
        listen("control"),
        "--data-listen".to_owned(),
        listen("data"),
        "--sync-listen".to_owned(),
        listen("sync"),
        "--size".to_owned(),
        r.spec.size.to_string(),
        "--volume".to_owned(),
        r.spec.volume.clone(),
    ];
    if let Some(sock) = data_socket(&ctx.cfg.data_dir, &name) {
        let dir = sock.parent().unwrap_or(&ctx.cfg.data_dir);
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        args.push("--data-unix".to_owned());
        args.push(sock.display().to_string());
    }
    if r.spec.revision_counter_disabled {
        args.push("--disable-revision-counter".to_owned());
    }
    match crate::backing_image::replica_backing(&ctx, r).await? {
        None => {}
        Some(ready @ crate::backing_image::ReplicaBacking::Ready { .. }) => args.extend(ready.replica_args()),
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
    let rec = local.sup.start(&name, args, restarts).await?;
    ctx.metrics.daemon_started();
    tracing::info!(replica = name, pid = rec.pid, "started replica");
    ctx.db
        .modify::<Replica>(&name, |r| {
            r.status.state = ProcessState::Starting;
            r.status.process = Some(rec.clone());
            // The address stays until the replica reports its new one: an engine that finds the old process ERR
            // still matches it to this document (and fails it, so it is replaced rather than re-added).
            true
        })
        .await?;
    Ok(Some(Duration::from_millis(200)))
}

/// Records the listeners a started replica reported and the address the engine reaches it at: it runs now.
async fn record_ready(ctx: &Ctx, name: &str, listen: BTreeMap<String, String>) -> anyhow::Result<()> {
    let address = replica_address(&listen).with_context(|| format!("replica {name} reported {listen:?}"))?;
    tracing::info!(replica = name, address, "replica ready");
    absent_ok(
        ctx.db
            .modify::<Replica>(name, |r| {
                r.status.state = ProcessState::Running;
                r.status.address.clone_from(&address);
                if let Some(p) = &mut r.status.process {
                    p.listen.clone_from(&listen);
                }
                true
            })
            .await,
    )?;
    Ok(())
}

/// The address an engine is given for a replica that reported `listen`: its control, data and sync endpoints.
fn replica_address(listen: &BTreeMap<String, String>) -> anyhow::Result<String> {
    let endpoint = |name: &str| -> anyhow::Result<corral_proto::Endpoint> {
        let a = listen.get(name).with_context(|| format!("no {name} listener"))?;
        Ok(a.parse()?)
    };
    let address = corral_proto::ReplicaAddress {
        control: endpoint("control")?,
        data: endpoint("data")?,
        sync: endpoint("sync")?,
        replica: None,
    };
    Ok(address.to_string())
}

/// Where replica `name` serves the data protocol on a unix socket: an engine on this node connects there instead
/// of TCP (issue 16 item 4). `None` when the path would not fit a socket address (the engine then uses TCP).
fn data_socket(data_dir: &std::path::Path, name: &str) -> Option<PathBuf> {
    // sockaddr_un.sun_path holds 108 bytes with the terminating NUL.
    const MAX_SOCKET_PATH: usize = 107;
    let sock = data_dir.join("sockets").join(format!("replica-{name}.data.sock"));
    if sock.as_os_str().len() > MAX_SOCKET_PATH {
        tracing::warn!(replica = name, path = %sock.display(), "socket path too long: data protocol over TCP only");
        return None;
    }
    Some(sock)
}

fn ignore_missing(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_address_carries_the_three_reported_endpoints() {
        let listen: BTreeMap<String, String> = [
            ("control", "127.0.0.1:40001"),
            ("data", "127.0.0.1:40777"),
            ("sync", "127.0.0.1:40123"),
            ("metrics", "127.0.0.1:40002"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let a: corral_proto::ReplicaAddress = replica_address(&listen).unwrap().parse().unwrap();
        assert_eq!(
            a,
            corral_proto::ReplicaAddress::tcp("127.0.0.1", 40001, 40777, 40123)
        );
        let mut no_sync = listen.clone();
        no_sync.remove("sync");
        let e = replica_address(&no_sync).unwrap_err().to_string();
        assert!(e.contains("sync"), "{e}");
    }
}
