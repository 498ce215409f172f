//! Backing-image wire types shared by the data source (`corral-datasource`), the backing-image manager
//! (`corral-bim`) and the control plane: the state of a backing-image file, and the data source's `GET /v1/file`
//! JSON. They are JSON (HTTP) and string fields of gRPC messages (`BimImageStatus.state`), not protobuf enums, so
//! the camelCase keys and the lower-case, dash-separated strings are the API.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// State of a backing-image file, on a data source or on a disk of a backing-image manager (ARCHITECTURE §10).
///
/// Data source: `pending` → `starting` → `in-progress` → `ready-for-transfer` → `ready` (a manager took the
/// file), or `failed`. Manager: `pending` → `starting` → `in-progress` → `ready` | `failed`, and `unknown` while a
/// file (or the disk) cannot be verified. A manager never reports `ready-for-transfer`; a data source never reports
/// `unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FileState {
    /// Waiting for input (an upload before it arrives; an image registered before its job starts).
    Pending,
    /// The job started; no data yet.
    Starting,
    /// Data is arriving, being converted or checksummed.
    InProgress,
    /// Data source: the file is complete and verified at `filePath`; a backing-image manager may take it.
    ReadyForTransfer,
    /// Manager: verified and served. Data source: a manager took the file; it is no longer the data source's.
    Ready,
    /// The job failed (see the message); its files are removed.
    Failed,
    /// Manager: the file or its disk cannot be verified right now; not served, files left alone.
    Unknown,
}

impl FileState {
    /// Every state, in lifecycle order.
    pub const ALL: [FileState; 7] = [
        FileState::Pending,
        FileState::Starting,
        FileState::InProgress,
        FileState::ReadyForTransfer,
        FileState::Ready,
        FileState::Failed,
        FileState::Unknown,
    ];

    /// The API string (`in-progress`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            FileState::Pending => "pending",
            FileState::Starting => "starting",
            FileState::InProgress => "in-progress",
            FileState::ReadyForTransfer => "ready-for-transfer",
            FileState::Ready => "ready",
            FileState::Failed => "failed",
            FileState::Unknown => "unknown",
        }
    }

    /// Ready, ready-for-transfer and failed do not change without a new request (or, on a manager, a check
    /// finding a modified file).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            FileState::ReadyForTransfer | FileState::Ready | FileState::Failed
        )
    }
}

impl fmt::Display for FileState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FileState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FileState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown backing-image state {s:?}"))
    }
}

/// Where the first copy of a backing image comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceType {
    /// Fetched from an HTTP(S) URL (`url`).
    #[default]
    Download,
    /// Sent by a client with `POST /v1/file?action=upload&size=N`.
    Upload,
    /// Received from a replica exporting a snapshot (`snapshot-name`, `sender-address`, `volume-size`, `file-type`).
    ExportFromVolume,
    /// Restored from a backup (`backup-url`).
    Restore,
    /// Copied from another backing image on the same disk (`backing-image`, `backing-image-uuid`).
    Clone,
}

impl SourceType {
    /// Every source type, in the order `--help` lists them.
    pub const ALL: [SourceType; 5] = [
        SourceType::Download,
        SourceType::Upload,
        SourceType::ExportFromVolume,
        SourceType::Restore,
        SourceType::Clone,
    ];

    /// Whether the source can produce the file again after every copy failed (an upload cannot: its data came
    /// from a client once).
    pub fn refetchable(self) -> bool {
        !matches!(self, SourceType::Upload)
    }

    /// The API string.
    pub const fn as_str(self) -> &'static str {
        match self {
            SourceType::Download => "download",
            SourceType::Upload => "upload",
            SourceType::ExportFromVolume => "export-from-volume",
            SourceType::Restore => "restore",
            SourceType::Clone => "clone",
        }
    }
}

impl fmt::Display for SourceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SourceType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        SourceType::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| {
                let known: Vec<_> = SourceType::ALL.iter().map(|t| t.as_str()).collect();
                format!("unknown source type {s:?}; expected one of {}", known.join(", "))
            })
    }
}

/// The `BackingImageManagerService` API this build speaks (`BimVersion.api_version` of its `corral-bim`).
pub const BIM_API_VERSION: u32 = 1;
/// The oldest API version a client may speak to this build's `corral-bim` (`BimVersion.api_min_version`).
pub const BIM_API_MIN_VERSION: u32 = 1;

/// Whether a `corral-bim` reporting `api_version` and `api_min_version` (its `VersionGet`) serves a client of this
/// build. A daemon that does not is of another version: the control plane must not ask it to fetch, sync or
/// delete files (it would lay them out or verify them differently); it stops it and starts its own `corral-bim`,
/// which adopts the files (seed 000, live upgrade).
pub fn bim_api_compatible(api_version: u32, api_min_version: u32) -> bool {
    api_min_version <= BIM_API_VERSION && BIM_API_VERSION <= api_version
}

/// A data source's `GET /v1/file`: everything known about the file being prepared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileInfo {
    /// Backing image name.
    pub name: String,
    /// Backing image uuid.
    pub uuid: String,
    pub source_type: SourceType,
    /// Source parameters as given (`url`, `size`, ...).
    pub parameters: BTreeMap<String, String>,
    /// The disk the file is on (from `corral-disk.cfg`).
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    /// Absolute path of the finished file (`<disk>/tmp/<name>-<uuid>`); it exists from `ready-for-transfer` on.
    pub file_path: String,
    /// Size of the file in bytes (0 while unknown).
    pub size: u64,
    /// Size of the disk the image describes (qcow2: its virtual size; raw: `size`).
    pub virtual_size: u64,
    /// Bytes allocated on disk (holes excluded).
    pub real_size: u64,
    pub state: FileState,
    /// Percent, 0–100.
    pub progress: u8,
    /// Bytes of source data received so far.
    pub processed_size: u64,
    /// SHA-512 (hex) the file must have; empty when none was given.
    pub expected_checksum: String,
    /// SHA-512 (hex) of the finished file; empty until computed.
    pub current_checksum: String,
    /// Why the job failed, or a note on what was done to the data.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bim_is_compatible_when_its_api_range_holds_ours() {
        let v = BIM_API_VERSION;
        for (api, min, ok) in [
            (v, BIM_API_MIN_VERSION, true),
            (v + 1, v, true),      // a newer daemon that still serves our version
            (v + 1, v + 1, false), // a newer daemon that dropped it
            (v - 1, 0, false),     // an older daemon that does not know our version
            (0, 0, false),         // reported nothing
        ] {
            assert_eq!(bim_api_compatible(api, min), ok, "api {api}, min {min}");
        }
    }

    #[test]
    fn states_round_trip_through_their_api_strings() {
        for st in FileState::ALL {
            assert_eq!(st.as_str().parse::<FileState>(), Ok(st));
            assert_eq!(serde_json::to_string(&st).unwrap(), format!("\"{st}\""));
            assert_eq!(
                serde_json::from_str::<FileState>(&format!("\"{st}\"")).unwrap(),
                st
            );
        }
        assert_eq!(FileState::InProgress.as_str(), "in-progress");
        assert_eq!(FileState::ReadyForTransfer.as_str(), "ready-for-transfer");
        assert!("done".parse::<FileState>().is_err());
        for t in SourceType::ALL {
            assert_eq!(t.as_str().parse::<SourceType>(), Ok(t));
            assert_eq!(serde_json::to_string(&t).unwrap(), format!("\"{t}\""));
        }
    }
}
