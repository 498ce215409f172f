//! Node-local: runs the `corral-engine` of every engine document of this node once its replicas run, watches the
//! replicas' modes through the engine's ControllerService, and repairs: an ERR replica next to a healthy one is
//! failed (the volume controller schedules a replacement), a replica in the spec but not in the engine is added
//! with a rebuild, one in the engine but not in the spec is removed; when every replica is ERR the engine is
//! restarted (with `--salvage-requested` when the volume keeps no revision counter).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use corral_proto::v1;
use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::data_engine::Strategy as _;

type ControllerClient = v1::controller_service_client::ControllerServiceClient<tonic::transport::Channel>;
use crate::model::{DesireState, Engine, ProcessState, Replica};
use crate::process::{Observed, Supervisor};
use crate::runtime::{Requeue, WorkQueue, feed, feed_node_local, now, run_worker};
use crate::store::{Event, Object, absent_ok};

pub const BINARY: &str = "corral-engine";

/// How often a running engine's replica modes are polled.
const POLL: Duration = Duration::from_secs(2);

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed_node_local::<Engine>(
        ctx,
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        |e: &Engine| e.spec.node_id.as_str(),
    );
    // A replica that changes may unblock an engine start: requeue the engines of its volume.
    let db = ctx.db.clone();
    let q2 = q.clone();
    feed::<Replica>(
        db,
        q2,
        cancel.clone(),
        Duration::from_secs(3600),
        move |ev| match ev {
            Event::Put(o) => Some(o.data.spec.volume.clone()),
            Event::Delete { .. } => None,
        },
        |_| None,
    );
    let sup = Arc::new(Supervisor::new(
        BINARY,
        "engine",
        &ctx.cfg.processes,
        &ctx.cfg.data_dir,
    ));
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("engine", q, c, m, |name| {
            reconcile(ctx.clone(), sup.clone(), name)
        })
        .await;
    });
}

async fn reconcile(ctx: Ctx, sup: Arc<Supervisor>, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<Engine>(&name).await? else {
        sup.stop(&name, None, Duration::from_secs(10)).await;
        return Ok(None);
    };
    let e = &obj.data;
    if e.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    let observed = sup.observe(&name, e.status.process.as_ref()).await;
    let alive = observed != Observed::Down;
    if let Observed::Ready(listen) = observed {
        record_ready(&ctx, &name, listen).await?;
        return Ok(Some(Duration::ZERO));
    }
    if e.spec.desire_state == DesireState::Stopped {
        if alive && let Some(p) = &e.status.process {
            tracing::info!(engine = name, "stopping engine");
            sup.stop(&name, Some(p), Duration::from_secs(15)).await;
        }
        if e.status.state != ProcessState::Stopped {
            ctx.db
                .modify::<Engine>(&name, |e| {
                    e.status.state = ProcessState::Stopped;
                    e.status.endpoints.clear();
                    e.status.replica_modes.clear();
                    true
                })
                .await?;
        }
        return Ok(None);
    }
    let replicas = spec_replicas(&ctx, e).await?;
    if alive && e.status.frontend_disabled != e.spec.disable_frontend {
        // Listeners are fixed at start: a change of mode is a clean restart (the replicas stay open and are taken
        // over by the new engine).
        if let Some(p) = &e.status.process {
            tracing::info!(
                engine = name,
                frontend = !e.spec.disable_frontend,
                "restarting engine to change its frontend"
            );
            sup.stop(&name, Some(p), Duration::from_secs(15)).await;
        }
        ctx.db
            .modify::<Engine>(&name, |e| {
                e.status.state = ProcessState::Stopped;
                e.status.endpoints.clear();
                true
            })
            .await?;
        return Ok(Some(Duration::from_millis(100)));
    }
    if alive {
        if e.status.address.is_empty() {
            // Started, not ready yet.
            return Ok(Some(Duration::from_millis(200)));
        }
        return watch_running(&ctx, &sup, &obj, &replicas).await;
    }
    start_engine(&ctx, &sup, &obj, &replicas).await
}

