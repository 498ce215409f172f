//! What a request must look like, once: the patterns, limits and enums the handlers check, and the OpenAPI 3
//! document built from the same constants (served at `/v1/openapi.json`), so the document cannot promise more or
//! less than the server accepts. `tests/api_schema.rs` runs schemathesis against it.

use std::sync::LazyLock;

use corral_disk::BLOCK_SIZE;
use regex::Regex;
use serde_json::{Value, json};

use crate::backing_image::model::SourceType;
use crate::error::{ApiError, ERROR_CODES};
use crate::model::{self, DesireState, Frontend, ProcessState, Robustness, VolumeState};

pub use super::patterns::NAME_PATTERN;
/// A clone's `dataSource`: `vol://NAME` or `snap://NAME/SNAPSHOT`, each name as [`NAME_PATTERN`] (a unit test
/// holds the two together; `clone::model::DataSource::parse` checks each name with [`check_name`]).
pub const DATA_SOURCE_PATTERN: &str = "^(vol://[A-Za-z0-9][A-Za-z0-9._-]{0,199}|snap://[A-Za-z0-9][A-Za-z0-9._-]{0,199}/[A-Za-z0-9][A-Za-z0-9._-]{0,199})$";
/// A disk's directory: absolute, no `..` component, no NUL.
pub const DISK_PATH_PATTERN: &str = r"^(/([^/.\x00][^/\x00]*|\.|\.[^/.\x00][^/\x00]*|\.\.[^/\x00]+)?)+$";
/// A backing image's expected SHA-512: 128 hex digits, or empty for none.
pub const CHECKSUM_PATTERN: &str = "^([0-9a-fA-F]{128})?$";
/// The URL of a `download` backing image.
pub const DOWNLOAD_URL_PATTERN: &str = "^https?://";
/// Volume sizes are whole blocks.
pub const SIZE_MULTIPLE: u64 = BLOCK_SIZE;
/// The largest volume Corral accepts (64 TiB): beyond what ext4 holds in one sparse replica file.
pub const MAX_VOLUME_SIZE: u64 = 64 << 40;
/// Replicas of a volume, copies of a backing image.
pub const MAX_COPIES: u32 = 16;
/// The largest JSON body a route that takes one reads (axum's default limit).
pub const BODY_LIMIT: usize = 2 << 20;

/// A setting's value: `true`/`false` for the boolean ones, a whole number (at most 19 digits) for the others,
/// 1 to 16 for the default number of copies of a backing image, a power of two from 4096 to 16777216 for
/// `backup-block-size`.
pub fn setting_value_pattern(name: &str, default: &str) -> &'static str {
    if name == crate::backing_image::image_controller::MIN_COPIES_SETTING {
        "^([1-9]|1[0-6])$"
    } else if name == crate::backup::openapi::BLOCK_SIZE_SETTING {
        crate::backup::openapi::BLOCK_SIZE_PATTERN
    } else if name == "default-data-engine" {
        "^(v1|v2)$"
    } else if matches!(default, "true" | "false") {
        "^(true|false)$"
    } else {
        "^[0-9]{1,19}$"
    }
}

fn regex(pattern: &'static str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("pattern {pattern}: {e}"))
}

static NAME: LazyLock<Regex> = LazyLock::new(|| regex(NAME_PATTERN));
static DISK_PATH: LazyLock<Regex> = LazyLock::new(|| regex(DISK_PATH_PATTERN));
static CHECKSUM: LazyLock<Regex> = LazyLock::new(|| regex(CHECKSUM_PATTERN));

pub fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    if NAME.is_match(name) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "{what} {name:?} is not a valid name: 1-200 letters, digits, '.', '_' and '-', starting with a letter or digit"
    )))
}

pub fn check_size(size: u64) -> Result<(), ApiError> {
    if size == 0 || !size.is_multiple_of(SIZE_MULTIPLE) || size > MAX_VOLUME_SIZE {
        return Err(ApiError::Invalid(format!(
            "size {size} is not a positive multiple of {SIZE_MULTIPLE} bytes up to {MAX_VOLUME_SIZE}"
        )));
    }
    Ok(())
}

