//! The enums and documents the views embed: a volume's data engine, frontend, state and robustness, a process's
//! state, a node's removed orphans, and the snapshot document (shown as it is stored).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The data engine of a volume, its replicas and the disks they go on (issue 20).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataEngine {
    /// One `corral-replica` process per replica, its data in files under the disk directory.
    #[default]
    V1,
    /// Replicas as lvol chains in the disk's lvstore, one `corral-replica serve-lvstore` per disk.
    V2,
}

impl DataEngine {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        }
    }
}

impl std::fmt::Display for DataEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DataEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" => Ok(Self::V1),
            "v2" => Ok(Self::V2),
            _ => Err(format!("unknown data engine {s:?}: v1 or v2")),
        }
    }
}

/// A stale daemon or replica data a node's manager removed after the store showed nobody used it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrphanRemoved {
    /// `replica-process`, `replica-data` or `engine-process`.
    pub kind: String,
    /// The replica's or the engine's (its volume's) name.
    pub name: String,
    /// Why it was stale, and what was removed (pid, path).
    pub detail: String,
    /// Unix seconds.
    pub at: i64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Frontend {
    #[default]
    Nbd,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeState {
    #[default]
    Detached,
    Attaching,
    Attached,
    Detaching,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Robustness {
    #[default]
    Unknown,
    Healthy,
    Degraded,
    Faulted,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DesireState {
    #[default]
    Stopped,
    Running,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProcessState {
    #[default]
    Stopped,
    Starting,
    Running,
    /// Exited unexpectedly; restarted with backoff.
    Crashed,
}

/// A snapshot as last observed through the volume's engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub volume: String,
    pub name: String,
    pub parent: String,
    pub children: Vec<String>,
    pub created: String,
    pub size: u64,
    pub removed: bool,
    pub user_created: bool,
    pub labels: BTreeMap<String, String>,
}
