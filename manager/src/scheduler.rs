//! Replica placement: the disks that could take a replica now ([`candidates`]: on up, schedulable nodes whose
//! data plane can run it), then distinct nodes first, then distinct disks, each with room for the replica; two
//! replicas of a volume share a node only when `replica-soft-anti-affinity` allows it.

use std::collections::BTreeMap;

use crate::context::Ctx;
use crate::model::{Node, Replica};

/// A node is up when its manager's heartbeat is recent.
pub async fn node_is_up(ctx: &Ctx, n: &Node) -> bool {
    let timeout = i64::try_from(ctx.setting_u64("node-down-timeout").await).unwrap_or(15);
    crate::runtime::now() - n.status.heartbeat <= timeout
}

/// Disks that could take a replica now, with their free space after the replicas already scheduled on them.
pub struct Candidates {
    pub disks: Vec<DiskCandidate>,
    /// Up, schedulable nodes left out because their data plane cannot run a replica of the volume: why, each.
    pub lacking: Vec<String>,
}

impl Candidates {
    /// A placement failure with the nodes whose data plane was too old for the volume, if any.
    pub fn explain(&self, why: String) -> String {
        if self.lacking.is_empty() {
            why
        } else {
            format!("{why}; left out: {}", self.lacking.join("; "))
        }
    }
}

/// Disks of the volume's data engine that could take a replica of a volume needing `needs`, on nodes whose data
/// plane can run it (`crate::data_plane`).
pub async fn candidates(ctx: &Ctx, needs: &crate::data_plane::Needs) -> anyhow::Result<Candidates> {
    let engine = needs.engine;
    let nodes = ctx.db.list::<Node>().await?;
    let replicas = ctx.db.list::<Replica>().await?;
    let over = ctx
        .setting_u64("storage-over-provisioning-percentage")
        .await
        .max(1);
    let mut out = Vec::new();
    let mut lacking = Vec::new();
    for n in &nodes {
        if !n.data.spec.allow_scheduling || !node_is_up(ctx, &n.data).await {
            continue;
        }
        if let Some(why) =
            crate::data_plane::lacking(&n.name, &n.data, needs, crate::data_plane::Role::Replica)
        {
            lacking.push(why);
            continue;
        }
        for (disk, d) in &n.data.spec.disks {
            let Some(st) = n.data.status.disks.get(disk) else {
                continue;
            };
            if !d.allow_scheduling || !st.error.is_empty() || d.engine != engine {
                continue;
            }
            let scheduled: u64 = replicas
                .iter()
                .filter(|r| r.data.spec.node_id == n.name && r.data.spec.disk == *disk)
                .map(|r| r.data.spec.size)
                .sum();
            let usable = st.storage_maximum.saturating_sub(d.storage_reserved);
            let limit = u64::try_from(u128::from(usable) * u128::from(over) / 100).unwrap_or(u64::MAX);
            out.push(DiskCandidate {
                node_id: n.name.clone(),
                disk: disk.clone(),
                disk_uuid: d.disk_uuid.clone(),
                path: d.path.clone(),
                free: limit.saturating_sub(scheduled),
            });
        }
    }
    Ok(Candidates { disks: out, lacking })
}

/// A disk that could take a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCandidate {
    pub node_id: String,
    pub disk: String,
    pub disk_uuid: String,
    pub path: String,
    /// Bytes still free for replicas: usable space × over-provisioning − scheduled.
    pub free: u64,
}

/// Where one new replica goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node_id: String,
    pub disk: String,
    pub disk_uuid: String,
    pub path: String,
}

/// [`place`] over the disks of `engine` (`candidates` holds only those): with none at all, says so.
pub fn place_on(
    engine: crate::model::DataEngine,
    candidates: Vec<DiskCandidate>,
    existing: &[(String, String)],
    count: usize,
    size: u64,
    soft_anti_affinity: bool,
) -> Result<Vec<Placement>, String> {
    if candidates.is_empty() && count > 0 {
        return Err(format!(
            "cannot place a {engine} replica: no schedulable {engine} disk (add one with `corral node disk-add \
             NODE DISK PATH --disk-engine {engine}`)"
        ));
    }
    place(candidates, existing, count, size, soft_anti_affinity)
}