pub fn check_disk_path(path: &str) -> Result<(), ApiError> {
    if DISK_PATH.is_match(path) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "disk path {path:?} must be absolute without '..' or NUL"
    )))
}

pub fn check_checksum(c: &str) -> Result<(), ApiError> {
    if CHECKSUM.is_match(c) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "expectedChecksum must be a SHA-512 (128 hex digits), got {} characters",
        c.len()
    )))
}

pub fn check_copies(what: &str, n: u32) -> Result<(), ApiError> {
    if (1..=MAX_COPIES).contains(&n) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "{what} {n} is out of range 1..={MAX_COPIES}"
    )))
}

pub fn check_setting_value(name: &str, default: &str, value: &str) -> Result<(), ApiError> {
    let pattern = setting_value_pattern(name, default);
    if regex(pattern).is_match(value) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "setting {name} takes {}, not {value:?}",
        match pattern {
            "^(true|false)$" => "true or false",
            "^[0-9]{1,19}$" => "a whole number (at most 19 digits)",
            crate::backup::openapi::BLOCK_SIZE_PATTERN => "a power of two from 4096 to 16777216 (bytes)",
            _ => "a whole number from 1 to 16",
        }
    )))
}

/// The lower-case API names of an enum's variants (exhaustive matches, so a new variant must be listed here).
fn names<T: serde::Serialize>(all: &[T]) -> Vec<Value> {
    all.iter()
        .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
        .collect()
}

fn clone_states() -> Vec<Value> {
    use crate::clone::model::CloneState;
    let all = [
        CloneState::Initiated,
        CloneState::Copying,
        CloneState::Completed,
        CloneState::Failed,
    ];
    for s in all {
        match s {
            CloneState::Initiated | CloneState::Copying | CloneState::Completed | CloneState::Failed => {}
        }
    }
    names(&all)
}

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
pub fn check_source_parameters(
    t: SourceType,
    p: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
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

fn name_schema() -> Value {
    json!({"type": "string", "pattern": NAME_PATTERN})
}

/// OpenAPI 3.0's `nullable`; an `enum` must list `null` itself to admit it.
fn nullable(mut s: Value) -> Value {
    s["nullable"] = json!(true);
    if let Some(e) = s.get_mut("enum").and_then(Value::as_array_mut) {
        e.push(Value::Null);
    }
    s
}

fn size_schema() -> Value {
    json!({"type": "integer", "minimum": SIZE_MULTIPLE, "maximum": MAX_VOLUME_SIZE, "multipleOf": SIZE_MULTIPLE})
}

fn uint() -> Value {
    json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})
}

/// A request object: exactly these properties (the server refuses unknown fields).
/// A recurring job's create body: a snapshot job, or a backup job which may also name its target and deltaMax
/// (one schema per task, so that the document says what the server refuses).
fn job_create_schema() -> Value {
    let job = |task: &str, backup: bool| {
        let mut props = json!({
            "name": name_schema(),
            "task": {"type": "string", "enum": [task]},
            "cron": {"type": "string", "pattern": crate::job::cron::PATTERN.as_str()},
            "retain": {"type": "integer", "minimum": 1, "maximum": crate::job::model::MAX_RETAIN},
            "concurrency": nullable(json!({"type": "integer", "minimum": 1, "maximum": crate::job::model::MAX_CONCURRENCY})),
            "volumes": {"type": "array", "items": name_schema()},
            "groups": {"type": "array", "items": name_schema()},
            "labels": string_map(),
        });
        if backup {
            props["target"] = nullable(name_schema());
            props["deltaMax"] = nullable(json!({"type": "integer", "minimum": 1, "maximum": u32::MAX}));
        }
        object(&["name", "task", "cron", "retain"], props)
    };
    json!({"oneOf": [job("snapshot", false), job("backup", true)]})
}

fn object(required: &[&str], props: Value) -> Value {
    let mut o = json!({"type": "object", "additionalProperties": false});
    o["properties"] = props;
    // OpenAPI 3.0 (JSON Schema draft 4) wants `required` non-empty when present.
    if !required.is_empty() {
        o["required"] = json!(required);
    }
    o
}

