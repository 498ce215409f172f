//! The state of one backing-image file on this disk (ARCHITECTURE §9).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `pending` → `starting` → `in-progress` → `ready` | `failed`; `unknown` while a file (or the disk) cannot be
/// verified. `ready-for-transfer` is a data source's state for a finished file; a manager never reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FileState {
    Pending,
    Starting,
    InProgress,
    Ready,
    Failed,
    Unknown,
    ReadyForTransfer,
}

impl FileState {
    /// Every state, in lifecycle order.
    pub const ALL: [FileState; 7] = [
        FileState::Pending,
        FileState::Starting,
        FileState::InProgress,
        FileState::Ready,
        FileState::Failed,
        FileState::Unknown,
        FileState::ReadyForTransfer,
    ];

    /// The API string (`in-progress`).
    pub fn as_str(self) -> &'static str {
        match self {
            FileState::Pending => "pending",
            FileState::Starting => "starting",
            FileState::InProgress => "in-progress",
            FileState::Ready => "ready",
            FileState::Failed => "failed",
            FileState::Unknown => "unknown",
            FileState::ReadyForTransfer => "ready-for-transfer",
        }
    }

    /// No more change without a new request (or a check finding a modified file).
    pub fn is_final(self) -> bool {
        matches!(self, FileState::Ready | FileState::Failed)
    }
}

impl fmt::Display for FileState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FileState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FileState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown backing-image state {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_through_their_api_strings() {
        for st in FileState::ALL {
            assert_eq!(st.as_str().parse::<FileState>(), Ok(st));
            assert_eq!(serde_json::to_string(&st).unwrap(), format!("\"{st}\""));
        }
        assert_eq!(FileState::InProgress.as_str(), "in-progress");
        assert!("done".parse::<FileState>().is_err());
    }
}
