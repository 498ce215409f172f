//! The stored token: its role and the SHA-256 of its secret, never the secret.

use serde::{Deserialize, Serialize};

use crate::store::Resource;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// GET only.
    Viewer,
    /// Volumes, snapshots, backups, jobs, clones and backing images; no settings, backup targets, tokens, nodes.
    Operator,
    /// Everything.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A bearer token in the store (kind `token`, named by the name it was created with).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Token {
    pub role: Role,
    /// Lower-case hex SHA-256 of the token's text.
    pub sha256: String,
    /// RFC 3339.
    pub created: String,
    /// RFC 3339 of the last request it authenticated (updated at most once a minute); empty: never used.
    #[serde(default)]
    pub last_used: String,
}

impl Resource for Token {
    const KIND: &'static str = "token";
}
