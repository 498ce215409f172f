//! The vocabulary every replica kind shares — the file-chain replica ([`crate::Replica`]) and the lvol replica
//! ([`crate::v2::lvol::LvolReplica`]): snapshot requests, replica and disk status, and how each maps to the wire
//! (`v1::Replica`, gRPC statuses, data-protocol errors, job and clone status messages).

use std::collections::BTreeMap;

use corral_proto::v1;
use data_protocol::{BackendError, ErrorKind as WireKind};
use serde::Serialize;
use tonic::Status;

use crate::error::{ErrorKind, ReplicaError};
use crate::jobs::{JobState, JobStatus};

/// Sector size reported to the engine; the map works on 4 KiB blocks, IO is accepted at 512-byte granularity.
pub const SECTOR_SIZE: u64 = 512;

/// A snapshot request.
#[derive(Debug, Clone, Default)]
pub struct SnapshotRequest {
    /// Snapshot name (validated) or file name.
    pub name: String,
    /// User snapshot (false for system snapshots: rebuild, expansion).
    pub user_created: bool,
    /// RFC 3339 creation time; empty means now.
    pub created: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// A disk as reported by [`crate::Replica::status`].
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    /// File name.
    pub name: String,
    /// Parent file name.
    pub parent: String,
    /// Children file names.
    pub children: Vec<String>,
    /// Marked removed.
    pub removed: bool,
    /// User snapshot.
    pub user_created: bool,
    /// RFC 3339.
    pub created: String,
    /// Allocated bytes.
    pub size: u64,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// Replica state and metadata, for the gRPC API and CLIs.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// initial | closed | open | dirty | rebuilding | error.
    pub state: String,
    /// Directory.
    pub dir: String,
    /// Volume size.
    pub size: u64,
    /// Sector size.
    pub sector_size: u64,
    /// Head file name.
    pub head: String,
    /// Head's parent.
    pub parent: String,
    /// `Dirty` flag as on disk.
    pub dirty: bool,
    /// `Rebuilding` flag.
    pub rebuilding: bool,
    /// `Error` text.
    pub error: String,
    /// Backing file path.
    pub backing_file: String,
    /// Live chain, head first.
    pub chain: Vec<String>,
    /// All disks.
    pub disks: BTreeMap<String, DiskStatus>,
    /// Revision counter (0 when disabled).
    pub revision_counter: u64,
    /// Revision counter disabled.
    pub revision_counter_disabled: bool,
    /// Head mtime in ns since the epoch.
    pub last_modify_time: i64,
    /// Head allocated bytes.
    pub head_file_size: u64,
    /// Number of runs in the location map (memory indicator); 0 offline.
    pub extent_map_runs: usize,
}

impl SnapshotRequest {
    /// The request a `ReplicaSnapshot` call carries.
    #[must_use]
    pub fn from_proto(req: v1::ReplicaSnapshotRequest) -> Self {
        Self {
            name: req.name,
            user_created: req.user_created,
            created: req.created,
            labels: req.labels.into_iter().collect(),
        }
    }
}

/// The wire form of a status.
pub fn to_proto(s: &ReplicaStatus, volume: &str) -> v1::Replica {
    v1::Replica {
        state: s.state.clone(),
        dirty: s.dirty,
        rebuilding: s.rebuilding,
        head: s.head.clone(),
        parent: s.parent.clone(),
        size: s.size,
        sector_size: u32::try_from(s.sector_size).unwrap_or(512),
        backing_file: s.backing_file.clone(),
        chain: s.chain.clone(),
        disks: s
            .disks
            .iter()
            .map(|(k, d)| {
                (
                    k.clone(),
                    v1::DiskInfo {
                        name: d.name.clone(),
                        parent: d.parent.clone(),
                        children: d.children.clone(),
                        removed: d.removed,
                        user_created: d.user_created,
                        created: d.created.clone(),
                        size: d.size,
                        labels: d.labels.clone().into_iter().collect(),
                    },
                )
            })
            .collect(),
        revision_counter: s.revision_counter,
        revision_counter_disabled: s.revision_counter_disabled,
        last_modify_time: s.last_modify_time,
        head_file_size: s.head_file_size,
        error: s.error.clone(),
        volume_name: volume.to_owned(),
    }
}

/// The daemon's other listeners, as bound, which `ReplicaResponse` reports so that a client given the control
/// endpoint learns the whole replica address.
#[derive(Debug, Clone)]
pub struct ServedEndpoints {
    pub data: std::net::SocketAddr,
    pub sync: std::net::SocketAddr,
    /// The data protocol's unix socket, when the daemon serves one.
    pub data_unix: Option<std::path::PathBuf>,
}