fn string_map() -> Value {
    json!({"type": "object", "additionalProperties": {"type": "string"}})
}

fn backing_image_create_schemas() -> Vec<Value> {
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

/// Every schema the document names under `components.schemas`.
fn components() -> Value {
    let codes: Vec<&str> = ERROR_CODES.iter().map(|c| c.1).collect();
    let replica = json!({
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
    });
    let clone_status = nullable(json!({
        "type": "object",
        "required": ["sourceVolume", "snapshot", "state", "progress", "message"],
        "properties": {
            "sourceVolume": {"type": "string"},
            "snapshot": {"type": "string"},
            "state": {"type": "string", "enum": clone_states()},
            "progress": {"type": "integer", "minimum": 0, "maximum": 100},
            "message": {"type": "string"},
        }
    }));
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
    let node = json!({
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
    });
    json!({
        "Error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string", "enum": codes}, "message": {"type": "string"}},
            "additionalProperties": false,
        },
        "VolumeCreate": object(&["name", "size"], json!({
            "name": name_schema(),
            "size": size_schema(),
            "numberOfReplicas": {"type": "integer", "minimum": 1, "maximum": MAX_COPIES, "default": 3},
            "disableRevisionCounter": nullable(json!({"type": "boolean"})),
            "frontend": nullable(json!({"type": "string", "enum": frontends()})),
            "backingImage": nullable(name_schema()),
            "dataSource": nullable(json!({"type": "string", "pattern": DATA_SOURCE_PATTERN})),
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
        "DiskCreate": object(&["name", "path"], json!({
            "name": name_schema(),
            "path": {"type": "string", "pattern": DISK_PATH_PATTERN},
            "allowScheduling": {"type": "boolean", "default": true},
            "storageReserved": uint(),
            "diskEngine": {"type": "string", "enum": ["v1", "v2"], "default": "v1"},
            "lvstoreSize": {"type": "integer", "format": "int64", "minimum": crate::v2::device::MIN_SIZE,
                "maximum": crate::v2::service::MAX_LVSTORE_SIZE, "multipleOf": crate::v2::device::SIZE_MULTIPLE,
                "description": "v2: bytes of the store file created on first use (default 10 GiB)"},
        })),
        "LvstoreDaemon": crate::v2::routes::schema(),
        "BackingImageCreate": {"oneOf": backing_image_create_schemas()},
        "CleanupRequest": object(&["disks"], json!({"disks": {"type": "array", "items": {"type": "string"}}})),
        "Replica": replica,
        "Volume": {
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
                "cloneStatus": clone_status,
                "engineGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                    "description": "the last engine generation handed out for the volume (issue 39 fencing)"},
            }
        },
        "Node": node,
        "Setting": {
            "type": "object",
            "required": ["name", "value", "default", "description"],
            "properties": {
                "name": {"type": "string"}, "value": {"type": "string"}, "default": {"type": "string"},
                "description": {"type": "string"},
            }
        },
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
        "RecurringJobCreate": job_create_schema(),
        "RecurringJob": {
            "type": "object",
            "required": ["name", "task", "cron", "retain", "concurrency", "volumes", "groups", "labels", "created",
                "lastScheduled", "lastMissed", "nextRun", "lastResults", "lastFinished"],
            "properties": {
                "name": {"type": "string"},
                "task": {"type": "string", "enum": ["snapshot", "backup"]},
                "cron": {"type": "string"}, "retain": {"type": "integer"}, "concurrency": {"type": "integer"},
                "volumes": {"type": "array", "items": {"type": "string"}},
                "groups": {"type": "array", "items": {"type": "string"}},
                "labels": string_map(), "created": {"type": "integer"},
                "lastScheduled": {"type": "integer"}, "lastMissed": {"type": "integer"},
                "nextRun": {"type": "integer"}, "lastResults": string_map(), "lastFinished": {"type": "integer"},
                "target": nullable(json!({"type": "string"})),
                "deltaMax": nullable(json!({"type": "integer", "minimum": 1})),
            }
        },
        "JobGroupsRequest": object(&["groups"], json!({"groups": {"type": "array", "items": name_schema()}})),
        "JobGroups": {
            "type": "object",
            "required": ["volume", "groups"],
            "properties": {"volume": {"type": "string"}, "groups": {"type": "array", "items": {"type": "string"}}},
        },
    })
}

