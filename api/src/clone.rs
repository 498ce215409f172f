//! A clone as a volume shows it.

use serde::{Deserialize, Serialize};

/// initiated → copying → completed | failed. A failed clone stays failed (its target holds partial data and is
/// never served): delete the volume and create it again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CloneState {
    #[default]
    Initiated,
    Copying,
    Completed,
    Failed,
}

impl CloneState {
    /// Still running: the target may not be attached for IO, the source may not be deleted.
    pub fn active(self) -> bool {
        matches!(self, Self::Initiated | Self::Copying)
    }
}

/// A clone as users see it (the controller's bookkeeping left out).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloneStatusView {
    pub source_volume: String,
    pub snapshot: String,
    pub state: CloneState,
    pub progress: u32,
    pub message: String,
}
