//! The OpenAPI side of the settings: the value each setting takes (checked by [`super::routes`] with the same
//! pattern the document shows), and one concrete path per setting in the document, since each takes its own kind
//! of value.

use serde_json::{Value, json};

use crate::api::openapi::{Concrete, Part, Shape, array_of, object, operation_id, regex, schema_ref};
use crate::error::ApiError;
use crate::model;

/// This feature's part of the document.
pub const PART: Part = Part {
    shape,
    schemas,
    path_param,
    concrete,
    ..Part::NONE
};

/// A setting's value: `true`/`false` for the boolean ones, a whole number (at most 19 digits) for the others,
/// 1 to 16 for the default number of copies of a backing image, a power of two from 4096 to 16777216 for
/// `backup-block-size`.
pub fn value_pattern(name: &str, default: &str) -> &'static str {
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

pub fn check_value(name: &str, default: &str, value: &str) -> Result<(), ApiError> {
    let pattern = value_pattern(name, default);
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

fn shape(method: &str, path: &str) -> Option<Shape> {
    Some(match (method, path) {
        ("get", "/v1/settings") => Shape::json(None, 200, Some(array_of("Setting"))),
        ("get", "/v1/settings/{setting}") => Shape::json(None, 200, Some(schema_ref("Setting"))),
        ("put", "/v1/settings/{setting}") => Shape::json(
            Some((object(&["value"], json!({"value": {"type": "string"}})), true)),
            200,
            Some(schema_ref("Setting")),
        ),
        _ => return None,
    })
}

fn schemas() -> Value {
    json!({
        "Setting": {
            "type": "object",
            "required": ["name", "value", "default", "description"],
            "properties": {
                "name": {"type": "string"}, "value": {"type": "string"}, "default": {"type": "string"},
                "description": {"type": "string"},
            }
        },
    })
}

fn path_param(p: &str) -> Option<Value> {
    let names: Vec<&str> = model::SETTINGS.iter().map(|s| s.0).collect();
    (p == "setting").then(|| json!({"type": "string", "enum": names}))
}

/// `/v1/settings/{setting}` as one path per setting, each with its description and (for `put`) its value's
/// pattern.
fn concrete(method: &str, path: &str, op: &Value) -> Option<Concrete> {
    if path != "/v1/settings/{setting}" {
        return None;
    }
    let mut out = Vec::new();
    for (name, default, description) in model::SETTINGS {
        let concrete = format!("/v1/settings/{name}");
        let mut op = op.clone();
        op["operationId"] = json!(operation_id(method, &concrete));
        op["parameters"] = json!([]);
        op["description"] = json!(description);
        if method == "put" {
            op["requestBody"]["content"]["application/json"]["schema"]["properties"]["value"] =
                json!({"type": "string", "pattern": value_pattern(name, default)});
        }
        out.push((concrete, op));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_patterns_accept_the_defaults() {
        for (name, default, _) in model::SETTINGS {
            check_value(name, default, default).unwrap();
        }
        assert!(check_value("x", "8", "+5").is_err());
        assert!(check_value("x", "true", "yes").is_err());
    }
}
