//! The status of a v2 backing image's copies (issue 21, seed 001), as the control plane keeps it: a copy is the
//! snapshot lvol `bi-NAME-disk-LVSUUID` in a v2 disk's store, reported by that disk's `serve-lvstore` daemon as a
//! `BackingImageV2CopyInfo`; here it becomes the disk's entry in the image's `diskFileStatusMap`. The rules the
//! seed gives for a status that cannot be had are in [`copy_status`], so the controller that polls the daemons
//! and the tests share them.

use corral_proto::v1;

pub use super::model::V2CopyInfo;
use super::model::{DiskFileStatus, FileState, state};
use super::strategy::CopyKind;

/// What asking a disk's daemon for a copy gave.
#[derive(Debug, Clone)]
pub enum Fetched {
    /// The daemon answered with the copy.
    Copy(v1::BackingImageV2CopyInfo),
    /// The daemon answered that it holds no such copy.
    Absent,
    /// The daemon did not answer (down, restarting, unreachable): why.
    Unreachable(String),
}

/// The disk's entry for a v2 copy of image `uuid` on node `node_id`, from what its daemon answered and the entry
/// kept before (seed 001): a copy whose status cannot be fetched is `unknown` (its last report kept, so the
/// controller deletes it only once its lvol is gone too); a copy that had a status but whose daemon no longer
/// has it (the lvol is gone) is `failed`, so it is made again; a copy of another image of the same name is
/// treated as absent.
pub fn copy_status(
    uuid: &str,
    node_id: &str,
    before: Option<&DiskFileStatus>,
    fetched: Fetched,
) -> Option<DiskFileStatus> {
    let entry = |state: FileState, progress: u32, message: String, copy: Option<V2CopyInfo>| DiskFileStatus {
        state,
        progress,
        message,
        node_id: node_id.to_owned(),
        data_engine: CopyKind::Lvol.engine(),
        v2_copy: copy,
    };
    let fetched = match fetched {
        Fetched::Copy(c) if c.uuid != uuid => Fetched::Absent,
        f => f,
    };
    match fetched {
        Fetched::Copy(c) => {
            let c = V2CopyInfo::from(c);
            let (st, progress, message) = (c.state, c.progress, c.message.clone());
            Some(entry(st, progress, message, Some(c)))
        }
        Fetched::Absent => before.map(|b| {
            entry(
                state::FAILED,
                0,
                "the copy's snapshot lvol is gone from the disk".to_owned(),
                b.v2_copy.clone(),
            )
        }),
        Fetched::Unreachable(why) => before.map(|b| {
            entry(
                state::UNKNOWN,
                b.progress,
                format!("cannot get the copy's status: {why}"),
                b.v2_copy.clone(),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DataEngine;

    fn info(state: &str, uuid: &str) -> v1::BackingImageV2CopyInfo {
        v1::BackingImageV2CopyInfo {
            name: "parrot".into(),
            uuid: uuid.into(),
            disk_uuid: "lvs-1".into(),
            size: 8 << 20,
            progress: 100,
            state: state.into(),
            current_checksum: "ab".repeat(64),
            message: String::new(),
            lvol: "bi-parrot-disk-lvs-1".into(),
        }
    }

    #[test]
    fn a_reported_copy_is_taken_as_is_and_one_that_cannot_be_fetched_is_unknown_keeping_its_last_report() {
        let ready = copy_status("u1", "n1", None, Fetched::Copy(info("ready", "u1"))).unwrap();
        assert_eq!((ready.state.as_str(), ready.progress), ("ready", 100));
        assert!(ready.is_lvol());
        let copy = ready.v2_copy.clone().unwrap();
        assert_eq!((copy.disk_uuid.as_str(), copy.size), ("lvs-1", 8 << 20));

        let unknown = copy_status(
            "u1",
            "n1",
            Some(&ready),
            Fetched::Unreachable("connection refused".into()),
        )
        .unwrap();
        assert_eq!(unknown.state, FileState::Unknown);
        assert!(unknown.message.contains("connection refused"), "{unknown:?}");
        assert_eq!(unknown.v2_copy, ready.v2_copy);
        // Never reported: nothing to say yet.
        assert_eq!(
            copy_status("u1", "n1", None, Fetched::Unreachable("down".into())),
            None
        );
    }

    #[test]
    fn a_copy_whose_lvol_is_gone_is_failed_and_one_of_another_image_of_the_name_is_absent() {
        let ready = copy_status("u1", "n1", None, Fetched::Copy(info("ready", "u1"))).unwrap();
        let gone = copy_status("u1", "n1", Some(&ready), Fetched::Absent).unwrap();
        assert_eq!((gone.state.as_str(), gone.progress), ("failed", 0));
        assert!(gone.message.contains("gone"), "{gone:?}");
        let other = copy_status("u1", "n1", Some(&ready), Fetched::Copy(info("ready", "u2"))).unwrap();
        assert_eq!(other.state, FileState::Failed);
        assert_eq!(copy_status("u1", "n1", None, Fetched::Absent), None);
    }

    #[test]
    fn records_written_before_v2_backing_images_read_as_v1() {
        let old = r#"{"spec":{"uuid":"u","sourceType":"download","parameters":{},"expectedChecksum":"",
            "minNumberOfCopies":1,"diskFileSpecMap":{"d1":{"nodeId":"n1"}},"dataEngine":"v1",
            "deletionTimestamp":null},
            "status":{"size":0,"virtualSize":0,"currentChecksum":"","diskFileStatusMap":{"d1":{"state":"ready",
            "progress":100,"message":"","nodeId":"n1"}},"diskLastRefAtMap":{},"message":""}}"#;
        let bi: super::super::model::BackingImage = serde_json::from_str(old).unwrap();
        assert_eq!(bi.spec.data_engine, DataEngine::V1);
        assert_eq!(bi.spec.disk_file_spec_map["d1"].data_engine, DataEngine::V1);
        assert_eq!(bi.status.disk_file_status_map["d1"].data_engine, DataEngine::V1);
        assert_eq!(bi.status.v2_first_copy_status, None);
        let older = old.replace(r#""dataEngine":"v1","#, "");
        let bi: super::super::model::BackingImage = serde_json::from_str(&older).unwrap();
        assert_eq!(bi.spec.data_engine, DataEngine::V1);
    }
}
