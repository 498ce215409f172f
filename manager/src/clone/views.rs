//! The JSON shape of a clone as a volume shows it.

use serde::{Deserialize, Serialize};

/// A clone as users see it (the controller's bookkeeping left out).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloneStatusView {
    pub source_volume: String,
    pub snapshot: String,
    pub state: super::model::CloneState,
    pub progress: u32,
    pub message: String,
}

impl From<&super::model::VolumeClone> for CloneStatusView {
    fn from(c: &super::model::VolumeClone) -> Self {
        Self {
            source_volume: c.source_volume.clone(),
            snapshot: c.snapshot.clone(),
            state: c.state,
            progress: c.progress,
            message: c.message.clone(),
        }
    }
}
