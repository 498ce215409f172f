//! The node's own heartbeat (every 2 s: disk identity checked or written, capacity measured) and, on the leader,
//! failing the replicas (of attached volumes) on nodes whose heartbeat stopped so the volume controller replaces
//! them.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::now;
use crate::context::Ctx;
use crate::model::{DataEngine, DiskSpec, DiskStatus, Node, Replica};

const HEARTBEAT: Duration = Duration::from_secs(2);

/// Checks (or, on a new empty disk, writes) the identity file and measures the file system (v1), or the store
/// device (v2: its size; a device that holds foreign data is an error, so nothing is placed there).
fn disk_status(path: &Path, spec: &DiskSpec) -> DiskStatus {
    let uuid = spec.disk_uuid.as_str();
    let mut st = DiskStatus::default();
    if let Err(e) = std::fs::create_dir_all(path) {
        st.error = format!("cannot create {}: {e}", path.display());
        return st;
    }
    match corral_daemon::disk::verify_disk(path, uuid) {
        Ok(()) => {}
        Err(corral_daemon::disk::DiskIdentityError::Missing { .. }) => {
            if let Err(e) = corral_daemon::disk::write_disk_config(path, uuid) {
                st.error = format!("cannot write the disk identity in {}: {e}", path.display());
                return st;
            }
        }
        Err(e) => {
            st.error = e.to_string();
            return st;
        }
    }
    if spec.engine == DataEngine::V2 {
        let dev = crate::v2::device::device_path(path);
        if let crate::v2::device::Probe::Foreign(why) = crate::v2::device::probe(&dev) {
            st.error = why;
            return st;
        }
        // A thin store: what it can hold is its size (not yet created: the size it will be created with).
        st.storage_maximum = crate::v2::device::device_bytes(&dev).unwrap_or(if spec.lvstore_size == 0 {
            crate::v2::device::DEFAULT_SIZE
        } else {
            spec.lvstore_size
        });
        st.storage_available = st.storage_maximum;
        return st;
    }
    match nix::sys::statvfs::statvfs(path) {
        Ok(v) => {
            let frag = v.fragment_size();
            st.storage_maximum = v.blocks().saturating_mul(frag);
            st.storage_available = v.blocks_available().saturating_mul(frag);
        }
        Err(e) => st.error = format!("statvfs {}: {e}", path.display()),
    }
    st
}

pub async fn heartbeat_once(ctx: &Ctx) -> anyhow::Result<()> {
    let node = ctx.db.must_get::<Node>(&ctx.cfg.node_id).await?;
    let disks: Vec<(String, DiskSpec)> = node
        .data
        .spec
        .disks
        .iter()
        .map(|(n, d)| (n.clone(), d.clone()))
        .collect();
    let statuses = tokio::task::spawn_blocking(move || {
        disks
            .into_iter()
            .map(|(n, d)| (n, disk_status(Path::new(&d.path), &d)))
            .collect::<BTreeMap<_, _>>()
    })
    .await?;
    let replicas = ctx.db.list::<Replica>().await?;
    let (im_url, im_version) = match ctx.cfg.processes.instance_manager() {
        Some(im) => (im.url.clone(), im.version_now().await),
        None => (String::new(), String::new()),
    };
    ctx.db
        .modify::<Node>(&ctx.cfg.node_id, |n| {
            n.status.heartbeat = now();
            n.status.disks = statuses.clone();
            env!("CARGO_PKG_VERSION").clone_into(&mut n.status.manager_version);
            n.status.instance_manager.clone_from(&im_url);
            n.status.instance_manager_version.clone_from(&im_version);
            for (disk, st) in &mut n.status.disks {
                st.storage_scheduled = replicas
                    .iter()
                    .filter(|r| r.data.spec.node_id == ctx.cfg.node_id && r.data.spec.disk == *disk)
                    .map(|r| r.data.spec.size)
                    .sum();
            }
            true
        })
        .await?;
    Ok(())
}

pub fn start_heartbeat(ctx: &Ctx, cancel: &CancellationToken) {
    let ctx = ctx.clone();
    let cancel = cancel.clone();
    tokio::spawn(async move {
        loop {
            if let Err(e) = heartbeat_once(&ctx).await {
                tracing::warn!(error = format!("{e:#}"), "heartbeat failed");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
    });
}

/// Leader: replicas on nodes without a recent heartbeat are failed.
pub fn start_failure_detector(ctx: &Ctx, cancel: &CancellationToken) {
    let ctx = ctx.clone();
    let cancel = cancel.clone();
    tokio::spawn(async move {
        loop {
            if let Err(e) = fail_replicas_of_down_nodes(&ctx).await {
                tracing::warn!(error = format!("{e:#}"), "node failure check failed");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
    });
}

async fn fail_replicas_of_down_nodes(ctx: &Ctx) -> anyhow::Result<()> {
    let mut down = Vec::new();
    for n in ctx.db.list::<Node>().await? {
        if !super::volume::node_is_up(ctx, &n.data).await {
            down.push(n.name);
        }
    }
    if down.is_empty() {
        return Ok(());
    }
    // Only replicas of attached volumes are failed (and so replaced): a detached volume keeps its replicas
    // through a node's outage; attaching it later fails the ones still unreachable then.
    let attached: Vec<String> = ctx
        .db
        .list::<crate::model::Volume>()
        .await?
        .into_iter()
        .filter(|v| v.data.spec.node_id.is_some())
        .map(|v| v.name)
        .collect();
    for r in ctx.db.list::<Replica>().await? {
        if down.contains(&r.data.spec.node_id)
            && r.data.spec.failed_at.is_none()
            && attached.contains(&r.data.spec.volume)
        {
            tracing::warn!(
                replica = r.name,
                node = r.data.spec.node_id,
                "node is down: failing its replica"
            );
            ctx.db
                .modify::<Replica>(&r.name, |x| {
                    x.spec.failed_at = Some(now());
                    x.status.message = format!("node {} is down", x.spec.node_id);
                    true
                })
                .await?;
        }
    }
    Ok(())
}
