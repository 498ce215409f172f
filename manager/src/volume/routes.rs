//! REST for volumes and their snapshots (`/v1/volumes`, `/v1/volumes/{volume}/...`): create (empty, as a clone
//! of a volume or snapshot, or restored from a backup), get, list, delete, attach, detach, expand, salvage, and
//! snapshot list, take, remove and revert. The volume's controller is [`super::controller`]. Validation happens
//! before anything is written: a refused request leaves nothing behind.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use super::views::*;
use crate::api::Routes;
use crate::api::extract::{Body, Path};
use crate::api::openapi::{check_copies, check_name, check_size};
use crate::clone::model::{CloneState, DataSource, VolumeClone};
use crate::context::Ctx;
use crate::controller::maintenance::with_volume_in_maintenance;
use crate::error::ApiError;
use crate::model::{self, Engine, Node, ProcessState, Replica, Volume, VolumeSpec};
use crate::scheduler::{self, candidates, node_is_up};
use crate::store::StoreError;
use crate::volume_engine::VolumeEngine;

type ApiResult<T> = Result<Json<T>, ApiError>;

/// The volume and snapshot routes.
pub fn register(r: &mut Routes) {
    r.add("get", "/v1/volumes", "List volumes", list_volumes);
    r.add("post", "/v1/volumes", "Create a volume", create_volume);
    r.add(
        "get",
        "/v1/volumes/{volume}",
        "Get a volume with its replicas",
        get_volume,
    );
    r.add(
        "delete",
        "/v1/volumes/{volume}",
        "Delete a detached volume and its replicas",
        delete_volume,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/attach",
        "Attach to a node (NBD frontend, or none with disableFrontend: maintenance mode)",
        attach_volume,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/detach",
        "Detach (stop the engine; replicas keep the data)",
        detach_volume,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/expand",
        "Grow an attached volume",
        expand_volume,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/salvage",
        "Restart a faulted volume's engine with salvage",
        salvage_volume,
    );
    r.add(
        "get",
        "/v1/volumes/{volume}/snapshots",
        "List snapshots",
        list_snapshots,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/snapshots",
        "Take a snapshot",
        create_snapshot,
    );
    r.add(
        "delete",
        "/v1/volumes/{volume}/snapshots/{snapshot}",
        "Remove a snapshot: marked removed, then purged (merged into its child) unless a rebuild, purge, export or backup runs",
        delete_snapshot,
    );
    r.add(
        "post",
        "/v1/volumes/{volume}/snapshots/{snapshot}/revert",
        "Revert the volume to a snapshot (a detached one is attached without a frontend for it, then detached)",
        revert_snapshot,
    );
}

fn volume_not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("volume {name:?} not found"))
}

async fn volume_view(ctx: &Ctx, name: &str) -> Result<VolumeView, ApiError> {
    let v = ctx
        .db
        .get::<Volume>(name)
        .await?
        .ok_or_else(|| volume_not_found(name))?;
    let e = ctx.db.get::<Engine>(name).await?;
    let rs = ctx.db.list::<Replica>().await?;
    let clone = ctx.db.get::<VolumeClone>(name).await?;
    let generation = crate::engine_generation::current(&ctx.db, name).await?;
    Ok(with_clone(
        super::views::volume_view(&v, e.as_ref(), &rs),
        clone.as_ref().map(|c| &c.data),
    )
    .with_engine_generation(generation))
}

async fn list_volumes(State(ctx): State<Ctx>) -> ApiResult<Vec<VolumeView>> {
    let rs = ctx.db.list::<Replica>().await?;
    let es = ctx.db.list::<Engine>().await?;
    let clones = ctx.db.list::<VolumeClone>().await?;
    let generations = ctx
        .db
        .list::<crate::engine_generation::EngineGeneration>()
        .await?;
    Ok(Json(
        ctx.db
            .list::<Volume>()
            .await?
            .iter()
            .map(|v| {
                with_clone(
                    super::views::volume_view(v, es.iter().find(|e| e.name == v.name), &rs),
                    clones.iter().find(|c| c.name == v.name).map(|c| &c.data),
                )
                .with_engine_generation(
                    generations
                        .iter()
                        .find(|g| g.name == v.name)
                        .map_or(0, |g| g.data.generation),
                )
            })
            .collect(),
    ))
}

