//! REST for nodes: list, get, disk add and remove (`/v1/nodes`, `/v1/nodes/{node}/disks`), cordon, uncordon and
//! drain (`POST /v1/nodes/{node}/{cordon,uncordon,drain}`), and the node view the API answers with (drain state,
//! replicas left, orphans removed). The drain's rules are in [`super::drain`].

use std::collections::{BTreeSet, HashMap};

use axum::Json;
use axum::extract::State;

use super::drain::{DrainState, drain_state, draining_nodes};
use super::openapi::check_disk_path;
use super::views::{DiskCreate, NodeView};
use crate::api::extract::{Body, Path};
use crate::api::openapi::check_name;
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::error::ApiError;
use crate::model::{DiskSpec, Node, Replica, Volume};
use crate::scheduler::{self, DiskCandidate};
use crate::store::Object;

type ApiResult<T> = Result<Json<T>, ApiError>;

pub fn register(r: &mut crate::api::routes::Routes) {
    r.add("get", "/v1/nodes", "List nodes with their disks", list_nodes);
    r.add("get", "/v1/nodes/{node}", "Get a node", get_node);
    r.add("post", "/v1/nodes/{node}/disks", "Add a disk to a node", add_disk);
    r.add(
        "delete",
        "/v1/nodes/{node}/disks/{disk}",
        "Remove a disk without replicas",
        remove_disk,
    );
    r.add(
        "post",
        "/v1/nodes/{node}/cordon",
        "Stop placing new replicas on a node (its replicas stay)",
        cordon,
    );
    r.add(
        "post",
        "/v1/nodes/{node}/uncordon",
        "Let a node take replicas again (ends a drain; replicas not moved yet stay)",
        uncordon,
    );
    r.add(
        "post",
        "/v1/nodes/{node}/drain",
        "Move every replica off a node, each rebuilt elsewhere before it is removed (409 when a volume could not keep its replica count)",
        drain,
    );
}

/// The API's view of `n`: the replicas still on it and where its drain is.
pub async fn node_view(ctx: &Ctx, n: &Object<Node>) -> Result<NodeView, ApiError> {
    let up = crate::scheduler::node_is_up(ctx, &n.data).await;
    let here: Vec<Object<Replica>> = ctx
        .db
        .list::<Replica>()
        .await?
        .into_iter()
        .filter(|r| r.data.spec.node_id == n.name)
        .collect();
    let left = here.len();
    let mut v = super::views::node_view(n, up);
    v.replicas = u32::try_from(left).unwrap_or(u32::MAX);
    v.drain_state = drain_state(&n.data, left);
    if v.drain_state == DrainState::Draining {
        let volumes: BTreeSet<&str> = here.iter().map(|r| r.data.spec.volume.as_str()).collect();
        for name in volumes {
            let detached = ctx
                .db
                .get::<Volume>(name)
                .await?
                .is_some_and(|vol| vol.data.spec.node_id.is_none());
            if detached {
                v.drain_blocked.push(format!(
                    "volume {name} is detached: its replica on {} moves once it is attached (on another node)",
                    n.name
                ));
            }
        }
    }
    Ok(v)
}

async fn get(ctx: &Ctx, node: &str) -> Result<Object<Node>, ApiError> {
    ctx.db
        .get::<Node>(node)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("node {node:?} not found")))
}

async fn set(
    ctx: &Ctx,
    node: &str,
    f: impl Fn(&mut Node) -> bool + Send,
) -> Result<Json<NodeView>, ApiError> {
    get(ctx, node).await?;
    let n = ctx.db.modify::<Node>(node, f).await?;
    Ok(Json(node_view(ctx, &n).await?))
}

async fn cordon(State(ctx): State<Ctx>, Path(node): Path<String>) -> Result<Json<NodeView>, ApiError> {
    set(&ctx, &node, |n| {
        std::mem::replace(&mut n.spec.allow_scheduling, false)
    })
    .await
}

async fn uncordon(State(ctx): State<Ctx>, Path(node): Path<String>) -> Result<Json<NodeView>, ApiError> {
    set(&ctx, &node, |n| {
        let changed = !n.spec.allow_scheduling || n.spec.drain_requested;
        n.spec.allow_scheduling = true;
        n.spec.drain_requested = false;
        changed
    })
    .await
}

