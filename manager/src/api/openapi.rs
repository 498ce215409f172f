//! The OpenAPI kit: the limits and patterns every feature's checks share, the schema builders, and the assembly
//! of the OpenAPI 3 document (served at `/v1/openapi.json`) from each feature's [`Part`] — the shapes of its
//! routes and the schemas they name, kept beside the feature (`backup::openapi`, `volume::openapi`, …) and built
//! from the same constants as its checks, so the document cannot promise more or less than the server accepts.
//! The kit names no feature: `crate::server::routes` hands it every feature's part. `tests/api_schema.rs` runs
//! schemathesis against the document.

use std::sync::LazyLock;

use corral_disk::BLOCK_SIZE;
use regex::Regex;
use serde_json::{Value, json};

use crate::error::{ApiError, ERROR_CODES};

/// Names of volumes, snapshots, disks, backing images and nodes: one path component on disk (the same rule as
/// `corral_disk::identity::check_path_component`, which the daemons apply).
pub const NAME_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$";
/// Volume sizes are whole blocks.
pub const SIZE_MULTIPLE: u64 = BLOCK_SIZE;
/// The largest volume Corral accepts (64 TiB): beyond what ext4 holds in one sparse replica file.
pub const MAX_VOLUME_SIZE: u64 = 64 << 40;
/// Replicas of a volume, copies of a backing image.
pub const MAX_COPIES: u32 = 16;
/// The largest JSON body a route that takes one reads (axum's default limit).
pub const BODY_LIMIT: usize = 2 << 20;

/// A compiled pattern of this API (the patterns are constants, so a bad one is a bug found by the first test).
pub fn regex(pattern: &'static str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("pattern {pattern}: {e}"))
}

static NAME: LazyLock<Regex> = LazyLock::new(|| regex(NAME_PATTERN));

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

pub fn check_copies(what: &str, n: u32) -> Result<(), ApiError> {
    if (1..=MAX_COPIES).contains(&n) {
        return Ok(());
    }
    Err(ApiError::Invalid(format!(
        "{what} {n} is out of range 1..={MAX_COPIES}"
    )))
}

/// The lower-case API names of an enum's variants (callers match exhaustively, so a new variant must be listed).
pub fn names<T: serde::Serialize>(all: &[T]) -> Vec<Value> {
    all.iter()
        .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
        .collect()
}

pub fn name_schema() -> Value {
    json!({"type": "string", "pattern": NAME_PATTERN})
}

/// OpenAPI 3.0's `nullable`; an `enum` must list `null` itself to admit it.
pub fn nullable(mut s: Value) -> Value {
    s["nullable"] = json!(true);
    if let Some(e) = s.get_mut("enum").and_then(Value::as_array_mut) {
        e.push(Value::Null);
    }
    s
}

pub fn size_schema() -> Value {
    json!({"type": "integer", "minimum": SIZE_MULTIPLE, "maximum": MAX_VOLUME_SIZE, "multipleOf": SIZE_MULTIPLE})
}

pub fn uint() -> Value {
    json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})
}

/// A request object: exactly these properties (the server refuses unknown fields).
pub fn object(required: &[&str], props: Value) -> Value {
    let mut o = json!({"type": "object", "additionalProperties": false});
    o["properties"] = props;
    // OpenAPI 3.0 (JSON Schema draft 4) wants `required` non-empty when present.
    if !required.is_empty() {
        o["required"] = json!(required);
    }
    o
}

pub fn string_map() -> Value {
    json!({"type": "object", "additionalProperties": {"type": "string"}})
}

pub fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

pub fn array_of(name: &str) -> Value {
    json!({"type": "array", "items": schema_ref(name)})
}

