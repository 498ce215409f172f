//! The Node service: stage an attached volume as a block device (and a file system on it), publish it to the
//! CO's target paths, report usage, grow the file system. What is staged is recorded in the state directory
//! ([`staging`]); a restarted plugin reads the records and carries on with what still runs.

pub mod host;
pub mod staging;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tonic::{Request, Response, Status};

use crate::capability::{self, Access};
use crate::controller::{CONTEXT_FS_TYPE, CONTEXT_NBD_TCP, CONTEXT_NBD_UNIX};
use crate::error::{CsiError, CsiResult};
use crate::in_flight::InFlight;
use crate::manager_api::ManagerApi;
use crate::proto::node_server::Node;
use crate::proto::node_service_capability::{self, rpc};
use crate::proto::*;
use staging::{StagedVolume, StateDir};

pub struct NodeService {
    pub node_id: String,
    pub manager: ManagerApi,
    pub state: StateDir,
    pub in_flight: InFlight,
    /// nbdfuse processes this plugin started (reaped on unstage); after a restart they belong to the init process.
    children: Mutex<HashMap<String, std::process::Child>>,
}

fn required<'a>(what: &str, v: &'a str) -> CsiResult<&'a str> {
    if v.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{what} is required")));
    }
    Ok(v)
}

/// Volume IDs become file names in the state directory: only manager volume names are accepted.
fn volume_name(id: &str) -> CsiResult<&str> {
    let id = required("volume_id", id)?;
    corral_disk::identity::check_path_component("volume_id", id)
        .map_err(|_| CsiError::NotFound(format!("volume {id:?} is not a Corral volume")))?;
    Ok(id)
}

impl NodeService {
    pub fn new(node_id: String, manager: ManagerApi, state: StateDir) -> Self {
        Self {
            node_id,
            manager,
            state,
            in_flight: InFlight::default(),
            children: Mutex::new(HashMap::new()),
        }
    }

    /// Reads what an earlier run staged and logs whether it still stands (a restarted plugin keeps serving it).
    pub async fn recover(&self) -> CsiResult<usize> {
        let all = self.state.all()?;
        for v in &all {
            let healthy = self.healthy(v).await;
            tracing::info!(volume = %v.volume_id, staging = %v.staging_path.display(), healthy, "found staged volume");
        }
        Ok(all.len())
    }

    /// nbdfuse alive, the loop device over its file, and the file system mounted when there is one.
    async fn healthy(&self, v: &StagedVolume) -> bool {
        let fuse_dir = self.state.fuse_dir(&v.volume_id);
        let Some(pid) = v.fuse_pid else {
            return false;
        };
        let Some(dev) = &v.loop_device else {
            return false;
        };
        if !staging::is_our_nbdfuse(pid, &fuse_dir) {
            return false;
        }
        let loops = host::loops_of(&staging::fuse_file(&fuse_dir))
            .await
            .unwrap_or_default();
        loops.contains(dev) && (v.block || host::is_mount_point(&v.staging_path))
    }

