//! The OpenAPI side of backing images: what a create request must hold per source type (the checks
//! [`super::routes`] makes, and the schemas built from the same tables), and the shapes and links of its routes.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Value, json};

use super::model::SourceType;
use crate::api::openapi::{
    MAX_COPIES, Part, Shape, array_of, name_schema, nullable, object, regex, schema_ref, string_map, uint,
};
use crate::error::ApiError;

/// This feature's part of the document.
pub const PART: Part = Part {
    shape,
    schemas,
    links,
    ..Part::NONE
};

/// A backing image's expected SHA-512: 128 hex digits, or empty for none.
pub const CHECKSUM_PATTERN: &str = "^([0-9a-fA-F]{128})?$";
/// The URL of a `download` backing image.
pub const DOWNLOAD_URL_PATTERN: &str = "^https?://";

static CHECKSUM: LazyLock<Regex> = LazyLock::new(|| regex(CHECKSUM_PATTERN));

pub fn check_checksum(c: &str) -> Result<(), ApiError> {
    if CHECKSUM.is_match(c) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "expectedChecksum must be a SHA-512 (128 hex digits), got {} characters",
        c.len()
    )))
}

pub fn source_types() -> [SourceType; 5] {
    let all = [
        SourceType::Download,
        SourceType::Upload,
        SourceType::ExportFromVolume,
        SourceType::Restore,
        SourceType::Clone,
    ];
    for s in all {
        match s {
            SourceType::Download
            | SourceType::Upload
            | SourceType::ExportFromVolume
            | SourceType::Restore
            | SourceType::Clone => {}
        }
    }
    all
}

/// The parameters a source type requires (non-empty strings), and the values some of them are limited to.
pub fn source_parameters(
    t: SourceType,
) -> (
    &'static [&'static str],
    &'static [(&'static str, &'static [&'static str])],
) {
    match t {
        SourceType::Download => (&["url"], &[]),
        SourceType::Upload => (&[], &[]),
        SourceType::ExportFromVolume => (&["volume", "snapshot"], &[("exportType", &["raw", "qcow2"])]),
        SourceType::Restore => (&["backupURL"], &[]),
        SourceType::Clone => (&["backingImage"], &[]),
    }
}

/// Checks a backing image's parameters against [`source_parameters`] (and a download's URL scheme).
pub fn check_source_parameters(t: SourceType, p: &BTreeMap<String, String>) -> Result<(), ApiError> {
    let (required, limited) = source_parameters(t);
    for k in required {
        if p.get(*k).is_none_or(String::is_empty) {
            return Err(ApiError::Invalid(format!(
                "source type {} needs the parameter {k:?}",
                t.as_str()
            )));
        }
    }
    for (k, allowed) in limited {
        if let Some(v) = p.get(*k)
            && !allowed.contains(&v.as_str())
        {
            return Err(ApiError::Invalid(format!(
                "parameter {k} {v:?} is not one of {}",
                allowed.join(", ")
            )));
        }
    }
    if t == SourceType::Download && !regex(DOWNLOAD_URL_PATTERN).is_match(&p["url"]) {
        return Err(ApiError::Invalid(format!(
            "url {:?} is not an http:// or https:// URL",
            p["url"]
        )));
    }
    Ok(())
}

