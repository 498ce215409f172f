//! The Controller service: volumes, attachment to nodes, snapshots and expansion, translated onto the manager's
//! REST API. Volume IDs are the manager's volume names (the CO's suggested name); snapshot IDs say where the
//! snapshot lives (`snap://VOLUME/SNAPSHOT` in the volume, `backup://TARGET/VOLUME/BACKUP` on a backup target, see
//! [`crate::backup_snapshot`]). Every call is idempotent; one call per volume or snapshot at a time (a concurrent
//! one gets ABORTED).

use std::collections::HashMap;
use std::time::Duration;

use corral_api::clone::CloneState;
use corral_api::volume::SnapshotView;
use corral_disk::BLOCK_SIZE;
use tonic::{Request, Response, Status};

use crate::capability::{self, Access};
use crate::error::{CsiError, CsiResult};
use crate::in_flight::InFlight;
use crate::manager_api::{ManagedVolume, ManagerApi, VolumeRequest};
use crate::parameters::{SnapshotKind, VolumeParameters, snapshot_kind};
use crate::proto::controller_server::Controller;
use crate::proto::controller_service_capability::{self, rpc};
use crate::proto::volume_content_source::{self, SnapshotSource, VolumeSource};
use crate::proto::*;
use crate::snapshot_id::SnapshotId;

/// How long a call waits for the manager to attach or detach a volume before answering DEADLINE_EXCEEDED (the
/// CO retries, and the retry finds the state reached).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);
/// How long CreateVolume waits for a clone to complete before answering ABORTED (the CO retries).
const CLONE_WAIT: Duration = Duration::from_secs(30);
/// How long CreateVolume waits for a backing image to be ready before answering ABORTED (the CO retries).
const BACKING_IMAGE_WAIT: Duration = Duration::from_secs(30);

/// The publish-context keys the node plugin reads.
pub const CONTEXT_NBD_UNIX: &str = "nbdUnix";
pub const CONTEXT_NBD_TCP: &str = "nbdTcp";
/// The volume-context key carrying the StorageClass's file system.
pub const CONTEXT_FS_TYPE: &str = "fsType";

pub struct ControllerService {
    pub manager: ManagerApi,
    pub in_flight: InFlight,
    /// How long CreateSnapshot of a backup waits for it to end before answering `ready_to_use: false` (the CO
    /// repeats the call until it is true).
    pub backup_wait: Duration,
}

fn required<'a>(what: &str, v: &'a str) -> CsiResult<&'a str> {
    if v.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{what} is required")));
    }
    Ok(v)
}

/// A CO-chosen name becomes a manager volume or snapshot name; the manager accepts a path-safe subset.
fn manager_name(what: &str, v: &str) -> CsiResult<()> {
    corral_disk::identity::check_path_component(what, v).map_err(CsiError::InvalidArgument)
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
}

/// The size a capacity range asks for, rounded up to the manager's 4 KiB block; OUT_OF_RANGE when no size fits.
fn size_for(range: Option<&CapacityRange>, minimum: u64) -> CsiResult<u64> {
    let (req, lim) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if req < 0 || lim < 0 {
        return Err(CsiError::InvalidArgument(
            "capacity_range values must not be negative".into(),
        ));
    }
    let (req, lim) = (req.unsigned_abs(), lim.unsigned_abs());
    let mut size = if req == 0 {
        crate::DEFAULT_VOLUME_SIZE.max(minimum)
    } else {
        round_up(req.max(minimum))
    };
    if lim > 0 && size > lim {
        if req == 0 && minimum <= lim {
            size = lim / BLOCK_SIZE * BLOCK_SIZE;
        }
        if size == 0 || size > lim || size < minimum {
            return Err(CsiError::OutOfRange(format!(
                "no size fits: required {req} bytes (at least {minimum}), limit {lim} bytes, sizes are multiples of {BLOCK_SIZE}"
            )));
        }
    }
    Ok(size)
}

fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    let (req, lim) = range.map_or((0, 0), |r| {
        (
            r.required_bytes.max(0).unsigned_abs(),
            r.limit_bytes.max(0).unsigned_abs(),
        )
    });
    size >= req && (lim == 0 || size <= lim)
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// What a new volume is filled from.
enum Source {
    /// The manager's `dataSource` (`vol://NAME` or `snap://NAME/SNAP`): a clone.
    Clone(String),
    /// The manager's `fromBackup` (`TARGET:BACKUP`): a restore.
    Restore(String),
}