/// Records the listeners a started engine reported: its ControllerService address and the NBD endpoints users
/// connect to.
async fn record_ready(ctx: &Ctx, name: &str, listen: BTreeMap<String, String>) -> anyhow::Result<()> {
    let control = listen
        .get("control")
        .with_context(|| format!("engine {name} reported no control listener: {listen:?}"))?
        .clone();
    tracing::info!(engine = name, ?listen, "engine ready");
    ctx.db
        .modify::<Engine>(name, |e| {
            let vol = &e.spec.volume;
            e.status.endpoints = nbd_endpoints(vol, &listen);
            e.status.address.clone_from(&control);
            if let Some(p) = &mut e.status.process {
                p.listen.clone_from(&listen);
            }
            true
        })
        .await?;
    Ok(())
}

/// The NBD URIs of a volume served by an engine that reported `listen` (unix socket first).
fn nbd_endpoints(volume: &str, listen: &BTreeMap<String, String>) -> Vec<String> {
    let unix = listen
        .get("nbd-unix")
        .and_then(|a| a.strip_prefix("unix:"))
        .map(|path| format!("nbd+unix:///{volume}?socket={path}"));
    // Under --tls-dir the manager's node daemons do too: the engine's TCP listener is then TLS-only (issue 40).
    let scheme = if corral_tls::installed().is_some() {
        "nbds"
    } else {
        "nbd"
    };
    let tcp = listen.get("nbd").map(|a| format!("{scheme}://{a}/{volume}"));
    unix.into_iter().chain(tcp).collect()
}

async fn spec_replicas(ctx: &Ctx, e: &Engine) -> anyhow::Result<Vec<Object<Replica>>> {
    let mut out = Vec::new();
    for r in &e.spec.replicas {
        if let Some(o) = ctx.db.get::<Replica>(r).await? {
            out.push(o);
        }
    }
    Ok(out)
}

fn running(r: &Object<Replica>) -> bool {
    r.data.status.state == ProcessState::Running && !r.data.status.address.is_empty()
}

