//! The OpenAPI side of nodes and their disks: the schemas of [`super::views`], the shapes and links of
//! [`super::routes`], and the disk path rule they check.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Value, json};

use crate::api::openapi::{Part, Shape, array_of, name_schema, object, regex, schema_ref, uint};
use crate::error::ApiError;

/// This feature's part of the document.
pub const PART: Part = Part {
    shape,
    schemas,
    links,
    ..Part::NONE
};

/// A disk's directory: absolute, no `..` component, no NUL.
pub const DISK_PATH_PATTERN: &str = r"^(/([^/.\x00][^/\x00]*|\.|\.[^/.\x00][^/\x00]*|\.\.[^/\x00]+)?)+$";

static DISK_PATH: LazyLock<Regex> = LazyLock::new(|| regex(DISK_PATH_PATTERN));

pub fn check_disk_path(path: &str) -> Result<(), ApiError> {
    if DISK_PATH.is_match(path) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "disk path {path:?} must be absolute without '..' or NUL"
    )))
}

fn shape(method: &str, path: &str) -> Option<Shape> {
    Some(match (method, path) {
        ("get", "/v1/nodes") => Shape::json(None, 200, Some(array_of("Node"))),
        ("get", "/v1/nodes/{node}") => Shape::json(None, 200, Some(schema_ref("Node"))),
        ("post", "/v1/nodes/{node}/disks") => Shape::json(
            Some((schema_ref("DiskCreate"), true)),
            200,
            Some(schema_ref("Node")),
        ),
        ("delete", "/v1/nodes/{node}/disks/{disk}") => Shape::json(None, 200, Some(schema_ref("Node"))),
        ("post", "/v1/nodes/{node}/cordon" | "/v1/nodes/{node}/uncordon" | "/v1/nodes/{node}/drain") => {
            Shape::json(None, 200, Some(schema_ref("Node")))
        }
        _ => return None,
    })
}

fn links(method: &str, path: &str) -> Option<Value> {
    match (method, path) {
        ("get", "/v1/nodes") => Some(crate::api::openapi::links_to(
            &[("get", "/v1/nodes/{node}")],
            &json!({"node": "$response.body#/0/name"}),
        )),
        _ => None,
    }
}

fn node_schema() -> Value {
    json!({
        "type": "object",
        "required": ["name", "address", "host", "ready", "allowScheduling", "disks"],
        "properties": {
            "name": {"type": "string"}, "address": {"type": "string"}, "host": {"type": "string"},
            "ready": {"type": "boolean"}, "allowScheduling": {"type": "boolean"}, "heartbeat": {"type": "integer"},
            "managerVersion": {"type": "string"}, "instanceManager": {"type": "string"},
            "instanceManagerVersion": {"type": "string"}, "dataPlaneVersion": {"type": "string"},
            "dataPlaneFeatures": {"type": "array", "items": {"type": "string"}},
            "disks": {"type": "array", "items": {
                "type": "object",
                "required": ["name", "path", "diskUUID", "allowScheduling"],
                "properties": {
                    "name": {"type": "string"}, "path": {"type": "string"}, "diskUUID": {"type": "string"},
                    "allowScheduling": {"type": "boolean"}, "storageReserved": uint(),
                    "diskEngine": {"type": "string", "enum": ["v1", "v2"]}, "lvstoreSize": uint(),
                    "storageMaximum": uint(), "storageAvailable": uint(), "storageScheduled": uint(),
                    "error": {"type": "string"},
                }
            }},
            "replicas": {"type": "integer", "minimum": 0},
            "drainState": {"type": "string", "enum": ["none", "draining", "drained"]},
            "drainBlocked": {"type": "array", "items": {"type": "string"}},
            "orphansRemoved": {"type": "array", "items": {
                "type": "object",
                "required": ["kind", "name", "detail", "at"],
                "properties": {
                    "kind": {"type": "string", "enum": ["replica-process", "replica-data", "engine-process"]},
                    "name": {"type": "string"}, "detail": {"type": "string"}, "at": {"type": "integer"},
                }
            }},
        }
    })
}

fn schemas() -> Value {
    json!({
        "DiskCreate": object(&["name", "path"], json!({
            "name": name_schema(),
            "path": {"type": "string", "pattern": DISK_PATH_PATTERN},
            "allowScheduling": {"type": "boolean", "default": true},
            "storageReserved": uint(),
            "diskEngine": {"type": "string", "enum": ["v1", "v2"], "default": "v1"},
            "lvstoreSize": {"type": "integer", "format": "int64", "minimum": crate::data_engine::device::MIN_SIZE,
                "maximum": crate::data_engine::MAX_LVSTORE_SIZE, "multipleOf": crate::data_engine::device::SIZE_MULTIPLE,
                "description": "v2: bytes of the store file created on first use (default 10 GiB)"},
        })),
        "Node": node_schema(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_paths_are_absolute_without_parent_components() {
        for ok in ["/", "/a", "/a/b/", "/a/./b", "/a/...", "/a/..b", "/.x", "//a"] {
            assert!(check_disk_path(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "a", "a/b", "/..", "/a/../b", "/a/..", "/a\0b"] {
            assert!(check_disk_path(bad).is_err(), "{bad:?}");
        }
    }
}