async fn get_volume(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<VolumeView> {
    Ok(Json(volume_view(&ctx, &name).await?))
}

async fn create_volume(
    State(ctx): State<Ctx>,
    Body(req): Body<VolumeCreate>,
) -> Result<(StatusCode, Json<VolumeView>), ApiError> {
    check_name("volume name", &req.name)?;
    check_size(req.size)?;
    let clone = match &req.data_source {
        Some(ds) => Some(clone_source(&ctx, &req, ds).await?),
        None => None,
    };
    if req.standby && req.from_backup.is_none() {
        // Well formed (OpenAPI 3.0 cannot tie one field to another), so not a 400.
        return Err(ApiError::Conflict(
            "a standby volume follows a backup volume: name its newest backup in fromBackup".into(),
        ));
    }
    if clone.is_some() && req.from_backup.is_some() {
        return Err(ApiError::Invalid(
            "dataSource and fromBackup exclude each other".into(),
        ));
    }
    let restore = match &req.from_backup {
        Some(b) => Some(
            crate::backup::service::check_restore_source(&ctx, b, req.size, req.backing_image.as_deref())
                .await?,
        ),
        None => None,
    };
    // A clone takes its source's backing image (checked equal in clone_source), a restore the backup's.
    let backing_image = match (&clone, &restore) {
        (Some((_, source)), _) => source.data.spec.backing_image.clone(),
        (None, Some((_, image))) => image.clone(),
        (None, None) => req.backing_image.clone(),
    };
    if let Some(f) = &req.frontend
        && f != "nbd"
    {
        return Err(ApiError::Invalid(format!(
            "frontend {f:?} is not supported (only nbd)"
        )));
    }
    check_copies("numberOfReplicas", req.number_of_replicas)?;
    let data_engine = crate::v2::service::volume_engine(
        &ctx,
        &req.name,
        req.data_engine,
        req.from_backup.is_some(),
        clone.as_ref().map(|(_, source)| &source.data),
        backing_image.as_deref(),
    )
    .await?;
    crate::backing_image::service::check_volume_image(&ctx, backing_image.as_deref(), req.size, data_engine)
        .await?;
    let disabled = match req.disable_revision_counter {
        Some(b) => b,
        None => ctx.setting_bool("disable-revision-counter").await,
    };
    // The replicas must be placeable now, on nodes whose data plane can run them: the same check the scheduler
    // makes at attach.
    let needs = crate::data_plane::Needs {
        engine: data_engine,
        revision_counter_disabled: disabled,
        backing_image: backing_image.is_some(),
    };
    let soft = ctx.setting_bool("replica-soft-anti-affinity").await;
    let count = usize::try_from(req.number_of_replicas).unwrap_or(usize::MAX);
    let cands = candidates(&ctx, &needs)
        .await
        .map_err(|e| ApiError::Unavailable(format!("{e:#}")))?;
    // A well-formed request the cluster has no room for: its state, not the request, has to change.
    scheduler::place_on(data_engine, cands.disks.clone(), &[], count, req.size, soft)
        .map_err(|why| ApiError::Conflict(cands.explain(why)))?;
    let vol = Volume {
        spec: VolumeSpec {
            // A clone starts at its source's size (the engine copies between volumes of one size) and grows to
            // `req.size` once the copy completed.
            size: clone.as_ref().map_or(req.size, |(_, s)| s.data.spec.size),
            number_of_replicas: req.number_of_replicas,
            frontend: model::Frontend::Nbd,
            disable_revision_counter: req.disable_revision_counter,
            node_id: None,
            salvage_requested: false,
            backing_image,
            disable_frontend: false,
            data_source: clone.as_ref().map(|(source, _)| source.to_string()),
            job_groups: Vec::new(),
            from_backup: restore
                .as_ref()
                .map(|(b, _)| crate::backup::service::from_backup_ref(b)),
            backup_max_count: None,
            backup_delta_max: None,
            data_engine,
        },
        status: model::VolumeStatus {
            revision_counter_disabled: disabled,
            ..Default::default()
        },
    };
    match ctx.db.create(&req.name, vol).await {
        Ok(_) => {}
        Err(StoreError::AlreadyExists { .. }) => {
            return Err(ApiError::Conflict(format!(
                "volume {:?} already exists",
                req.name
            )));
        }
        Err(e) => return Err(e.into()),
    }
    if let Some((source, _)) = clone {
        let record = VolumeClone {
            data_source: source.to_string(),
            source_volume: source.volume().to_owned(),
            snapshot: match &source {
                DataSource::Snapshot(_, s) => s.clone(),
                DataSource::Volume(_) => crate::clone::snapshot_name_for(&req.name),
            },
            size: req.size,
            ..Default::default()
        };
        if let Err(e) = ctx.db.create(&req.name, record).await {
            // No clone record, no volume: a volume that claims a source it never copied would be served empty.
            ctx.db.delete_any::<Volume>(&req.name).await?;
            return Err(e.into());
        }
    }
    if let Some((b, _)) = &restore
        && let Err(e) = crate::backup::service::start_restore(&ctx, &req.name, b, req.standby).await
    {
        // No restore record, no volume: it would wait for a restore nobody runs.
        ctx.db.delete_any::<Volume>(&req.name).await?;
        return Err(e.into());
    }
    Ok((StatusCode::CREATED, Json(volume_view(&ctx, &req.name).await?)))
}

/// Checks a clone's `dataSource`: the source volume (and snapshot) exist, the clone is not smaller than its
/// source, and asks for no other backing image than the source's.
async fn clone_source(
    ctx: &Ctx,
    req: &VolumeCreate,
    ds: &str,
) -> Result<(DataSource, crate::store::Object<Volume>), ApiError> {
    let source = DataSource::parse(ds, |what, name| check_name(what, name).map_err(|e| e.to_string()))
        .map_err(ApiError::Invalid)?;
    let v = ctx
        .db
        .get::<Volume>(source.volume())
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("source volume {:?} not found", source.volume())))?;
    if let Some(c) = ctx.db.get::<VolumeClone>(source.volume()).await?
        && c.data.state != CloneState::Completed
    {
        return Err(ApiError::Conflict(format!(
            "source volume {} is itself a clone that has not completed",
            source.volume()
        )));
    }
    if let DataSource::Snapshot(vol, snap) = &source {
        let known = crate::snapshot::recorded(&ctx.db, vol)
            .await?
            .iter()
            .any(|s| s.name == *snap && !s.removed);
        if !known {
            return Err(ApiError::NotFound(format!(
                "volume {vol} has no snapshot {snap:?}"
            )));
        }
    }
    if req.size < v.data.spec.size {
        return Err(ApiError::Conflict(format!(
            "a clone cannot be smaller than its source: {} is {} bytes",
            source.volume(),
            v.data.spec.size
        )));
    }
    if let Some(bi) = &req.backing_image
        && v.data.spec.backing_image.as_ref() != Some(bi)
    {
        return Err(ApiError::Conflict(format!(
            "a clone uses its source's backing image ({}), not {bi}",
            v.data.spec.backing_image.as_deref().unwrap_or("none")
        )));
    }
    Ok((source, v))
}

