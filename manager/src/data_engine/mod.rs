//! What differs between the two data engines in the control plane, in one place (issue 44 item 2): where a
//! replica's data goes on its disk, whether replicas run as processes of their own (v1) or live in their disk's
//! lvstore served by its `serve-lvstore` daemon (v2), what a disk holds and can hold ([`device`] for a v2 disk's
//! store device), and what a new disk or volume of the engine must satisfy. Callers ask [`Strategy`] instead of
//! matching on [`DataEngine`]; the v2 machinery (its daemons, replica hosting) lives in [`crate::v2`], what v2
//! cannot do yet in [`crate::v2::support`].

pub mod device;

use std::path::{Path, PathBuf};

use crate::error::ApiError;
use crate::model::DataEngine;
use device::Probe;

/// Largest `lvstoreSize`: 64 TiB.
pub const MAX_LVSTORE_SIZE: u64 = 64 << 40;

/// The per-engine rules, asked of a volume's, replica's or disk's [`DataEngine`].
pub trait Strategy: Copy {
    /// Replicas live in their disk's lvstore, hosted by the disk's `serve-lvstore` daemon (no process of their
    /// own), and the disk holds that lvstore; else each replica is a `corral-replica` process over its own
    /// directory.
    fn in_lvstore(self) -> bool;

    /// The `dataPath` of replica `replica` on the disk at `disk`: its directory under the disk's replica
    /// directory, or its lvol in the disk's store device.
    fn replica_data_path(self, disk: &Path, replica: &str) -> PathBuf;

    /// The directory of the disk at `disk` that holds its replicas' directories; None when they are lvols.
    fn replicas_dir(self, disk: &Path) -> Option<PathBuf>;

    /// What the disk at `disk` can hold, (maximum, available) bytes: its file system's size and free space, or its
    /// store device's size (not made yet: `lvstore_size`, 0 for the default) — what a thin store still holds free
    /// is its daemon's to say. Err: why nothing can be placed there (a device holding foreign data).
    fn disk_capacity(self, disk: &Path, lvstore_size: u64) -> Result<(u64, u64), String>;

    /// Checks a disk to add (`lvstoreSize`, `path`), and on this host (`local`) that a v2 disk's store device is
    /// usable (an lvstore, or nothing yet: never foreign data). Returns the store size to record (0: the default).
    fn check_new_disk(self, lvstore_size: Option<u64>, path: &str, local: bool) -> Result<u64, ApiError>;

    /// Checks the name of a new volume of this engine.
    fn check_volume_name(self, name: &str) -> Result<(), ApiError>;
}

impl Strategy for DataEngine {
    fn in_lvstore(self) -> bool {
        match self {
            Self::V1 => false,
            Self::V2 => true,
        }
    }

    fn replica_data_path(self, disk: &Path, replica: &str) -> PathBuf {
        match self {
            Self::V1 => disk.join("replicas").join(replica),
            Self::V2 => device::device_path(disk).with_extension(format!("img#{replica}")),
        }
    }

    fn replicas_dir(self, disk: &Path) -> Option<PathBuf> {
        match self {
            Self::V1 => Some(disk.join("replicas")),
            Self::V2 => None,
        }
    }

    fn disk_capacity(self, disk: &Path, lvstore_size: u64) -> Result<(u64, u64), String> {
        match self {
            Self::V1 => {
                let v = nix::sys::statvfs::statvfs(disk)
                    .map_err(|e| format!("statvfs {}: {e}", disk.display()))?;
                let frag = v.fragment_size();
                Ok((
                    v.blocks().saturating_mul(frag),
                    v.blocks_available().saturating_mul(frag),
                ))
            }
            Self::V2 => {
                let dev = device::device_path(disk);
                if let Probe::Foreign(why) = device::probe(&dev) {
                    return Err(why);
                }
                // A thin store: what it can hold is its size (not yet created: the size it will be created with).
                let max = device::device_bytes(&dev).unwrap_or(if lvstore_size == 0 {
                    device::DEFAULT_SIZE
                } else {
                    lvstore_size
                });
                Ok((max, max)) // available: until its daemon answers
            }
        }
    }

    fn check_new_disk(self, lvstore_size: Option<u64>, path: &str, local: bool) -> Result<u64, ApiError> {
        if self == Self::V1 {
            if lvstore_size.is_some() {
                return Err(ApiError::Invalid(
                    "lvstoreSize is for v2 disks (--disk-engine v2)".into(),
                ));
            }
            return Ok(0);
        }
        let size = lvstore_size.unwrap_or(0);
        if lvstore_size.is_some()
            && (!(device::MIN_SIZE..=MAX_LVSTORE_SIZE).contains(&size)
                || !size.is_multiple_of(device::SIZE_MULTIPLE))
        {
            return Err(ApiError::Invalid(format!(
                "lvstoreSize {size} is not a whole number of MiB from {} to {MAX_LVSTORE_SIZE}",
                device::MIN_SIZE
            )));
        }
        if local {
            let dir = Path::new(path);
            if dir.exists() && !dir.is_dir() {
                return Err(ApiError::Conflict(format!(
                    "{path} is not a directory: a v2 disk is a directory holding its store device {}",
                    device::DEVICE_FILE
                )));
            }
            if let Probe::Foreign(why) = device::probe(&device::device_path(dir)) {
                return Err(ApiError::Conflict(why));
            }
        }
        Ok(size)
    }

    fn check_volume_name(self, name: &str) -> Result<(), ApiError> {
        if self.in_lvstore() && name.contains('.') {
            return Err(ApiError::Invalid(format!(
                "volume name {name:?}: a v2 volume's name holds no '.' (its replicas are lvols named after it)"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v2_volume_name_holds_no_dot_and_a_v1_name_may() {
        let err = DataEngine::V2.check_volume_name("H.").unwrap_err();
        assert!(
            matches!(&err, ApiError::Invalid(m) if m.contains("holds no '.'")),
            "{err:?}"
        );
        DataEngine::V2.check_volume_name("vol-1").unwrap();
        DataEngine::V1.check_volume_name("H.").unwrap();
    }
}
