//! The backing-image manager (`corral-bim`, one per disk) owns the backing-image files of one disk directory:
//! `<disk>/backing-images/<name>-<uuid>/backing` with its `backing.cfg`. It takes a finished file over from a data
//! source by rename (no copy), copies files between disks with sparse-sync (holes stay holes), serves them over HTTP
//! (raw with ranges, or gzip), re-verifies files whose mtime changed, and re-adopts every ready file from its
//! `backing.cfg` after a restart without copying or re-hashing it (live upgrade). A disk whose identity file
//! (`corral-disk.cfg`) is missing or names another disk makes every image `unknown` and freezes all file changes.

mod adopt;
mod check;
pub mod checksum;
mod cleanup;
pub mod daemon;
pub mod datasource;
pub mod error;
mod fetch;
pub mod files;
pub mod grpc;
pub mod http;
pub mod image;
pub mod manager;
pub mod metrics;
mod peer;
pub mod ports;
mod send;
pub mod state;
mod sync;
mod verify;

/// The client side of the gRPC service (connect to another manager).
pub mod client {
    pub use crate::peer::{BimClient, connect, connect_with};
    pub use crate::send::SEND_LIMIT;
}

pub use error::BimError;
pub use files::BackingConfig;
pub use manager::{Manager, ManagerConfig};
pub use ports::PortRange;
pub use state::FileState;
