//! The on-disk layout of a manager's disk (docs/formats.md, "Backing-image files"):
//!
//! ```text
//! <disk>/corral-disk.cfg                          disk identity ({"diskUUID": ...})
//! <disk>/tmp/<name>-<uuid>                        a data source's file (taken over by rename)
//! <disk>/backing-images/<name>-<uuid>/backing     the image, read-only once ready
//! <disk>/backing-images/<name>-<uuid>/backing.cfg BackingConfig (JSON), written atomically
//! <disk>/backing-images/<name>-<uuid>/backing.tmp the file while it is received or verified
//! ```
//!
//! Everything here is blocking file IO: callers run it on `spawn_blocking`.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use chrono::{DateTime, SecondsFormat, Utc};
use corral_disk::durable::{sync_parent_dir, write_atomic};
use serde::{Deserialize, Serialize};

/// Directory under the disk holding one directory per image.
pub const IMAGES_DIR: &str = "backing-images";
/// Directory under the disk where data sources prepare files.
pub const DATA_SOURCE_DIR: &str = "tmp";
/// The image file.
pub const BACKING_FILE: &str = "backing";
/// The image's config.
pub const CONFIG_FILE: &str = "backing.cfg";
/// The image while it is received or verified.
pub const TEMP_FILE: &str = "backing.tmp";

/// `backing.cfg`: what was verified about `backing`, so a restart can adopt it without hashing again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingConfig {
    pub name: String,
    pub uuid: String,
    /// Bytes of `backing`.
    pub size: u64,
    /// Size of the disk the image describes (qcow2 virtual size; = size for raw).
    pub virtual_size: u64,
    /// Allocated bytes of `backing` (`st_blocks × 512`).
    pub real_size: u64,
    /// SHA-512 the caller asked for (empty: none given).
    #[serde(default)]
    pub expected_checksum: String,
    /// SHA-512 of `backing` when it was verified.
    pub current_checksum: String,
    /// mtime of `backing` when it was verified (RFC 3339, UTC, nanoseconds): a different mtime means "re-verify".
    pub modification_time: String,
}

impl BackingConfig {
    /// The record of the file at `path` (whose `stat` is `facts`) verified to have SHA-512 `checksum`.
    pub fn verified(
        name: &str,
        uuid: &str,
        expected_checksum: &str,
        checksum: String,
        facts: FileFacts,
        path: &Path,
    ) -> Self {
        BackingConfig {
            name: name.to_owned(),
            uuid: uuid.to_owned(),
            size: facts.size,
            virtual_size: virtual_size(path, facts.size),
            real_size: facts.real_size,
            expected_checksum: expected_checksum.to_owned(),
            current_checksum: checksum,
            modification_time: facts.modification_time,
        }
    }
}

/// Paths of one image on a disk.
#[derive(Debug, Clone)]
pub struct ImagePaths {
    pub dir: PathBuf,
    pub backing: PathBuf,
    pub config: PathBuf,
    pub temp: PathBuf,
    /// sparse-sync's partial file of `temp` while a transfer runs.
    pub partial: PathBuf,
}

impl ImagePaths {
    /// `name` and `uuid` must have been checked with `check_path_component`.
    pub fn new(disk: &Path, name: &str, uuid: &str) -> Self {
        let dir = disk.join(IMAGES_DIR).join(dir_name(name, uuid));
        let temp = dir.join(TEMP_FILE);
        ImagePaths {
            backing: dir.join(BACKING_FILE),
            config: dir.join(CONFIG_FILE),
            partial: sparse_sync::receiver::partial_path(&temp),
            temp,
            dir,
        }
    }

    /// Removes the temporary files of an unfinished fetch or sync (never `backing` or `backing.cfg`).
    pub fn remove_temp_files(&self) -> io::Result<()> {
        let mut cfg_tmp = self.config.as_os_str().to_owned();
        cfg_tmp.push(".tmp");
        for p in [&self.temp, &self.partial, &PathBuf::from(cfg_tmp)] {
            remove_if_exists(p)?;
        }
        Ok(())
    }

