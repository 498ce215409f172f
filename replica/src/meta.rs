//! Replica metadata files: `volume.meta`, `<disk>.img.meta`, `<snapshot>.img.checksum`, and the crash-safe way
//! every one of them is written (temp file, fsync, rename, fsync of the directory).
//!
//! JSON keys are the Go field names Longhorn v1 uses, so a Longhorn replica directory can be adopted and a
//! Corral one read by Longhorn tools. Keys Longhorn does not know are ignored by its decoder.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use corral_disk::durable;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::error::{IoContext, ReplicaError, Result};

/// Contents of `volume.meta`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct VolumeInfo {
    /// Volume size in bytes.
    #[serde(default)]
    pub size: u64,
    /// File name of the writable head.
    #[serde(default)]
    pub head: String,
    /// Opened and not cleanly closed since.
    #[serde(default)]
    pub dirty: bool,
    /// A rebuild into this replica started and did not finish.
    #[serde(default)]
    pub rebuilding: bool,
    /// Non-empty when the replica was put in error.
    #[serde(default)]
    pub error: String,
    /// File name of the head's parent, "" when the head is the root.
    #[serde(default)]
    pub parent: String,
    /// Sector size reported to the engine.
    #[serde(default)]
    pub sector_size: u64,
    /// Absolute path of the backing file, "" without one. Refreshed on every open.
    #[serde(default)]
    pub backing_file_path: String,
    /// Encrypted volume (Longhorn key; Corral does not encrypt and refuses to open such a replica).
    #[serde(default)]
    pub encrypted: bool,
    /// Corral extension: the revision counter is not kept for this replica.
    #[serde(default)]
    pub revision_counter_disabled: bool,
}

/// Contents of `<disk>.img.meta`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiskMeta {
    /// File name of the disk (rewritten from the meta file name on load).
    #[serde(default)]
    pub name: String,
    /// Parent file name, "" for the root.
    #[serde(default)]
    pub parent: String,
    /// Marked for removal; data goes away at the next purge.
    #[serde(default)]
    pub removed: bool,
    /// Created by a user (as opposed to a system snapshot: rebuild, expansion).
    #[serde(default)]
    pub user_created: bool,
    /// RFC 3339 creation time.
    #[serde(default)]
    pub created: String,
    /// User labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Reads and parses a JSON metadata file; a missing file is `Ok(None)`, anything unparsable names the file.
pub fn load_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ReplicaError::io("read", path, e)),
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ReplicaError::CorruptMeta {
            path: path.to_owned(),
            reason: "file is empty".into(),
        });
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ReplicaError::CorruptMeta {
            path: path.to_owned(),
            reason: e.to_string(),
        })
}

/// Writes `value` as JSON to `dir/name` crash-safely: write `name.tmp`, fsync it, rename over `name`, fsync `dir`.
/// After a crash the file holds either the old or the new contents, never a mix.
pub fn write_json_atomic<T: Serialize>(dir: &Path, name: &str, value: &T) -> Result<()> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| ReplicaError::InvalidArgument(format!("cannot encode {name}: {e}")))?;
    let path = dir.join(name);
    durable::write_atomic(&path, &bytes).ctx("write crash-safely", &path)
}

/// fsyncs a directory so that renames, links and unlinks in it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    durable::sync_dir(dir).ctx("fsync directory", dir)
}

/// Removes a file if it exists.
pub fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ReplicaError::io("remove", path, e)),
    }
}

/// The current time as recorded in metadata (`Created` of a disk, `lastHashedAt` of a checksum).
pub(crate) fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_meta_uses_longhorn_keys() {
        let info = VolumeInfo {
            size: 4096,
            head: "volume-head-001.img".into(),
            ..Default::default()
        };
        let json = serde_json::to_string(&info).unwrap();
        assert!(
            json.contains("\"Size\":4096") && json.contains("\"Head\":\"volume-head-001.img\""),
            "{json}"
        );
        assert!(json.contains("\"BackingFilePath\""), "{json}");
        // Longhorn's own volume.meta parses.
        let lh = r#"{"Size":10737418240,"Head":"volume-head-002.img","Dirty":true,"Rebuilding":false,"Error":"","Parent":"volume-snap-a.img","SectorSize":512,"BackingFilePath":"","Encrypted":false}"#;
        let parsed: VolumeInfo = serde_json::from_str(lh).unwrap();
        assert_eq!(parsed.parent, "volume-snap-a.img");
        assert_eq!(parsed.size, 10_737_418_240);
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        write_json_atomic(
            dir.path(),
            "x.meta",
            &DiskMeta {
                parent: "a".into(),
                ..Default::default()
            },
        )
        .unwrap();
        write_json_atomic(
            dir.path(),
            "x.meta",
            &DiskMeta {
                parent: "b".into(),
                ..Default::default()
            },
        )
        .unwrap();
        let m: DiskMeta = load_json(&dir.path().join("x.meta")).unwrap().unwrap();
        assert_eq!(m.parent, "b");
        assert!(!dir.path().join("x.meta.tmp").exists());
    }

    #[test]
    fn corrupt_or_empty_meta_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.meta");
        fs::write(&p, b"{\"Size\": ").unwrap();
        let err = load_json::<VolumeInfo>(&p).unwrap_err().to_string();
        assert!(err.contains("volume.meta"), "{err}");
        fs::write(&p, b"").unwrap();
        let err = load_json::<VolumeInfo>(&p).unwrap_err().to_string();
        assert!(err.contains("volume.meta") && err.contains("empty"), "{err}");
    }
}
