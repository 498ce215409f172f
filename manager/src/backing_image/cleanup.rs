//! Which disks may lose their copy of an image: the seed's four steps for `diskLastRefAtMap`, as a pure function
//! (no store, no clock) so the order is tested on its own.
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
