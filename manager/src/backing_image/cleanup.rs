//! Which disks hold an image's copies: the disks added to reach `minNumberOfCopies` ([`disks_to_add`]) and the
//! seed's four steps for `diskLastRefAtMap` ([`last_ref_marks`]), as pure functions (no store, no clock) so the
//! order is tested on its own. Both engines use them: v1 files ([`super::image_controller`]) and v2 copies
//! ([`super::v2_controller`]).
//!
//! 1. A disk whose file no replica and no data source uses gets a timestamp (kept if it already had one); a used
//!    disk loses it.
//! 2. If fewer than `min_copies` ready files remain without a timestamp, the timestamps of disks with ready files
//!    are removed (disks on nodes not yet holding a retained copy first).
//! 3. If that is still short, disks with pending or in-progress files are retained too.
//! 4. If still short, disks with failed files are retained (a later sync can repair them).
//!
//! A disk whose timestamp is older than the wait interval is then removed from the image's spec ([`expired`]).

use std::collections::{BTreeMap, BTreeSet};

/// What one disk holds of the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileClass {
    Ready,
    /// pending, starting, in-progress (or not reported yet).
    InProgress,
    /// Failed, or unknown (its disk or node is not ready).
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskUse {
    pub disk_uuid: String,
    pub node_id: String,
    pub file: FileClass,
    /// A replica (of a volume using the image) or the data source is on this disk.
    pub in_use: bool,
}

/// The new `diskLastRefAtMap` for the disks of the image's spec.
pub fn last_ref_marks(
    disks: &[DiskUse],
    previous: &BTreeMap<String, i64>,
    min_copies: usize,
    now: i64,
) -> BTreeMap<String, i64> {
    // Step 1.
    let mut marks: BTreeMap<String, i64> = disks
        .iter()
        .filter(|d| !d.in_use)
        .map(|d| {
            (
                d.disk_uuid.clone(),
                previous.get(&d.disk_uuid).copied().unwrap_or(now),
            )
        })
        .collect();
    let retained = |marks: &BTreeMap<String, i64>, classes: &[FileClass]| {
        disks
            .iter()
            .filter(|d| !marks.contains_key(&d.disk_uuid) && classes.contains(&d.file))
            .count()
    };
    // Steps 2-4: each widens what counts as a copy and retains disks of the newly counted class.
    let steps: [&[FileClass]; 3] = [
        &[FileClass::Ready],
        &[FileClass::Ready, FileClass::InProgress],
        &[FileClass::Ready, FileClass::InProgress, FileClass::Failed],
    ];
    for classes in steps {
        let class = classes[classes.len() - 1];
        while retained(&marks, classes) < min_copies {
            let nodes: BTreeSet<&str> = disks
                .iter()
                .filter(|d| !marks.contains_key(&d.disk_uuid) && d.file != FileClass::Failed)
                .map(|d| d.node_id.as_str())
                .collect();
            // A disk on a node without a retained copy first, then by UUID (stable).
            let pick = disks
                .iter()
                .filter(|d| d.file == class && marks.contains_key(&d.disk_uuid))
                .min_by_key(|d| (nodes.contains(d.node_id.as_str()), d.disk_uuid.clone()));
            let Some(d) = pick else { break };
            marks.remove(&d.disk_uuid);
        }
    }
    marks
}

/// HA: the disks of `candidates` (disks that could take a copy and hold none in the spec) to add so that the
/// copies of `held` (the image's disks) that can serve — any class but [`FileClass::Failed`] — plus the added ones
/// reach `min_copies`: a disk on a node holding none of the image's disks first (distinct nodes), then by UUID
/// (distinct disks). A candidate whose file is failed is added but does not count. `in_use` plays no part.
pub fn disks_to_add(held: &[DiskUse], candidates: &[DiskUse], min_copies: usize) -> Vec<String> {
    let mut nodes: BTreeSet<&str> = held.iter().map(|d| d.node_id.as_str()).collect();
    let mut healthy = held.iter().filter(|d| d.file != FileClass::Failed).count();
    let mut pool: Vec<&DiskUse> = candidates.iter().collect();
    let mut out = Vec::new();
    while healthy < min_copies {
        let Some(i) =
            (0..pool.len()).min_by_key(|i| (nodes.contains(pool[*i].node_id.as_str()), &pool[*i].disk_uuid))
        else {
            break;
        };
        let d = pool.remove(i);
        nodes.insert(&d.node_id);
        if d.file != FileClass::Failed {
            healthy += 1;
        }
        out.push(d.disk_uuid.clone());
    }
    out
}

