//! The OpenAPI side of volumes, their snapshots and replicas: the schemas of [`super::views`] and the shapes and
//! links of [`super::routes`] (and of `GET /v1/replicas`), merged into the document by `crate::server::routes`.

use serde_json::{Value, json};

use crate::api::openapi::{
    MAX_COPIES, Part, Shape, array_of, name_schema, names, nullable, object, schema_ref, size_schema,
    string_map, uint,
};
use crate::model::{DesireState, Frontend, ProcessState, Robustness, VolumeState};

/// This feature's part of the document.
pub const PART: Part = Part {
    shape,
    schemas,
    links,
    ..Part::NONE
};

fn volume_states() -> Vec<Value> {
    let all = [
        VolumeState::Detached,
        VolumeState::Attaching,
        VolumeState::Attached,
        VolumeState::Detaching,
    ];
    for s in all {
        match s {
            VolumeState::Detached
            | VolumeState::Attaching
            | VolumeState::Attached
            | VolumeState::Detaching => {}
        }
    }
    names(&all)
}

fn robustness() -> Vec<Value> {
    let all = [
        Robustness::Unknown,
        Robustness::Healthy,
        Robustness::Degraded,
        Robustness::Faulted,
    ];
    for s in all {
        match s {
            Robustness::Unknown | Robustness::Healthy | Robustness::Degraded | Robustness::Faulted => {}
        }
    }
    names(&all)
}

fn process_states() -> Vec<Value> {
    let all = [
        ProcessState::Stopped,
        ProcessState::Starting,
        ProcessState::Running,
        ProcessState::Crashed,
    ];
    for s in all {
        match s {
            ProcessState::Stopped
            | ProcessState::Starting
            | ProcessState::Running
            | ProcessState::Crashed => {}
        }
    }
    names(&all)
}

fn desire_states() -> Vec<Value> {
    let all = [DesireState::Stopped, DesireState::Running];
    for s in all {
        match s {
            DesireState::Stopped | DesireState::Running => {}
        }
    }
    names(&all)
}

fn frontends() -> Vec<Value> {
    let all = [Frontend::Nbd];
    for s in all {
        match s {
            Frontend::Nbd => {}
        }
    }
    names(&all)
}

fn shape(method: &str, path: &str) -> Option<Shape> {
    Some(match (method, path) {
        ("get", "/v1/volumes") => Shape::json(None, 200, Some(array_of("Volume"))),
        ("post", "/v1/volumes") => Shape::json(
            Some((schema_ref("VolumeCreate"), true)),
            201,
            Some(schema_ref("Volume")),
        ),
        ("get", "/v1/volumes/{volume}") => Shape::json(None, 200, Some(schema_ref("Volume"))),
        ("delete", "/v1/volumes/{volume}") => Shape::json(None, 204, None),
        ("post", "/v1/volumes/{volume}/attach") => Shape::json(
            Some((schema_ref("AttachRequest"), false)),
            200,
            Some(schema_ref("Volume")),
        ),
        ("post", "/v1/volumes/{volume}/expand") => Shape::json(
            Some((schema_ref("SizeRequest"), true)),
            200,
            Some(schema_ref("Volume")),
        ),
        ("post", "/v1/volumes/{volume}/detach" | "/v1/volumes/{volume}/salvage") => {
            Shape::json(None, 200, Some(schema_ref("Volume")))
        }
        ("get", "/v1/volumes/{volume}/snapshots") => Shape::json(None, 200, Some(array_of("Snapshot"))),
        ("post", "/v1/volumes/{volume}/snapshots") => Shape::json(
            Some((schema_ref("SnapshotCreate"), false)),
            201,
            Some(schema_ref("SnapshotCreated")),
        ),
        ("delete", "/v1/volumes/{volume}/snapshots/{snapshot}") => Shape::json(None, 204, None),
        ("post", "/v1/volumes/{volume}/snapshots/{snapshot}/revert") => {
            Shape::json(None, 200, Some(schema_ref("Volume")))
        }
        ("get", "/v1/replicas") => Shape::json(None, 200, Some(array_of("Replica"))),
        _ => return None,
    })
}

fn links(method: &str, path: &str) -> Option<Value> {
    let volume_ops: &[(&str, &str)] = &[
        ("get", "/v1/volumes/{volume}"),
        ("delete", "/v1/volumes/{volume}"),
        ("post", "/v1/volumes/{volume}/attach"),
        ("post", "/v1/volumes/{volume}/detach"),
        ("post", "/v1/volumes/{volume}/expand"),
        ("post", "/v1/volumes/{volume}/salvage"),
        ("get", "/v1/volumes/{volume}/snapshots"),
        ("post", "/v1/volumes/{volume}/snapshots"),
    ];
    let to = crate::api::openapi::links_to;
    Some(match (method, path) {
        ("post", "/v1/volumes") => to(volume_ops, &json!({"volume": "$response.body#/name"})),
        ("post", "/v1/volumes/{volume}/attach") => to(
            &[
                ("post", "/v1/volumes/{volume}/snapshots"),
                ("post", "/v1/volumes/{volume}/detach"),
            ],
            &json!({"volume": "$response.body#/name"}),
        ),
        ("post", "/v1/volumes/{volume}/snapshots") => to(
            &[
                ("delete", "/v1/volumes/{volume}/snapshots/{snapshot}"),
                ("post", "/v1/volumes/{volume}/snapshots/{snapshot}/revert"),
            ],
            &json!({"volume": "$request.path.volume", "snapshot": "$response.body#/name"}),
        ),
        _ => return None,
    })
}