/// What an operation takes and answers: (request body schema, body required), success status, (response schema,
/// response media type).
pub struct Shape {
    pub body: Option<(Value, bool)>,
    pub status: u16,
    pub response: Option<(Value, &'static str)>,
}

impl Shape {
    /// An operation answering JSON (or nothing).
    pub fn json(body: Option<(Value, bool)>, status: u16, response: Option<Value>) -> Self {
        Self {
            body,
            status,
            response: response.map(|s| (s, "application/json")),
        }
    }
}

/// Concrete paths, each with its operation (see [`Part::concrete`]).
pub type Concrete = Vec<(String, Value)>;

/// One feature's part of the document: the shapes, parameters and links of its routes and the schemas they name.
/// Each feature's `openapi` module has one; `crate::server::routes` hands them all to [`document`]. A part leaves
/// out what it does not need with `..Part::NONE`.
pub struct Part {
    /// The shape of one of the feature's operations; `None`: not the feature's.
    pub shape: fn(&str, &str) -> Option<Shape>,
    /// The schemas the shapes name (an object, merged into `components.schemas`).
    pub schemas: fn() -> Value,
    /// The links of an operation's success response: after a success, which operations can use what it
    /// returned (an object of links; `None`: not the feature's).
    pub links: fn(&str, &str) -> Option<Value>,
    /// The schema of a path parameter that is not a plain name.
    pub path_param: fn(&str) -> Option<Value>,
    /// The query parameters of an operation.
    pub query_params: fn(&str, &str) -> Vec<Value>,
    /// A route the document describes one concrete path each instead (the settings, each taking its own kind of
    /// value): (concrete path, its operation) made from the route's generic operation.
    pub concrete: fn(&str, &str, &Value) -> Option<Concrete>,
}

impl Part {
    /// Nothing: the base of a part that contributes only some of the above.
    pub const NONE: Part = Part {
        shape: |_, _| None,
        schemas: || json!({}),
        links: |_, _| None,
        path_param: |_| None,
        query_params: |_, _| Vec::new(),
        concrete: |_, _, _| None,
    };
}

/// Links from an operation's success to `targets`, passing them `params`.
pub fn links_to(targets: &[(&str, &str)], params: &Value) -> Value {
    let mut m = serde_json::Map::new();
    for (tm, tp) in targets {
        let id = operation_id(tm, tp);
        m.insert(id.clone(), json!({"operationId": id, "parameters": params}));
    }
    Value::Object(m)
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

/// The document's view of every feature's parts, and which routes take no token.
struct Parts<'a> {
    parts: &'a [Part],
    open: &'a dyn Fn(&str, &str) -> bool,
}

impl Parts<'_> {
    fn shape(&self, method: &str, path: &str) -> Shape {
        self.parts
            .iter()
            .find_map(|p| (p.shape)(method, path))
            .unwrap_or_else(|| {
                panic!("the OpenAPI document does not describe {method} {path}: add it to its feature's openapi::PART")
            })
    }

    fn path_param(&self, p: &str) -> Value {
        self.parts
            .iter()
            .find_map(|part| (part.path_param)(p))
            .unwrap_or_else(name_schema)
    }

    fn operation(&self, method: &str, path: &str, summary: &str) -> Value {
        let s = self.shape(method, path);
        let mut params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|p| json!({"name": p, "in": "path", "required": true, "schema": self.path_param(p)}))
            .collect();
        for part in self.parts {
            params.extend((part.query_params)(method, path));
        }
        // A multipart upload (`…/upload`) takes the file's size in the query.
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
        let l = self
            .parts
            .iter()
            .find_map(|p| (p.links)(method, path))
            .unwrap_or_else(|| json!({}));
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
        if (self.open)(method, path) {
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

    fn schemas(&self) -> Value {
        let codes: Vec<&str> = ERROR_CODES.iter().map(|c| c.1).collect();
        let mut all = serde_json::Map::new();
        all.insert(
            "Error".to_owned(),
            json!({
                "type": "object",
                "required": ["code", "message"],
                "properties": {"code": {"type": "string", "enum": codes}, "message": {"type": "string"}},
                "additionalProperties": false,
            }),
        );
        for part in self.parts {
            if let Value::Object(more) = (part.schemas)() {
                all.extend(more);
            }
        }
        Value::Object(all)
    }
}

/// The OpenAPI 3 document of the `documented` routes (path, method, summary): every route, its parameters,
/// bodies, responses and links, as the features' `parts` describe them; `open(method, path)` says which take no
/// token.
pub fn document(
    documented: &[(&'static str, &'static str, &'static str)],
    parts: &[Part],
    open: &dyn Fn(&str, &str) -> bool,
) -> Value {
    let parts = Parts { parts, open };
    let mut paths = serde_json::Map::new();
    for (path, method, summary) in documented {
        let op = parts.operation(method, path, summary);
        if let Some(concrete) = parts.parts.iter().find_map(|p| (p.concrete)(method, path, &op)) {
            for (concrete, op) in concrete {
                paths.entry(concrete).or_insert_with(|| json!({}))[*method] = op;
            }
            continue;
        }
        paths.entry((*path).to_owned()).or_insert_with(|| json!({}))[*method] = op;
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
            "schemas": parts.schemas(),
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
}