    /// The NBD URI to connect to: the unix socket when it is on this host, else TCP; without a publish context the
    /// manager's endpoints of a volume attached here.
    async fn nbd_uri(&self, volume: &str, ctx: &HashMap<String, String>) -> CsiResult<String> {
        let socket_here = |uri: &str| {
            uri.split_once("socket=")
                .is_some_and(|(_, p)| Path::new(p).exists())
        };
        if let Some(u) = ctx.get(CONTEXT_NBD_UNIX)
            && socket_here(u)
        {
            return Ok(u.clone());
        }
        if let Some(u) = ctx.get(CONTEXT_NBD_TCP) {
            return Ok(u.clone());
        }
        let v = self
            .manager
            .volume(volume)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {volume} does not exist")))?;
        if v.view.current_node_id.as_deref() != Some(self.node_id.as_str()) || v.view.endpoints.is_empty() {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {volume} is not attached to node {} (ControllerPublishVolume first)",
                self.node_id
            )));
        }
        let unix = v
            .view
            .endpoints
            .iter()
            .find(|e| e.starts_with("nbd+unix://") && socket_here(e));
        let tcp = v.view.endpoints.iter().find(|e| e.starts_with("nbd://"));
        unix.or(tcp)
            .cloned()
            .ok_or_else(|| CsiError::FailedPrecondition(format!("volume {volume} has no NBD endpoint")))
    }

    /// Takes down whatever the record says was made, in reverse order; the record goes last.
    async fn tear_down(&self, v: &StagedVolume) -> CsiResult<()> {
        let fuse_dir = self.state.fuse_dir(&v.volume_id);
        if !v.block {
            host::unmount(&v.staging_path).await?;
        }
        staging::detach_loops(&fuse_dir).await?;
        let child = self
            .children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&v.volume_id);
        staging::stop_nbdfuse(&fuse_dir, v.fuse_pid, child).await?;
        let _ = std::fs::remove_file(fuse_dir.with_extension("log"));
        self.state.remove(&v.volume_id)
    }

    async fn stage(&self, req: NodeStageVolumeRequest) -> CsiResult<NodeStageVolumeResponse> {
        let volume = volume_name(&req.volume_id)?;
        let staging_path = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let cap = capability::check(
            req.volume_capability
                .as_ref()
                .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?,
        )?;
        let _guard = self.in_flight.begin(volume)?;
        let (block, fs, flags) = match &cap.access {
            Access::Block => (true, None, Vec::new()),
            Access::Mount { fs_type, flags } => {
                let fs = if fs_type.is_empty() {
                    req.volume_context
                        .get(CONTEXT_FS_TYPE)
                        .cloned()
                        .unwrap_or_else(|| "ext4".into())
                } else {
                    fs_type.clone()
                };
                (false, Some(fs), flags.clone())
            }
        };
        if let Some(old) = self.state.load(volume)? {
            if old.staging_path != staging_path || old.block != block || (!block && old.fs_type != fs) {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {volume} is staged at {} as {}: incompatible with this request",
                    old.staging_path.display(),
                    if old.block {
                        "a block device".to_owned()
                    } else {
                        old.fs_type.clone().unwrap_or_default()
                    }
                )));
            }
            if self.healthy(&old).await {
                return Ok(NodeStageVolumeResponse {});
            }
            tracing::warn!(
                volume,
                "staged volume is broken (nbdfuse or loop device gone): staging it again"
            );
            self.tear_down(&old).await?;
        }
        let uri = self.nbd_uri(volume, &req.publish_context).await?;
        let mut rec = StagedVolume {
            volume_id: volume.to_owned(),
            staging_path: staging_path.clone(),
            uri: uri.clone(),
            block,
            fs_type: fs.clone(),
            read_only: cap.read_only,
            mount_flags: flags.clone(),
            fuse_pid: None,
            loop_device: None,
            targets: Vec::new(),
        };
        self.state.save(&rec)?;
        match self.bring_up(&mut rec).await {
            Ok(()) => Ok(NodeStageVolumeResponse {}),
            Err(e) => {
                // Nothing half-made stays behind.
                if let Err(t) = self.tear_down(&rec).await {
                    tracing::error!(volume, error = %t, "cleaning up a failed stage");
                }
                Err(e)
            }
        }
    }

    async fn bring_up(&self, rec: &mut StagedVolume) -> CsiResult<()> {
        let volume = rec.volume_id.clone();
        let fuse_dir = self.state.fuse_dir(&volume);
        let log = fuse_dir.with_extension("log");
        let (pid, child) = staging::start_nbdfuse(&fuse_dir, &rec.uri, &log).await?;
        self.children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(volume.clone(), child);
        rec.fuse_pid = Some(pid);
        self.state.save(rec)?;
        let dev = host::attach_loop(&staging::fuse_file(&fuse_dir)).await?;
        rec.loop_device = Some(dev.clone());
        self.state.save(rec)?;
        if let Some(fs) = rec.fs_type.clone() {
            match host::fs_on(&dev).await? {
                None => host::make_fs(&dev, &fs).await?,
                Some(found) if found == fs => {
                    // The volume grew while unpublished (ControllerExpandVolume): grow ext4 before mounting it.
                    if fs == "ext4" && host::ext4_smaller_than_device(&dev).await? {
                        host::grow_ext4_offline(&dev).await?;
                    }
                }
                Some(found) => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "volume {volume} holds a {found} file system, not {fs}: refusing to format it"
                    )));
                }
            }
            std::fs::create_dir_all(&rec.staging_path).map_err(|e| {
                CsiError::Internal(format!("cannot create {}: {e}", rec.staging_path.display()))
            })?;
            let mut opts = rec.mount_flags.clone();
            if rec.read_only {
                opts.push("ro".into());
            }
            host::mount(&dev, &rec.staging_path, Some(&fs), &opts).await?;
        }
        Ok(())
    }

    async fn unstage(&self, req: NodeUnstageVolumeRequest) -> CsiResult<NodeUnstageVolumeResponse> {
        let volume = volume_name(&req.volume_id)?;
        let staging_path = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let _guard = self.in_flight.begin(volume)?;
        let Some(rec) = self.state.load(volume)? else {
            return Ok(NodeUnstageVolumeResponse {});
        };
        if rec.staging_path != staging_path {
            return Err(CsiError::NotFound(format!(
                "volume {volume} is staged at {}, not at {}",
                rec.staging_path.display(),
                staging_path.display()
            )));
        }
        if let Some(t) = rec.targets.iter().find(|t| host::is_mount_point(t)) {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {volume} is still published at {}: unpublish it first",
                t.display()
            )));
        }
        self.tear_down(&rec).await?;
        Ok(NodeUnstageVolumeResponse {})
    }

    async fn publish(&self, req: NodePublishVolumeRequest) -> CsiResult<NodePublishVolumeResponse> {
        let volume = volume_name(&req.volume_id)?;
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let staging_path = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let cap = capability::check(
            req.volume_capability
                .as_ref()
                .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?,
        )?;
        let _guard = self.in_flight.begin(volume)?;
        let mut rec = self.state.load(volume)?.ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "volume {volume} is not staged on this node (NodeStageVolume first)"
            ))
        })?;
        if rec.staging_path != staging_path {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {volume} is staged at {}, not at {}",
                rec.staging_path.display(),
                staging_path.display()
            )));
        }
        if matches!(cap.access, Access::Block) != rec.block {
            return Err(CsiError::AlreadyExists(format!(
                "volume {volume} is staged as {}: cannot publish it as {}",
                if rec.block {
                    "a block device"
                } else {
                    "a file system"
                },
                if rec.block {
                    "a file system"
                } else {
                    "a block device"
                }
            )));
        }
        if host::is_mount_point(&target) {
            return Ok(NodePublishVolumeResponse {});
        }
        let read_only = req.readonly || cap.read_only;
        let mk = |r: std::io::Result<()>, p: &Path| {
            r.map_err(|e| CsiError::Internal(format!("cannot create {}: {e}", p.display())))
        };
        if rec.block {
            let dev = rec.loop_device.clone().ok_or_else(|| {
                CsiError::FailedPrecondition(format!("volume {volume} has no block device"))
            })?;
            if let Some(parent) = target.parent() {
                mk(std::fs::create_dir_all(parent), parent)?;
            }
            if !target.exists() {
                mk(std::fs::File::create(&target).map(drop), &target)?;
            }
            host::bind_mount(&dev, &target, read_only).await?;
        } else {
            mk(std::fs::create_dir_all(&target), &target)?;
            host::bind_mount(&staging_path.to_string_lossy(), &target, read_only).await?;
        }
        if !rec.targets.contains(&target) {
            rec.targets.push(target);
            self.state.save(&rec)?;
        }
        Ok(NodePublishVolumeResponse {})
    }

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> CsiResult<NodeUnpublishVolumeResponse> {
        let volume = volume_name(&req.volume_id)?;
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let _guard = self.in_flight.begin(volume)?;
        host::unmount(&target).await?;
        let removed = if target.is_dir() {
            std::fs::remove_dir(&target)
        } else {
            std::fs::remove_file(&target)
        };
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(CsiError::Internal(format!(
                    "cannot remove {}: {e}",
                    target.display()
                )));
            }
        }
        if let Some(mut rec) = self.state.load(volume)?
            && rec.targets.contains(&target)
        {
            rec.targets.retain(|t| *t != target);
            self.state.save(&rec)?;
        }
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// The record of a volume whose `path` is its staging path or one of its targets; NOT_FOUND otherwise.
    fn staged_at(&self, volume_id: &str, path: &str) -> CsiResult<StagedVolume> {
        let volume = volume_name(volume_id)?;
        let path = PathBuf::from(required("volume_path", path)?);
        let rec = self
            .state
            .load(volume)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {volume} is not staged on this node")))?;
        if rec.staging_path != path && !rec.targets.contains(&path) || !path.exists() {
            return Err(CsiError::NotFound(format!(
                "volume {volume} is not staged or published at {}",
                path.display()
            )));
        }
        Ok(rec)
    }

    async fn stats(&self, req: NodeGetVolumeStatsRequest) -> CsiResult<NodeGetVolumeStatsResponse> {
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let rec = self.staged_at(&req.volume_id, &req.volume_path)?;
        let healthy = self.healthy(&rec).await;
        let condition = Some(VolumeCondition {
            abnormal: !healthy,
            message: if healthy {
                "nbdfuse, loop device and mount in place".into()
            } else {
                "nbdfuse or the loop device is gone: restage the volume".into()
            },
        });
        let usage = if rec.block {
            let dev = rec.loop_device.clone().unwrap_or_default();
            let size = host::device_size(&dev).await?;
            vec![VolumeUsage {
                available: 0,
                total: i64::try_from(size).unwrap_or(i64::MAX),
                used: 0,
                unit: volume_usage::Unit::Bytes.into(),
            }]
        } else {
            let s = nix::sys::statvfs::statvfs(Path::new(&req.volume_path))
                .map_err(|e| CsiError::Internal(format!("statvfs {}: {e}", req.volume_path)))?;
            let frsize = s.fragment_size();
            let n = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
            let blocks = s.blocks();
            vec![
                VolumeUsage {
                    available: n(s.blocks_available() * frsize),
                    total: n(blocks * frsize),
                    used: n(blocks.saturating_sub(s.blocks_free()) * frsize),
                    unit: volume_usage::Unit::Bytes.into(),
                },
                VolumeUsage {
                    available: n(s.files_available()),
                    total: n(s.files()),
                    used: n(s.files().saturating_sub(s.files_free())),
                    unit: volume_usage::Unit::Inodes.into(),
                },
            ]
        };
        Ok(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: condition,
        })
    }

    async fn expand(&self, req: NodeExpandVolumeRequest) -> CsiResult<NodeExpandVolumeResponse> {
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let rec = self.staged_at(&req.volume_id, &req.volume_path)?;
        let _guard = self.in_flight.begin(&rec.volume_id)?;
        let dev = rec.loop_device.clone().ok_or_else(|| {
            CsiError::FailedPrecondition(format!("volume {} has no block device", rec.volume_id))
        })?;
        let size = host::device_size(&dev).await?;
        let wanted = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| r.required_bytes.max(0).unsigned_abs());
        if wanted > size {
            return Err(CsiError::FailedPrecondition(format!(
                "the block device of {} has {size} bytes, less than {wanted}: Corral grows volumes offline, \
                 unstage and stage it again after ControllerExpandVolume",
                rec.volume_id
            )));
        }
        if let Some(fs) = &rec.fs_type
            && !rec.block
        {
            // ext4 was grown at stage already (offline); xfs grows only mounted.
            let ext4_done = fs == "ext4" && !host::ext4_smaller_than_device(&dev).await?;
            if !ext4_done {
                host::grow_fs(&dev, fs, &rec.staging_path).await?;
            }
        }
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
        })
    }
}

