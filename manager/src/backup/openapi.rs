//! The OpenAPI side of the backup routes: their request and response schemas and the patterns the handlers check,
//! merged into the document as [`PART`] by `crate::server::routes`.

use serde_json::{Value, json};

use super::model::BackupState;
use crate::api::openapi::{NAME_PATTERN, Part, Shape};

/// This feature's part of the document.
pub const PART: Part = Part {
    shape: |method, path| {
        shape(method, path).map(|(body, status, response)| Shape::json(body, status, response))
    },
    schemas,
    path_param,
    query_params,
    ..Part::NONE
};

/// `[TARGET:]NAME` of a backup or backup volume: a target name, a colon, and a backup store name (1-63 of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-`).
pub const BACKUP_REF_PATTERN: &str = "^([A-Za-z0-9][A-Za-z0-9._-]{0,199}:)?[A-Za-z0-9_][A-Za-z0-9._-]{0,62}$";
/// A target URL as `PUT` takes it: `file:///DIR` or `s3://BUCKET[/PREFIX]`, without a query.
pub const TARGET_URL_PATTERN: &str = "^(file:///[^?#\\x00]*|s3://[^/?#\\x00]+(/[^?#\\x00]*)?)$";
/// The credential names a target keeps.
pub const CREDENTIAL_KEYS: [&str; 3] = backupstore::target::CREDENTIAL_KEYS;
/// The setting that gives new backup volumes their block size (bytes).
pub const BLOCK_SIZE_SETTING: &str = "backup-block-size";
/// A backup volume's block size as the setting and `blockSize` take it: a power of two from 4 KiB to 16 MiB
/// (`backupstore::check_block_size`; a unit test holds the two together).
pub const BLOCK_SIZE_PATTERN: &str =
    "^(4096|8192|16384|32768|65536|131072|262144|524288|1048576|2097152|4194304|8388608|16777216)$";
/// Default seconds between two listings of a target.
pub const DEFAULT_POLL_INTERVAL: u64 = 300;

/// The OpenAPI shape of a route of this module: (request body, required), success status, response.
#[allow(clippy::type_complexity)]
pub fn shape(method: &str, path: &str) -> Option<(Option<(Value, bool)>, u16, Option<Value>)> {
    let r = |n: &str| json!({"$ref": format!("#/components/schemas/{n}")});
    let arr = |n: &str| json!({"type": "array", "items": r(n)});
    Some(match (method, path) {
        ("get", "/v1/backuptargets") => (None, 200, Some(arr("BackupTarget"))),
        ("get", "/v1/backuptargets/{backuptarget}") => (None, 200, Some(r("BackupTarget"))),
        ("put", "/v1/backuptargets/{backuptarget}") => {
            (Some((r("BackupTargetSet"), true)), 200, Some(r("BackupTarget")))
        }
        (
            "delete",
            "/v1/backuptargets/{backuptarget}"
            | "/v1/backupvolumes/{backupvolume}"
            | "/v1/backups/{backup}"
            | "/v1/backingimagebackups/{backingimagebackup}",
        ) => (None, 204, None),
        ("post", "/v1/backingimagebackups/{backingimagebackup}/cancel") => {
            (None, 200, Some(r("BackingImageBackup")))
        }
        ("get", "/v1/backupvolumes") => (None, 200, Some(arr("BackupVolume"))),
        ("get", "/v1/backupvolumes/{backupvolume}") => (None, 200, Some(r("BackupVolume"))),
        ("post", "/v1/backingimages/{backingimage}/backup") => (
            Some((r("BackingImageBackupRequest"), false)),
            201,
            Some(r("BackingImageBackup")),
        ),
        ("get", "/v1/backingimagebackups") => (None, 200, Some(arr("BackingImageBackup"))),
        ("get", "/v1/backingimagebackups/{backingimagebackup}") => (None, 200, Some(r("BackingImageBackup"))),
        ("get", "/v1/backups") => (None, 200, Some(arr("Backup"))),
        ("post", "/v1/backups") => (Some((r("BackupCreate"), true)), 201, Some(r("Backup"))),
        ("get", "/v1/backups/{backup}") => (None, 200, Some(r("Backup"))),
        ("put", "/v1/volumes/{volume}/backupmaxcount") => {
            (Some((r("BackupMaxCount"), true)), 200, Some(r("BackupMaxCount")))
        }
        ("put", "/v1/volumes/{volume}/backupdeltamax") => {
            (Some((r("BackupDeltaMax"), true)), 200, Some(r("BackupDeltaMax")))
        }
        ("get", "/v1/volumes/{volume}/restore") => (None, 200, Some(r("Restore"))),
        ("post", "/v1/volumes/{volume}/activate") => (None, 200, Some(r("Restore"))),
        ("post", "/v1/volumes/{volume}/restore") => {
            (Some((r("RestoreRequest"), true)), 200, Some(r("Restore")))
        }
        _ => return None,
    })
}

