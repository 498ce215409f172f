//! Volume capabilities Corral serves: one node at a time (a volume is attached to one node), as a raw block
//! device or an ext4/xfs file system.

use crate::error::{CsiError, CsiResult};
use crate::parameters::FS_TYPES;
use crate::proto::VolumeCapability;
use crate::proto::volume_capability::{AccessType, access_mode::Mode};

/// How a volume is used on its node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Block,
    /// `fs_type` empty: the StorageClass's or ext4.
    Mount {
        fs_type: String,
        flags: Vec<String>,
    },
}

/// A checked capability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    pub access: Access,
    pub read_only: bool,
}

pub fn check(cap: &VolumeCapability) -> CsiResult<Capability> {
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| CsiError::InvalidArgument("volume capability without access_mode".into()))?
        .mode();
    let read_only = match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => false,
        Mode::SingleNodeReaderOnly => true,
        other => {
            return Err(CsiError::InvalidArgument(format!(
                "access mode {} is not supported: a Corral volume is attached to one node at a time",
                other.as_str_name()
            )));
        }
    };
    let access = match &cap.access_type {
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => {
            if !m.fs_type.is_empty() && !FS_TYPES.contains(&m.fs_type.as_str()) {
                return Err(CsiError::InvalidArgument(format!(
                    "file system {:?} is not supported (ext4 or xfs)",
                    m.fs_type
                )));
            }
            Access::Mount {
                fs_type: m.fs_type.clone(),
                flags: m.mount_flags.clone(),
            }
        }
        None => {
            return Err(CsiError::InvalidArgument(
                "volume capability without access_type (block or mount)".into(),
            ));
        }
    };
    Ok(Capability { access, read_only })
}

/// Checks a required list of capabilities (CreateVolume, ValidateVolumeCapabilities).
pub fn check_all(caps: &[VolumeCapability]) -> CsiResult<Vec<Capability>> {
    if caps.is_empty() {
        return Err(CsiError::InvalidArgument(
            "volume_capabilities is required".into(),
        ));
    }
    caps.iter().map(check).collect()
}