fn with_backup_schemas(mut c: Value) -> Value {
    if let (Some(all), Value::Object(more)) = (c.as_object_mut(), crate::backup::openapi::schemas()) {
        all.extend(more);
    }
    if let (Some(all), Value::Object(more)) =
        (c.as_object_mut(), crate::token::openapi::schemas(&name_schema()))
    {
        all.extend(more);
    }
    c
}

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn array_of(name: &str) -> Value {
    json!({"type": "array", "items": schema_ref(name)})
}

/// What an operation takes and answers: (request body schema, body required, success status, response schema,
/// response media type).
struct Shape {
    body: Option<(Value, bool)>,
    status: u16,
    response: Option<(Value, &'static str)>,
}

fn shape(method: &str, path: &str) -> Shape {
    let json_resp = |s: Value| Some((s, "application/json"));
    let (body, status, response) = match (method, path) {
        ("get", "/v1/nodes") => (None, 200, json_resp(array_of("Node"))),
        ("get", "/v1/nodes/{node}") => (None, 200, json_resp(schema_ref("Node"))),
        ("post", "/v1/nodes/{node}/disks") => (
            Some((schema_ref("DiskCreate"), true)),
            200,
            json_resp(schema_ref("Node")),
        ),
        ("delete", "/v1/nodes/{node}/disks/{disk}") => (None, 200, json_resp(schema_ref("Node"))),
        ("post", "/v1/nodes/{node}/cordon" | "/v1/nodes/{node}/uncordon" | "/v1/nodes/{node}/drain") => {
            (None, 200, json_resp(schema_ref("Node")))
        }
        ("get", "/v1/volumes") => (None, 200, json_resp(array_of("Volume"))),
        ("post", "/v1/volumes") => (
            Some((schema_ref("VolumeCreate"), true)),
            201,
            json_resp(schema_ref("Volume")),
        ),
        ("get", "/v1/volumes/{volume}") => (None, 200, json_resp(schema_ref("Volume"))),
        ("delete", "/v1/volumes/{volume}") => (None, 204, None),
        ("post", "/v1/volumes/{volume}/attach") => (
            Some((schema_ref("AttachRequest"), false)),
            200,
            json_resp(schema_ref("Volume")),
        ),
        ("post", "/v1/volumes/{volume}/expand") => (
            Some((schema_ref("SizeRequest"), true)),
            200,
            json_resp(schema_ref("Volume")),
        ),
        ("post", "/v1/volumes/{volume}/detach" | "/v1/volumes/{volume}/salvage") => {
            (None, 200, json_resp(schema_ref("Volume")))
        }
        ("get", "/v1/volumes/{volume}/snapshots") => (None, 200, json_resp(array_of("Snapshot"))),
        ("post", "/v1/volumes/{volume}/snapshots") => (
            Some((schema_ref("SnapshotCreate"), false)),
            201,
            json_resp(schema_ref("SnapshotCreated")),
        ),
        ("delete", "/v1/volumes/{volume}/snapshots/{snapshot}") => (None, 204, None),
        ("post", "/v1/volumes/{volume}/snapshots/{snapshot}/revert") => {
            (None, 200, json_resp(schema_ref("Volume")))
        }
        ("get", "/v1/replicas") => (None, 200, json_resp(array_of("Replica"))),
        ("get", "/v1/settings") => (None, 200, json_resp(array_of("Setting"))),
        ("get", "/v1/settings/{setting}") => (None, 200, json_resp(schema_ref("Setting"))),
        ("put", "/v1/settings/{setting}") => (
            Some((object(&["value"], json!({"value": {"type": "string"}})), true)),
            200,
            json_resp(schema_ref("Setting")),
        ),
        ("get", "/v1/backingimages") => (None, 200, json_resp(array_of("BackingImage"))),
        ("post", "/v1/backingimages") => (
            Some((schema_ref("BackingImageCreate"), true)),
            201,
            json_resp(schema_ref("BackingImage")),
        ),
        ("get", "/v1/backingimages/{backingimage}") => (None, 200, json_resp(schema_ref("BackingImage"))),
        ("delete", "/v1/backingimages/{backingimage}") => (None, 204, None),
        ("post", "/v1/backingimages/{backingimage}/cleanup") => (
            Some((schema_ref("CleanupRequest"), true)),
            200,
            json_resp(schema_ref("BackingImage")),
        ),
        ("post", "/v1/backingimages/{backingimage}/copy") => (
            Some((schema_ref("CleanupRequest"), true)),
            200,
            json_resp(schema_ref("BackingImage")),
        ),
        ("post", "/v1/backingimages/{backingimage}/upload") => {
            (None, 200, json_resp(schema_ref("BackingImage")))
        }
        ("get", "/v1/recurringjobs") => (None, 200, json_resp(array_of("RecurringJob"))),
        ("post", "/v1/recurringjobs") => (
            Some((schema_ref("RecurringJobCreate"), true)),
            201,
            json_resp(schema_ref("RecurringJob")),
        ),
        ("get", "/v1/recurringjobs/{job}") => (None, 200, json_resp(schema_ref("RecurringJob"))),
        ("delete", "/v1/recurringjobs/{job}") => (None, 204, None),
        ("put", "/v1/volumes/{volume}/jobgroups") => (
            Some((schema_ref("JobGroupsRequest"), true)),
            200,
            json_resp(schema_ref("JobGroups")),
        ),
        ("get", "/v1/lvstores") => (None, 200, json_resp(array_of("LvstoreDaemon"))),
        ("get", "/v1/openapi.json") => (None, 200, json_resp(json!({"type": "object"}))),
        ("get", "/metrics") => (
            None,
            200,
            Some((json!({"type": "string"}), "application/openmetrics-text")),
        ),
        ("get", "/healthz") => (None, 200, Some((json!({"type": "string"}), "text/plain"))),
        _ => match crate::backup::openapi::shape(method, path)
            .or_else(|| crate::token::openapi::shape(method, path))
        {
            Some((body, status, response)) => (body, status, response.and_then(json_resp)),
            None => panic!(
                "the OpenAPI document does not describe {method} {path}: add it to api::openapi::shape"
            ),
        },
    };
    Shape {
        body,
        status,
        response,
    }
}

/// `get /v1/volumes/{volume}` → `getVolumesByVolume`: stable, unique, readable in links.
pub fn operation_id(method: &str, path: &str) -> String {
    let mut id = method.to_owned();
    for seg in path.split('/').filter(|s| !s.is_empty() && *s != "v1") {
        let (prefix, word) = match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            Some(p) => ("By", p),
            None => ("", seg),
        };
        id.push_str(prefix);
        for part in word.split(['-', '.', '_']) {
            let mut c = part.chars();
            if let Some(f) = c.next() {
                id.extend(f.to_uppercase());
                id.push_str(c.as_str());
            }
        }
    }
    id
}

