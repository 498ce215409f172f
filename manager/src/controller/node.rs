//! The node's own heartbeat (every 2 s: disk identity checked or written, capacity measured) and, on the leader,
//! failing the replicas (of attached volumes) on nodes whose heartbeat stopped so the volume controller replaces
//! them.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::{DiskSpec, DiskStatus, Node, Replica};
use crate::runtime::now;

const HEARTBEAT: Duration = Duration::from_secs(2);

/// Checks (or, on a new empty disk, writes) the identity file and measures the file system (v1), or the store
/// device (v2: its size; a device that holds foreign data is an error, so nothing is placed there). What a v2 store
/// still holds free is its daemon's to say ([`heartbeat_once`] asks it).
fn disk_status(path: &Path, spec: &DiskSpec) -> DiskStatus {
    let uuid = spec.disk_uuid.as_str();
    let mut st = DiskStatus::default();
    if let Err(e) = std::fs::create_dir_all(path) {
        st.error = format!("cannot create {}: {e}", path.display());
        return st;
    }
    match corral_disk::identity::verify_disk(path, uuid) {
        Ok(()) => {}
        Err(corral_disk::identity::DiskIdentityError::Missing { .. }) => {
            if let Err(e) = corral_disk::identity::write_disk_config(path, uuid) {
                st.error = format!("cannot write the disk identity in {}: {e}", path.display());
                return st;
            }
        }
        Err(e) => {
            st.error = e.to_string();
            return st;
        }
    }
    match spec.engine.disk_capacity(path, spec.lvstore_size) {
        Ok((max, available)) => (st.storage_maximum, st.storage_available) = (max, available),
        Err(e) => st.error = e,
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
    let mut statuses = statuses;
    for (name, st) in &mut statuses {
        let v2 = node
            .data
            .spec
            .disks
            .get(name)
            .is_some_and(|d| d.engine.in_lvstore());
        if v2
            && st.error.is_empty()
            && let Some(free) = crate::v2::replica::store_free_bytes(ctx, name).await
        {
            st.storage_available = free.min(st.storage_maximum);
        }
    }
    let replicas = ctx.db.list::<Replica>().await?;
    // The data plane's version and features: the instance manager's as it answers now (kept as last known when
    // it does not answer), or this manager's own build, whose binaries run the daemons.
    let (im_url, im_version, data_plane) = match ctx.cfg.processes.instance_manager() {
        Some(im) => match im.version_now().await {
            Ok(r) => (im.url.clone(), r.shown, Some((r.version, r.features))),
            Err(shown) => (im.url.clone(), shown, None),
        },
        None => (
            String::new(),
            String::new(),
            Some((
                ctx.cfg.version.clone(),
                corral_proto::data_plane::ALL
                    .iter()
                    .map(|f| (*f).to_owned())
                    .collect(),
            )),
        ),
    };
    ctx.db
        .modify::<Node>(&ctx.cfg.node_id, |n| {
            n.status.heartbeat = now();
            n.status.disks = statuses.clone();
            n.status.manager_version.clone_from(&ctx.cfg.version);
            n.status.instance_manager.clone_from(&im_url);
            n.status.instance_manager_version.clone_from(&im_version);
            if let Some((version, features)) = &data_plane {
                n.status.data_plane_version.clone_from(version);
                n.status.data_plane_features.clone_from(features);
            }
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
        // A new leader has watched no heartbeat yet: every node gets a full timeout from now.
        let mut watch = HeartbeatWatch::default();
        loop {
            if let Err(e) = fail_replicas_of_down_nodes(&ctx, &mut watch, &cancel).await {
                // The store did not answer: heartbeats could not be written either, so what was watched says
                // nothing about the nodes.
                watch.forget();
                tracing::warn!(error = format!("{e:#}"), "node failure check failed");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
    });
}

/// The heartbeats the failure detector has seen, each with the instant (this leader's clock) it first saw that
/// value. A heartbeat older than the timeout by the wall clock is not enough to call a node down: after a store
/// outage (no etcd quorum, a leader change) every node's heartbeat is that old at once, because none could be
/// written, not because the nodes stopped. A node is down only when this leader, reading the store all along
/// (reads at most [`MAX_GAP`] apart), has also watched its heartbeat stand still for the timeout.
#[derive(Default)]
pub struct HeartbeatWatch {
    seen: HashMap<String, (i64, Instant)>,
    last_read: Option<Instant>,
}

/// Reads of the nodes further apart than this (a store that did not answer, a read that hung through an outage)
/// start the watch afresh: the nodes may not have been able to write their heartbeats in between either.
pub const MAX_GAP: Duration = Duration::from_secs(6);

impl HeartbeatWatch {
    /// A read of every node completed at `at`.
    pub fn read_at(&mut self, at: Instant) {
        if self
            .last_read
            .is_some_and(|l| at.saturating_duration_since(l) > MAX_GAP)
        {
            self.seen.clear();
        }
        self.last_read = Some(at);
    }

    /// Records `heartbeat` of `node` seen by the read at `at`; returns how long the same value has been watched.
    pub fn unchanged_for(&mut self, node: &str, heartbeat: i64, at: Instant) -> Duration {
        let seen = self
            .seen
            .entry(node.to_owned())
            .and_modify(|e| {
                if e.0 != heartbeat {
                    *e = (heartbeat, at);
                }
            })
            .or_insert((heartbeat, at));
        at.saturating_duration_since(seen.1)
    }

    /// The store did not answer: start watching afresh.
    pub fn forget(&mut self) {
        self.seen.clear();
        self.last_read = None;
    }
}

async fn fail_replicas_of_down_nodes(
    ctx: &Ctx,
    watch: &mut HeartbeatWatch,
    leading: &CancellationToken,
) -> anyhow::Result<()> {
    let timeout = ctx.setting_u64("node-down-timeout").await;
    let nodes = ctx.db.list::<Node>().await?;
    let at = Instant::now();
    watch.read_at(at);
    let mut down = Vec::new();
    let mut up = Vec::new();
    for n in nodes {
        let watched = watch.unchanged_for(&n.name, n.data.status.heartbeat, at);
        if !crate::scheduler::node_is_up(ctx, &n.data).await && watched >= Duration::from_secs(timeout) {
            down.push(n.name);
        } else {
            up.push(n.name);
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
    let replicas = ctx.db.list::<Replica>().await?;
    for r in &replicas {
        if down.contains(&r.data.spec.node_id)
            && r.data.spec.failed_at.is_none()
            && attached.contains(&r.data.spec.volume)
        {
            // A failed replica is deleted, its data with it. Only a replica whose volume keeps its data elsewhere
            // (another replica that held it, not failed, on a node that is up) is failed; the last ones stay for
            // their node's return, or for a salvage.
            let kept_elsewhere = replicas.iter().any(|o| {
                o.name != r.name
                    && o.data.spec.volume == r.data.spec.volume
                    && o.data.spec.failed_at.is_none()
                    && o.data.status.initialized
                    && up.contains(&o.data.spec.node_id)
            });
            // Leadership lost while a store call hung: what this pass read is another leader's to judge.
            if leading.is_cancelled() {
                return Ok(());
            }
            if !kept_elsewhere {
                tracing::warn!(
                    replica = r.name,
                    node = r.data.spec.node_id,
                    "node is down, but no replica on a node that is up holds the volume's data: not failing its replica"
                );
                continue;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_counts_as_stopped_only_for_as_long_as_it_was_watched() {
        let mut w = HeartbeatWatch::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // First seen (a new leader, or after the store was away): however old the value, it is watched from now.
        w.read_at(at(0));
        assert_eq!(w.unchanged_for("n1", 100, at(0)), Duration::ZERO);
        for s in [2, 4, 6, 8] {
            w.read_at(at(s));
            assert_eq!(w.unchanged_for("n1", 100, at(s)), Duration::from_secs(s));
        }
        // A new value starts the watch again.
        w.read_at(at(10));
        assert_eq!(w.unchanged_for("n1", 130, at(10)), Duration::ZERO);
        w.read_at(at(12));
        assert_eq!(w.unchanged_for("n1", 130, at(12)), Duration::from_secs(2));
        // A read that came back long after the one before (it hung through a store outage): the same old value
        // is watched afresh, the nodes could not write either.
        w.read_at(at(12) + MAX_GAP + Duration::from_secs(1));
        assert_eq!(
            w.unchanged_for("n1", 130, at(12) + MAX_GAP + Duration::from_secs(1)),
            Duration::ZERO
        );
        // The store did not answer: nothing watched counts.
        w.forget();
        w.read_at(at(40));
        assert_eq!(w.unchanged_for("n1", 130, at(40)), Duration::ZERO);
    }
}