fn content_source_of(data_source: Option<&str>) -> Option<VolumeContentSource> {
    let ds = data_source?;
    let t = if let Some(v) = ds.strip_prefix("vol://") {
        volume_content_source::Type::Volume(VolumeSource {
            volume_id: v.to_owned(),
        })
    } else {
        volume_content_source::Type::Snapshot(SnapshotSource {
            snapshot_id: ds.to_owned(),
        })
    };
    Some(VolumeContentSource { r#type: Some(t) })
}

impl ControllerService {
    fn csi_volume(
        &self,
        v: &ManagedVolume,
        context: HashMap<String, String>,
        topology: Vec<Topology>,
    ) -> Volume {
        Volume {
            capacity_bytes: as_i64(v.view.size),
            volume_id: v.view.name.clone(),
            volume_context: context,
            content_source: content_source_of(v.data_source.as_deref()),
            accessible_topology: topology,
        }
    }

    /// What a content source fills the new volume with, and the source's size, after checking the source exists
    /// (NOT_FOUND) and can be read now.
    async fn data_source(&self, src: &VolumeContentSource) -> CsiResult<(Source, u64)> {
        match &src.r#type {
            Some(volume_content_source::Type::Volume(VolumeSource { volume_id })) => {
                let v = self
                    .manager
                    .volume(required("volume_content_source.volume.volume_id", volume_id)?)
                    .await?
                    .ok_or_else(|| CsiError::NotFound(format!("source volume {volume_id} does not exist")))?;
                Ok((Source::Clone(format!("vol://{volume_id}")), v.view.size))
            }
            Some(volume_content_source::Type::Snapshot(SnapshotSource { snapshot_id })) => {
                let id = required("volume_content_source.snapshot.snapshot_id", snapshot_id)?;
                let (volume, snapshot) = match SnapshotId::parse(id) {
                    Some(SnapshotId::InVolume { volume, snapshot }) => (volume, snapshot),
                    Some(SnapshotId::Backup {
                        target,
                        volume,
                        backup,
                    }) => {
                        let r = self.restore_source(id, &target, &volume, &backup).await?;
                        return Ok((Source::Restore(r.from_backup), r.size));
                    }
                    None => return Err(CsiError::NotFound(format!("source snapshot {id} does not exist"))),
                };
                let Some(v) = self.manager.volume(&volume).await? else {
                    return Err(CsiError::NotFound(format!(
                        "source snapshot {id} does not exist (no volume {volume})"
                    )));
                };
                let live = self
                    .manager
                    .snapshots(&volume)
                    .await?
                    .into_iter()
                    .any(|s| s.name == snapshot && !s.removed);
                if !live {
                    return Err(CsiError::NotFound(format!(
                        "source snapshot {id} does not exist or was removed"
                    )));
                }
                Ok((Source::Clone(format!("snap://{volume}/{snapshot}")), v.view.size))
            }
            None => Err(CsiError::InvalidArgument(
                "volume_content_source names no source".into(),
            )),
        }
    }

    /// Runs `op` with the volume attached: as it is when published, else attached on the answering manager's
    /// node for the call and detached again (snapshots and growth need a running engine).
    async fn with_engine<T>(
        &self,
        v: &ManagedVolume,
        op: impl AsyncFnOnce() -> CsiResult<T>,
    ) -> CsiResult<T> {
        if let Some(node) = &v.view.node_id {
            if v.view.disable_frontend {
                // Attached without a frontend (for a backup): the engine runs, no NBD endpoint will appear.
                self.manager
                    .wait_volume(&v.view.name, "attached", ATTACH_TIMEOUT, |v| {
                        v.view.state == corral_api::model::VolumeState::Attached
                    })
                    .await?;
            } else {
                self.manager
                    .wait_attached(&v.view.name, node, ATTACH_TIMEOUT)
                    .await?;
            }
            return op().await;
        }
        let name = &v.view.name;
        self.manager.attach(name, None).await?;
        let attached = self
            .manager
            .wait_volume(name, "attached", ATTACH_TIMEOUT, |v| {
                v.view.state == corral_api::model::VolumeState::Attached && !v.view.endpoints.is_empty()
            })
            .await;
        let result = match attached {
            Ok(_) => op().await,
            Err(e) => Err(e),
        };
        self.manager.detach(name).await?;
        self.manager.wait_detached(name, ATTACH_TIMEOUT).await?;
        result
    }

    /// Waits for a clone to complete. A failed clone is deleted (the seed's recovery: re-create it) so the CO's
    /// retry of CreateVolume starts it again.
    async fn clone_completed(&self, v: ManagedVolume) -> CsiResult<ManagedVolume> {
        let name = v.view.name.clone();
        let done = |v: &ManagedVolume| v.clone.as_ref().is_none_or(|c| !c.state.active());
        let v = match self.manager.wait_volume(&name, "cloned", CLONE_WAIT, done).await {
            Ok(v) => v,
            Err(CsiError::DeadlineExceeded(_)) => {
                let progress = self
                    .manager
                    .volume(&name)
                    .await?
                    .and_then(|v| v.clone)
                    .map_or(0, |c| c.progress);
                return Err(CsiError::Aborted(format!(
                    "volume {name} is still being cloned ({progress}%)"
                )));
            }
            Err(e) => return Err(e),
        };
        if let Some(c) = &v.clone
            && c.state == CloneState::Failed
        {
            self.manager.delete_volume(&name).await?;
            return Err(CsiError::Internal(format!(
                "clone into {name} failed: {}; the target was deleted, a retry creates it again",
                c.message
            )));
        }
        Ok(v)
    }

    /// The StorageClass's backing image, made from its data source when the manager has none of that name (seed
    /// 000), and ready. ABORTED with the progress while it is prepared; the CO retries CreateVolume.
    async fn backing_image_ready(&self, params: &VolumeParameters) -> CsiResult<()> {
        let Some(name) = &params.backing_image else {
            return Ok(());
        };
        if self.manager.backing_image(name).await?.is_none() {
            let Some(src) = &params.backing_image_source else {
                return Err(CsiError::InvalidArgument(format!(
                    "backingImage {name} does not exist, and no backingImageDataSourceType says how to make it"
                )));
            };
            match self
                .manager
                .create_backing_image(name, &src.source_type, &src.parameters)
                .await
            {
                // Another CreateVolume made it meanwhile.
                Ok(()) | Err(CsiError::FailedPrecondition(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let end = std::time::Instant::now() + BACKING_IMAGE_WAIT;
        loop {
            let b = self
                .manager
                .backing_image(name)
                .await?
                .ok_or_else(|| CsiError::NotFound(format!("backing image {name} disappeared")))?;
            match b.state.as_str() {
                "ready" => return Ok(()),
                "failed" => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "backing image {name} failed: {}",
                        b.message
                    )));
                }
                _ if std::time::Instant::now() >= end => {
                    return Err(CsiError::Aborted(format!(
                        "backing image {name} is being prepared ({}, {}%)",
                        b.state, b.progress
                    )));
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Requested topology resolved to Corral nodes that exist; RESOURCE_EXHAUSTED when none does.
    async fn accessible(&self, req: Option<&TopologyRequirement>) -> CsiResult<Vec<Topology>> {
        let Some(req) = req else {
            return Ok(Vec::new());
        };
        let nodes = self.manager.nodes().await?;
        let mut out: Vec<Topology> = Vec::new();
        for t in req.preferred.iter().chain(&req.requisite) {
            let Some(node) = t.segments.get(crate::TOPOLOGY_NODE_KEY) else {
                continue;
            };
            if nodes.iter().any(|n| &n.name == node) && !out.iter().any(|o| o.segments == t.segments) {
                out.push(Topology {
                    segments: [(crate::TOPOLOGY_NODE_KEY.to_owned(), node.clone())].into(),
                });
            }
        }
        if out.is_empty() && !(req.preferred.is_empty() && req.requisite.is_empty()) {
            return Err(CsiError::ResourceExhausted(format!(
                "no Corral node matches the requested topology (key {})",
                crate::TOPOLOGY_NODE_KEY
            )));
        }
        Ok(out)
    }

    async fn create_volume_impl(&self, req: CreateVolumeRequest) -> CsiResult<CreateVolumeResponse> {
        let name = required("name", &req.name)?;
        manager_name("volume name", name)?;
        let caps = capability::check_all(&req.volume_capabilities)?;
        let params = VolumeParameters::parse(&req.parameters)?;
        let _guard = self.in_flight.begin(name)?;
        let topology = self.accessible(req.accessibility_requirements.as_ref()).await?;
        let mut context = HashMap::new();
        let fs = caps
            .iter()
            .find_map(|c| match &c.access {
                Access::Mount { fs_type, .. } if !fs_type.is_empty() => Some(fs_type.clone()),
                _ => None,
            })
            .or_else(|| params.fs_type.clone());
        if let Some(fs) = fs {
            context.insert(CONTEXT_FS_TYPE.to_owned(), fs);
        }
        let source = match &req.volume_content_source {
            Some(src) => Some(self.data_source(src).await?),
            None => None,
        };
        let source_size = source.as_ref().map_or(0, |s| s.1);
        let response = |v: &ManagedVolume| {
            let mut vol = self.csi_volume(v, context.clone(), topology.clone());
            if req.volume_content_source.is_some() {
                vol.content_source = req.volume_content_source.clone();
            }
            CreateVolumeResponse { volume: Some(vol) }
        };
        if let Some(existing) = self.manager.volume(name).await? {
            let restored_from = self
                .manager
                .restore(name)
                .await?
                .map(|r| format!("{}:{}", r.restore.target, r.restore.backup));
            let same_source = match source.as_ref().map(|s| &s.0) {
                None => existing.data_source.is_none() && restored_from.is_none(),
                Some(Source::Clone(ds)) => existing.data_source.as_deref() == Some(ds.as_str()),
                Some(Source::Restore(b)) => restored_from.as_deref() == Some(b.as_str()),
            };
            let same_replicas = params
                .number_of_replicas
                .is_none_or(|n| n == existing.view.number_of_replicas);
            if !fits(existing.view.size, req.capacity_range.as_ref()) || !same_source || !same_replicas {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {name} exists with size {}, {} replicas, source {:?}: incompatible with this request",
                    existing.view.size,
                    existing.view.number_of_replicas,
                    existing.data_source.as_ref().or(restored_from.as_ref())
                )));
            }
            let existing = self.clone_completed(existing).await?;
            if restored_from.is_some() {
                self.restore_completed(name, CLONE_WAIT).await?;
            }
            return Ok(response(&existing));
        }
        if source.is_some()
            && req
                .capacity_range
                .as_ref()
                .is_some_and(|r| r.limit_bytes > 0 && r.limit_bytes.unsigned_abs() < source_size)
        {
            return Err(CsiError::OutOfRange(format!(
                "a clone cannot be smaller than its source ({source_size} bytes)"
            )));
        }
        let size = size_for(req.capacity_range.as_ref(), source_size)?;
        self.backing_image_ready(&params).await?;
        let created = self
            .manager
            .create_volume(&VolumeRequest {
                name: name.to_owned(),
                size,
                number_of_replicas: params.number_of_replicas,
                disable_revision_counter: params.disable_revision_counter,
                data_source: match &source {
                    Some((Source::Clone(ds), _)) => Some(ds.clone()),
                    _ => None,
                },
                from_backup: match &source {
                    Some((Source::Restore(b), _)) => Some(b.clone()),
                    _ => None,
                },
                backing_image: params.backing_image.clone(),
            })
            .await
            .map_err(|e| match e {
                // A race with another creator of the same name.
                CsiError::FailedPrecondition(m) => CsiError::AlreadyExists(m),
                e => e,
            })?;
        let created = match &source {
            Some((Source::Clone(_), _)) => self.clone_completed(created).await?,
            Some((Source::Restore(_), _)) => {
                self.restore_completed(name, CLONE_WAIT).await?;
                created
            }
            None => created,
        };
        Ok(response(&created))
    }

    async fn delete_volume_impl(&self, req: DeleteVolumeRequest) -> CsiResult<DeleteVolumeResponse> {
        let id = required("volume_id", &req.volume_id)?;
        if manager_name("volume id", id).is_err() {
            // No such volume can exist: deleting it is done.
            return Ok(DeleteVolumeResponse {});
        }
        let _guard = self.in_flight.begin(id)?;
        let Some(v) = self.manager.volume(id).await? else {
            return Ok(DeleteVolumeResponse {});
        };
        if let Some(node) = &v.view.node_id {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is published on node {node}: unpublish it first"
            )));
        }
        self.manager.delete_volume(id).await?;
        Ok(DeleteVolumeResponse {})
    }

    async fn publish_impl(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> CsiResult<ControllerPublishVolumeResponse> {
        let id = required("volume_id", &req.volume_id)?;
        let node = required("node_id", &req.node_id)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        capability::check(cap)?;
        let _guard = self.in_flight.begin(id)?;
        let v = self
            .manager
            .volume(id)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if self.manager.node(node).await?.is_none() {
            return Err(CsiError::NotFound(format!("node {node} does not exist")));
        }
        self.check_filled(&v).await?;
        match v.view.node_id.as_deref() {
            Some(cur) if cur != node => {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} is published on node {cur}: a Corral volume is attached to one node at a time"
                )));
            }
            Some(_) => {}
            None => self.manager.attach(id, Some(node)).await?,
        }
        let v = self.manager.wait_attached(id, node, ATTACH_TIMEOUT).await?;
        let mut context = HashMap::new();
        for e in &v.view.endpoints {
            if e.starts_with("nbd+unix://") {
                context.insert(CONTEXT_NBD_UNIX.to_owned(), e.clone());
            } else if e.starts_with("nbd://") {
                context.insert(CONTEXT_NBD_TCP.to_owned(), e.clone());
            }
        }
        Ok(ControllerPublishVolumeResponse {
            publish_context: context,
        })
    }

    /// A volume is served only once its clone or restore completed (the manager refuses the attach before):
    /// ABORTED while it runs (the CO retries and succeeds later), FAILED_PRECONDITION once it failed (the volume
    /// has to be re-created). A volume attached without a frontend for a backup is ABORTED until detached again.
    async fn check_filled(&self, v: &ManagedVolume) -> CsiResult<()> {
        use corral_api::backup::RestoreState;
        let id = &v.view.name;
        if let Some(c) = &v.clone {
            match c.state {
                CloneState::Completed => {}
                CloneState::Failed => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "the clone into {id} failed ({}): delete the volume and create it again",
                        c.message
                    )));
                }
                CloneState::Initiated | CloneState::Copying => {
                    return Err(CsiError::Aborted(format!(
                        "volume {id} is being cloned ({}%): it can be published once the clone completed",
                        c.progress
                    )));
                }
            }
        }
        if let Some(r) = self.manager.restore(id).await? {
            let r = r.restore;
            match r.state {
                RestoreState::Completed => {}
                RestoreState::Failed => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "the restore of backup {} into {id} failed ({}): its data is incomplete; delete the volume",
                        r.backup, r.message
                    )));
                }
                RestoreState::Initiated | RestoreState::Restoring => {
                    return Err(CsiError::Aborted(format!(
                        "volume {id} is being restored from backup {} ({}%): it can be published once the restore completed",
                        r.backup, r.progress
                    )));
                }
            }
        }
        if v.view.node_id.is_some() && v.view.disable_frontend {
            return Err(CsiError::Aborted(format!(
                "volume {id} is attached without a frontend (a backup or maintenance): it can be published once detached"
            )));
        }
        Ok(())
    }

    async fn unpublish_impl(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> CsiResult<ControllerUnpublishVolumeResponse> {
        let id = required("volume_id", &req.volume_id)?;
        let _guard = self.in_flight.begin(id)?;
        let Some(v) = self.manager.volume(id).await? else {
            // Gone volumes are not published anywhere.
            return Ok(ControllerUnpublishVolumeResponse {});
        };
        let published_here = match v.view.node_id.as_deref() {
            None => false,
            Some(cur) => req.node_id.is_empty() || req.node_id == cur,
        };
        if published_here {
            self.manager.detach(id).await?;
        }
        if published_here
            || v.view.state != corral_api::model::VolumeState::Detached && v.view.node_id.is_none()
        {
            self.manager.wait_detached(id, ATTACH_TIMEOUT).await?;
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }

    async fn validate_impl(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> CsiResult<ValidateVolumeCapabilitiesResponse> {
        let id = required("volume_id", &req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities is required".into(),
            ));
        }
        if self.manager.volume(id).await?.is_none() {
            return Err(CsiError::NotFound(format!("volume {id} does not exist")));
        }
        if let Err(e) = capability::check_all(&req.volume_capabilities) {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            });
        }
        if let Err(e) = VolumeParameters::parse(&req.parameters) {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            });
        }
        Ok(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: HashMap::new(),
            }),
            message: String::new(),
        })
    }

    async fn list_volumes_impl(&self, req: ListVolumesRequest) -> CsiResult<ListVolumesResponse> {
        let mut vols = self.manager.volumes().await?;
        vols.sort_by(|a, b| a.view.name.cmp(&b.view.name));
        let (start, end) = page(vols.len(), req.max_entries, &req.starting_token)?;
        let entries = vols[start..end]
            .iter()
            .map(|v| list_volumes_response::Entry {
                volume: Some(self.csi_volume(v, HashMap::new(), Vec::new())),
                status: None,
            })
            .collect();
        Ok(ListVolumesResponse {
            entries,
            next_token: if end < vols.len() {
                end.to_string()
            } else {
                String::new()
            },
        })
    }

    async fn get_capacity_impl(&self, req: GetCapacityRequest) -> CsiResult<GetCapacityResponse> {
        for c in &req.volume_capabilities {
            capability::check(c)?;
        }
        VolumeParameters::parse(&req.parameters)?;
        let want = req
            .accessible_topology
            .as_ref()
            .and_then(|t| t.segments.get(crate::TOPOLOGY_NODE_KEY).cloned());
        let nodes = self.manager.nodes().await?;
        let mut available = 0u64;
        let mut largest = 0u64;
        for n in nodes
            .iter()
            .filter(|n| n.ready && want.as_ref().is_none_or(|w| w == &n.name))
        {
            for d in n
                .disks
                .iter()
                .filter(|d| d.allow_scheduling && d.error.is_empty())
            {
                let free = d.storage_available.saturating_sub(d.storage_reserved);
                available += free;
                largest = largest.max(free);
            }
        }
        Ok(GetCapacityResponse {
            available_capacity: as_i64(available),
            maximum_volume_size: Some(as_i64(largest)),
            minimum_volume_size: Some(as_i64(BLOCK_SIZE)),
        })
    }

    /// Every live snapshot of every volume (or of one), as CSI snapshots.
    async fn all_snapshots(&self, only_volume: Option<&str>) -> CsiResult<Vec<(String, SnapshotView, u64)>> {
        let mut out = Vec::new();
        for v in self.manager.volumes().await? {
            if only_volume.is_some_and(|o| o != v.view.name) {
                continue;
            }
            for s in self.manager.snapshots(&v.view.name).await? {
                // The snapshot a backup took for itself is part of that backup, not a CSI snapshot of its own.
                if !s.removed && s.name != "volume-head" && !s.labels.contains_key("corral.io/backup") {
                    out.push((v.view.name.clone(), s, v.view.size));
                }
            }
        }
        Ok(out)
    }

    async fn create_snapshot_impl(&self, req: CreateSnapshotRequest) -> CsiResult<CreateSnapshotResponse> {
        let volume = required("source_volume_id", &req.source_volume_id)?;
        let name = required("name", &req.name)?;
        manager_name("snapshot name", name)?;
        if let SnapshotKind::Backup { target } = snapshot_kind(&req.parameters)? {
            let snapshot = self.create_backup_snapshot(volume, name, &target).await?;
            return Ok(CreateSnapshotResponse {
                snapshot: Some(snapshot),
            });
        }
        let _guard = self.in_flight.begin(volume)?;
        for (vol, s, size) in self.all_snapshots(None).await? {
            if s.name == name {
                if vol != volume {
                    return Err(CsiError::AlreadyExists(format!(
                        "snapshot {name} exists on volume {vol}, not on {volume}"
                    )));
                }
                return Ok(CreateSnapshotResponse {
                    snapshot: Some(csi_snapshot(&vol, &s, size)),
                });
            }
        }
        let v = self
            .manager
            .volume(volume)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("source volume {volume} does not exist")))?;
        // Listed while the engine runs: a detached volume shows the snapshots the manager recorded when it last
        // listed them through the engine, so the list is taken (and recorded) before the volume is detached again.
        let listed = self
            .with_engine(&v, async || {
                self.manager.create_snapshot(volume, name).await?;
                self.manager.snapshots(volume).await
            })
            .await?;
        let s = listed
            .into_iter()
            .find(|s| s.name == name && !s.removed)
            .ok_or_else(|| {
                CsiError::Internal(format!("snapshot {name} of {volume} was taken but is not listed"))
            })?;
        Ok(CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(volume, &s, v.view.size)),
        })
    }

    async fn delete_snapshot_impl(&self, req: DeleteSnapshotRequest) -> CsiResult<DeleteSnapshotResponse> {
        let id = required("snapshot_id", &req.snapshot_id)?;
        let (volume, snapshot) = match SnapshotId::parse(id) {
            Some(SnapshotId::InVolume { volume, snapshot }) => (volume, snapshot),
            Some(SnapshotId::Backup {
                target,
                volume,
                backup,
            }) => {
                self.delete_backup_snapshot(&target, &volume, &backup).await?;
                return Ok(DeleteSnapshotResponse {});
            }
            // An ID this plugin never hands out names nothing.
            None => return Ok(DeleteSnapshotResponse {}),
        };
        let _guard = self.in_flight.begin(&volume)?;
        let Some(v) = self.manager.volume(&volume).await? else {
            return Ok(DeleteSnapshotResponse {});
        };
        let live = self
            .manager
            .snapshots(&volume)
            .await?
            .iter()
            .any(|s| s.name == snapshot && !s.removed);
        if live {
            // Listed again while attached, so the record of a detached volume drops it too.
            self.with_engine(&v, async || {
                self.manager.delete_snapshot(&volume, &snapshot).await?;
                self.manager.snapshots(&volume).await
            })
            .await?;
        }
        Ok(DeleteSnapshotResponse {})
    }

    async fn list_snapshots_impl(&self, req: ListSnapshotsRequest) -> CsiResult<ListSnapshotsResponse> {
        let only_volume = Some(req.source_volume_id.as_str()).filter(|v| !v.is_empty());
        let in_volume = |list: Vec<(String, SnapshotView, u64)>| -> Vec<Snapshot> {
            list.iter()
                .map(|(v, s, size)| csi_snapshot(v, s, *size))
                .collect()
        };
        let mut snaps: Vec<Snapshot> = if !req.snapshot_id.is_empty() {
            match SnapshotId::parse(&req.snapshot_id) {
                Some(SnapshotId::InVolume { volume, snapshot }) => {
                    if self.manager.volume(&volume).await?.is_none() {
                        Vec::new()
                    } else {
                        in_volume(
                            self.all_snapshots(Some(&volume))
                                .await?
                                .into_iter()
                                .filter(|(_, s, _)| s.name == snapshot)
                                .collect(),
                        )
                    }
                }
                Some(SnapshotId::Backup {
                    target,
                    volume,
                    backup,
                }) => {
                    self.backup_snapshots(Some((&target, &volume, &backup)), None)
                        .await?
                }
                None => Vec::new(),
            }
        } else {
            // A volume's backups outlive it: they are listed whether or not the volume still exists.
            let mut all = self.backup_snapshots(None, only_volume).await?;
            let volume_exists = match only_volume {
                Some(v) => self.manager.volume(v).await?.is_some(),
                None => true,
            };
            if volume_exists {
                all.extend(in_volume(self.all_snapshots(only_volume).await?));
            }
            all
        };
        if let Some(v) = only_volume {
            snaps.retain(|s| s.source_volume_id == v);
        }
        snaps.sort_by(|a, b| {
            (&a.source_volume_id, &a.snapshot_id).cmp(&(&b.source_volume_id, &b.snapshot_id))
        });
        let (start, end) = page(snaps.len(), req.max_entries, &req.starting_token)?;
        let next_token = if end < snaps.len() {
            end.to_string()
        } else {
            String::new()
        };
        Ok(ListSnapshotsResponse {
            entries: snaps
                .drain(start..end)
                .map(|s| list_snapshots_response::Entry { snapshot: Some(s) })
                .collect(),
            next_token,
        })
    }

    async fn expand_impl(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> CsiResult<ControllerExpandVolumeResponse> {
        let id = required("volume_id", &req.volume_id)?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("capacity_range is required".into()))?;
        let node_expansion_required = !req
            .volume_capability
            .as_ref()
            .is_some_and(|c| matches!(c.access_type, Some(volume_capability::AccessType::Block(_))));
        let _guard = self.in_flight.begin(id)?;
        let v = self
            .manager
            .volume(id)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let size = size_for(Some(range), 0)?;
        if v.view.size >= size {
            return Ok(ControllerExpandVolumeResponse {
                capacity_bytes: as_i64(v.view.size),
                node_expansion_required,
            });
        }
        if let Some(node) = &v.view.node_id {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is published on node {node}: Corral grows volumes offline (an NBD client keeps the size \
                 it connected with); unpublish it first"
            )));
        }
        self.with_engine(&v, async || self.manager.expand(id, size).await)
            .await?;
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: as_i64(size),
            node_expansion_required,
        })
    }
}