/// The links of the stateful flows: after a success of (method, path), which operations can use what it returned.
fn links(method: &str, path: &str) -> Value {
    let to = |targets: &[(&str, &str)], params: Value| -> Value {
        let mut m = serde_json::Map::new();
        for (tm, tp) in targets {
            let id = operation_id(tm, tp);
            m.insert(id.clone(), json!({"operationId": id, "parameters": params}));
        }
        Value::Object(m)
    };
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
    match (method, path) {
        ("post", "/v1/volumes") => to(volume_ops, json!({"volume": "$response.body#/name"})),
        ("post", "/v1/volumes/{volume}/attach") => to(
            &[
                ("post", "/v1/volumes/{volume}/snapshots"),
                ("post", "/v1/volumes/{volume}/detach"),
            ],
            json!({"volume": "$response.body#/name"}),
        ),
        ("post", "/v1/volumes/{volume}/snapshots") => to(
            &[
                ("delete", "/v1/volumes/{volume}/snapshots/{snapshot}"),
                ("post", "/v1/volumes/{volume}/snapshots/{snapshot}/revert"),
            ],
            json!({"volume": "$request.path.volume", "snapshot": "$response.body#/name"}),
        ),
        ("post", "/v1/backingimages") => to(
            &[
                ("get", "/v1/backingimages/{backingimage}"),
                ("delete", "/v1/backingimages/{backingimage}"),
                ("post", "/v1/backingimages/{backingimage}/cleanup"),
                ("post", "/v1/backingimages/{backingimage}/copy"),
                ("post", "/v1/backingimages/{backingimage}/upload"),
            ],
            json!({"backingimage": "$response.body#/name"}),
        ),
        ("post", "/v1/recurringjobs") => to(
            &[
                ("get", "/v1/recurringjobs/{job}"),
                ("delete", "/v1/recurringjobs/{job}"),
            ],
            json!({"job": "$response.body#/name"}),
        ),
        ("get", "/v1/nodes") => to(
            &[("get", "/v1/nodes/{node}")],
            json!({"node": "$response.body#/0/name"}),
        ),
        _ => json!({}),
    }
}

