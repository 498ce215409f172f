//! Cluster-wide (leader only): turns a volume's spec into replica and engine documents. Attached: enough healthy
//! replicas placed by the scheduler and running, one engine on the attach node serving them; detached: the engine
//! stopped and deleted, replicas stopped (their data stays). Failed replicas are deleted (their node's manager
//! removes the process and data) and replaced, except the last copies of the data: when no healthy replica holds
//! it, the failed ones that do are kept, the volume is faulted and nothing runs until `corral volume salvage`. The
//! volume's status (state, robustness, endpoints) is derived here.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::{
    DesireState, Engine, EngineSpec, Node, ProcessState, Replica, ReplicaSpec, Robustness, Volume,
    VolumeState, VolumeStatus,
};
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::scheduler;
use crate::store::{Event, Object};

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<Volume>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        |ev| Some(ev.name().to_owned()),
        |o| Some(o.name.clone()),
    );
    feed::<Replica>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        |ev| match ev {
            Event::Put(o) => Some(o.data.spec.volume.clone()),
            Event::Delete { .. } => None,
        },
        |o| Some(o.data.spec.volume.clone()),
    );
    feed::<Engine>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3600),
        |ev| Some(ev.name().to_owned()),
        |_| None,
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("volume", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

fn replica_name(volume: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{volume}-r-{}", &id[..8])
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let all: Vec<Object<Replica>> = ctx
        .db
        .list::<Replica>()
        .await?
        .into_iter()
        .filter(|r| r.data.spec.volume == name)
        .collect();
    let Some(vol) = ctx.db.get::<Volume>(&name).await? else {
        ctx.db.delete_any::<Engine>(&name).await?;
        crate::engine_generation::forget(&ctx.db, &name).await?;
        for r in &all {
            ctx.db.delete_any::<Replica>(&r.name).await?;
        }
        crate::snapshot::record(&ctx.db, &name, &[]).await?;
        return Ok(None);
    };
    let v = &vol.data;
    // Failed replicas go: their node's manager stops them and removes their data. Not the last copies of the
    // data, though (see `last_copies`).
    let (failed, healthy): (Vec<_>, Vec<_>) = all.into_iter().partition(|r| r.data.spec.failed_at.is_some());
    let kept = last_copies(&failed, &healthy);
    for r in failed.iter().filter(|r| !kept.contains(&r.name)) {
        tracing::info!(volume = name, replica = r.name, "deleting failed replica");
        ctx.db.delete_any::<Replica>(&r.name).await?;
    }
    let engine = ctx.db.get::<Engine>(&name).await?;
    let mut status = v.status.clone();
    status.message.clear();
    if !kept.is_empty() {
        return hold_for_salvage(&ctx, &vol, engine, &kept, status).await;
    }
    let requeue = match &v.spec.node_id {
        Some(node) => attach(&ctx, &vol, node, engine, healthy, &mut status).await?,
        None => detach(&ctx, &name, engine, &healthy, &mut status).await?,
    };
    write_status(&ctx, &name, &v.status, &status).await?;
    Ok(requeue)
}

/// Attached: the replicas ([`ensure_replicas`]), and one engine on `node` serving them; the volume's status follows
/// the engine's.
async fn attach(
    ctx: &Ctx,
    vol: &Object<Volume>,
    node: &str,
    engine: Option<Object<Engine>>,
    mut healthy: Vec<Object<Replica>>,
    status: &mut VolumeStatus,
) -> anyhow::Result<Requeue> {
    let (name, v) = (&vol.name, &vol.data);
    let want = usize::try_from(v.spec.number_of_replicas).unwrap_or(0);
    let names = ensure_replicas(ctx, vol, engine.as_ref(), want, &mut healthy, status).await?;
    let spec = EngineSpec {
        volume: name.clone(),
        node_id: node.to_owned(),
        size: v.spec.size,
        replicas: names,
        revision_counter_disabled: v.status.revision_counter_disabled,
        salvage_requested: v.spec.salvage_requested,
        disable_frontend: v.spec.disable_frontend,
        desire_state: DesireState::Running,
    };
    let mut requeue = None;
    match engine {
        Some(e) if e.data.spec.node_id != *node => {
            // Attached elsewhere before (that node died): that engine document goes, a new one follows.
            ctx.db.delete_any::<Engine>(name).await?;
            requeue = Some(Duration::from_millis(200));
            status.state = VolumeState::Attaching;
            status.frontend_disabled = false;
        }
        Some(mut e) => {
            if e.data.spec != spec {
                e.data.spec = spec;
                ctx.db.update(&mut e).await?;
            }
            // Running in the mode asked for: a mode change restarts the engine, attaching until then.
            let running = e.data.status.state == ProcessState::Running
                && e.data.status.frontend_disabled == e.data.spec.disable_frontend;
            status.frontend_disabled = running && e.data.status.frontend_disabled;
            status.state = if running {
                VolumeState::Attached
            } else {
                VolumeState::Attaching
            };
            status.current_node_id = Some(node.to_owned());
            status.endpoints = if running {
                e.data.status.endpoints.clone()
            } else {
                Vec::new()
            };
            status.robustness = robustness(&e.data, &healthy, want);
            if running && v.spec.salvage_requested && status.robustness != Robustness::Faulted {
                ctx.db
                    .modify::<Volume>(name, |v| {
                        v.spec.salvage_requested = false;
                        true
                    })
                    .await?;
            }
        }
        None => {
            ctx.db
                .create(
                    name,
                    Engine {
                        spec,
                        status: Default::default(),
                    },
                )
                .await?;
            status.state = VolumeState::Attaching;
            status.frontend_disabled = false;
            status.current_node_id = Some(node.to_owned());
        }
    }
    Ok(requeue)
}

/// The replicas of an attached volume: enough healthy ones (those on draining nodes replaced first, then evicted
/// once out of the engine), all running. Returns the replicas the engine serves.
async fn ensure_replicas(
    ctx: &Ctx,
    vol: &Object<Volume>,
    engine: Option<&Object<Engine>>,
    want: usize,
    healthy: &mut Vec<Object<Replica>>,
    status: &mut VolumeStatus,
) -> anyhow::Result<Vec<String>> {
    let (name, v) = (&vol.name, &vol.data);
    // Replicas on draining nodes do not count: each gets a replacement first (`crate::node::drain`).
    let draining = crate::node::drain::draining_nodes(ctx).await?;
    let modes = engine
        .map(|e| e.data.status.replica_modes.clone())
        .unwrap_or_default();
    let staying = crate::node::drain::evict(healthy, &draining, &modes, want).staying;
    // A replica added to a volume that holds data joins through a rebuild, which v2 cannot do yet.
    let refused = if healthy.iter().any(|r| r.data.status.initialized) {
        crate::v2::support::check(v.spec.data_engine, crate::v2::support::Op::Rebuild).err()
    } else {
        None
    };
    if staying < want
        && let Some(msg) = refused
    {
        status.message = format!("{staying} of {want} replicas: {msg}");
    } else if staying < want {
        match schedule_replicas(ctx, vol, healthy, &draining, want - staying).await? {
            Ok(mut new) => healthy.append(&mut new),
            Err(msg) => status.message = msg,
        }
    }
    for r in healthy
        .iter()
        .filter(|r| r.data.spec.desire_state != DesireState::Running)
    {
        ctx.db
            .modify::<Replica>(&r.name, |x| {
                x.spec.desire_state = DesireState::Running;
                true
            })
            .await?;
    }
    let eviction = crate::node::drain::evict(healthy, &draining, &modes, want);
    for r in &eviction.delete {
        tracing::info!(
            volume = name,
            replica = r,
            "evicted replica is out of the engine: deleting it"
        );
        ctx.db.delete_any::<Replica>(r).await?;
    }
    healthy.retain(|r| !eviction.delete.contains(&r.name));
    Ok(eviction.engine_replicas)
}

/// Places `count` new replicas of the volume (not on draining nodes, apart from `healthy` ones as the anti-affinity
/// setting says) and creates their documents; `Ok(Err(why))` when the scheduler finds no room.
async fn schedule_replicas(
    ctx: &Ctx,
    vol: &Object<Volume>,
    healthy: &[Object<Replica>],
    draining: &std::collections::HashSet<String>,
    count: usize,
) -> anyhow::Result<Result<Vec<Object<Replica>>, String>> {
    let (name, v) = (&vol.name, &vol.data);
    let existing: Vec<(String, String)> = healthy
        .iter()
        .filter(|r| !draining.contains(&r.data.spec.node_id))
        .map(|r| (r.data.spec.node_id.clone(), r.data.spec.disk.clone()))
        .collect();
    let soft = ctx.setting_bool("replica-soft-anti-affinity").await;
    let pool = scheduler::candidates(ctx, &crate::data_plane::Needs::of(v)).await?;
    let places = match scheduler::place_on(
        v.spec.data_engine,
        pool.disks.clone(),
        &existing,
        count,
        v.spec.size,
        soft,
    )
    .map_err(|why| pool.explain(why))
    {
        Ok(places) => places,
        Err(msg) => return Ok(Err(msg)),
    };
    let mut created = Vec::new();
    for p in places {
        let rname = replica_name(name);
        let data_path = v
            .spec
            .data_engine
            .replica_data_path(std::path::Path::new(&p.path), &rname);
        let spec = ReplicaSpec {
            volume: name.clone(),
            node_id: p.node_id,
            disk: p.disk,
            disk_uuid: p.disk_uuid,
            data_path: data_path.display().to_string(),
            size: v.spec.size,
            revision_counter_disabled: v.status.revision_counter_disabled,
            desire_state: DesireState::Running,
            failed_at: None,
            data_engine: v.spec.data_engine,
        };
        tracing::info!(
            volume = name,
            replica = rname,
            node = spec.node_id,
            disk = spec.disk,
            "scheduled replica"
        );
        let o = ctx
            .db
            .create(
                &rname,
                Replica {
                    spec,
                    status: Default::default(),
                },
            )
            .await?;
        created.push(o);
    }
    Ok(Ok(created))
}

/// The volume is detached (no node asked for): its engine is asked to stop (its document deleted when its node is
/// gone) and, once it is gone, its replicas are stopped.
async fn detach(
    ctx: &Ctx,
    name: &str,
    engine: Option<Object<Engine>>,
    healthy: &[Object<Replica>],
    status: &mut VolumeStatus,
) -> anyhow::Result<Requeue> {
    status.endpoints.clear();
    status.frontend_disabled = false;
    match engine {
        Some(mut e)
            if e.data.status.state != ProcessState::Stopped
                || e.data.spec.desire_state == DesireState::Running =>
        {
            if e.data.spec.desire_state != DesireState::Stopped {
                e.data.spec.desire_state = DesireState::Stopped;
                ctx.db.update(&mut e).await?;
            }
            // The engine's node may be gone: it cannot report stopped. Then the document just goes.
            let node_up = match ctx.db.get::<Node>(&e.data.spec.node_id).await? {
                Some(n) => scheduler::node_is_up(ctx, &n.data).await,
                None => false,
            };
            if !node_up {
                ctx.db.delete_any::<Engine>(name).await?;
            }
            status.state = VolumeState::Detaching;
            return Ok(Some(Duration::from_millis(300)));
        }
        Some(e) => {
            ctx.db.delete::<Engine>(name, e.version).await?;
            status.state = VolumeState::Detaching;
            return Ok(Some(Duration::from_millis(100)));
        }
        None => {
            for r in healthy
                .iter()
                .filter(|r| r.data.spec.desire_state != DesireState::Stopped)
            {
                ctx.db
                    .modify::<Replica>(&r.name, |x| {
                        x.spec.desire_state = DesireState::Stopped;
                        true
                    })
                    .await?;
            }
            status.state = VolumeState::Detached;
            status.current_node_id = None;
            status.robustness = Robustness::Unknown;
        }
    }
    Ok(None)
}

/// Every replica holding the volume's data failed (`kept`: those kept for a salvage). On a salvage request they
/// come back and the engine starts on them alone; otherwise no engine runs and nothing is scheduled (an engine on
/// fresh replicas would serve an empty volume) until one.
async fn hold_for_salvage(
    ctx: &Ctx,
    vol: &Object<Volume>,
    engine: Option<Object<Engine>>,
    kept: &[String],
    mut status: VolumeStatus,
) -> anyhow::Result<Requeue> {
    let (name, v) = (&vol.name, &vol.data);
    if v.spec.salvage_requested {
        // The user asked for a salvage: the kept replicas come back, and the engine starts on them alone
        // (it starts on the replicas that held data) and picks the best one.
        for r in kept {
            tracing::warn!(
                volume = name,
                replica = r,
                "salvage: un-failing a replica that holds the data"
            );
            ctx.db
                .modify::<Replica>(r, |x| {
                    let changed = x.spec.failed_at.is_some();
                    x.spec.failed_at = None;
                    x.status.message.clear();
                    changed
                })
                .await?;
        }
        return Ok(Some(Duration::from_millis(100)));
    }
    // No replica serving the volume holds its data: an engine on fresh replicas would serve an empty volume.
    // Nothing is scheduled and no engine runs until a salvage.
    if let Some(e) = &engine {
        tracing::warn!(
            volume = name,
            "every replica holding the data failed: stopping the engine"
        );
        ctx.db.delete::<Engine>(name, e.version).await?;
    }
    status.robustness = Robustness::Faulted;
    status.endpoints.clear();
    status.state = if v.spec.node_id.is_some() {
        VolumeState::Attaching
    } else {
        VolumeState::Detached
    };
    status.message = format!(
        "every replica holding the volume's data failed; kept for a salvage: {} (`corral volume salvage {name}`)",
        kept.join(", ")
    );
    write_status(ctx, name, &v.status, &status).await?;
    Ok(Some(Duration::from_secs(5)))
}

/// Writes the volume's derived status when it differs from what the document holds.
async fn write_status(
    ctx: &Ctx,
    name: &str,
    had: &VolumeStatus,
    status: &VolumeStatus,
) -> anyhow::Result<()> {
    if status != had {
        ctx.db
            .modify::<Volume>(name, |v| {
                let changed = v.status != *status;
                v.status = status.clone();
                changed
            })
            .await?;
    }
    Ok(())
}

/// The failed replicas the volume controller must keep: those that hold the volume's data (they were RW in an
/// engine once) when no healthy replica holds it. They are then the last copies of the data, and deleting them
/// would leave the volume to fresh, empty replicas. No normal path fails every copy (the engine salvages instead
/// when all its replicas are ERR, and a down node's replicas are failed only while another copy is up): this is
/// the safety net for the paths that went wrong before (a store outage read as every node down).
fn last_copies(failed: &[Object<Replica>], healthy: &[Object<Replica>]) -> Vec<String> {
    if healthy.iter().any(|r| r.data.status.initialized) {
        return Vec::new();
    }
    failed
        .iter()
        .filter(|r| r.data.status.initialized)
        .map(|r| r.name.clone())
        .collect()
}

fn robustness(e: &Engine, healthy: &[Object<Replica>], want: usize) -> Robustness {
    if e.status.state != ProcessState::Running {
        return Robustness::Unknown;
    }
    let rw = healthy
        .iter()
        .filter(|r| {
            e.status
                .replica_modes
                .get(&r.data.status.address)
                .is_some_and(|m| m == "RW")
        })
        .count();
    if rw == 0 {
        Robustness::Faulted
    } else if rw >= want {
        Robustness::Healthy
    } else {
        Robustness::Degraded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ReplicaStatus;

    fn replica(name: &str, initialized: bool, failed: bool) -> Object<Replica> {
        Object {
            name: name.into(),
            version: 1,
            data: Replica {
                spec: ReplicaSpec {
                    failed_at: failed.then_some(1_764_028_800),
                    ..Default::default()
                },
                status: ReplicaStatus {
                    initialized,
                    ..Default::default()
                },
            },
        }
    }

    fn split(rs: Vec<Object<Replica>>) -> Vec<String> {
        let (failed, healthy): (Vec<_>, Vec<_>) =
            rs.into_iter().partition(|r| r.data.spec.failed_at.is_some());
        last_copies(&failed, &healthy)
    }

    #[test]
    fn failed_replicas_holding_the_only_copies_of_the_data_are_kept_and_the_rest_may_go() {
        // A healthy replica holds the data: every failed one may go.
        assert!(
            split(vec![
                replica("a", true, false),
                replica("b", true, true),
                replica("c", false, true)
            ])
            .is_empty()
        );
        // Every data holder failed, fresh replicas are healthy: the data holders are kept, the fresh failed one not.
        assert_eq!(
            split(vec![
                replica("a", true, true),
                replica("b", true, true),
                replica("c", false, true),
                replica("d", false, false),
            ]),
            ["a", "b"]
        );
        // A new volume whose replicas never held data: nothing to keep.
        assert!(split(vec![replica("a", false, true), replica("b", false, false)]).is_empty());
    }
}
