//! The JSON shapes of the settings routes, shared by the server and the CLI.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingValue {
    pub value: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SettingView {
    pub name: String,
    pub value: String,
    pub default: String,
    pub description: String,
}