/// A page of `len` sorted entries: the token is the index of the first entry. An unknown token is ABORTED, as
/// the specification asks.
fn page(len: usize, max_entries: i32, token: &str) -> CsiResult<(usize, usize)> {
    if max_entries < 0 {
        return Err(CsiError::InvalidArgument(
            "max_entries must not be negative".into(),
        ));
    }
    let start = if token.is_empty() {
        0
    } else {
        token.parse::<usize>().ok().filter(|s| *s <= len).ok_or_else(|| {
            CsiError::Aborted(format!(
                "starting_token {token:?} is not one this plugin handed out"
            ))
        })?
    };
    let max = usize::try_from(max_entries).unwrap_or(usize::MAX);
    let end = if max == 0 {
        len
    } else {
        len.min(start.saturating_add(max))
    };
    Ok((start, end))
}

fn csi_snapshot(volume: &str, s: &SnapshotView, size: u64) -> Snapshot {
    let created = chrono::DateTime::parse_from_rfc3339(&s.created)
        .map(|t| t.with_timezone(&chrono::Utc))
        .unwrap_or_else(|_| chrono::Utc::now());
    Snapshot {
        size_bytes: as_i64(size),
        snapshot_id: SnapshotId::in_volume(volume, &s.name),
        source_volume_id: volume.to_owned(),
        creation_time: Some(prost_types::Timestamp {
            seconds: created.timestamp(),
            nanos: i32::try_from(created.timestamp_subsec_nanos()).unwrap_or(0),
        }),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

type R<T> = Result<Response<T>, Status>;

fn answer<T>(r: CsiResult<T>) -> R<T> {
    r.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(&self, r: Request<CreateVolumeRequest>) -> R<CreateVolumeResponse> {
        answer(self.create_volume_impl(r.into_inner()).await)
    }
    async fn delete_volume(&self, r: Request<DeleteVolumeRequest>) -> R<DeleteVolumeResponse> {
        answer(self.delete_volume_impl(r.into_inner()).await)
    }
    async fn controller_publish_volume(
        &self,
        r: Request<ControllerPublishVolumeRequest>,
    ) -> R<ControllerPublishVolumeResponse> {
        answer(self.publish_impl(r.into_inner()).await)
    }
    async fn controller_unpublish_volume(
        &self,
        r: Request<ControllerUnpublishVolumeRequest>,
    ) -> R<ControllerUnpublishVolumeResponse> {
        answer(self.unpublish_impl(r.into_inner()).await)
    }
    async fn validate_volume_capabilities(
        &self,
        r: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> R<ValidateVolumeCapabilitiesResponse> {
        answer(self.validate_impl(r.into_inner()).await)
    }
    async fn list_volumes(&self, r: Request<ListVolumesRequest>) -> R<ListVolumesResponse> {
        answer(self.list_volumes_impl(r.into_inner()).await)
    }
    async fn get_capacity(&self, r: Request<GetCapacityRequest>) -> R<GetCapacityResponse> {
        answer(self.get_capacity_impl(r.into_inner()).await)
    }
    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> R<ControllerGetCapabilitiesResponse> {
        use rpc::Type;
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::PublishUnpublishVolume,
            Type::CloneVolume,
            Type::CreateDeleteSnapshot,
            Type::ListVolumes,
            Type::ListSnapshots,
            Type::ExpandVolume,
            Type::GetCapacity,
        ]
        .into_iter()
        .map(|t| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t.into() },
            )),
        })
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse { capabilities }))
    }
    async fn create_snapshot(&self, r: Request<CreateSnapshotRequest>) -> R<CreateSnapshotResponse> {
        answer(self.create_snapshot_impl(r.into_inner()).await)
    }
    async fn delete_snapshot(&self, r: Request<DeleteSnapshotRequest>) -> R<DeleteSnapshotResponse> {
        answer(self.delete_snapshot_impl(r.into_inner()).await)
    }
    async fn list_snapshots(&self, r: Request<ListSnapshotsRequest>) -> R<ListSnapshotsResponse> {
        answer(self.list_snapshots_impl(r.into_inner()).await)
    }
    async fn controller_expand_volume(
        &self,
        r: Request<ControllerExpandVolumeRequest>,
    ) -> R<ControllerExpandVolumeResponse> {
        answer(self.expand_impl(r.into_inner()).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(req: i64, lim: i64) -> CapacityRange {
        CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        }
    }

    #[test]
    fn sizes_round_up_to_blocks_and_respect_the_limit() {
        assert_eq!(size_for(None, 0).unwrap(), crate::DEFAULT_VOLUME_SIZE);
        assert_eq!(size_for(Some(&range(1, 0)), 0).unwrap(), 4096);
        assert_eq!(size_for(Some(&range(8192, 8192)), 0).unwrap(), 8192);
        assert_eq!(size_for(Some(&range(0, 1 << 20)), 0).unwrap(), 1 << 20);
        assert!(matches!(
            size_for(Some(&range(5000, 6000)), 0),
            Err(CsiError::OutOfRange(_))
        ));
        assert!(matches!(
            size_for(Some(&range(0, 1 << 20)), 2 << 20),
            Err(CsiError::OutOfRange(_))
        ));
        assert!(matches!(
            size_for(Some(&range(-1, 0)), 0),
            Err(CsiError::InvalidArgument(_))
        ));
        // A clone takes at least its source's size.
        assert_eq!(size_for(Some(&range(4096, 0)), 1 << 20).unwrap(), 1 << 20);
    }

    #[test]
    fn pages_follow_tokens_and_unknown_tokens_abort() {
        assert_eq!(page(5, 2, "").unwrap(), (0, 2));
        assert_eq!(page(5, 2, "4").unwrap(), (4, 5));
        assert_eq!(page(5, 0, "").unwrap(), (0, 5));
        assert!(matches!(page(5, 2, "x"), Err(CsiError::Aborted(_))));
        assert!(matches!(page(5, 2, "6"), Err(CsiError::Aborted(_))));
        assert!(matches!(page(5, -1, ""), Err(CsiError::InvalidArgument(_))));
    }
}
