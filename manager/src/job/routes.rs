//! REST: `/v1/recurringjobs` (create, list, get, delete) and `/v1/volumes/{volume}/jobgroups` (the groups a
//! volume belongs to). Every check runs before the first write.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::cron::Cron;
use super::model::{JobSpec, JobStatus, MAX_CONCURRENCY, MAX_RETAIN, RecurringJob, Task};
use crate::api::extract::{Body, Path};
use crate::api::openapi::check_name;
use crate::api::routes::Routes;
use crate::backup::model::BackupTarget;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::Volume;
use crate::store::{Object, StoreError};

type ApiResult<T> = Result<Json<T>, ApiError>;

pub fn register(r: &mut Routes) {
    r.add("get", "/v1/recurringjobs", "List recurring jobs", list);
    r.add(
        "post",
        "/v1/recurringjobs",
        "Create a recurring job: a snapshot or backup task on a cron schedule (UTC) over volumes by name or group",
        create,
    );
    r.add(
        "get",
        "/v1/recurringjobs/{job}",
        "Get a recurring job with its last run",
        get,
    );
    r.add(
        "delete",
        "/v1/recurringjobs/{job}",
        "Delete a recurring job (what it made stays)",
        delete,
    );
    r.add(
        "put",
        "/v1/volumes/{volume}/jobgroups",
        "Set the recurring-job groups a volume belongs to (`{groups: [...]}`)",
        set_groups,
    );
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobCreate {
    pub name: String,
    /// `snapshot` | `backup`.
    pub task: String,
    pub cron: String,
    pub retain: u32,
    #[serde(default)]
    pub concurrency: Option<u32>,
    #[serde(default)]
    pub volumes: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Backup task: the backup target (default: `default`); it must be set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Backup task: the job's `backup-delta-max`, over the setting's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_max: Option<u32>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GroupsRequest {
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub name: String,
    pub task: Task,
    pub cron: String,
    pub retain: u32,
    pub concurrency: u32,
    pub volumes: Vec<String>,
    pub groups: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub created: i64,
    /// Backup task: the target (None: `default`).
    #[serde(default)]
    pub target: Option<String>,
    /// Backup task: the job's `backup-delta-max` (None: the setting's).
    #[serde(default)]
    pub delta_max: Option<u32>,
    #[serde(flatten)]
    pub status: JobStatus,
}

impl JobView {
    fn new(o: Object<RecurringJob>) -> Self {
        let RecurringJob { spec, status } = o.data;
        Self {
            name: o.name,
            task: spec.task,
            cron: spec.cron,
            retain: spec.retain,
            concurrency: spec.concurrency,
            volumes: spec.volumes,
            groups: spec.groups,
            labels: spec.labels,
            created: spec.created,
            target: spec.target,
            delta_max: spec.delta_max,
            status,
        }
    }
}

/// A volume's groups, as set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupsView {
    pub volume: String,
    pub groups: Vec<String>,
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("recurring job {name:?} not found"))
}

/// Checks a create request and turns it into the job's spec.
pub fn validate(req: &JobCreate, created: i64) -> Result<JobSpec, ApiError> {
    check_name("job name", &req.name)?;
    let task = match req.task.as_str() {
        "snapshot" => Task::Snapshot,
        "backup" => Task::Backup,
        t => {
            return Err(ApiError::Invalid(format!(
                "task {t:?} is not one of snapshot, backup"
            )));
        }
    };
    Cron::parse(&req.cron).map_err(ApiError::Invalid)?;
    if req.retain == 0 || req.retain > MAX_RETAIN {
        return Err(ApiError::Invalid(format!(
            "retain {} is outside 1-{MAX_RETAIN}",
            req.retain
        )));
    }
    let concurrency = req.concurrency.unwrap_or(1);
    if concurrency == 0 || concurrency > MAX_CONCURRENCY {
        return Err(ApiError::Invalid(format!(
            "concurrency {concurrency} is outside 1-{MAX_CONCURRENCY}"
        )));
    }
    for v in &req.volumes {
        check_name("volume name", v)?;
    }
    for g in &req.groups {
        check_name("group name", g)?;
    }
    if task != Task::Backup && (req.target.is_some() || req.delta_max.is_some()) {
        return Err(ApiError::Invalid(format!(
            "target and deltaMax are for backup jobs, not {task} jobs"
        )));
    }
    if let Some(t) = &req.target {
        check_name("backup target", t)?;
    }
    if req.delta_max == Some(0) {
        return Err(ApiError::Invalid(
            "deltaMax 0: a chain holds at least its full backup (1 makes every backup full)".into(),
        ));
    }
    Ok(JobSpec {
        task,
        cron: req.cron.clone(),
        retain: req.retain,
        concurrency,
        volumes: req.volumes.clone(),
        groups: req.groups.clone(),
        labels: req.labels.clone(),
        created,
        target: req.target.clone(),
        delta_max: req.delta_max,
    })
}

async fn create(
    State(ctx): State<Ctx>,
    Body(req): Body<JobCreate>,
) -> Result<(StatusCode, Json<JobView>), ApiError> {
    let spec = validate(&req, crate::runtime::now())?;
    // A job that could never back anything up is refused now, not at each fire time.
    if let Some(t) = &spec.target
        && ctx.db.get::<BackupTarget>(t).await?.is_none()
    {
        return Err(ApiError::NotFound(format!(
            "backup target {t:?} is not set (corral backup target set URL --name {t})"
        )));
    }
    let job = RecurringJob {
        spec,
        status: JobStatus::default(),
    };
    match ctx.db.create(&req.name, job).await {
        Ok(o) => Ok((StatusCode::CREATED, Json(JobView::new(o)))),
        Err(StoreError::AlreadyExists { .. }) => Err(ApiError::Conflict(format!(
            "recurring job {:?} already exists",
            req.name
        ))),
        Err(e) => Err(e.into()),
    }
}

async fn list(State(ctx): State<Ctx>) -> ApiResult<Vec<JobView>> {
    let mut all: Vec<JobView> = ctx
        .db
        .list::<RecurringJob>()
        .await?
        .into_iter()
        .map(JobView::new)
        .collect();
    all.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Json(all))
}

async fn get(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<JobView> {
    let o = ctx
        .db
        .get::<RecurringJob>(&name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    Ok(Json(JobView::new(o)))
}

async fn delete(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let o = ctx
        .db
        .get::<RecurringJob>(&name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    match ctx.db.delete::<RecurringJob>(&name, o.version).await {
        Ok(()) | Err(StoreError::NotFound { .. }) => Ok(StatusCode::NO_CONTENT),
        Err(e) => Err(e.into()),
    }
}

async fn set_groups(
    State(ctx): State<Ctx>,
    Path(volume): Path<String>,
    Body(req): Body<GroupsRequest>,
) -> ApiResult<GroupsView> {
    for g in &req.groups {
        check_name("group name", g)?;
    }
    let mut groups = req.groups.clone();
    groups.sort();
    groups.dedup();
    let found = ctx
        .db
        .modify::<Volume>(&volume, |v| {
            if v.spec.job_groups == groups {
                return false;
            }
            v.spec.job_groups.clone_from(&groups);
            true
        })
        .await;
    match found {
        Ok(_) => Ok(Json(GroupsView { volume, groups })),
        Err(StoreError::NotFound { .. }) => Err(ApiError::NotFound(format!("volume {volume:?} not found"))),
        Err(e) => Err(e.into()),
    }
}
