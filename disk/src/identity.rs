//! A Corral disk directory: its identity file, checked by every daemon that keeps files on a disk (data-source,
//! backing-image manager, manager), and the names allowed as path components in it. Files on it are written
//! with [`crate::durable`].
//!
//! `<disk>/corral-disk.cfg` holds `{"diskUUID": "..."}`. The manager writes it when a disk is added; every daemon
//! started on the disk gets the UUID on its command line and checks it, so a daemon pointed at the wrong directory
//! (or at a disk that was replaced under the same mount point) refuses to touch it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name of the identity file at the root of a disk directory.
pub const DISK_CONFIG_FILE: &str = "corral-disk.cfg";

/// The content of `corral-disk.cfg`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskConfig {
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
}

/// Why a disk directory cannot be trusted as the expected disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskIdentityError {
    /// `{path}` is missing: the directory is not an initialised Corral disk (or was unmounted)
    #[error(
        "{path} is missing: the directory is not an initialised Corral disk (or the disk is not mounted)"
    )]
    Missing { path: PathBuf },
    /// The file exists but cannot be read or parsed.
    #[error("cannot read disk identity {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    /// The file names another disk.
    #[error("{path} names disk {found}, expected {expected}: refusing to use another disk's directory")]
    Mismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
}

/// Reads `<dir>/corral-disk.cfg`.
pub fn read_disk_config(dir: &Path) -> Result<DiskConfig, DiskIdentityError> {
    let path = dir.join(DISK_CONFIG_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(DiskIdentityError::Missing { path }),
        Err(e) => {
            return Err(DiskIdentityError::Unreadable {
                path,
                reason: e.to_string(),
            });
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| DiskIdentityError::Unreadable {
        path,
        reason: e.to_string(),
    })
}

/// Checks that `<dir>/corral-disk.cfg` names `expected_uuid`.
pub fn verify_disk(dir: &Path, expected_uuid: &str) -> Result<(), DiskIdentityError> {
    let cfg = read_disk_config(dir)?;
    if cfg.disk_uuid == expected_uuid {
        Ok(())
    } else {
        Err(DiskIdentityError::Mismatch {
            path: dir.join(DISK_CONFIG_FILE),
            found: cfg.disk_uuid,
            expected: expected_uuid.to_owned(),
        })
    }
}

/// Writes `<dir>/corral-disk.cfg` naming `disk_uuid` (atomically, durable).
pub fn write_disk_config(dir: &Path, disk_uuid: &str) -> io::Result<()> {
    let cfg = DiskConfig {
        disk_uuid: disk_uuid.to_owned(),
    };
    let bytes = serde_json::to_vec_pretty(&cfg).map_err(io::Error::other)?;
    crate::durable::write_atomic(&dir.join(DISK_CONFIG_FILE), &bytes)
}

/// Checks a name that becomes one component of a path on disk (an image name, a uuid, a volume name): 1–200
/// bytes of ASCII letters, digits, `.`, `_` and `-`, starting with a letter or digit. Refuses `..`, `/`, NUL and
/// everything else that could leave the intended directory.
pub fn check_path_component(what: &str, value: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if value.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if value.len() > 200 {
        return Err(format!("{what} is longer than 200 bytes"));
    }
    if !value.starts_with(|c: char| c.is_ascii_alphanumeric()) || !value.chars().all(ok_char) {
        return Err(format!(
            "{what} {value:?} is not a valid name: use letters, digits, '.', '_' and '-', starting with a letter or digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_checked_against_the_expected_uuid() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            verify_disk(dir.path(), "a"),
            Err(DiskIdentityError::Missing { .. })
        ));
        write_disk_config(dir.path(), "disk-a").unwrap();
        verify_disk(dir.path(), "disk-a").unwrap();
        let err = verify_disk(dir.path(), "disk-b").unwrap_err().to_string();
        assert!(err.contains("disk-a") && err.contains("disk-b"), "{err}");
        let raw = fs::read_to_string(dir.path().join(DISK_CONFIG_FILE)).unwrap();
        assert!(raw.contains("\"diskUUID\""), "{raw}");
        assert!(!dir.path().join("corral-disk.cfg.tmp").exists());
        fs::write(dir.path().join(DISK_CONFIG_FILE), b"{").unwrap();
        assert!(matches!(
            verify_disk(dir.path(), "disk-a"),
            Err(DiskIdentityError::Unreadable { .. })
        ));
    }

    #[test]
    fn path_components_refuse_traversal() {
        for bad in [
            "",
            "..",
            ".",
            "../etc",
            "a/b",
            "a\0b",
            ".hidden",
            "-rf",
            "a b",
            &"x".repeat(201),
        ] {
            assert!(check_path_component("name", bad).is_err(), "{bad:?} accepted");
        }
        for good in ["ubuntu-22.04", "img_1", "0f6e9a4e-3b6c-4b53-9f0e-3f0f6b3f7a11"] {
            check_path_component("name", good).unwrap();
        }
    }
}