impl ServedEndpoints {
    /// The `ReplicaResponse` of `replica` served at these endpoints (v1 and v2 daemons answer alike).
    #[must_use]
    pub fn response(&self, replica: v1::Replica) -> v1::ReplicaResponse {
        v1::ReplicaResponse {
            replica: Some(replica),
            data_endpoint: self.data.to_string(),
            sync_endpoint: self.sync.to_string(),
            data_local_endpoint: self
                .data_unix
                .as_ref()
                .map(|p| format!("unix:{}", p.display()))
                .unwrap_or_default(),
        }
    }
}

/// A purge's status as the wire message.
pub(crate) fn purge_status(s: JobStatus) -> v1::SnapshotPurgeStatusResponse {
    v1::SnapshotPurgeStatusResponse {
        is_purging: s.state == JobState::InProgress,
        state: s.state.as_str().to_owned(),
        progress: s.progress,
        error: s.error,
    }
}

/// The final status of a job that ended with `result`.
pub(crate) fn job_outcome(result: &Result<(), ReplicaError>) -> JobStatus {
    match result {
        Ok(()) => JobStatus {
            state: JobState::Complete,
            ..Default::default()
        },
        Err(e) => job_failure(e),
    }
}

/// The final status of a job that failed with `e` (or was cancelled).
pub(crate) fn job_failure(e: &ReplicaError) -> JobStatus {
    match e {
        ReplicaError::Cancelled => JobStatus {
            state: JobState::Cancelled,
            ..Default::default()
        },
        e => JobStatus {
            state: JobState::Error,
            error: e.to_string(),
            ..Default::default()
        },
    }
}

impl From<ReplicaError> for Status {
    fn from(e: ReplicaError) -> Self {
        let msg = e.to_string();
        match e.kind() {
            ErrorKind::InvalidArgument => Status::invalid_argument(msg),
            ErrorKind::NotFound => Status::not_found(msg),
            ErrorKind::AlreadyExists => Status::already_exists(msg),
            ErrorKind::FailedPrecondition => Status::failed_precondition(msg),
            ErrorKind::Corrupt => Status::data_loss(msg),
            ErrorKind::NoSpace => Status::resource_exhausted(msg),
            ErrorKind::Io => Status::internal(msg),
        }
    }
}

/// A replica error as the data protocol reports it.
pub(crate) fn wire_error(e: &ReplicaError) -> BackendError {
    let kind = match e {
        ReplicaError::OutOfRange { .. } => WireKind::OutOfRange,
        _ => match e.kind() {
            ErrorKind::NoSpace => WireKind::NoSpace,
            ErrorKind::InvalidArgument => WireKind::Invalid,
            ErrorKind::FailedPrecondition => WireKind::Unavailable,
            _ => WireKind::Io,
        },
    };
    BackendError::new(kind, e.to_string())
}

/// The data protocol's answer when the engine generation record cannot be read: writes are refused.
pub(crate) fn generation_unreadable(e: &impl std::fmt::Display) -> BackendError {
    BackendError::new(
        WireKind::Unavailable,
        format!(
            "the replica refuses writes: its engine generation record is unreadable ({e}); see \
             docs/formats.md, engine generation, for the recovery"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One error of each kind, as both replica kinds raise them.
    fn samples() -> Vec<ReplicaError> {
        vec![
            ReplicaError::InvalidArgument("bad size".into()),
            ReplicaError::OutOfRange {
                offset: 4096,
                len: 512,
                size: 4096,
            },
            ReplicaError::NotFound("snapshot s1".into()),
            ReplicaError::AlreadyExists("snapshot s1".into()),
            ReplicaError::FailedPrecondition("replica r1 is not open".into()),
            ReplicaError::CorruptMeta {
                path: "/d/volume.meta".into(),
                reason: "truncated".into(),
            },
            ReplicaError::NoSpace {
                op: "write",
                path: "/d/head.img".into(),
            },
            ReplicaError::Cancelled,
        ]
    }

    #[test]
    fn every_error_kind_maps_to_one_grpc_code_and_one_wire_kind_with_its_message() {
        use tonic::Code;
        let want = [
            (Code::InvalidArgument, WireKind::Invalid),
            (Code::InvalidArgument, WireKind::OutOfRange),
            (Code::NotFound, WireKind::Io),
            (Code::AlreadyExists, WireKind::Io),
            (Code::FailedPrecondition, WireKind::Unavailable),
            (Code::DataLoss, WireKind::Io),
            (Code::ResourceExhausted, WireKind::NoSpace),
            (Code::Internal, WireKind::Io),
        ];
        for (e, (code, wire)) in samples().into_iter().zip(want) {
            let msg = e.to_string();
            let backend = wire_error(&e);
            assert_eq!(
                (backend.kind, backend.message.as_str()),
                (wire, msg.as_str()),
                "{e:?}"
            );
            let status = Status::from(e);
            assert_eq!((status.code(), status.message()), (code, msg.as_str()));
        }
    }
}