async fn delete_volume(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    if let Some(c) = ctx.db.get::<VolumeClone>(&name).await?
        && c.data.state.active()
    {
        return Err(ApiError::Conflict(format!(
            "volume {name} is being cloned from {} ({}%): wait until the clone completed or failed",
            c.data.data_source, c.data.progress
        )));
    }
    if let Some(target) = crate::clone::reading_from(&ctx, &name).await? {
        return Err(ApiError::Conflict(format!(
            "volume {name} is the source of the clone into {target}: wait until that clone completed or failed"
        )));
    }
    crate::backup::restore::check_detach(&ctx, &name).await?;
    if v.data.spec.node_id.is_some() || v.data.status.state != model::VolumeState::Detached {
        return Err(ApiError::Conflict(format!(
            "volume {name} is {}: detach it first",
            serde_json::to_string(&v.data.status.state)
                .unwrap_or_default()
                .trim_matches('"')
        )));
    }
    ctx.db.delete::<Volume>(&name, v.version).await?;
    ctx.db.delete_any::<VolumeClone>(&name).await?;
    ctx.db
        .delete_any::<crate::backup::model::VolumeRestore>(&name)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn attach_volume(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    body: Option<Body<AttachRequest>>,
) -> ApiResult<VolumeView> {
    let req = body.map(|b| b.0).unwrap_or_default();
    let disable_frontend = req.disable_frontend;
    let node = req.node_id.unwrap_or_else(|| ctx.cfg.node_id.clone());
    let target = ctx
        .db
        .get::<Node>(&node)
        .await?
        .ok_or_else(|| ApiError::Conflict(format!("nodeId {node:?}: no such node")))?;
    if !node_is_up(&ctx, &target.data).await {
        return Err(ApiError::Conflict(format!("node {node} is down")));
    }
    let mut v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    let clone = ctx.db.get::<VolumeClone>(&name).await?;
    if let (Some(ds), None) = (&v.data.spec.data_source, &clone) {
        return Err(ApiError::Conflict(format!(
            "volume {name} is a clone of {ds} whose copy has not started: it can be attached once the clone completed"
        )));
    }
    if let Some(c) = clone {
        match c.data.state {
            CloneState::Completed => {}
            CloneState::Failed => {
                return Err(ApiError::Conflict(format!(
                    "the clone into {name} failed ({}): its data is incomplete; delete the volume and create it again",
                    c.data.message
                )));
            }
            CloneState::Initiated | CloneState::Copying => {
                return Err(ApiError::Conflict(format!(
                    "volume {name} is being cloned from {} ({}%): it can be attached once the clone completed",
                    c.data.data_source, c.data.progress
                )));
            }
        }
    }
    crate::backup::restore::check_attach(&ctx, &name, &v.data.spec).await?;
    // The engine runs on the target node: its data plane must be able to (a manager newer than that data plane
    // refuses here, before anything is written).
    if let Some(why) = crate::data_plane::lacking(
        &node,
        &target.data,
        &crate::data_plane::Needs::of(&v.data),
        crate::data_plane::Role::Engine,
    ) {
        return Err(ApiError::Conflict(format!(
            "cannot attach volume {name} on node {node}: {why}"
        )));
    }
    if let Some(cur) = v.data.spec.node_id.clone()
        && cur != node
    {
        // Moving is allowed only away from a dead node.
        let cur_up = match ctx.db.get::<Node>(&cur).await? {
            Some(n) => node_is_up(&ctx, &n.data).await,
            None => false,
        };
        if cur_up {
            return Err(ApiError::Conflict(format!(
                "volume {name} is attached to node {cur}: detach it first"
            )));
        }
    }
    if v.data.spec.node_id.as_deref() != Some(node.as_str()) {
        if v.data.status.state == model::VolumeState::Detaching {
            return Err(ApiError::Conflict(format!("volume {name} is still detaching")));
        }
        v.data.spec.node_id = Some(node);
        v.data.spec.disable_frontend = disable_frontend;
        ctx.db.update(&mut v).await?;
    } else if v.data.spec.disable_frontend != disable_frontend {
        // Switching would cut off the clients of a served volume or expose one under maintenance.
        return Err(ApiError::Conflict(format!(
            "volume {name} is attached {}: detach it first",
            if v.data.spec.disable_frontend {
                "without a frontend (maintenance)"
            } else {
                "with a frontend"
            }
        )));
    }
    Ok(Json(volume_view(&ctx, &name).await?))
}

async fn detach_volume(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<VolumeView> {
    let mut v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    // A clone attached these itself (without a frontend) and detaches them when it ends.
    if let Some(c) = ctx.db.get::<VolumeClone>(&name).await?
        && c.data.state.active()
    {
        return Err(ApiError::Conflict(format!(
            "volume {name} is being cloned from {} ({}%): it is detached when the clone ends",
            c.data.data_source, c.data.progress
        )));
    }
    if let Some(target) = crate::clone::attached_for(&ctx, &name).await? {
        return Err(ApiError::Conflict(format!(
            "volume {name} was attached for the clone into {target}: it is detached when that clone ends"
        )));
    }
    crate::backup::restore::check_detach(&ctx, &name).await?;
    if v.data.spec.node_id.is_some() || v.data.spec.disable_frontend {
        v.data.spec.node_id = None;
        v.data.spec.disable_frontend = false;
        ctx.db.update(&mut v).await?;
    }
    Ok(Json(volume_view(&ctx, &name).await?))
}

async fn expand_volume(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<SizeRequest>,
) -> ApiResult<VolumeView> {
    check_size(req.size)?;
    let v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    if req.size < v.data.spec.size {
        return Err(ApiError::Conflict(format!(
            "size {} is smaller than the volume ({}): volumes only grow",
            req.size, v.data.spec.size
        )));
    }
    if req.size == v.data.spec.size {
        return Ok(Json(volume_view(&ctx, &name).await?));
    }
    VolumeEngine::of_attached(&ctx, &name)
        .await?
        .expand(&ctx, req.size)
        .await?;
    Ok(Json(volume_view(&ctx, &name).await?))
}

async fn salvage_volume(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<VolumeView> {
    let v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    if v.data.status.robustness != model::Robustness::Faulted {
        return Err(ApiError::Conflict(format!(
            "volume {name} is not faulted: nothing to salvage"
        )));
    }
    ctx.db
        .modify::<Volume>(&name, |v| {
            v.spec.salvage_requested = true;
            true
        })
        .await?;
    Ok(Json(volume_view(&ctx, &name).await?))
}

async fn list_snapshots(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<Vec<SnapshotView>> {
    ctx.db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    let running = ctx
        .db
        .get::<Engine>(&name)
        .await?
        .is_some_and(|e| e.data.status.state == ProcessState::Running);
    if !running {
        // Detached: what the engine showed last.
        return Ok(Json(crate::snapshot::recorded(&ctx.db, &name).await?));
    }
    let mut e = VolumeEngine::of_attached(&ctx, &name).await?;
    Ok(Json(e.snapshots(&ctx).await?))
}

async fn create_snapshot(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    body: Option<Body<SnapshotCreate>>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let req = body.map(|b| b.0).unwrap_or_default();
    if let Some(s) = &req.name {
        check_name("snapshot name", s)?;
    }
    let taken = VolumeEngine::of_attached(&ctx, &name)
        .await?
        .snapshot_create(
            &ctx,
            req.name.unwrap_or_default(),
            req.labels.into_iter().collect(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(serde_json::json!({"name": taken}))))
}

async fn delete_snapshot(
    State(ctx): State<Ctx>,
    Path((name, snap)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    check_name("snapshot name", &snap)?;
    if let Some((backup, s)) = crate::backup::running_on(&ctx, &name).await?
        && s == snap
    {
        return Err(ApiError::Conflict(format!(
            "backup {backup} is reading snapshot {snap}: remove it once the backup completed or failed"
        )));
    }
    let mut engine = VolumeEngine::of_attached(&ctx, &name).await?;
    engine.snapshot_remove(&ctx, snap.clone()).await?;
    // The space comes back: a purge merges the removed snapshot into its child (the newest snapshot, under the
    // head, stays marked removed until a snapshot is taken above it). Refused while a replica rebuilds, a purge,
    // export or backup runs: the next removal or job purge merges it then.
    if let Err(e) = engine.snapshot_purge().await {
        tracing::info!(volume = name, snapshot = snap, error = %e, "purge after a snapshot removal deferred");
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn revert_snapshot(
    State(ctx): State<Ctx>,
    Path((name, snap)): Path<(String, String)>,
) -> ApiResult<VolumeView> {
    check_name("snapshot name", &snap)?;
    if let Some((backup, s)) = crate::backup::running_on(&ctx, &name).await? {
        return Err(ApiError::Conflict(format!(
            "backup {backup} is reading snapshot {s} of volume {name}: revert once the backup completed or failed"
        )));
    }
    let v = ctx
        .db
        .get::<Volume>(&name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    if v.data.spec.node_id.is_none() {
        // Detached: borrow the volume in maintenance mode (no frontend) for the revert, then detach again.
        let known = crate::snapshot::recorded(&ctx.db, &name)
            .await?
            .iter()
            .any(|s| s.name == snap && !s.removed);
        if !known {
            return Err(ApiError::NotFound(format!(
                "volume {name} has no snapshot {snap:?}"
            )));
        }
        let (ctx2, vol) = (ctx.clone(), name.clone());
        with_volume_in_maintenance(&ctx, &name, |c| async move {
            Ok(VolumeEngine::new(&vol, c)
                .snapshot_revert(&ctx2, snap, false)
                .await?)
        })
        .await?;
        return Ok(Json(volume_view(&ctx, &name).await?));
    }
    // Maintenance mode has no frontend to take down and bring back.
    VolumeEngine::of_attached(&ctx, &name)
        .await?
        .snapshot_revert(&ctx, snap, !v.data.spec.disable_frontend)
        .await?;
    Ok(Json(volume_view(&ctx, &name).await?))
}
