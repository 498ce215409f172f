//! Recorded whole-file checksums (`<file>.checksum`), the basis of whole-file skip ("fast rebuild").
//!
//! A record holds a checksum and the file's ctime when it was taken; it is valid only while the ctime is
//! unchanged, since any write, truncate, rename or attribute change moves the ctime. The JSON keys are Longhorn's
//! (`method`, `checksum`, `change_time`, `last_hashed_at`, `silently_corrupted`).

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::plan::{DEFAULT_BATCH_SIZE, Work, plan};
use crate::wire::FileChecksum;
use corral_disk::sparse::{SparseRead, read_ranges};

/// Method name of [`content_checksum`].
pub const CONTENT_CHECKSUM_METHOD: &str = "xxh3-128-layout";

/// Errors reading or writing a checksum record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The file or its record could not be read or written.
    #[error("checksum record {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// The record is not valid JSON of the expected shape.
    #[error("checksum record {path} is malformed: {source}")]
    Malformed {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// The JSON stored in `<file>.checksum`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChecksumRecord {
    pub method: String,
    pub checksum: String,
    /// The file's ctime when the checksum was recorded, `seconds.nanoseconds`.
    pub change_time: String,
    #[serde(default)]
    pub last_hashed_at: String,
    #[serde(default)]
    pub silently_corrupted: bool,
}

/// Path of the record beside `file`.
pub fn record_path(file: &Path) -> PathBuf {
    let mut s = file.as_os_str().to_owned();
    s.push(".checksum");
    PathBuf::from(s)
}

/// The file's ctime as recorded.
pub fn change_time(file: &Path) -> io::Result<String> {
    let m = std::fs::metadata(file)?;
    Ok(format!("{}.{:09}", m.ctime(), m.ctime_nsec()))
}

/// The recorded checksum of `file` if a record exists and the file's ctime still equals the recorded one.
pub fn read_valid(file: &Path) -> Result<Option<FileChecksum>, RecordError> {
    let path = record_path(file);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(RecordError::Io { path, source }),
    };
    let record: ChecksumRecord = serde_json::from_slice(&text).map_err(|source| RecordError::Malformed {
        path: path.clone(),
        source,
    })?;
    let now = match change_time(file) {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(RecordError::Io {
                path: file.to_path_buf(),
                source,
            });
        }
    };
    if record.change_time != now || record.silently_corrupted {
        return Ok(None);
    }
    Ok(Some(FileChecksum {
        method: record.method,
        checksum: record.checksum,
    }))
}

/// Records `sum` for `file` with the file's current ctime (write temp, fsync, rename, fsync dir).
pub fn write_record(file: &Path, sum: &FileChecksum) -> Result<(), RecordError> {
    let path = record_path(file);
    let io_err = |source| RecordError::Io {
        path: path.clone(),
        source,
    };
    let record = ChecksumRecord {
        method: sum.method.clone(),
        checksum: sum.checksum.clone(),
        change_time: change_time(file).map_err(|source| RecordError::Io {
            path: file.to_path_buf(),
            source,
        })?,
        last_hashed_at: format!(
            "{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        ),
        silently_corrupted: false,
    };
    let json = serde_json::to_vec(&record).map_err(|source| RecordError::Malformed {
        path: path.clone(),
        source,
    })?;
    corral_disk::durable::write_atomic(&path, &json).map_err(io_err)
}

/// Removes the record beside `file`, if any.
pub fn remove_record(file: &Path) -> io::Result<()> {
    match std::fs::remove_file(record_path(file)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Checksum of a source's content *and* layout ([`CONTENT_CHECKSUM_METHOD`]): xxh3-128 over each data range's
/// offsets and bytes plus the size, so two files with equal bytes but different holes differ. Reads only data.
pub fn content_checksum(src: &dyn SparseRead, cancel: &CancellationToken) -> io::Result<FileChecksum> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&src.size().to_le_bytes());
    let (mut buf, mut scratch) = (Vec::new(), Vec::new());
    plan(
        src,
        DEFAULT_BATCH_SIZE,
        |work| {
            if cancel.is_cancelled() {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "cancelled"));
            }
            if let Work::Data { ranges, .. } = work {
                buf.clear();
                read_ranges(src, &ranges, &mut buf, &mut scratch)?;
                for r in &ranges {
                    hasher.update(&r.start.to_le_bytes());
                    hasher.update(&r.end.to_le_bytes());
                }
                hasher.update(&buf);
            }
            Ok(())
        },
        |e| e,
    )?;
    Ok(FileChecksum {
        method: CONTENT_CHECKSUM_METHOD.into(),
        checksum: format!("{:032x}", hasher.digest128()),
    })
}
