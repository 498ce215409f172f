//! The data source's public record: [`FileInfo`] (the `GET /v1/file` JSON) and its enums. The backing-image
//! manager deserializes the same types, so the camelCase keys and the kebab-case strings are an API.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// State of the file a data source prepares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FileState {
    /// Waiting for input (an upload source before its upload arrives).
    Pending,
    /// The job started; no data yet.
    Starting,
    /// Data is arriving, being converted or checksummed.
    InProgress,
    /// The file is complete and verified at `filePath`; a backing-image manager may take it.
    ReadyForTransfer,
    /// A backing-image manager took the file (`action=transfer`); it is no longer this server's.
    Ready,
    /// The job failed (see `message`); no file is left behind.
    Failed,
}

impl FileState {
    /// The API string (`in-progress`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FileState::Pending => "pending",
            FileState::Starting => "starting",
            FileState::InProgress => "in-progress",
            FileState::ReadyForTransfer => "ready-for-transfer",
            FileState::Ready => "ready",
            FileState::Failed => "failed",
        }
    }

    /// Ready, ready-for-transfer and failed do not change on their own any more.
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

/// Where the first copy of a backing image comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceType {
    /// Fetched from an HTTP(S) URL (`url`).
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

    /// The API string.
    pub fn as_str(self) -> &'static str {
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

/// `GET /v1/file`: everything known about the file being prepared.
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
