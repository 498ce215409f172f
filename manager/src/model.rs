//! The resources the manager keeps in its store. Each is a spec (what the user or a controller wants) and a status
//! (what the owner observed). Names: nodes, volumes and settings are chosen by users; a replica is
//! `<volume>-r-<8 hex>`; the engine of a volume carries the volume's name.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use corral_api::model::{
    DataEngine, DesireState, Frontend, OrphanRemoved, ProcessState, Robustness, Snapshot, VolumeState,
};

use crate::store::Resource;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    pub spec: NodeSpec,
    pub status: NodeStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// The node manager's REST address (`http://HOST:PORT`).
    pub address: String,
    /// Host daemons of this node listen on.
    pub host: String,
    pub allow_scheduling: bool,
    pub disks: BTreeMap<String, DiskSpec>,
    /// `corral node drain`: every replica on the node gets a replacement elsewhere, rebuilt before the one here is
    /// removed (`crate::node::drain`). Set with `allowScheduling` false; cleared by `corral node uncordon`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain_requested: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskSpec {
    pub path: String,
    /// Written to `<path>/corral-disk.cfg` when the disk is added.
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    pub allow_scheduling: bool,
    /// Bytes kept free for other users of the file system.
    pub storage_reserved: u64,
    /// The data engine whose replicas the disk takes: v1 (a directory of replica files) or v2 (an lvstore in
    /// `<path>/lvstore.img`, served by one `corral-replica serve-lvstore` per disk; see `crate::v2`).
    #[serde(default)]
    pub engine: DataEngine,
    /// v2 only: bytes of the store file the manager creates (preallocated) when the disk holds none; 0 = the
    /// default (`crate::data_engine::device::DEFAULT_SIZE`). Ignored for a block device or an existing store.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lvstore_size: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Unix seconds of the last heartbeat of the node's manager.
    pub heartbeat: i64,
    pub disks: BTreeMap<String, DiskStatus>,
    /// What the node's manager removed because the store no longer needed it (`crate::controller::orphans`),
    /// newest last, at most [`ORPHANS_KEPT`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orphans_removed: Vec<OrphanRemoved>,
    /// The version of the node's manager, as of its last heartbeat.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub manager_version: String,
    /// The URL of the node's instance manager (`--instance-manager`); empty: the manager runs the daemons itself.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance_manager: String,
    /// The instance manager's version (and instance API), as of the last heartbeat.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance_manager_version: String,
    /// The build version of the node's data plane: its instance manager's, or the manager's own when the manager
    /// runs the daemons itself.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub data_plane_version: String,
    /// What the node's data plane can do (`corral_proto::data_plane`); empty: reported by no one yet (a manager
    /// older than the report), taken as everything (`crate::data_plane`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_plane_features: Vec<String>,
}

/// How many removals a node's status keeps.
pub const ORPHANS_KEPT: usize = 32;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    pub storage_maximum: u64,
    pub storage_available: u64,
    /// Sum of the sizes of replicas scheduled on the disk.
    pub storage_scheduled: u64,
    /// Empty when the disk's identity file matches.
    pub error: String,
}

