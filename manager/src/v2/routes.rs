//! REST for the v2 engine: `GET /v1/lvstores` (the per-disk daemons).

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::model::LvstoreDaemon;
use crate::api::openapi::{Part, Shape, array_of};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::ProcessState;

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

/// This feature's part of the OpenAPI document.
pub const PART: Part = Part {
    shape: |method, path| {
        (method == "get" && path == "/v1/lvstores")
            .then(|| Shape::json(None, 200, Some(array_of("LvstoreDaemon"))))
    },
    schemas: || json!({"LvstoreDaemon": schema()}),
    ..Part::NONE
};

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
