//! The OpenAPI side of the token routes: their shapes and schemas, merged into the document as [`PART`] by
//! `crate::server::routes`.

use serde_json::{Value, json};

use crate::api::openapi::{Part, Shape, name_schema};

/// This feature's part of the document.
pub const PART: Part = Part {
    shape: |method, path| {
        shape(method, path).map(|(body, status, response)| Shape::json(body, status, response))
    },
    schemas: || schemas(&name_schema()),
    ..Part::NONE
};

/// The OpenAPI shape of these routes: (request body, required), success status, response.
#[allow(clippy::type_complexity)]
pub fn shape(method: &str, path: &str) -> Option<(Option<(Value, bool)>, u16, Option<Value>)> {
    let r = |n: &str| json!({"$ref": format!("#/components/schemas/{n}")});
    Some(match (method, path) {
        ("get", "/v1/tokens") => (None, 200, Some(json!({"type": "array", "items": r("Token")}))),
        ("post", "/v1/tokens") => (Some((r("TokenCreate"), true)), 201, Some(r("TokenCreated"))),
        ("delete", "/v1/tokens/{token}") => (None, 204, None),
        _ => return None,
    })
}

/// The schemas of these routes, merged into the document's components.
pub fn schemas(name_schema: &Value) -> Value {
    let roles = json!({"type": "string", "enum": ["admin", "operator", "viewer"]});
    let view = json!({
        "name": {"type": "string"}, "role": roles, "created": {"type": "string"},
        "lastUsed": {"type": "string", "description": "RFC 3339; empty: never used"},
    });
    let mut created = view.clone();
    created["token"] = json!({"type": "string", "description": "The secret: shown this once, never again"});
    json!({
        "TokenCreate": {
            "type": "object", "additionalProperties": false, "required": ["name", "role"],
            "properties": {"name": name_schema, "role": roles},
        },
        "Token": {"type": "object", "required": ["name", "role", "created", "lastUsed"], "properties": view},
        "TokenCreated": {
            "type": "object", "required": ["name", "role", "created", "lastUsed", "token"], "properties": created,
        },
    })
}
