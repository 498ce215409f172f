//! The OpenAPI side of clones: the `dataSource` a volume is created from and the clone status it shows.

use serde_json::{Value, json};

use super::model::CloneState;
use crate::api::openapi::{names, nullable};

/// A clone's `dataSource`: `vol://NAME` or `snap://NAME/SNAPSHOT`, each name as
/// [`NAME_PATTERN`](crate::api::openapi::NAME_PATTERN) (a unit test holds the two together;
/// [`DataSource::parse`](super::model::DataSource::parse) checks each name with
/// [`check_name`](crate::api::openapi::check_name)).
pub const DATA_SOURCE_PATTERN: &str = "^(vol://[A-Za-z0-9][A-Za-z0-9._-]{0,199}|snap://[A-Za-z0-9][A-Za-z0-9._-]{0,199}/[A-Za-z0-9][A-Za-z0-9._-]{0,199})$";

fn states() -> Vec<Value> {
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

/// A volume's `cloneStatus` ([`super::views::CloneStatusView`]).
pub fn status_schema() -> Value {
    nullable(json!({
        "type": "object",
        "required": ["sourceVolume", "snapshot", "state", "progress", "message"],
        "properties": {
            "sourceVolume": {"type": "string"},
            "snapshot": {"type": "string"},
            "state": {"type": "string", "enum": states()},
            "progress": {"type": "integer", "minimum": 0, "maximum": 100},
            "message": {"type": "string"},
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openapi::{check_name, regex};

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
}