fn error_responses(method: &str, has_body: bool) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for (status, code, description) in ERROR_CODES {
        let applies = match *status {
            413 | 415 => has_body,
            409 => method != "get",
            _ => true,
        };
        if applies {
            out.insert(
                status.to_string(),
                json!({
                    "description": format!("{code}: {description}"),
                    "content": {"application/json": {"schema": schema_ref("Error")}},
                }),
            );
        }
    }
    out
}

fn operation(method: &str, path: &str, summary: &str, path_param: &dyn Fn(&str) -> Value) -> Value {
    let s = shape(method, path);
    let mut params: Vec<Value> = path
        .split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(|p| json!({"name": p, "in": "path", "required": true, "schema": path_param(p)}))
        .collect();
    params.extend(crate::backup::openapi::query_params(method, path));
    let upload = path.ends_with("/upload");
    if upload {
        params.push(json!({
            "name": "size", "in": "query", "required": true,
            "description": "The file's size in bytes",
            "schema": {"type": "integer", "minimum": 1, "maximum": u64::MAX},
        }));
    }
    let mut responses = error_responses(method, s.body.is_some() || upload);
    let mut ok = json!({"description": "OK"});
    if let Some((schema, media)) = s.response {
        ok["content"] = json!({media: {"schema": schema}});
    }
    let l = links(method, path);
    if l.as_object().is_some_and(|m| !m.is_empty()) {
        ok["links"] = l;
    }
    responses.insert(s.status.to_string(), ok);
    let mut op = json!({
        "operationId": operation_id(method, path),
        "summary": summary,
        "parameters": params,
        "responses": responses,
    });
    if crate::token::auth::required_role(&method.to_uppercase().parse().unwrap_or_default(), path).is_none() {
        // Open routes (health, metrics) take no token.
        op["security"] = json!([]);
    }
    if let Some((schema, required)) = s.body {
        op["requestBody"] =
            json!({"required": required, "content": {"application/json": {"schema": schema}}});
    }
    if upload {
        op["requestBody"] = json!({"required": true, "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary"}},
        }}}});
    }
    op
}