/// Disks whose timestamp is at least `wait_secs` old (0 = every marked disk, at this reconcile).
pub fn expired(marks: &BTreeMap<String, i64>, wait_secs: i64, now: i64) -> Vec<String> {
    marks
        .iter()
        .filter(|(_, at)| now.saturating_sub(**at) >= wait_secs)
        .map(|(d, _)| d.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use FileClass::*;

    fn d(uuid: &str, node: &str, file: FileClass, in_use: bool) -> DiskUse {
        DiskUse {
            disk_uuid: uuid.into(),
            node_id: node.into(),
            file,
            in_use,
        }
    }

    fn kept(disks: &[DiskUse], prev: &[(&str, i64)], min: usize) -> Vec<String> {
        let prev: BTreeMap<String, i64> = prev.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
        let marks = last_ref_marks(disks, &prev, min, 100);
        disks
            .iter()
            .filter(|d| !marks.contains_key(&d.disk_uuid))
            .map(|d| d.disk_uuid.clone())
            .collect()
    }

    #[test]
    fn the_four_steps_in_order() {
        // (case, disks, previous marks, min copies, disks that keep their file)
        type Case<'a> = (&'a str, Vec<DiskUse>, Vec<(&'a str, i64)>, usize, Vec<&'a str>);
        let cases: Vec<Case> = vec![
            (
                "step 1: unused disks are marked, used ones kept even beyond the minimum",
                vec![
                    d("a", "n1", Ready, true),
                    d("b", "n2", Ready, true),
                    d("c", "n3", Ready, false),
                ],
                vec![],
                1,
                vec!["a", "b"],
            ),
            (
                "step 2: unused ready copies are retained up to the minimum, on another node first",
                vec![
                    d("a", "n1", Ready, true),
                    d("b", "n1", Ready, false),
                    d("c", "n2", Ready, false),
                    d("e", "n3", Ready, false),
                ],
                vec![],
                2,
                vec!["a", "c"],
            ),
            (
                "step 3: in-progress copies are retained only when ready ones do not reach the minimum",
                vec![
                    d("a", "n1", Ready, false),
                    d("b", "n2", InProgress, false),
                    d("c", "n3", InProgress, false),
                    d("e", "n4", Failed, false),
                ],
                vec![],
                2,
                vec!["a", "b"],
            ),
            (
                "step 4: failed copies are retained last",
                vec![
                    d("a", "n1", Ready, false),
                    d("e", "n2", Failed, false),
                    d("f", "n3", Failed, false),
                ],
                vec![],
                3,
                vec!["a", "e", "f"],
            ),
            (
                "a failed copy is not retained while in-progress ones suffice",
                vec![d("b", "n1", InProgress, false), d("e", "n2", Failed, false)],
                vec![],
                1,
                vec!["b"],
            ),
            (
                "nothing needed: every unused disk is marked",
                vec![d("a", "n1", Ready, false), d("b", "n2", Ready, false)],
                vec![],
                0,
                vec![],
            ),
        ];
        for (what, disks, prev, min, want) in cases {
            assert_eq!(kept(&disks, &prev, min), want, "{what}");
        }
    }

    #[test]
    fn copies_are_added_on_distinct_nodes_first_then_distinct_disks_up_to_the_minimum() {
        let held = [d("a", "n1", Ready, false), d("x", "n2", Failed, false)];
        let candidates = [
            d("b", "n1", InProgress, false),
            d("c", "n2", InProgress, false),
            d("e", "n3", InProgress, false),
            d("f", "n3", InProgress, false),
        ];
        // A failed copy counts for its node but not towards the minimum.
        assert_eq!(disks_to_add(&held, &candidates, 1), Vec::<String>::new());
        assert_eq!(disks_to_add(&held, &candidates, 2), ["e"]);
        assert_eq!(disks_to_add(&held, &candidates, 3), ["e", "b"]);
        assert_eq!(disks_to_add(&held, &candidates, 9), ["e", "b", "c", "f"]);
        // A candidate holding a failed file is added but does not count.
        let with_failed = [d("b", "n4", Failed, false), d("c", "n5", InProgress, false)];
        assert_eq!(disks_to_add(&held, &with_failed, 2), ["b", "c"]);
        assert_eq!(disks_to_add(&[], &candidates, 2), ["b", "c"]);
    }

    #[test]
    fn a_mark_keeps_its_first_time_and_expiry_follows_the_wait() {
        let disks = [d("a", "n1", Ready, true), d("b", "n2", Ready, false)];
        let prev: BTreeMap<String, i64> = [("b".to_owned(), 40)].into_iter().collect();
        let marks = last_ref_marks(&disks, &prev, 1, 100);
        assert_eq!(marks.get("b"), Some(&40), "the first unused time is kept");
        assert_eq!(expired(&marks, 60, 100), vec!["b".to_owned()]);
        assert!(expired(&marks, 61, 100).is_empty());
        let fresh = last_ref_marks(&disks, &BTreeMap::new(), 1, 100);
        assert_eq!(
            expired(&fresh, 0, 100),
            vec!["b".to_owned()],
            "wait 0 = this reconcile"
        );
    }
}
