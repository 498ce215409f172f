//! Backup targets, below the features that use them: the documents the cluster keeps of each configured target
//! and of the backups found on it ([`model`]; the backup feature in `crate::backup` writes and mirrors them), and
//! the [`restore_source`] of a backing image restored from a backup (its URL checked against those documents, the
//! target's credentials handed to the data source).

pub mod model;
pub mod restore_source;