async fn drain(State(ctx): State<Ctx>, Path(node): Path<String>) -> Result<Json<NodeView>, ApiError> {
    let n = get(&ctx, &node).await?;
    if !n.data.spec.drain_requested {
        check(&ctx, &node).await?;
        tracing::info!(
            node,
            "draining node: its replicas are rebuilt elsewhere, then removed"
        );
    }
    set(&ctx, &node, |n| {
        let changed = n.spec.allow_scheduling || !n.spec.drain_requested;
        n.spec.allow_scheduling = false;
        n.spec.drain_requested = true;
        changed
    })
    .await
}

/// Refuses a drain of `node` that could not complete (see [`super::drain`]), before anything is written.
pub async fn check(ctx: &Ctx, node: &str) -> Result<(), ApiError> {
    let volumes = ctx.db.list::<Volume>().await?;
    let replicas: Vec<Object<Replica>> = ctx
        .db
        .list::<Replica>()
        .await?
        .into_iter()
        .filter(|r| r.data.spec.failed_at.is_none())
        .collect();
    let mut draining = draining_nodes(ctx).await?;
    draining.insert(node.to_owned());
    let mut problems = Vec::new();
    for v in &volumes {
        let engine_here = v.data.spec.node_id.as_deref() == Some(node)
            || (v.data.spec.node_id.is_some() && v.data.status.current_node_id.as_deref() == Some(node));
        if engine_here {
            problems.push(format!(
                "{} is attached on {node} (its engine runs there; drain moves replicas, not engines): detach it or \
                 attach it on another node first",
                v.name
            ));
        }
    }
    // Candidates once the node is unschedulable, shared by the volumes placed one after the other (free space
    // per data engine); each volume uses those on nodes whose data plane can run its replicas.
    let mut pools: HashMap<crate::model::DataEngine, Vec<DiskCandidate>> = HashMap::new();
    let mut able: HashMap<crate::data_plane::Needs, crate::scheduler::Candidates> = HashMap::new();
    let soft = ctx.setting_bool("replica-soft-anti-affinity").await;
    for v in &volumes {
        let mine: Vec<&Object<Replica>> = replicas.iter().filter(|r| r.data.spec.volume == v.name).collect();
        let on_node = mine.iter().filter(|r| r.data.spec.node_id == node).count();
        if on_node == 0 {
            continue;
        }
        if v.data.spec.node_id.is_none() {
            problems.push(format!(
                "{} is detached with {on_node} replica(s) on {node}: a replacement is rebuilt through the volume's \
                 engine; attach it on another node first",
                v.name
            ));
            continue;
        }
        let want = usize::try_from(v.data.spec.number_of_replicas).unwrap_or(0);
        let staying: Vec<(String, String)> = mine
            .iter()
            .filter(|r| !draining.contains(&r.data.spec.node_id))
            .map(|r| (r.data.spec.node_id.clone(), r.data.spec.disk.clone()))
            .collect();
        let missing = want.saturating_sub(staying.len());
        if missing == 0 {
            continue;
        }
        let engine = v.data.spec.data_engine;
        let candidates = |needs: crate::data_plane::Needs| async move {
            crate::scheduler::candidates(ctx, &needs)
                .await
                .map_err(|e| ApiError::Internal(format!("{e:#}")))
        };
        if let std::collections::hash_map::Entry::Vacant(slot) = pools.entry(engine) {
            let plain = crate::data_plane::Needs {
                engine,
                revision_counter_disabled: false,
                backing_image: false,
            };
            let c = candidates(plain).await?;
            slot.insert(
                c.disks
                    .into_iter()
                    .filter(|c| !draining.contains(&c.node_id))
                    .collect(),
            );
        }
        let needs = crate::data_plane::Needs::of(&v.data);
        if let std::collections::hash_map::Entry::Vacant(slot) = able.entry(needs.clone()) {
            slot.insert(candidates(needs.clone()).await?);
        }
        let found = &able[&needs];
        let pool = pools.entry(engine).or_default();
        let usable: Vec<DiskCandidate> = pool
            .iter()
            .filter(|c| found.disks.iter().any(|f| f.node_id == c.node_id))
            .cloned()
            .collect();
        match scheduler::place_on(engine, usable, &staying, missing, v.data.spec.size, soft)
            .map_err(|why| found.explain(why))
        {
            Ok(places) => {
                for p in places {
                    if let Some(c) = pool
                        .iter_mut()
                        .find(|c| c.node_id == p.node_id && c.disk == p.disk)
                    {
                        c.free = c.free.saturating_sub(v.data.spec.size);
                    }
                }
            }
            Err(why) => problems.push(format!(
                "{} would be left with {} of {want} replicas ({why})",
                v.name,
                staying.len()
            )),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ApiError::Conflict(format!(
            "cannot drain node {node}: {}",
            problems.join("; ")
        )))
    }
}