async fn start_engine(
    ctx: &Ctx,
    sup: &Supervisor,
    obj: &Object<Engine>,
    replicas: &[Object<Replica>],
) -> anyhow::Result<Requeue> {
    let name = &obj.name;
    let e = &obj.data;
    let crashed = e.status.process.is_some() && e.status.state != ProcessState::Stopped;
    let restarts = e.status.process.as_ref().map_or(0, |p| p.restarts) + u32::from(crashed);
    if crashed && let Some(wait) = Supervisor::restart_wait(e.status.process.as_ref(), restarts) {
        return Ok(Some(wait));
    }
    // Replicas that held the volume's data must all be up (a new volume: every replica); fresh ones join later
    // through a rebuild.
    let initialized: Vec<&Object<Replica>> = replicas.iter().filter(|r| r.data.status.initialized).collect();
    let members: Vec<&Object<Replica>> = if initialized.is_empty() {
        replicas.iter().collect()
    } else {
        initialized
    };
    if members.is_empty() || !members.iter().all(|r| running(r)) {
        return Ok(Some(Duration::from_millis(500)));
    }
    let host = ctx.cfg.host.clone();
    // NBD clients keep the address they were given across a restart of the engine.
    let nbd_port = Supervisor::previous_port(e.status.process.as_ref(), "nbd");
    let sock_dir = ctx.cfg.data_dir.join("sockets");
    std::fs::create_dir_all(&sock_dir).with_context(|| format!("create {}", sock_dir.display()))?;
    let sock = sock_dir.join(format!("{name}.sock"));
    let _ = std::fs::remove_file(&sock);
    // Without a revision counter the engine cannot tell stale replicas at start: after any unclean end of the
    // previous engine (crash, or every replica ERR) it must pick the best replica itself.
    let salvage =
        e.spec.revision_counter_disabled && (e.spec.salvage_requested || e.status.salvage_next || crashed);
    let mut args = vec![
        "serve".to_owned(),
        "--volume".to_owned(),
        e.spec.volume.clone(),
        "--size".to_owned(),
        e.spec.size.to_string(),
        "--listen".to_owned(),
        format!("{host}:0"),
    ];
    // Maintenance mode: no listener at all, so nothing can reach the volume for IO (the engine refuses
    // FrontendStart too).
    if !e.spec.disable_frontend {
        args.extend([
            "--nbd-listen".to_owned(),
            format!("unix:{}", sock.display()),
            "--nbd-listen".to_owned(),
            format!("tcp:{}:{nbd_port}", ctx.cfg.storage_host),
        ]);
    }
    args.extend([
        "--metrics-listen".to_owned(),
        format!("{host}:0"),
        "--replica-timeout".to_owned(),
        ctx.setting_u64("replica-timeout").await.max(1).to_string(),
    ]);
    for r in &members {
        args.push("--replica".to_owned());
        args.push(r.data.status.address.clone());
    }
    if e.spec.revision_counter_disabled {
        args.push("--disable-revision-counter".to_owned());
    }
    if salvage {
        args.push("--salvage-requested".to_owned());
    }
    // A new generation for every start, taken last (nothing can fail between taking it and starting): the
    // replicas refuse every engine of an earlier start from now on, wherever it still runs.
    // A data plane older than fencing refuses the flag: its engine runs without one (replicas that have recorded a
    // generation refuse it, asking for an upgrade).
    let fencing = ctx
        .db
        .get::<crate::model::Node>(&ctx.cfg.node_id)
        .await?
        .is_none_or(|n| {
            crate::data_plane::features(&n.data)
                .iter()
                .any(|f| f == corral_proto::data_plane::ENGINE_GENERATION)
        });
    let generation = if fencing {
        let g = crate::engine_generation::next(&ctx.db, &e.spec.volume).await?;
        args.extend(["--generation".to_owned(), g.to_string()]);
        g
    } else {
        tracing::warn!(
            engine = name,
            "this node's data plane predates engine generations: starting the engine without one (unfenced)"
        );
        0
    };
    let rec = sup.start(name, args, restarts).await?;
    ctx.metrics.daemon_started();
    tracing::info!(
        engine = name,
        pid = rec.pid,
        generation,
        salvage,
        frontend = !e.spec.disable_frontend,
        replicas = members.len(),
        "started engine"
    );
    let frontend_disabled = e.spec.disable_frontend;
    ctx.db
        .modify::<Engine>(name, |e| {
            e.status.state = ProcessState::Starting;
            e.status.process = Some(rec.clone());
            // Known once the engine reports ready.
            e.status.address.clear();
            e.status.endpoints.clear();
            e.status.salvage_next = false;
            e.status.frontend_disabled = frontend_disabled;
            e.status.generation = generation;
            true
        })
        .await?;
    Ok(Some(Duration::from_millis(200)))
}

async fn watch_running(
    ctx: &Ctx,
    sup: &Supervisor,
    obj: &Object<Engine>,
    replicas: &[Object<Replica>],
) -> anyhow::Result<Requeue> {
    let name = &obj.name;
    let e = &obj.data;
    let mut c = match crate::volume_engine::client(&e.status.address).await {
        Ok(c) => c,
        Err(err) if e.status.state == ProcessState::Starting => {
            tracing::debug!(engine = name, error = %err, "engine not answering yet");
            return Ok(Some(Duration::from_millis(300)));
        }
        Err(err) => return Err(err).context("connect to the engine"),
    };
    let vol = c.volume_get(v1::Empty {}).await?.into_inner();
    if !vol.fenced.is_empty() {
        return stop_fenced(ctx, sup, obj, &vol.fenced).await;
    }
    let list = c.replica_list(v1::Empty {}).await?.into_inner().replicas;
    let modes: std::collections::BTreeMap<String, String> =
        list.iter().map(|r| (r.address.clone(), r.mode.clone())).collect();
    let rw = list.iter().filter(|r| r.mode == "RW").count();
    let rebuild_progress: std::collections::BTreeMap<String, u32> = if list.iter().any(|r| r.mode == "WO") {
        c.rebuild_status(v1::Empty {})
            .await?
            .into_inner()
            .replicas
            .into_iter()
            .filter(|r| r.is_rebuilding)
            .map(|r| (r.address, r.progress))
            .collect()
    } else {
        Default::default()
    };
    record_status(ctx, obj, replicas, &vol, &modes, rebuild_progress).await?;
    if rw == 0 {
        return restart_to_salvage(ctx, sup, obj, replicas).await;
    }
    remove_unwanted(ctx, &mut c, name, &list, replicas).await?;
    // Keep the observed snapshots current (listed from the store while detached).
    let snaps = c.snapshot_list(v1::Empty {}).await?.into_inner();
    crate::snapshot::record(
        &ctx.db,
        &e.spec.volume,
        &crate::snapshot::from_engine(&e.spec.volume, &snaps),
    )
    .await?;
    add_replicas(ctx, &mut c, name, &list, &modes, replicas, vol.size).await
}

