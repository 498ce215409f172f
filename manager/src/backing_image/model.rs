//! The three backing-image resources (seed 000, "Design"): a `BackingImage` (what the user asked for and what the
//! cluster holds of it), its `BackingImageDataSource` (the daemon that prepares the first copy) and one
//! `BackingImageManager` per disk (the `corral-bim` that owns the files on that disk).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{DataEngine, ProcessRecord};
use crate::store::Resource;

/// Where the first copy of an image comes from, and the state of a file: the types `corral-datasource` and
/// `corral-bim` report, defined once in `corral-proto`.
pub use corral_proto::backing_image::{FileState, SourceType};

/// The [`FileState`]s by their short names (`ready-for-transfer` is the data source's finished file before a
/// manager took it). A copy's state is a [`FileState`] in the store and the API, spelled as the daemons spell it;
/// a daemon's state string is parsed once where the manager reads it ([`file_state`]).
pub mod state {
    use super::FileState;

    pub const PENDING: FileState = FileState::Pending;
    pub const STARTING: FileState = FileState::Starting;
    pub const IN_PROGRESS: FileState = FileState::InProgress;
    pub const READY_FOR_TRANSFER: FileState = FileState::ReadyForTransfer;
    pub const READY: FileState = FileState::Ready;
    pub const FAILED: FileState = FileState::Failed;
    pub const UNKNOWN: FileState = FileState::Unknown;
}

/// The state of a disk's manager (its `corral-bim`), not of a file: `running` (its daemon answers), `starting`
/// (just started, addresses not known yet), `unknown` (the disk is not ready or is another disk, or an
/// incompatible daemon is being replaced); `stopped` and `error` are read back but not set by this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ManagerState {
    Running,
    Starting,
    Stopped,
    Unknown,
    Error,
}

impl ManagerState {
    pub const ALL: [ManagerState; 5] = [
        Self::Running,
        Self::Starting,
        Self::Stopped,
        Self::Unknown,
        Self::Error,
    ];

    /// The store's text (`running`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Starting => "starting",
            Self::Stopped => "stopped",
            Self::Unknown => "unknown",
            Self::Error => "error",
        }
    }
}

/// A state kept as its text in the store and the API: [`FileState`], [`ManagerState`].
pub(crate) trait StateText: Copy + Sized {
    fn as_text(self) -> &'static str;
    /// The state of `text`; text this build does not know reads as the type's `unknown`.
    fn from_text(text: &str) -> Self;
}

impl StateText for FileState {
    fn as_text(self) -> &'static str {
        self.as_str()
    }

    fn from_text(text: &str) -> Self {
        file_state(text)
    }
}

impl StateText for ManagerState {
    fn as_text(self) -> &'static str {
        self.as_str()
    }

    fn from_text(text: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|s| s.as_str() == text)
            .unwrap_or(Self::Unknown)
    }
}

/// A file or copy state a daemon reports, or a store document holds: a state this build does not know (a newer
/// daemon's) reads as `unknown` — not served, nothing deleted — rather than failing the whole report or document.
pub fn file_state(s: &str) -> FileState {
    s.parse().unwrap_or(FileState::Unknown)
}

/// Serde for a state: its text, read with [`StateText::from_text`].
pub(crate) mod file_state_serde {
    use serde::{Deserialize, Deserializer};

    use super::StateText;

    pub fn deserialize<'de, D: Deserializer<'de>, T: StateText>(d: D) -> Result<T, D::Error> {
        Ok(T::from_text(&String::deserialize(d)?))
    }
}