async fn list_nodes(State(ctx): State<Ctx>) -> ApiResult<Vec<NodeView>> {
    let mut out = Vec::new();
    for n in ctx.db.list::<Node>().await? {
        out.push(node_view(&ctx, &n).await?);
    }
    Ok(Json(out))
}

async fn get_node(State(ctx): State<Ctx>, Path(node): Path<String>) -> ApiResult<NodeView> {
    let n = ctx
        .db
        .get::<Node>(&node)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("node {node:?} not found")))?;
    Ok(Json(node_view(&ctx, &n).await?))
}

async fn add_disk(
    State(ctx): State<Ctx>,
    Path(node): Path<String>,
    Body(req): Body<DiskCreate>,
) -> ApiResult<NodeView> {
    check_name("disk name", &req.name)?;
    check_disk_path(&req.path)?;
    let path = std::path::Path::new(&req.path);
    let n = ctx
        .db
        .get::<Node>(&node)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("node {node:?} not found")))?;
    if let Some(why) = disk_clash(&node, &n.data, &req.name, &req.path) {
        return Err(ApiError::Conflict(why));
    }
    let local = n.data.spec.host == ctx.cfg.host || node == ctx.cfg.node_id;
    let lvstore_size = req
        .disk_engine
        .check_new_disk(req.lvstore_size, &req.path, local)?;
    // A directory that already is a Corral disk keeps its identity.
    let uuid = match corral_disk::identity::read_disk_config(path) {
        Ok(c) if local => c.disk_uuid,
        _ => uuid::Uuid::new_v4().to_string(),
    };
    let disk = DiskSpec {
        path: req.path.clone(),
        disk_uuid: uuid,
        allow_scheduling: req.allow_scheduling,
        storage_reserved: req.storage_reserved,
        engine: req.disk_engine,
        lvstore_size,
    };
    // The node's heartbeat rewrites its document every few seconds, and the checks above can take a while (a v2
    // disk probes its device): write with retries on a version conflict, checking again for a clash each time.
    let mut clash = None;
    let n = ctx
        .db
        .modify::<Node>(&node, |data| {
            clash = disk_clash(&node, data, &req.name, &req.path);
            if clash.is_some() {
                return false;
            }
            data.spec.disks.insert(req.name.clone(), disk.clone());
            true
        })
        .await?;
    if let Some(why) = clash {
        return Err(ApiError::Conflict(why));
    }
    Ok(Json(node_view(&ctx, &n).await?))
}

/// Why disk `name` at `path` cannot be added to `node`, if it cannot.
fn disk_clash(node: &str, n: &Node, name: &str, path: &str) -> Option<String> {
    if n.spec.disks.contains_key(name) {
        return Some(format!("node {node} already has a disk {name:?}"));
    }
    n.spec
        .disks
        .values()
        .any(|d| d.path == path)
        .then(|| format!("node {node} already uses {path}"))
}

async fn remove_disk(
    State(ctx): State<Ctx>,
    Path((node, disk)): Path<(String, String)>,
) -> ApiResult<NodeView> {
    let mut n = ctx
        .db
        .get::<Node>(&node)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("node {node:?} not found")))?;
    if !n.data.spec.disks.contains_key(&disk) {
        return Err(ApiError::NotFound(format!("node {node} has no disk {disk:?}")));
    }
    let used = ctx
        .db
        .list::<Replica>()
        .await?
        .iter()
        .filter(|r| r.data.spec.node_id == node && r.data.spec.disk == disk)
        .count();
    if used > 0 {
        return Err(ApiError::Conflict(format!(
            "disk {disk} of node {node} holds {used} replicas"
        )));
    }
    n.data.spec.disks.remove(&disk);
    ctx.db.update(&mut n).await?;
    Ok(Json(node_view(&ctx, &n).await?))
}