/// Records what the engine reports: its state, replica modes, rebuild progress, size and frontend in the engine's
/// status, and each replica's mode in the replica's.
async fn record_status(
    ctx: &Ctx,
    obj: &Object<Engine>,
    replicas: &[Object<Replica>],
    vol: &v1::Volume,
    modes: &BTreeMap<String, String>,
    rebuild_progress: BTreeMap<String, u32>,
) -> anyhow::Result<()> {
    let frontend_up = vol.frontend_state == "attached" || !vol.endpoints.is_empty();
    ctx.db
        .modify::<Engine>(&obj.name, |e| {
            let before = e.status.clone();
            e.status.state = ProcessState::Running;
            e.status.replica_modes.clone_from(modes);
            e.status.rebuild_progress.clone_from(&rebuild_progress);
            e.status.current_size = vol.size;
            if e.spec.disable_frontend {
                e.status.message = "maintenance: no frontend".into();
            } else if !frontend_up {
                e.status.message = "frontend down".into();
            } else {
                e.status.message.clear();
            }
            e.status != before
        })
        .await?;
    // Record what each replica is in this engine.
    for r in replicas {
        let mode = modes.get(&r.data.status.address).cloned().unwrap_or_default();
        if r.data.status.mode != mode || (mode == "RW" && !r.data.status.initialized) {
            absent_ok(
                ctx.db
                    .modify::<Replica>(&r.name, |x| {
                        let changed = x.status.mode != mode || (mode == "RW" && !x.status.initialized);
                        x.status.mode.clone_from(&mode);
                        x.status.initialized |= mode == "RW";
                        changed
                    })
                    .await,
            )?;
        }
    }
    Ok(())
}

/// Every replica is ERR: once every replica process runs again, the engine is restarted to salvage (its start picks
/// the best replica).
async fn restart_to_salvage(
    ctx: &Ctx,
    sup: &Supervisor,
    obj: &Object<Engine>,
    replicas: &[Object<Replica>],
) -> anyhow::Result<Requeue> {
    // Faulted: restart once every replica process runs again; the engine's start picks the best replica.
    if !replicas.iter().all(running) {
        return Ok(Some(Duration::from_millis(500)));
    }
    tracing::warn!(
        engine = obj.name,
        "every replica is ERR: restarting the engine to salvage"
    );
    if let Some(p) = &obj.data.status.process {
        sup.stop(&obj.name, Some(p), Duration::from_secs(10)).await;
    }
    ctx.db
        .modify::<Engine>(&obj.name, |e| {
            e.status.state = ProcessState::Stopped;
            e.status.salvage_next = true;
            true
        })
        .await?;
    Ok(Some(Duration::from_millis(100)))
}