/// The block sizes [`BLOCK_SIZE_PATTERN`] takes.
fn block_sizes() -> Vec<u64> {
    (12..=24).map(|s| 1u64 << s).collect()
}

/// The query parameters of this module's routes.
pub fn query_params(method: &str, path: &str) -> Vec<Value> {
    match (method, path) {
        ("get", "/v1/backups") => vec![
            json!({"name": "target", "in": "query", "required": false,
                "description": "Only the backups of this target (404 when no such target is set)",
                "schema": {"type": "string", "pattern": NAME_PATTERN}}),
            json!({"name": "volume", "in": "query", "required": false,
                "description": "Only the backups of this backup volume",
                "schema": {"type": "string", "pattern": "^[A-Za-z0-9_][A-Za-z0-9._-]{0,62}$"}}),
        ],
        _ => Vec::new(),
    }
}

/// The path parameters of this module's routes that are not plain names.
pub fn path_param(p: &str) -> Option<Value> {
    matches!(p, "backup" | "backupvolume" | "backingimagebackup")
        .then(|| json!({"type": "string", "pattern": BACKUP_REF_PATTERN}))
}

fn states() -> Vec<Value> {
    let all = [
        BackupState::Pending,
        BackupState::InProgress,
        BackupState::Completed,
        BackupState::Failed,
    ];
    for s in all {
        match s {
            BackupState::Pending | BackupState::InProgress | BackupState::Completed | BackupState::Failed => {
            }
        }
    }
    all.iter().map(|s| json!(s.as_str())).collect()
}

fn restore_states() -> Vec<Value> {
    use super::model::RestoreState;
    let all = [
        RestoreState::Initiated,
        RestoreState::Restoring,
        RestoreState::Completed,
        RestoreState::Failed,
    ];
    for s in all {
        match s {
            RestoreState::Initiated
            | RestoreState::Restoring
            | RestoreState::Completed
            | RestoreState::Failed => {}
        }
    }
    all.iter()
        .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
        .collect()
}