fn replica_schema() -> Value {
    json!({
        "type": "object",
        "required": ["name", "volume", "nodeId", "disk", "dataPath", "state", "desireState", "mode", "address", "failed", "message"],
        "properties": {
            "name": {"type": "string"}, "volume": {"type": "string"}, "nodeId": {"type": "string"},
            "disk": {"type": "string"}, "dataPath": {"type": "string"},
            "state": {"type": "string", "enum": process_states()},
            "desireState": {"type": "string", "enum": desire_states()},
            "mode": {"type": "string", "description": "RW | WO | ERR in the volume's engine, empty when in none"},
            "rebuildProgress": nullable(json!({"type": "integer", "minimum": 0, "maximum": 100})),
            "address": {"type": "string"},
            "dataEngine": {"type": "string", "enum": ["v1", "v2"]},
            "pid": nullable(json!({"type": "integer"})),
            "failed": {"type": "boolean"}, "message": {"type": "string"},
        }
    })
}

fn volume_schema() -> Value {
    let engine = nullable(json!({
        "type": "object",
        "required": ["nodeId", "state", "address", "restarts"],
        "properties": {
            "nodeId": {"type": "string"},
            "state": {"type": "string", "enum": process_states()},
            "address": {"type": "string"},
            "pid": nullable(json!({"type": "integer"})),
            "restarts": {"type": "integer", "minimum": 0},
            "generation": {"type": "integer", "format": "int64", "minimum": 0,
                "description": "the generation the running engine was started with"},
            "lastFenced": {"type": "string",
                "description": "the last time an engine of the volume was fenced by a newer generation and stopped"},
        }
    }));
    json!({
        "type": "object",
        "required": ["name", "size", "numberOfReplicas", "frontend", "state", "robustness", "endpoints", "replicas"],
        "properties": {
            "name": {"type": "string"},
            "size": uint(),
            "numberOfReplicas": {"type": "integer"},
            "frontend": {"type": "string", "enum": frontends()},
            "dataEngine": {"type": "string", "enum": ["v1", "v2"]},
            "disableRevisionCounter": nullable(json!({"type": "boolean"})),
            "revisionCounterDisabled": {"type": "boolean"},
            "nodeId": nullable(json!({"type": "string"})),
            "currentNodeId": nullable(json!({"type": "string"})),
            "state": {"type": "string", "enum": volume_states()},
            "robustness": {"type": "string", "enum": robustness()},
            "endpoints": {"type": "array", "items": {"type": "string"}},
            "disableFrontend": {"type": "boolean"},
            "frontendDisabled": {"type": "boolean"},
            "salvageRequested": {"type": "boolean"},
            "message": {"type": "string"},
            "backingImage": nullable(json!({"type": "string"})),
            "engine": engine,
            "replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}},
            "dataSource": nullable(json!({"type": "string"})),
            "cloneStatus": crate::clone::openapi::status_schema(),
            "engineGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                "description": "the last engine generation handed out for the volume (issue 39 fencing)"},
        }
    })
}

fn schemas() -> Value {
    json!({
        "VolumeCreate": object(&["name", "size"], json!({
            "name": name_schema(),
            "size": size_schema(),
            "numberOfReplicas": {"type": "integer", "minimum": 1, "maximum": MAX_COPIES, "default": 3},
            "disableRevisionCounter": nullable(json!({"type": "boolean"})),
            "frontend": nullable(json!({"type": "string", "enum": frontends()})),
            "backingImage": nullable(name_schema()),
            "dataSource": nullable(json!({"type": "string", "pattern": crate::clone::openapi::DATA_SOURCE_PATTERN})),
            "fromBackup": nullable(json!({"type": "string", "pattern": crate::backup::openapi::BACKUP_REF_PATTERN})),
            "standby": {"type": "boolean", "default": false, "description": "with fromBackup: a DR volume"},
            "dataEngine": {"type": "string", "enum": ["v1", "v2"], "description": "default: the default-data-engine setting"},
        })),
        "AttachRequest": object(&[], json!({
            "nodeId": nullable(json!({"type": "string"})),
            "disableFrontend": {"type": "boolean", "default": false},
        })),
        "SizeRequest": object(&["size"], json!({"size": size_schema()})),
        "SnapshotCreate": object(&[], json!({
            "name": nullable(name_schema()),
            "labels": string_map(),
        })),
        "Replica": replica_schema(),
        "Volume": volume_schema(),
        "Snapshot": {
            "type": "object",
            "required": ["volume", "name", "parent", "children", "created", "size", "removed", "userCreated", "labels"],
            "properties": {
                "volume": {"type": "string"}, "name": {"type": "string"}, "parent": {"type": "string"},
                "children": {"type": "array", "items": {"type": "string"}}, "created": {"type": "string"},
                "size": uint(), "removed": {"type": "boolean"}, "userCreated": {"type": "boolean"},
                "labels": string_map(),
            }
        },
        "SnapshotCreated": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}
        },
    })
}