type R<T> = Result<Response<T>, Status>;

fn answer<T>(r: CsiResult<T>) -> R<T> {
    r.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(&self, r: Request<NodeStageVolumeRequest>) -> R<NodeStageVolumeResponse> {
        answer(self.stage(r.into_inner()).await)
    }
    async fn node_unstage_volume(
        &self,
        r: Request<NodeUnstageVolumeRequest>,
    ) -> R<NodeUnstageVolumeResponse> {
        answer(self.unstage(r.into_inner()).await)
    }
    async fn node_publish_volume(
        &self,
        r: Request<NodePublishVolumeRequest>,
    ) -> R<NodePublishVolumeResponse> {
        answer(self.publish(r.into_inner()).await)
    }
    async fn node_unpublish_volume(
        &self,
        r: Request<NodeUnpublishVolumeRequest>,
    ) -> R<NodeUnpublishVolumeResponse> {
        answer(self.unpublish(r.into_inner()).await)
    }
    async fn node_get_volume_stats(
        &self,
        r: Request<NodeGetVolumeStatsRequest>,
    ) -> R<NodeGetVolumeStatsResponse> {
        answer(self.stats(r.into_inner()).await)
    }
    async fn node_expand_volume(&self, r: Request<NodeExpandVolumeRequest>) -> R<NodeExpandVolumeResponse> {
        answer(self.expand(r.into_inner()).await)
    }
    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> R<NodeGetCapabilitiesResponse> {
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::ExpandVolume,
            rpc::Type::VolumeCondition,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: t.into(),
            })),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }
    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> R<NodeGetInfoResponse> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(Topology {
                segments: [(crate::TOPOLOGY_NODE_KEY.to_owned(), self.node_id.clone())].into(),
            }),
        }))
    }
}