impl Resource for Node {
    const KIND: &'static str = "node";
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub spec: VolumeSpec,
    pub status: VolumeStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSpec {
    pub size: u64,
    pub number_of_replicas: u32,
    pub frontend: Frontend,
    /// None: the `disable-revision-counter` setting decides at creation.
    pub disable_revision_counter: Option<bool>,
    /// The node the volume should be attached to; None = detached.
    pub node_id: Option<String>,
    /// Set by `POST /v1/volumes/{name}/salvage` (`corral volume salvage`); cleared by the volume controller once
    /// the engine runs with a robustness other than faulted. The engine controller passes `--salvage-requested`
    /// only when the volume also keeps no revision counter.
    pub salvage_requested: bool,
    /// The backing image under the volume's data (its replicas start with `--backing-file`).
    #[serde(default)]
    pub backing_image: Option<String>,
    /// Attached without a frontend (maintenance mode: revert of a detached volume, restore, clone target): the
    /// engine runs but serves no NBD, so nobody can reach the volume for IO. Set by attach, cleared by detach.
    #[serde(default)]
    pub disable_frontend: bool,
    /// `vol://NAME` or `snap://NAME/SNAPSHOT` when the volume is a clone: written with the volume itself, so no
    /// attach can slip in before the clone's record exists (attach needs that record `completed`).
    #[serde(default)]
    pub data_source: Option<String>,
    /// Recurring-job groups the volume belongs to (`PUT /v1/volumes/{name}/jobgroups`): jobs naming one of them
    /// apply to it.
    #[serde(default)]
    pub job_groups: Vec<String>,
    /// `TARGET:BACKUP` when the volume is (being) restored from a backup: written before the restore's record, so
    /// attach is refused until that record says completed (`backup::restore::check_attach`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_backup: Option<String>,
    /// This volume's `backup-max-count` (None: the setting's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_max_count: Option<u32>,
    /// This volume's `backup-delta-max` (None: the setting's); a recurring job's own `deltaMax` goes over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_delta_max: Option<u32>,
    /// v1 or v2 (the `default-data-engine` setting at creation); replicas go only on disks of this engine.
    #[serde(default)]
    pub data_engine: DataEngine,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatus {
    pub state: VolumeState,
    pub robustness: Robustness,
    /// The node the engine runs on.
    pub current_node_id: Option<String>,
    /// NBD URIs while attached (none without a frontend).
    pub endpoints: Vec<String>,
    /// The running engine serves no frontend (maintenance mode).
    #[serde(default)]
    pub frontend_disabled: bool,
    /// Effective value (volume override or the global setting at creation).
    pub revision_counter_disabled: bool,
    pub message: String,
}

impl Resource for Volume {
    const KIND: &'static str = "volume";
}

/// How the manager recognises a daemon it started, across its own restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessRecord {
    pub pid: i32,
    /// Field 22 of `/proc/PID/stat` (clock ticks after boot): a reused pid has another.
    pub start_time: u64,
    /// Listener name → address (`HOST:PORT` or `unix:/PATH`) as the daemon reported in its ready file; empty
    /// until it is ready (and in records written before ready files: those held a `port`, now ignored).
    #[serde(default)]
    pub listen: BTreeMap<String, String>,
    /// Unix milliseconds when the manager started it: restart backoff and the ready deadline count from here
    /// (0 in records written before ready files).
    #[serde(default)]
    pub started_at_ms: i64,
    pub restarts: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Replica {
    pub spec: ReplicaSpec,
    pub status: ReplicaStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSpec {
    pub volume: String,
    pub node_id: String,
    pub disk: String,
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    /// `<disk path>/replicas/<replica name>` (v1); `<disk path>/lvstore.img#<replica name>` (v2: the lvol chain
    /// named after the replica in the disk's store).
    pub data_path: String,
    pub size: u64,
    pub revision_counter_disabled: bool,
    pub desire_state: DesireState,
    /// Set when the replica cannot serve any more (its node is gone): a new one is scheduled instead.
    pub failed_at: Option<i64>,
    /// v1: its own `corral-replica serve` process; v2: hosted by the disk's `serve-lvstore` daemon.
    #[serde(default)]
    pub data_engine: DataEngine,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    pub state: ProcessState,
    pub process: Option<ProcessRecord>,
    /// The replica's address (`corral_proto::ReplicaAddress`, `tcp://HOST:PORT?data=PORT&sync=PORT`) built from the
    /// endpoints it reported ready; kept over a restart until the new process reports.
    pub address: String,
    /// RW | WO | ERR as the engine sees it.
    pub mode: String,
    /// Has been RW in an engine: holds the volume's data (a fresh replica joins only through a rebuild).
    pub initialized: bool,
    pub message: String,
}

impl Resource for Replica {
    const KIND: &'static str = "replica";
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Engine {
    pub spec: EngineSpec,
    pub status: EngineStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    pub volume: String,
    pub node_id: String,
    pub size: u64,
    /// Replica names the engine should serve with.
    pub replicas: Vec<String>,
    pub revision_counter_disabled: bool,
    pub salvage_requested: bool,
    /// Run without NBD listeners (maintenance mode); a change restarts the engine.
    #[serde(default)]
    pub disable_frontend: bool,
    pub desire_state: DesireState,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineStatus {
    pub state: ProcessState,
    pub process: Option<ProcessRecord>,
    /// `HOST:PORT` of the engine's ControllerService.
    pub address: String,
    pub endpoints: Vec<String>,
    /// Replica address → mode (RW | WO | ERR) as last listed.
    pub replica_modes: BTreeMap<String, String>,
    /// Replica address → rebuild progress (0–100) of replicas being rebuilt (WO).
    #[serde(default)]
    pub rebuild_progress: BTreeMap<String, u32>,
    /// The size the running engine serves (expansion updates it).
    pub current_size: u64,
    /// The next start passes `--salvage-requested` (every replica failed).
    pub salvage_next: bool,
    /// The running engine was started without a frontend.
    #[serde(default)]
    pub frontend_disabled: bool,
    pub message: String,
    /// The generation the engine process was started with (`--generation`; see [`crate::engine_generation`]).
    #[serde(default)]
    pub generation: u64,
    /// The last time an engine of this document was found fenced (a replica accepted a newer generation) and
    /// stopped: the engine's own words, "fenced by generation N > M (replica ADDRESS)". Kept across restarts.
    #[serde(default)]
    pub last_fenced: String,
}

impl Resource for Engine {
    const KIND: &'static str = "engine";
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Setting {
    pub value: String,
}

impl Resource for Setting {
    const KIND: &'static str = "setting";
}

impl Resource for Snapshot {
    const KIND: &'static str = "snapshot";
}

/// The settings the manager knows, with their defaults and what they mean.
pub const SETTINGS: &[(&str, &str, &str)] = &[
    (
        "replica-soft-anti-affinity",
        "true",
        "Allow two replicas of a volume on one node when no other node fits.",
    ),
    (
        "disable-revision-counter",
        "false",
        "Default for volumes created without disableRevisionCounter: replicas keep no revision counter (salvage by head mtime and size).",
    ),
    (
        "replica-timeout",
        "8",
        "Seconds before an unanswered replica request puts the replica ERR.",
    ),
    (
        "node-down-timeout",
        "15",
        "Seconds without a heartbeat after which a node's replicas are failed and replaced.",
    ),
    (
        "storage-over-provisioning-percentage",
        "100",
        "Scheduled replica bytes a disk may hold, in percent of its usable space.",
    ),
    (
        "backing-image-cleanup-wait-interval",
        "60",
        "Minutes a backing-image copy no replica uses is kept before it is removed (0 = at the next reconcile; never below the image's minimum copies).",
    ),
    (
        "clone-max-bytes-per-second",
        "0",
        "Upper bound on the data bytes per second a clone's source replica sends (0 = unlimited), so a clone does not starve the source's IO.",
    ),
    (
        "rebuild-max-bytes-per-second",
        "0",
        "Upper bound on the data bytes per second a replica rebuild moves, local copy or network (0 = the engine's --rebuild-max-rate, unlimited by default; the engine also slows a rebuild while the new replica serves IO).",
    ),
    (
        "concurrent-rebuilds-per-volume",
        "2",
        "How many replicas of one volume may rebuild at once (0 counts as 1: a volume always heals): after losing two replicas, both come back in the time of one rebuild; each rebuild is rate-shaped on its own.",
    ),
    (
        "backup-delta-max",
        "7",
        "Incremental backups after a full one before the next full (the chain policy the backup store applies).",
    ),
    (
        "backup-incremental",
        "true",
        "Back up incrementally when the chain allows; false makes every backup full.",
    ),
    (
        "backup-block-size",
        "524288",
        "Block size in bytes of new backup volumes (a power of two from 4096 to 16777216); a volume's first backup on a target fixes it for that backup volume. Smaller blocks upload less for scattered small changes and cost more objects, requests and block-map entries (bench/backup/README.md).",
    ),
    (
        "backup-max-count",
        "0",
        "Backups a volume may have on a target before a new one is refused (0 = no limit); a volume's own backupMaxCount overrides it.",
    ),
    (
        "default-data-engine",
        "v1",
        "Data engine of volumes created without dataEngine: v1 (a process and files per replica) or v2 (lvol chains in a per-disk lvstore).",
    ),
    (
        "backing-image-min-copies",
        "1",
        "Default minNumberOfCopies of new backing images: ready copies kept on distinct nodes, then disks.",
    ),
];

/// Checks a setting name and value.
pub fn validate_setting(name: &str, value: &str) -> Result<(), String> {
    let Some((_, default, _)) = SETTINGS.iter().find(|(n, _, _)| *n == name) else {
        return Err(format!(
            "unknown setting {name:?}; known: {}",
            SETTINGS.iter().map(|s| s.0).collect::<Vec<_>>().join(", ")
        ));
    };
    if name == "default-data-engine" {
        return value
            .parse::<DataEngine>()
            .map(drop)
            .map_err(|e| format!("setting {name}: {e}"));
    }
    let is_bool = matches!(*default, "true" | "false");
    if is_bool && !matches!(value, "true" | "false") {
        return Err(format!("setting {name} takes true or false, not {value:?}"));
    }
    if !is_bool && value.parse::<u64>().is_err() {
        return Err(format!("setting {name} takes a whole number, not {value:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_record_stored_before_ready_files_still_loads() {
        let old = r#"{"pid":4242,"startTime":991,"port":20003,"restarts":2}"#;
        let rec: ProcessRecord = serde_json::from_str(old).unwrap();
        assert_eq!((rec.pid, rec.start_time, rec.restarts), (4242, 991, 2));
        assert!(rec.listen.is_empty());
        assert_eq!(rec.started_at_ms, 0);
        let engine = r#"{"state":"running","process":{"pid":1,"startTime":2,"port":3,"restarts":0},"nbdPort":4,
            "metricsPort":5,"address":"127.0.0.1:3","endpoints":[],"replicaModes":{},"currentSize":0,
            "salvageNext":false,"message":""}"#;
        let st: EngineStatus = serde_json::from_str(engine).unwrap();
        assert_eq!(st.address, "127.0.0.1:3");
    }
}
