//! Corral's CSI plugin: the Container Storage Interface v1 (Identity, Controller and Node services) served on a
//! unix socket, so an orchestrator such as Kubernetes provisions, attaches, snapshots, clones and expands Corral
//! volumes. The controller side is a translation onto the manager's REST API (`corral_api::client`); the node side
//! turns an attached volume's NBD export into a block device (`nbdfuse` + a loop device: this kernel kind has no
//! NBD client), makes a file system on first use, mounts it, and keeps what it staged in a state directory so a
//! restarted plugin finds its volumes again.

pub mod backup_snapshot;
pub mod capability;
pub mod controller;
pub mod error;
pub mod identity;
pub mod in_flight;
pub mod manager_api;
pub mod node;
pub mod parameters;
pub mod server;
pub mod snapshot_id;

/// The CSI v1 wire types and service traits generated from `proto/csi/v1/csi.proto`.
#[allow(clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("csi.v1");
}

/// The driver's name (the CSIDriver object and the StorageClass `provisioner` use it).
pub const DRIVER_NAME: &str = "csi.corral.io";

/// The topology key a node reports: volumes are attached to the node named by it.
pub const TOPOLOGY_NODE_KEY: &str = "corral.io/node";

/// Size of a volume created without a capacity range (1 GiB).
pub const DEFAULT_VOLUME_SIZE: u64 = 1 << 30;