/// Picks disks for `count` new replicas of `size` bytes. `existing` lists (node, disk) of the volume's healthy
/// replicas. Fails with a message naming what is missing.
pub fn place(
    mut candidates: Vec<DiskCandidate>,
    existing: &[(String, String)],
    count: usize,
    size: u64,
    soft_anti_affinity: bool,
) -> Result<Vec<Placement>, String> {
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_disk: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (n, d) in existing {
        *per_node.entry(n.clone()).or_default() += 1;
        *per_disk.entry((n.clone(), d.clone())).or_default() += 1;
    }
    let mut out = Vec::new();
    for _ in 0..count {
        let best = candidates
            .iter_mut()
            .filter(|c| c.free >= size)
            .filter(|c| soft_anti_affinity || !per_node.contains_key(&c.node_id))
            // Fewest replicas of this volume on the node, then on the disk, then the most free space.
            .min_by_key(|c| {
                (
                    per_node.get(&c.node_id).copied().unwrap_or(0),
                    per_disk
                        .get(&(c.node_id.clone(), c.disk.clone()))
                        .copied()
                        .unwrap_or(0),
                    std::cmp::Reverse(c.free),
                )
            });
        let Some(c) = best else {
            let why = if soft_anti_affinity {
                "no schedulable disk has room".to_owned()
            } else {
                "no other schedulable node has a disk with room and replica-soft-anti-affinity is false"
                    .to_owned()
            };
            return Err(format!(
                "cannot place replica {} of {count} ({} bytes): {why}",
                out.len() + 1,
                size
            ));
        };
        c.free -= size;
        *per_node.entry(c.node_id.clone()).or_default() += 1;
        *per_disk.entry((c.node_id.clone(), c.disk.clone())).or_default() += 1;
        out.push(Placement {
            node_id: c.node_id.clone(),
            disk: c.disk.clone(),
            disk_uuid: c.disk_uuid.clone(),
            path: c.path.clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(node: &str, disk: &str, free: u64) -> DiskCandidate {
        DiskCandidate {
            node_id: node.into(),
            disk: disk.into(),
            disk_uuid: format!("{node}-{disk}"),
            path: format!("/d/{node}/{disk}"),
            free,
        }
    }

    #[test]
    fn replicas_spread_over_nodes_before_sharing_one() {
        let c = vec![
            disk("a", "1", 100),
            disk("a", "2", 100),
            disk("b", "1", 50),
            disk("c", "1", 10),
        ];
        let p = place(c, &[], 3, 10, true).unwrap();
        let nodes: Vec<_> = p.iter().map(|p| p.node_id.as_str()).collect();
        assert_eq!(nodes, ["a", "b", "c"]);
    }

    #[test]
    fn one_node_takes_three_replicas_on_distinct_disks_only_with_soft_anti_affinity() {
        let c = vec![disk("a", "1", 100), disk("a", "2", 100), disk("a", "3", 100)];
        let p = place(c.clone(), &[], 3, 10, true).unwrap();
        let mut disks: Vec<_> = p.iter().map(|p| p.disk.clone()).collect();
        disks.sort();
        assert_eq!(disks, ["1", "2", "3"]);
        let err = place(c, &[], 3, 10, false).unwrap_err();
        assert!(err.contains("replica-soft-anti-affinity"), "{err}");
    }

    #[test]
    fn a_replacement_avoids_nodes_that_hold_the_volume_and_disks_without_room() {
        let c = vec![
            disk("a", "1", 100),
            disk("b", "1", 100),
            disk("c", "1", 5),
            disk("d", "1", 100),
        ];
        let existing = [("a".to_owned(), "1".to_owned()), ("b".to_owned(), "1".to_owned())];
        let p = place(c, &existing, 1, 10, false).unwrap();
        assert_eq!(p[0].node_id, "d");
    }
}
