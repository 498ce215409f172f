//! The data source's public record: [`FileInfo`] (the `GET /v1/file` JSON) with [`FileState`] and [`SourceType`]
//! live in `corral_proto::backing_image`, shared with the backing-image manager without it depending on this
//! crate; [`DataEngine`] is the data source's own flag.

pub use corral_proto::backing_image::{FileInfo, FileState, SourceType};

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The data engine the image is prepared for: v2 needs raw images (qcow2 sources are converted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataEngine {
    #[default]
    V1,
    V2,
}

impl FromStr for DataEngine {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" => Ok(DataEngine::V1),
            "v2" => Ok(DataEngine::V2),
            _ => Err(format!("unknown data engine {s:?}; expected v1 or v2")),
        }
    }
}
