//! A clone as a volume shows it: `corral_api::clone::CloneStatusView` (re-exported here), from the clone's record.

pub use corral_api::clone::CloneStatusView;

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