/// The schemas this module's shapes name.
pub fn schemas() -> Value {
    // Bounded like the u64 fields they are: a request with a larger number is outside the schema, not a 400 the
    // document does not announce (schemathesis ST202).
    let uint = json!({"type": "integer", "minimum": 0, "maximum": u64::MAX});
    let s = json!({"type": "string"});
    let map = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let cred_props: serde_json::Map<String, Value> = CREDENTIAL_KEYS
        .iter()
        .map(|k| ((*k).to_owned(), json!({"type": "string"})))
        .collect();
    json!({
        "BackupTargetSet": {
            "type": "object", "additionalProperties": false, "required": ["url"],
            "properties": {
                "url": {"type": "string", "pattern": TARGET_URL_PATTERN},
                "endpoint": {"type": "string", "pattern": "^(https?://[^?&#=\\x00]*)?$"},
                "region": {"type": "string", "pattern": "^[^?&#=\\x00]*$"},
                "pollInterval": {"type": "integer", "minimum": 1, "maximum": u64::MAX, "nullable": true},
                "credentials": {"type": "object", "nullable": true, "additionalProperties": false, "properties": cred_props},
            }
        },
        "BackupTarget": {
            "type": "object",
            "required": ["name", "url", "endpoint", "region", "pollInterval", "credentialKeys", "available", "message", "lastSyncedAt"],
            "properties": {
                "name": s, "url": s, "endpoint": s, "region": s, "pollInterval": uint,
                "credentialKeys": {"type": "array", "items": {"type": "string", "enum": CREDENTIAL_KEYS}},
                "available": {"type": "boolean"}, "message": s, "lastSyncedAt": {"type": "integer"},
            }
        },
        "BackupVolume": {
            "type": "object",
            "required": ["id", "target", "name", "size", "lastBackupName", "backingImageName", "backingImageChecksum", "labels"],
            "properties": {
                "id": s, "target": s, "name": s, "size": uint, "lastBackupName": s, "lastBackupAt": s,
                "backingImageName": s, "backingImageChecksum": s, "labels": map, "created": s, "backupCount": uint,
                "blockSize": uint,
            }
        },
        "BackupCreate": {
            "type": "object", "additionalProperties": false, "required": ["volume"],
            "properties": {
                // A Corral volume name (NAME_PATTERN) that the backup store also takes (at most 63 characters).
                "volume": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"},
                "snapshot": {"type": "string", "pattern": NAME_PATTERN, "nullable": true},
                "full": {"type": "boolean", "default": false},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "target": {"type": "string", "pattern": NAME_PATTERN, "nullable": true},
                "deltaMax": {"type": "integer", "minimum": 1, "maximum": u32::MAX, "nullable": true},
                "blockSize": {"type": "integer", "enum": block_sizes(), "nullable": true},
            }
        },
        "Backup": {
            "type": "object",
            "required": ["id", "url", "target", "volume", "name", "snapshot", "state", "progress", "size", "isIncremental", "chainPosition", "fullReason", "error"],
            "properties": {
                "id": s, "url": s, "target": s, "volume": s, "name": s, "snapshot": s, "labels": map,
                "state": {"type": "string", "enum": states()},
                "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                "size": uint, "isIncremental": {"type": "boolean"}, "chainPosition": uint,
                "fullReason": s, "baseBackup": s, "readBytes": uint, "newBytes": uint,
                "started": s, "completed": s, "error": s, "sourceVolume": s,
                "mode": {"type": "string", "enum": ["auto", "full"]},
                "snapshotTaken": {"type": "boolean"}, "replica": s,
                "backingImageName": s, "backingImageChecksum": s,
                "deltaMax": {"type": "integer", "minimum": 0, "maximum": u32::MAX},
                "blockSize": uint,
            }
        },
        "BackingImageBackupRequest": {
            "type": "object", "additionalProperties": false,
            "properties": {
                "target": {"type": "string", "pattern": NAME_PATTERN, "nullable": true},
                "maxUploadRate": {"type": "integer", "minimum": 0, "maximum": u64::MAX, "nullable": true},
            }
        },
        "BackingImageBackup": {
            "type": "object",
            "required": ["id", "image", "imageUuid", "target", "backup", "backupUrl", "checksum", "nodeId", "state", "progress",
                "size", "newBytes", "deduplicatedBlocks", "started", "completed", "error"],
            "properties": {
                "id": s, "image": s, "imageUuid": s, "target": s, "backup": s, "backupUrl": s, "checksum": s, "nodeId": s,
                "state": {"type": "string", "enum": states()},
                "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                "size": uint, "newBytes": uint, "deduplicatedBlocks": uint, "started": s, "completed": s, "error": s,
                "maxUploadRate": uint, "cancelRequested": {"type": "boolean"},
            }
        },
        "BackupMaxCount": {
            "type": "object", "additionalProperties": false,
            "properties": {"backupMaxCount": {"type": "integer", "minimum": 0, "maximum": u32::MAX, "nullable": true}}
        },
        "BackupDeltaMax": {
            "type": "object", "additionalProperties": false,
            "properties": {"backupDeltaMax": {"type": "integer", "minimum": 1, "maximum": u32::MAX, "nullable": true}}
        },
        "RestoreRequest": {
            "type": "object", "additionalProperties": false, "required": ["backup"],
            "properties": {"backup": {"type": "string", "pattern": BACKUP_REF_PATTERN}}
        },
        "Restore": {
            "type": "object",
            "required": ["volume", "target", "backupVolume", "backup", "state", "progress", "message"],
            "properties": {
                "volume": s, "target": s, "backupVolume": s, "backup": s,
                "state": {"type": "string", "enum": restore_states()},
                "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                "message": s, "replicas": {"type": "array", "items": s},
                "restored": {"type": "boolean"}, "attempts": uint, "standby": {"type": "boolean"},
                "activate": {"type": "boolean"}, "incremental": {"type": "boolean"}, "bytesWritten": uint,
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_size_pattern_takes_exactly_what_the_backup_store_takes() {
        let re = regex::Regex::new(BLOCK_SIZE_PATTERN).unwrap();
        let mut candidates: Vec<u64> = (0..=26).map(|s| 1u64 << s).collect();
        candidates.extend(candidates.clone().iter().flat_map(|c| [c - 1, c + 1]));
        candidates.extend([0, 3 << 20, 12 << 10]);
        for bs in candidates {
            assert_eq!(
                re.is_match(&bs.to_string()),
                backupstore::check_block_size(bs).is_ok(),
                "block size {bs}"
            );
        }
        assert_eq!(
            block_sizes()
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("|"),
            BLOCK_SIZE_PATTERN.trim_start_matches("^(").trim_end_matches(")$")
        );
    }
}