fn create_schemas() -> Vec<Value> {
    source_types()
        .into_iter()
        .map(|t| {
            let (required, limited) = source_parameters(t);
            let mut props = serde_json::Map::new();
            for k in required {
                let mut s = json!({"type": "string", "minLength": 1});
                if t == SourceType::Download {
                    s["pattern"] = json!(DOWNLOAD_URL_PATTERN);
                }
                props.insert((*k).to_owned(), s);
            }
            for (k, allowed) in limited {
                props.insert((*k).to_owned(), json!({"type": "string", "enum": allowed}));
            }
            let top: &[&str] = if required.is_empty() {
                &["name", "sourceType"]
            } else {
                &["name", "sourceType", "parameters"]
            };
            object(
                top,
                json!({
                    "name": name_schema(),
                    "sourceType": {"type": "string", "enum": [t.as_str()]},
                    "parameters": if required.is_empty() {
                        json!({"type": "object", "properties": props, "additionalProperties": {"type": "string"}})
                    } else {
                        json!({
                            "type": "object",
                            "required": required,
                            "properties": props,
                            "additionalProperties": {"type": "string"},
                        })
                    },
                    "expectedChecksum": {"type": "string", "pattern": CHECKSUM_PATTERN},
                    "minNumberOfCopies": nullable(json!({"type": "integer", "minimum": 1, "maximum": MAX_COPIES})),
                    "diskSelector": {"type": "array", "items": {"type": "string"}},
                    "nodeSelector": {"type": "array", "items": {"type": "string"}},
                    "dataEngine": nullable(json!({"type": "string", "enum": ["v1", "v2"]})),
                }),
            )
        })
        .collect()
}

fn shape(method: &str, path: &str) -> Option<Shape> {
    Some(match (method, path) {
        ("get", "/v1/backingimages") => Shape::json(None, 200, Some(array_of("BackingImage"))),
        ("post", "/v1/backingimages") => Shape::json(
            Some((schema_ref("BackingImageCreate"), true)),
            201,
            Some(schema_ref("BackingImage")),
        ),
        ("get", "/v1/backingimages/{backingimage}") => {
            Shape::json(None, 200, Some(schema_ref("BackingImage")))
        }
        ("delete", "/v1/backingimages/{backingimage}") => Shape::json(None, 204, None),
        ("post", "/v1/backingimages/{backingimage}/cleanup" | "/v1/backingimages/{backingimage}/copy") => {
            Shape::json(
                Some((schema_ref("CleanupRequest"), true)),
                200,
                Some(schema_ref("BackingImage")),
            )
        }
        ("post", "/v1/backingimages/{backingimage}/upload") => {
            Shape::json(None, 200, Some(schema_ref("BackingImage")))
        }
        _ => return None,
    })
}

fn links(method: &str, path: &str) -> Option<Value> {
    match (method, path) {
        ("post", "/v1/backingimages") => Some(crate::api::openapi::links_to(
            &[
                ("get", "/v1/backingimages/{backingimage}"),
                ("delete", "/v1/backingimages/{backingimage}"),
                ("post", "/v1/backingimages/{backingimage}/cleanup"),
                ("post", "/v1/backingimages/{backingimage}/copy"),
                ("post", "/v1/backingimages/{backingimage}/upload"),
            ],
            &json!({"backingimage": "$response.body#/name"}),
        )),
        _ => None,
    }
}

fn schemas() -> Value {
    json!({
        "BackingImageCreate": {"oneOf": create_schemas()},
        "CleanupRequest": object(&["disks"], json!({"disks": {"type": "array", "items": {"type": "string"}}})),
        "BackingImage": {
            "type": "object",
            "required": ["name", "uuid", "sourceType", "parameters", "state", "progress", "disks"],
            "properties": {
                "name": {"type": "string"}, "uuid": {"type": "string"},
                "sourceType": {"type": "string", "enum": source_types().map(SourceType::as_str)},
                "parameters": string_map(),
                "expectedChecksum": {"type": "string"}, "currentChecksum": {"type": "string"},
                "minNumberOfCopies": {"type": "integer"}, "size": uint(), "virtualSize": uint(),
                "state": {"type": "string"},
                "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                "message": {"type": "string"},
                "deletionTimestamp": nullable(json!({"type": "integer"})),
                "dataEngine": {"type": "string", "enum": ["v1", "v2"]},
                "v2FirstCopyStatus": {"type": "string", "description": "v2 images: pending | in-progress | ready | failed | unknown"},
                "v2FirstCopyDisk": {"type": "string"}, "v2FirstCopyMessage": {"type": "string"},
                "disks": {"type": "array", "items": {"type": "object"}},
            }
        },
    })
}
