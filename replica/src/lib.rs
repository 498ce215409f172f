//! The replica owns one volume's copy on one disk: a chain of sparse files (a writable head over read-only
//! snapshots, optionally over a read-only backing file) in a Longhorn-v1-compatible directory layout, the block
//! location map over that chain, crash-safe snapshot/revert/expand/purge, the revision counter, snapshot
//! hashing, and the daemon that serves it: gRPC `ReplicaService` (`--listen`), the block data protocol
//! (`--data-listen`, and `--data-unix`) and gRPC `SyncAgentService` (`--sync-listen`), each on its own address (port
//! 0 picks a free one; the ready file reports them). See `docs/formats.md` for every file format.

pub mod backing;
pub mod backup;
pub mod backup_service;
mod chain;
pub mod clone;
pub mod error;
pub mod export;
pub mod extent_map;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod generation;
pub mod hash;
pub mod host;
pub mod image_cli;
mod io;
pub mod jobs;
pub mod layout;
mod local_copy;
mod locks;
pub mod meta;
pub mod model;
pub mod names;
mod purge;
pub mod rebuild;
pub mod replica;
pub mod revision;

pub use error::{ErrorKind, ReplicaError, Result};
pub use model::{ReplicaStatus, SnapshotRequest};
pub use replica::{Replica, ReplicaOptions, inspect};
pub mod cli;
pub mod daemon;
pub mod metrics;
pub mod service;
pub mod v2;