/// Removes from the engine the replicas that are ERR (marking them failed, so the volume controller replaces them)
/// or no longer in the spec — never the engine's last RW replica when no replica of the spec holds the data.
async fn remove_unwanted(
    ctx: &Ctx,
    c: &mut ControllerClient,
    name: &str,
    list: &[v1::ControllerReplica],
    replicas: &[Object<Replica>],
) -> anyhow::Result<()> {
    // Every replica of the spec, running or restarting: a replica whose process is being restarted stays in the
    // engine until the engine itself finds it ERR (then it is failed and replaced); removing it as unwanted
    // instead would re-add the same replica with a rebuild once it is back.
    let spec_addrs: Vec<&str> = replicas
        .iter()
        .map(|r| r.data.status.address.as_str())
        .filter(|a| !a.is_empty())
        .collect();
    // The RW replicas that stay: an unwanted RW replica is never removed when it would leave the engine without
    // one (the spec lost its data-holding replicas: serving on fresh ones would be an empty volume).
    let wanted_rw = list
        .iter()
        .filter(|r| r.mode == "RW" && spec_addrs.contains(&r.address.as_str()))
        .count();
    for r in list {
        let wanted = spec_addrs.contains(&r.address.as_str());
        if !wanted && r.mode == "RW" && wanted_rw == 0 {
            tracing::error!(
                engine = name,
                replica = r.address,
                "not removing an unwanted replica: it is the engine's last RW replica, and no replica of the spec \
                 holds the data"
            );
            continue;
        }
        if r.mode == "ERR" || !wanted {
            tracing::warn!(
                engine = name,
                replica = r.address,
                mode = r.mode,
                error = r.error,
                "removing replica from engine"
            );
            c.replica_remove(v1::ReplicaAddress {
                address: r.address.clone(),
            })
            .await?;
            if r.mode == "ERR"
                && let Some(o) = replicas.iter().find(|o| o.data.status.address == r.address)
            {
                // The volume controller replaces a failed replica with a new one.
                absent_ok(
                    ctx.db
                        .modify::<Replica>(&o.name, |x| {
                            x.spec.failed_at = Some(now());
                            x.status.message = format!("ERR in engine: {}", r.error);
                            true
                        })
                        .await,
                )?;
            }
        }
    }
    Ok(())
}

/// Adds the spec's running replicas the engine does not have, with a rebuild, up to
/// `concurrent-rebuilds-per-volume` at once; a replica the engine refuses as not belonging to the volume is failed.
async fn add_replicas(
    ctx: &Ctx,
    c: &mut ControllerClient,
    name: &str,
    list: &[v1::ControllerReplica],
    modes: &BTreeMap<String, String>,
    replicas: &[Object<Replica>],
    size: u64,
) -> anyhow::Result<Requeue> {
    // New replicas join with a rebuild, several at once up to `concurrent-rebuilds-per-volume` (the engine
    // rebuilds each from the RW replicas with its own rebuild snapshot).
    let rebuilding = list.iter().filter(|r| r.mode == "WO").count();
    let limit = usize::try_from(ctx.setting_u64("concurrent-rebuilds-per-volume").await)
        .unwrap_or(1)
        .max(1);
    let new: Vec<&Object<Replica>> = replicas
        .iter()
        .filter(|r| {
            running(r) && !modes.contains_key(&r.data.status.address) && r.data.spec.failed_at.is_none()
        })
        .take(limit.saturating_sub(rebuilding))
        .collect();
    if new.is_empty() {
        return Ok(Some(POLL));
    }
    let rate = ctx.setting_u64("rebuild-max-bytes-per-second").await;
    for new in new {
        grow_fresh_replica(ctx, name, new, size).await;
        tracing::info!(
            engine = name,
            replica = new.name,
            rebuilding,
            "adding replica with a rebuild"
        );
        let added = c
            .replica_add(v1::ReplicaAddRequest {
                address: new.data.status.address.clone(),
                rebuild: true,
                timeout_seconds: 0,
                max_bytes_per_second: rate,
                busy_bytes_per_second: 0,
            })
            .await;
        match added {
            Ok(_) => {}
            // The engine refuses a replica that cannot belong to the volume (another size: it missed an expand
            // while it was out; another sector size): it is failed, so the volume controller replaces it with
            // a new one rebuilt from the volume, instead of the engine being asked again forever.
            Err(s) if s.code() == tonic::Code::InvalidArgument => {
                tracing::warn!(
                    engine = name,
                    replica = new.name,
                    error = s.message(),
                    "replica refused by the engine: failed"
                );
                absent_ok(
                    ctx.db
                        .modify::<Replica>(&new.name, |x| {
                            x.spec.failed_at = Some(now());
                            x.status.message = format!("refused by the engine: {}", s.message());
                            true
                        })
                        .await,
                )?;
            }
            Err(s) => return Err(s.into()),
        }
    }
    Ok(Some(Duration::from_millis(500)))
}

