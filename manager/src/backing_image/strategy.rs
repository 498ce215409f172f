//! What differs between a v1 and a v2 backing image's copies, in one place (issue 44 item 2; the backing-image
//! side of [`crate::data_engine::Strategy`]): where a copy lives (a file of its disk's `corral-bim`, or a snapshot
//! lvol in a v2 disk's store), which disks can hold one, and whether the first prepared file is itself a copy or
//! only the source of the first lvol copy. The image's entries in its spec and status maps say the same of each
//! copy ([`DiskFileSpec::is_lvol`], [`DiskFileStatus::is_lvol`]). The controllers ask these instead of matching on
//! [`DataEngine`]: files are [`super::image_controller`]'s to make, read and clean up, lvols
//! [`super::v2_controller`]'s.

use super::model::{DiskFileSpec, DiskFileStatus};
use crate::model::DataEngine;

/// Where a copy of a backing image lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// A file under its disk's directory, made, synced, reported and deleted by the disk's `corral-bim`.
    File,
    /// The snapshot lvol `bi-NAME-disk-LVSUUID` in a v2 disk's store, made, reported and deleted by the disk's
    /// `serve-lvstore` daemon.
    Lvol,
}

impl CopyKind {
    /// The engine a copy's entry records (`dataEngine` of the image's `diskFileSpecMap` and `diskFileStatusMap`).
    pub const fn engine(self) -> DataEngine {
        match self {
            Self::File => DataEngine::V1,
            Self::Lvol => DataEngine::V2,
        }
    }
}

/// The per-engine rules of a backing image's copies, asked of the image's (or a copy entry's) [`DataEngine`].
pub trait CopyStrategy: Copy {
    /// Where the copies live.
    fn copy_kind(self) -> CopyKind;

    /// The copies are snapshot lvols ([`CopyKind::Lvol`]).
    fn copies_are_lvols(self) -> bool {
        self.copy_kind() == CopyKind::Lvol
    }

    /// The first file the data source prepares is one of the image's copies, kept and synced to other disks (v1);
    /// else it is only the source of the first lvol copy, removed once that copy is ready.
    fn first_file_is_copy(self) -> bool {
        self.copy_kind() == CopyKind::File
    }

    /// A disk of engine `disk` can hold a copy: a file serves v1 replicas, which live on v1 disks only; an lvol
    /// lives in a v2 disk's store.
    fn copy_fits(self, disk: DataEngine) -> bool;
}

impl CopyStrategy for DataEngine {
    fn copy_kind(self) -> CopyKind {
        match self {
            Self::V1 => CopyKind::File,
            Self::V2 => CopyKind::Lvol,
        }
    }

    fn copy_fits(self, disk: DataEngine) -> bool {
        self == disk
    }
}

impl DiskFileSpec {
    /// The spec entry of an lvol copy on a disk of node `node_id`.
    pub fn lvol_copy(node_id: String) -> Self {
        Self {
            node_id,
            data_engine: CopyKind::Lvol.engine(),
        }
    }

    /// The entry is an lvol copy's ([`super::v2_controller`]'s); else a file's.
    pub fn is_lvol(&self) -> bool {
        self.data_engine.copies_are_lvols()
    }
}

impl DiskFileStatus {
    /// The entry is an lvol copy's ([`super::v2_controller`]'s); else a file's.
    pub fn is_lvol(&self) -> bool {
        self.data_engine.copies_are_lvols()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v1_image_keeps_files_on_v1_disks_and_a_v2_image_lvols_in_v2_stores() {
        let (v1, v2) = (DataEngine::V1, DataEngine::V2);
        for (engine, kind) in [(v1, CopyKind::File), (v2, CopyKind::Lvol)] {
            assert_eq!(engine.copy_kind(), kind);
            assert_eq!(kind.engine(), engine);
            assert_eq!(engine.first_file_is_copy(), kind == CopyKind::File);
            assert!(engine.copy_fits(engine));
        }
        assert!(!v1.copy_fits(v2) && !v2.copy_fits(v1));
        assert!(DiskFileSpec::lvol_copy("n1".into()).is_lvol());
        assert!(!DiskFileSpec::default().is_lvol());
        assert!(!DiskFileStatus::default().is_lvol());
    }
}
