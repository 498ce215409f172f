//! The v2 data engine's replica service (issue 20, item 2): one daemon per disk (`corral-replica
//! serve-lvstore`) hosting many replicas as lvol chains in the disk's lvstore (crate `lvstore`), each served
//! over the same data protocol and gRPC services as a v1 replica, so the engine has one code path for both.
//!
//! - [`lvol`]: one replica over an lvol chain (IO, snapshot, revert, expand, purge, salvage xattrs);
//! - [`service`]: its data-protocol backend and gRPC services;
//! - [`hash`], [`clone`]: snapshot hashing, export and clone, as v1's;
//! - [`backup`]: its backup source, restore sink and backup records (xattrs) for `ReplicaBackupService`;
//! - [`daemon`]: the per-disk daemon and its `LvstoreService` (add, list, remove replicas);
//! - [`metrics`]: its Prometheus metrics (per-replica IO and latency, the store's space and journal);
//! - [`backing_image`]: the disk's copies of v2 backing images (snapshot lvols `bi-NAME-disk-LVSUUID`), and
//!   [`backing_image_cli`] to drive them on a running daemon by hand.

pub mod backing_image;
pub mod backing_image_cli;
pub mod backup;
pub mod clone;
pub mod daemon;
pub mod hash;
pub mod lvol;
pub mod metrics;
pub mod rebuild;
pub mod service;
pub mod snapshot_view;