/// A replica accepted a newer engine generation than this engine's: another start of the volume's engine took over
/// (this one is stale and fails all IO). The engine is stopped and the event recorded in the engine's status
/// (`lastFenced`, shown by `corral volume get`). The document still asks for an engine here, so the next pass starts
/// one as after a crash — with a new generation and the crash back-off.
async fn stop_fenced(
    ctx: &Ctx,
    sup: &Supervisor,
    obj: &Object<Engine>,
    fenced: &str,
) -> anyhow::Result<Requeue> {
    let name = &obj.name;
    tracing::error!(
        engine = name,
        generation = obj.data.status.generation,
        fenced,
        "engine fenced by a newer generation: stopping it"
    );
    if let Some(p) = &obj.data.status.process {
        sup.stop(name, Some(p), Duration::from_secs(10)).await;
    }
    // This document still asks for the engine: the store's intent wins over a generation it never handed out
    // (an engine started by hand, a store restored from an older backup), so the next start is above it.
    if let Some(seen) = crate::engine_generation::fencing_generation(fenced) {
        crate::engine_generation::raise_to(&ctx.db, &obj.data.spec.volume, seen).await?;
    }
    let message = format!("stopped: {fenced}");
    absent_ok(
        ctx.db
            .modify::<Engine>(name, |e| {
                e.status.last_fenced.clone_from(&message);
                e.status.message.clone_from(&message);
                e.status.address.clear();
                e.status.endpoints.clear();
                true
            })
            .await,
    )?;
    Ok(Some(Duration::from_millis(100)))
}

/// A fresh replica (never RW: it holds none of the volume's data yet) that still has the volume's size from before
/// an expansion — it was started from a document written before the size was recorded, or came up after the engine
/// restarted at the new size — is grown to `size` through its own ReplicaService before the engine is asked to add
/// it, which would refuse it for its size and so fail it (a replacement and a second rebuild for nothing). A
/// replica that held data is never touched here: its size is the engine's start-up check to judge. Best effort:
/// on any error the add goes ahead and the engine's refusal handles it as before.
async fn grow_fresh_replica(ctx: &Ctx, engine: &str, r: &Object<Replica>, size: u64) {
    if r.data.status.initialized || r.data.spec.data_engine.in_lvstore() {
        return;
    }
    // The expand presents the volume's generation, as every call that changes a replica must.
    let Ok(generation) = crate::engine_generation::current(&ctx.db, &r.data.spec.volume).await else {
        return;
    };
    let Ok(address) = r.data.status.address.parse::<corral_proto::ReplicaAddress>() else {
        return;
    };
    let Ok(ch) =
        corral_proto::grpc::connect_endpoint(&address.control, corral_proto::grpc::GrpcTimeouts::CONTROL)
            .await
    else {
        return;
    };
    let mut c = v1::replica_service_client::ReplicaServiceClient::with_interceptor(
        ch,
        corral_proto::engine_generation::EngineGeneration(generation),
    );
    let Ok(have) = c.replica_get(v1::Empty {}).await else {
        return;
    };
    let have = have.into_inner().replica.map_or(0, |x| x.size);
    if have == 0 || have >= size {
        return;
    }
    match c.replica_expand(v1::ReplicaExpandRequest { size }).await {
        Ok(_) => tracing::warn!(
            engine,
            replica = r.name,
            from = have,
            to = size,
            "fresh replica still had the size from before an expansion: grown before it joins"
        ),
        Err(e) => tracing::warn!(engine, replica = r.name, error = %e, "cannot grow fresh replica"),
    }
}
