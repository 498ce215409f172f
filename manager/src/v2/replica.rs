//! v2 replicas on their node: instead of a process of its own, a v2 replica is hosted by the disk's
//! `serve-lvstore` daemon — added over gRPC `LvstoreService` (idempotent: the daemon answers with the replica's
//! address, the same after a daemon restart since the ports are recorded in the store), removed from serving
//! when the volume detaches, and removed with its lvols when the replica document is deleted. The node's
//! replica controller (`crate::controller::replica`) calls in here for every replica whose `dataEngine` is v2.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use corral_proto::v1::{self, lvstore_service_client::LvstoreServiceClient};
use tonic::transport::Channel;

use super::model::{LvstoreDaemon, daemon_name};
use crate::context::Ctx;
use crate::model::{DesireState, ProcessState, Replica};
use crate::runtime::Requeue;
use crate::store::absent_ok;

/// A client of a disk daemon's `LvstoreService` at `address` (`HOST:PORT`).
pub async fn client(address: &str) -> anyhow::Result<LvstoreServiceClient<Channel>> {
    let ch = corral_proto::grpc::connect(address, corral_proto::grpc::GrpcTimeouts::CONTROL).await?;
    Ok(LvstoreServiceClient::new(ch))
}

/// The v2 replicas this manager process hosts, by name → the daemon document hosting them: a deleted replica's
/// lvols are removed through it (a replica deleted while this manager was down is collected by
/// [`super::controller`] instead).
#[derive(Default)]
pub struct Hosted(Mutex<HashMap<String, String>>);

/// The running daemon of `daemon` (its document), or None while it is not serving.
async fn running_daemon(ctx: &Ctx, daemon: &str) -> anyhow::Result<Option<LvstoreDaemon>> {
    Ok(ctx
        .db
        .get::<LvstoreDaemon>(daemon)
        .await?
        .map(|o| o.data)
        .filter(|d| d.state == ProcessState::Running && !d.address.is_empty()))
}

/// What the store of `disk` on this node can still hold (its free clusters), asked of its running daemon; None
/// when the daemon does not serve or does not answer within a second (the heartbeat then reports the store's size).
pub async fn store_free_bytes(ctx: &Ctx, disk: &str) -> Option<u64> {
    let d = running_daemon(ctx, &daemon_name(&ctx.cfg.node_id, disk))
        .await
        .ok()??;
    let ask = async {
        let mut c = client(&d.address).await.ok()?;
        let s = c.lvstore_info(v1::LvstoreEmpty {}).await.ok()?.into_inner();
        Some(s.free_clusters.saturating_mul(s.cluster_size))
    };
    tokio::time::timeout(Duration::from_secs(1), ask).await.ok()?
}

/// The replica document `name` is gone: remove its lvols from the daemon that hosted it. Ok(false) when this
/// manager did not host it.
pub async fn deleted(ctx: &Ctx, hosted: &Hosted, name: &str) -> anyhow::Result<bool> {
    let daemon = hosted.0.lock().ok().and_then(|m| m.get(name).cloned());
    let Some(daemon) = daemon else { return Ok(false) };
    let Some(d) = running_daemon(ctx, &daemon).await? else {
        // Not serving now: the daemon's controller collects the orphan once it runs.
        tracing::info!(
            replica = name,
            daemon,
            "lvstore daemon down: its controller removes the replica later"
        );
        if let Ok(mut m) = hosted.0.lock() {
            m.remove(name);
        }
        return Ok(true);
    };
    remove(&d.address, name, true).await?;
    tracing::info!(replica = name, daemon, "removed deleted v2 replica and its lvols");
    if let Ok(mut m) = hosted.0.lock() {
        m.remove(name);
    }
    Ok(true)
}

/// Stops serving `name` on the daemon at `address`, with `delete_data` its lvols too; absent is fine.
pub async fn remove(address: &str, name: &str, delete_data: bool) -> anyhow::Result<()> {
    match client(address)
        .await?
        .lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
            name: name.to_owned(),
            delete_data,
        })
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
        Err(s) => {
            Err(s).with_context(|| format!("remove replica {name} from the lvstore daemon at {address}"))
        }
    }
}

/// Brings v2 replica `name` (of this node) to its spec: hosted and serving while it should run, not served
/// otherwise. `backing_image` is the v2 backing image its head is cloned from
/// (`crate::backing_image::v2_replica_backing`: Ok("") for none, Ok(name) once ready on its disk, Err(why) while
/// not), awaited only when the replica should serve.
pub async fn reconcile(
    ctx: &Ctx,
    hosted: &Hosted,
    name: &str,
    r: &Replica,
    backing_image: impl Future<Output = anyhow::Result<Result<String, String>>>,
) -> anyhow::Result<Requeue> {
    let daemon = daemon_name(&r.spec.node_id, &r.spec.disk);
    if let Ok(mut m) = hosted.0.lock() {
        m.insert(name.to_owned(), daemon.clone());
    }
    let should_run = r.spec.desire_state == DesireState::Running && r.spec.failed_at.is_none();
    let Some(d) = running_daemon(ctx, &daemon).await? else {
        // Its daemon is down or starting: the replica does not serve until the daemon is back (it re-hosts every
        // replica of its store at the recorded address).
        let message = format!("waiting for the lvstore daemon of disk {}", r.spec.disk);
        let state = if should_run {
            ProcessState::Starting
        } else {
            ProcessState::Stopped
        };
        set_status(ctx, name, state, None, &message).await?;
        return Ok(Some(Duration::from_millis(500)));
    };
    if !should_run {
        if r.status.state != ProcessState::Stopped || !r.status.address.is_empty() {
            remove(&d.address, name, false).await?;
            set_status(ctx, name, ProcessState::Stopped, Some(String::new()), "").await?;
        }
        return Ok(None);
    }
    let backing_image = match backing_image.await? {
        Ok(image) => image,
        // Serving already: its head exists (cloned when it was made), so a copy that reads unknown for a moment
        // does not stop it.
        Err(_) if r.status.state == ProcessState::Running => String::new(),
        Err(waiting) => {
            set_status(ctx, name, ProcessState::Starting, None, &waiting).await?;
            return Ok(Some(Duration::from_secs(1)));
        }
    };
    let added = client(&d.address)
        .await?
        .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
            name: name.to_owned(),
            size: r.spec.size,
            disable_revision_counter: r.spec.revision_counter_disabled,
            backing_image,
            ..Default::default()
        })
        .await
        .with_context(|| format!("add replica {name} to the lvstore daemon {daemon}"))?
        .into_inner();
    if r.status.state != ProcessState::Running || r.status.address != added.address {
        tracing::info!(
            replica = name,
            daemon,
            address = added.address,
            "v2 replica serving"
        );
    }
    set_status(ctx, name, ProcessState::Running, Some(added.address), "").await?;
    // Looked at again soon: a daemon restart is noticed here (the replica is re-added at the same address).
    Ok(Some(Duration::from_secs(2)))
}

async fn set_status(
    ctx: &Ctx,
    name: &str,
    state: ProcessState,
    address: Option<String>,
    message: &str,
) -> anyhow::Result<()> {
    absent_ok(
        ctx.db
            .modify::<Replica>(name, |r| {
                let before = r.status.clone();
                r.status.state = state;
                if let Some(a) = &address {
                    r.status.address.clone_from(a);
                }
                r.status.process = None;
                message.clone_into(&mut r.status.message);
                r.status != before
            })
            .await,
    )?;
    Ok(())
}
