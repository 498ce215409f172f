//! The OpenAPI side of recurring jobs: the schemas, shapes and links of [`super::routes`].

use serde_json::{Value, json};

use crate::api::openapi::{Part, Shape, array_of, name_schema, nullable, object, schema_ref, string_map};

/// This feature's part of the document.
pub const PART: Part = Part {
    shape,
    schemas,
    links,
    ..Part::NONE
};

/// A recurring job's create body: a snapshot job, or a backup job which may also name its target and deltaMax
/// (one schema per task, so that the document says what the server refuses).
fn create_schema() -> Value {
    let job = |task: &str, backup: bool| {
        let mut props = json!({
            "name": name_schema(),
            "task": {"type": "string", "enum": [task]},
            "cron": {"type": "string", "pattern": super::cron::PATTERN.as_str()},
            "retain": {"type": "integer", "minimum": 1, "maximum": super::model::MAX_RETAIN},
            "concurrency": nullable(json!({"type": "integer", "minimum": 1, "maximum": super::model::MAX_CONCURRENCY})),
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

fn shape(method: &str, path: &str) -> Option<Shape> {
    Some(match (method, path) {
        ("get", "/v1/recurringjobs") => Shape::json(None, 200, Some(array_of("RecurringJob"))),
        ("post", "/v1/recurringjobs") => Shape::json(
            Some((schema_ref("RecurringJobCreate"), true)),
            201,
            Some(schema_ref("RecurringJob")),
        ),
        ("get", "/v1/recurringjobs/{job}") => Shape::json(None, 200, Some(schema_ref("RecurringJob"))),
        ("delete", "/v1/recurringjobs/{job}") => Shape::json(None, 204, None),
        ("put", "/v1/volumes/{volume}/jobgroups") => Shape::json(
            Some((schema_ref("JobGroupsRequest"), true)),
            200,
            Some(schema_ref("JobGroups")),
        ),
        _ => return None,
    })
}

fn links(method: &str, path: &str) -> Option<Value> {
    match (method, path) {
        ("post", "/v1/recurringjobs") => Some(crate::api::openapi::links_to(
            &[
                ("get", "/v1/recurringjobs/{job}"),
                ("delete", "/v1/recurringjobs/{job}"),
            ],
            &json!({"job": "$response.body#/name"}),
        )),
        _ => None,
    }
}

fn schemas() -> Value {
    json!({
        "RecurringJobCreate": create_schema(),
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