/// Serde for a state that may not be there yet (`v2FirstCopyStatus` before the first copy starts, a data source's
/// state before its daemon reports, a disk manager's before it is started): empty text, else the state.
pub(crate) mod optional_state_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::StateText;

    // serde's `with` hands the field by reference.
    #[allow(clippy::ref_option)]
    pub fn serialize<S: Serializer, T: StateText>(st: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(st.map_or("", T::as_text))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: StateText>(d: D) -> Result<Option<T>, D::Error> {
        let text = String::deserialize(d)?;
        Ok((!text.is_empty()).then(|| T::from_text(&text)))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImage {
    pub spec: BackingImageSpec,
    pub status: BackingImageStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageSpec {
    /// Generated at creation and stored with the first write: the work directories are `<name>-<uuid>`, so a
    /// re-created image of the same name never meets the old one's leftovers.
    pub uuid: String,
    pub source_type: SourceType,
    /// download: `url`; export-from-volume: `volume`, `snapshot`, `exportType`; restore: `backupURL`; clone:
    /// `backingImage`.
    pub parameters: BTreeMap<String, String>,
    /// SHA-512 (lower-case hex) the file must have; empty = whatever arrives.
    pub expected_checksum: String,
    pub min_number_of_copies: u32,
    /// Disk names copies may be placed on (empty = any); replicas' disks always get a copy.
    #[serde(default)]
    pub disk_selector: Vec<String>,
    /// Nodes copies may be placed on (empty = any).
    #[serde(default)]
    pub node_selector: Vec<String>,
    /// Disk UUID → the disk must hold a copy (replicas use it, the data source is there, or HA needs it).
    pub disk_file_spec_map: BTreeMap<String, DiskFileSpec>,
    /// `v1`: files managed by `corral-bim`; `v2`: snapshot lvols in v2 disks' stores (issue 21; the v1 file is
    /// only the first copy's source). Records written before issue 21 read as `v1`.
    #[serde(default)]
    pub data_engine: DataEngine,
    /// Unix seconds the user asked for deletion; the image goes once every file is removed.
    pub deletion_timestamp: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskFileSpec {
    /// Node of the disk.
    pub node_id: String,
    /// The engine of the copy on the disk (a v2 image's first v1 file is `v1`).
    #[serde(default)]
    pub data_engine: DataEngine,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageStatus {
    /// Bytes of the file.
    pub size: u64,
    /// Size of the disk the image holds (qcow2 header; raw: the size). A volume must be at least this large.
    pub virtual_size: u64,
    /// SHA-512 of the first verified copy.
    pub current_checksum: String,
    /// Disk UUID → what is on that disk.
    pub disk_file_status_map: BTreeMap<String, DiskFileStatus>,
    /// Disk UUID → unix seconds since no replica uses the file there (cleanup after the wait interval).
    pub disk_last_ref_at_map: BTreeMap<String, i64>,
    pub message: String,
    /// v2 images: the first v2 copy, made from the prepared v1 file: `pending` → `in-progress` → `ready` |
    /// `failed` | `unknown` (a failed or unknown one is deleted and retried from `pending` with backoff); None
    /// (empty text) before it starts.
    #[serde(default, with = "optional_state_serde")]
    pub v2_first_copy_status: Option<FileState>,
    /// v2 images: the disk UUID the first v2 copy is made on.
    #[serde(default)]
    pub v2_first_copy_disk: String,
    /// v2 images: why the first v2 copy waits or failed (empty once it is ready).
    #[serde(default)]
    pub v2_first_copy_message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskFileStatus {
    /// pending | starting | in-progress | ready-for-transfer | ready | failed | unknown
    #[serde(deserialize_with = "file_state_serde::deserialize")]
    pub state: FileState,
    pub progress: u32,
    pub message: String,
    pub node_id: String,
    /// `v2`: the copy is a snapshot lvol, [`v2_copy`](Self::v2_copy) its daemon's last report.
    #[serde(default)]
    pub data_engine: DataEngine,
    /// v2 copies: seed 001's `BackingImageV2CopyInfo` (`super::v2_copy::copy_status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v2_copy: Option<V2CopyInfo>,
}

impl Default for DiskFileStatus {
    fn default() -> Self {
        Self {
            state: FileState::Pending,
            progress: 0,
            message: String::new(),
            node_id: String::new(),
            data_engine: DataEngine::default(),
            v2_copy: None,
        }
    }
}

impl Resource for BackingImage {
    const KIND: &'static str = "backingimage";
}

/// One per image, same name: the first copy's preparation on one disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageDataSource {
    pub spec: DataSourceSpec,
    pub status: DataSourceStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataSourceSpec {
    pub uuid: String,
    pub node_id: String,
    pub disk_uuid: String,
    pub disk_path: String,
    pub source_type: SourceType,
    /// The `--param` pairs of `corral-datasource` (already translated from the image's parameters).
    pub parameters: BTreeMap<String, String>,
    pub expected_checksum: String,
    /// A manager took the file: the daemon is stopped and the document only waits for the image's deletion.
    pub started: bool,
    /// Bumped to run the source again (all copies failed): the node restarts its daemon.
    pub generation: u32,
    /// restore: the configured backup target the backup URL points into (its credentials go to the daemon in a
    /// file); empty when no configured target matches the URL.
    #[serde(default)]
    pub backup_target: String,
    /// The image's engine: for `v2` the data source converts a qcow2 to raw, so the prepared file is what a v2
    /// copy (an lvol) holds byte for byte.
    #[serde(default)]
    pub data_engine: DataEngine,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataSourceStatus {
    /// Its daemon's last report (None, empty text: none yet).
    #[serde(with = "optional_state_serde")]
    pub state: Option<FileState>,
    pub progress: u32,
    pub message: String,
    pub size: u64,
    pub virtual_size: u64,
    pub current_checksum: String,
    /// HOST:PORT of the data source's HTTP API while it runs.
    pub address: String,
    pub process: Option<ProcessRecord>,
    /// The `generation` the running (or last) daemon was started for.
    pub generation: u32,
    /// Consecutive failed polls of the running daemon.
    pub poll_failures: u32,
    /// Starts of the daemon for this generation (download retries back off by it).
    pub attempts: u32,
}

impl Resource for BackingImageDataSource {
    const KIND: &'static str = "backingimagedatasource";
}

/// One per disk (`bim-<disk UUID>`): the `corral-bim` of that disk and the images it must hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageManager {
    pub spec: ManagerSpec,
    pub status: ManagerStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagerSpec {
    pub node_id: String,
    pub disk_name: String,
    pub disk_uuid: String,
    pub disk_path: String,
    /// Image name → image UUID.
    pub backing_images: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagerStatus {
    /// None (empty text) until the controller first looks at the disk.
    #[serde(with = "optional_state_serde")]
    pub state: Option<ManagerState>,
    pub message: String,
    pub process: Option<ProcessRecord>,
    /// gRPC HOST:PORT (`BackingImageManagerService`).
    pub address: String,
    /// HTTP HOST:PORT (downloads).
    pub http_address: String,
    /// Image name → the file as the daemon reports it.
    pub files: BTreeMap<String, ManagerFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagerFile {
    pub uuid: String,
    #[serde(deserialize_with = "file_state_serde::deserialize")]
    pub state: FileState,
    pub progress: u32,
    pub message: String,
    pub size: u64,
    pub virtual_size: u64,
    pub current_checksum: String,
    /// The `backing` file: a replica's `--backing-file`.
    pub path: String,
    /// Sends running from this copy.
    pub sending_reference: u32,
    /// gRPC address of the manager this copy is synced from (while in progress).
    pub sender_address: String,
}

impl Default for ManagerFile {
    fn default() -> Self {
        Self {
            uuid: String::new(),
            state: FileState::Pending,
            progress: 0,
            message: String::new(),
            size: 0,
            virtual_size: 0,
            current_checksum: String::new(),
            path: String::new(),
            sending_reference: 0,
            sender_address: String::new(),
        }
    }
}

impl Resource for BackingImageManager {
    const KIND: &'static str = "backingimagemanager";
}

/// The document name of a disk's manager.
pub fn manager_name(disk_uuid: &str) -> String {
    format!("bim-{disk_uuid}")
}

/// Seed 001's `BackingImageV2CopyInfo`: one disk's copy as its daemon reported it last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct V2CopyInfo {
    pub name: String,
    pub uuid: String,
    /// The store's UUID (the disk's `diskUUID` in the lvstore, not the manager's disk UUID).
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    pub size: u64,
    pub progress: u32,
    #[serde(deserialize_with = "file_state_serde::deserialize")]
    pub state: FileState,
    pub current_checksum: String,
    pub message: String,
}

impl From<corral_proto::v1::BackingImageV2CopyInfo> for V2CopyInfo {
    fn from(i: corral_proto::v1::BackingImageV2CopyInfo) -> Self {
        Self {
            name: i.name,
            uuid: i.uuid,
            disk_uuid: i.disk_uuid,
            size: i.size,
            progress: i.progress,
            state: file_state(&i.state),
            current_checksum: i.current_checksum,
            message: i.message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_wire_text_and_one_this_build_does_not_know_reads_as_unknown() {
        let doc = r#"{"spec":{"uuid":"u","sourceType":"download","parameters":{},"expectedChecksum":"",
            "minNumberOfCopies":1,"diskFileSpecMap":{},"dataEngine":"v2","deletionTimestamp":null},
            "status":{"size":0,"virtualSize":0,"currentChecksum":"","diskFileStatusMap":{
            "d1":{"state":"in-progress","progress":5,"message":"","nodeId":"n1","dataEngine":"v2"},
            "d2":{"state":"defragmenting","progress":0,"message":"","nodeId":"n2","dataEngine":"v2"}},
            "diskLastRefAtMap":{},"message":"","v2FirstCopyStatus":"","v2FirstCopyDisk":"",
            "v2FirstCopyMessage":""}}"#;
        let bi: BackingImage = serde_json::from_str(doc).unwrap();
        let map = &bi.status.disk_file_status_map;
        assert_eq!(map["d1"].state, FileState::InProgress);
        assert_eq!(map["d2"].state, FileState::Unknown);
        assert_eq!(bi.status.v2_first_copy_status, None);
        let back = serde_json::to_value(&bi).unwrap();
        assert_eq!(back["status"]["diskFileStatusMap"]["d1"]["state"], "in-progress");
        assert_eq!(back["status"]["v2FirstCopyStatus"], "");

        let mut ds = DataSourceStatus::default();
        assert_eq!(serde_json::to_value(&ds).unwrap()["state"], "");
        ds.state = Some(FileState::ReadyForTransfer);
        let text = serde_json::to_string(&ds).unwrap();
        assert!(text.contains(r#""state":"ready-for-transfer""#), "{text}");
        assert_eq!(serde_json::from_str::<DataSourceStatus>(&text).unwrap(), ds);
        let m: ManagerStatus = serde_json::from_str(
            r#"{"state":"","message":"","process":null,"address":"","httpAddress":"","files":{}}"#,
        )
        .unwrap();
        assert_eq!(m.state, None);
        assert_eq!(serde_json::to_value(&m).unwrap()["state"], "");
        for (text, st) in [
            ("running", ManagerState::Running),
            ("exploding", ManagerState::Unknown),
        ] {
            let v = serde_json::json!({"state": text, "message": "", "process": null, "address": "",
                "httpAddress": "", "files": {}});
            assert_eq!(
                serde_json::from_value::<ManagerStatus>(v).unwrap().state,
                Some(st)
            );
        }
        assert_eq!(file_state("ready"), FileState::Ready);
        assert_eq!(file_state(""), FileState::Unknown);
    }
}