/// The OpenAPI 3 document of `routes`: every route, its parameters, bodies, responses and links. The settings
/// are described one concrete path each, since each takes its own kind of value.
pub fn document(documented: &[(&'static str, &'static str, &'static str)]) -> Value {
    let setting_names: Vec<&str> = model::SETTINGS.iter().map(|s| s.0).collect();
    let path_param = |p: &str| -> Value {
        match p {
            "setting" => json!({"type": "string", "enum": setting_names}),
            p => crate::backup::openapi::path_param(p).unwrap_or_else(name_schema),
        }
    };
    let mut paths = serde_json::Map::new();
    for (path, method, summary) in documented {
        if *path == "/v1/settings/{setting}" {
            for (name, default, description) in model::SETTINGS {
                let concrete = format!("/v1/settings/{name}");
                let mut op = operation(method, path, summary, &path_param);
                op["operationId"] = json!(operation_id(method, &concrete));
                op["parameters"] = json!([]);
                op["description"] = json!(description);
                if *method == "put" {
                    op["requestBody"]["content"]["application/json"]["schema"]["properties"]["value"] =
                        json!({"type": "string", "pattern": setting_value_pattern(name, default)});
                }
                paths.entry(concrete).or_insert_with(|| json!({}))[*method] = op;
            }
            continue;
        }
        paths.entry((*path).to_owned()).or_insert_with(|| json!({}))[*method] =
            operation(method, path, summary, &path_param);
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Corral manager",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Every error is JSON {code, message}; names match NAME_PATTERN; sizes are whole 4 KiB blocks.",
        },
        "paths": paths,
        "components": {
            "schemas": with_backup_schemas(components()),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "An API token (`corral token create`; the first admin token is DATA_DIR/admin.token)",
            }},
        },
        "security": [{"bearer": []}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_pattern_agrees_with_the_daemons_path_component_rule() {
        let samples = [
            "a", "A.b_c-9", "0", ".hidden", "-x", "_x", "a/b", "..", "a..b", "", "a b", "ä", "a\n", "a\0",
        ];
        let long_ok = "a".repeat(200);
        let long_bad = "a".repeat(201);
        for s in samples
            .iter()
            .copied()
            .chain([long_ok.as_str(), long_bad.as_str()])
        {
            assert_eq!(
                NAME.is_match(s),
                corral_disk::identity::check_path_component("x", s).is_ok(),
                "{s:?}"
            );
        }
    }

    #[test]
    fn data_source_pattern_accepts_exactly_what_the_server_parses() {
        use crate::clone::model::DataSource;
        let pattern = regex(DATA_SOURCE_PATTERN);
        let long = "a".repeat(200);
        let too_long = "a".repeat(201);
        let samples = [
            "vol://a".to_owned(),
            "snap://a/s".to_owned(),
            format!("vol://{long}"),
            format!("snap://{long}/{long}"),
            format!("vol://{too_long}"),
            "vol://".into(),
            "vol://a/b".into(),
            "snap://a".into(),
            "snap://a/".into(),
            "snap://a/b/c".into(),
            "snap://.a/b".into(),
            "vol://-a".into(),
            "http://a".into(),
            String::new(),
        ];
        for s in &samples {
            let parsed = DataSource::parse(s, |what, n| check_name(what, n).map_err(|e| e.to_string()));
            assert_eq!(pattern.is_match(s), parsed.is_ok(), "{s:?}: {parsed:?}");
        }
    }

    #[test]
    fn disk_paths_are_absolute_without_parent_components() {
        for ok in ["/", "/a", "/a/b/", "/a/./b", "/a/...", "/a/..b", "/.x", "//a"] {
            assert!(check_disk_path(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "a", "a/b", "/..", "/a/../b", "/a/..", "/a\0b"] {
            assert!(check_disk_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_route_is_described_with_unique_operation_ids() {
        let doc = crate::server::routes::openapi_document();
        let mut ids = std::collections::BTreeSet::new();
        for (_, item) in doc["paths"].as_object().unwrap() {
            for (_, op) in item.as_object().unwrap() {
                assert!(ids.insert(op["operationId"].as_str().unwrap().to_owned()), "{op}");
            }
        }
        // Every link names an operation of the document.
        for (_, item) in doc["paths"].as_object().unwrap() {
            for (_, op) in item.as_object().unwrap() {
                for (_, resp) in op["responses"].as_object().unwrap() {
                    for (_, link) in resp["links"].as_object().into_iter().flatten() {
                        assert!(ids.contains(link["operationId"].as_str().unwrap()), "{link}");
                    }
                }
            }
        }
    }

    #[test]
    fn setting_patterns_accept_the_defaults() {
        for (name, default, _) in model::SETTINGS {
            check_setting_value(name, default, default).unwrap();
        }
        assert!(check_setting_value("x", "8", "+5").is_err());
        assert!(check_setting_value("x", "true", "yes").is_err());
    }
}