    /// Removes everything of the image, then its directory.
    pub fn remove_all(&self) -> io::Result<()> {
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => sync_parent_dir(&self.dir),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Creates the image directory (and `backing-images/`) durably.
    pub fn create_dir(&self) -> io::Result<()> {
        fs::create_dir_all(&self.dir)?;
        sync_parent_dir(&self.dir)
    }
}

/// `<name>-<uuid>`.
pub fn dir_name(name: &str, uuid: &str) -> String {
    format!("{name}-{uuid}")
}

/// Where a data source of this disk keeps the file of `name`/`uuid`.
pub fn data_source_file(disk: &Path, name: &str, uuid: &str) -> PathBuf {
    disk.join(DATA_SOURCE_DIR).join(dir_name(name, uuid))
}

/// Removes `path`; a missing file is fine.
pub fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// The mtime as `backing.cfg` records it.
pub fn format_mtime(t: SystemTime) -> String {
    DateTime::<Utc>::from(t).to_rfc3339_opts(SecondsFormat::Nanos, true)
}

/// What `stat` says about a file, in the terms `backing.cfg` uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFacts {
    pub size: u64,
    pub real_size: u64,
    pub modification_time: String,
    pub inode: u64,
}

/// Stats `path`; `Ok(None)` when it does not exist.
pub fn facts(path: &Path) -> io::Result<Option<FileFacts>> {
    let md = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !md.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(Some(FileFacts {
        size: md.len(),
        real_size: md.blocks() * 512,
        modification_time: format_mtime(md.modified()?),
        inode: md.ino(),
    }))
}

/// Reads `backing.cfg`; `Ok(None)` when it does not exist.
pub fn read_config(path: &Path) -> io::Result<Option<BackingConfig>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))
}

/// Writes `backing.cfg` atomically and durably.
pub fn write_config(path: &Path, cfg: &BackingConfig) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(cfg).map_err(io::Error::other)?;
    write_atomic(path, &bytes)
}

/// Size of the disk an image describes (`disk_image::probe`: a qcow2 header's virtual size); `size` when the
/// file cannot be probed (a raw file is its own size anyway).
pub fn virtual_size(path: &Path, size: u64) -> u64 {
    disk_image::probe(path).map_or(size, |i| i.virtual_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_round_trips_with_longhorn_field_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(CONFIG_FILE);
        assert_eq!(read_config(&p).unwrap(), None);
        let cfg = BackingConfig {
            name: "img".into(),
            uuid: "u1".into(),
            size: 4096,
            virtual_size: 4096,
            real_size: 0,
            expected_checksum: String::new(),
            current_checksum: "ab".into(),
            modification_time: format_mtime(SystemTime::UNIX_EPOCH),
        };
        write_config(&p, &cfg).unwrap();
        let raw = fs::read_to_string(&p).unwrap();
        for key in [
            "virtualSize",
            "realSize",
            "expectedChecksum",
            "currentChecksum",
            "modificationTime",
        ] {
            assert!(raw.contains(key), "{key} missing in {raw}");
        }
        assert_eq!(read_config(&p).unwrap(), Some(cfg));
        fs::write(&p, b"{").unwrap();
        assert!(read_config(&p).is_err());
    }

    #[test]
    fn image_paths_stay_inside_the_disk() {
        let p = ImagePaths::new(Path::new("/d"), "img", "u1");
        assert_eq!(p.backing, Path::new("/d/backing-images/img-u1/backing"));
        assert_eq!(
            p.partial,
            Path::new("/d/backing-images/img-u1/backing.tmp.sync-partial")
        );
        assert_eq!(
            data_source_file(Path::new("/d"), "img", "u1"),
            Path::new("/d/tmp/img-u1")
        );
    }
}
