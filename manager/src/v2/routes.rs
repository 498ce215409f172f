//! REST for the v2 engine: `GET /v1/lvstores` (the per-disk daemons), and the checks `POST /v1/nodes/{node}/disks`
//! and `POST /v1/volumes` make for v2 (called from `crate::api`).

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::device::{self, Probe};
use super::model::LvstoreDaemon;
use super::support::{self, Op};
use crate::api::views::{DiskCreate, VolumeCreate};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{DataEngine, ProcessState, Volume};

/// Largest `lvstoreSize`: 64 TiB.
pub const MAX_LVSTORE_SIZE: u64 = 64 << 40;

pub fn register(r: &mut crate::api::routes::Routes) {
    r.add(
        "get",
        "/v1/lvstores",
        "List the v2 disks' lvstore daemons (one per v2 disk)",
        list,
    );
}

/// A per-disk daemon as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LvstoreView {
    pub name: String,
    pub node_id: String,
    pub disk: String,
    pub device: String,
    pub state: ProcessState,
    pub address: String,
    pub pid: Option<i32>,
    pub restarts: u32,
    pub message: String,
}

/// Its OpenAPI schema.
pub fn schema() -> Value {
    let s = json!({"type": "string"});
    json!({
        "type": "object",
        "required": ["name", "nodeId", "disk", "device", "state", "address", "restarts", "message"],
        "properties": {
            "name": s, "nodeId": s, "disk": s, "device": s, "address": s, "message": s,
            "state": {"type": "string", "enum": ["stopped", "starting", "running", "crashed"]},
            "pid": {"type": "integer", "nullable": true},
            "restarts": {"type": "integer", "minimum": 0},
        }
    })
}

async fn list(State(ctx): State<Ctx>) -> Result<Json<Vec<LvstoreView>>, ApiError> {
    Ok(Json(
        ctx.db
            .list::<LvstoreDaemon>()
            .await?
            .into_iter()
            .map(|o| LvstoreView {
                pid: o.data.process.as_ref().map(|p| p.pid),
                restarts: o.data.process.as_ref().map_or(0, |p| p.restarts),
                name: o.name,
                node_id: o.data.node_id,
                disk: o.data.disk,
                device: o.data.device,
                state: o.data.state,
                address: o.data.address,
                message: o.data.message,
            })
            .collect(),
    ))
}

/// Checks a disk to add: its `lvstoreSize`, and for a v2 disk on this host that its store device is usable
/// (an lvstore, or nothing yet: never foreign data). Returns the store size to record (0: the default).
pub fn check_disk(req: &DiskCreate, local: bool) -> Result<u64, ApiError> {
    if req.disk_engine == DataEngine::V1 {
        if req.lvstore_size.is_some() {
            return Err(ApiError::Invalid(
                "lvstoreSize is for v2 disks (--disk-engine v2)".into(),
            ));
        }
        return Ok(0);
    }
    let size = req.lvstore_size.unwrap_or(0);
    if req.lvstore_size.is_some()
        && (!(device::MIN_SIZE..=MAX_LVSTORE_SIZE).contains(&size)
            || !size.is_multiple_of(device::SIZE_MULTIPLE))
    {
        return Err(ApiError::Invalid(format!(
            "lvstoreSize {size} is not a whole number of MiB from {} to {MAX_LVSTORE_SIZE}",
            device::MIN_SIZE
        )));
    }
    if local {
        let path = std::path::Path::new(&req.path);
        if path.exists() && !path.is_dir() {
            return Err(ApiError::Conflict(format!(
                "{} is not a directory: a v2 disk is a directory holding its store device {}",
                req.path,
                device::DEVICE_FILE
            )));
        }
        if let Probe::Foreign(why) = device::probe(&device::device_path(path)) {
            return Err(ApiError::Conflict(why));
        }
    }
    Ok(size)
}

/// The engine of a volume to create (`dataEngine`, else the `default-data-engine` setting), refusing what v2
/// cannot do yet ([`support`]): a restore into v2, a backing image under v2.
pub async fn volume_engine(
    ctx: &Ctx,
    req: &VolumeCreate,
    clone_source: Option<&Volume>,
    backing_image: Option<&str>,
) -> Result<DataEngine, ApiError> {
    let engine = match req.data_engine {
        Some(e) => e,
        None => ctx
            .setting("default-data-engine")
            .await
            .parse()
            .unwrap_or_default(),
    };
    let refuse = |e: DataEngine, op| support::check(e, op).map_err(ApiError::Conflict);
    if let Some(source) = clone_source {
        refuse(source.spec.data_engine, Op::Clone)?;
        refuse(engine, Op::Clone)?;
    }
    if req.from_backup.is_some() {
        refuse(engine, Op::Restore)?;
    }
    if backing_image.is_some() {
        refuse(engine, Op::BackingImage)?;
    }
    if engine == DataEngine::V2 && req.name.contains('.') {
        return Err(ApiError::Invalid(format!(
            "volume name {:?}: a v2 volume's name holds no '.' (its replicas are lvols named after it)",
            req.name
        )));
    }
    Ok(engine)
}
