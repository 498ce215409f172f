//! The instance manager (`corral-im`): one per node, it owns the node's data-plane processes — `corral-engine`,
//! `corral-replica` (also `serve-lvstore`), `corral-bim`, `corral-datasource` — behind a gRPC process API
//! (`corral.v1.InstanceService`), so their lifetime is not the manager's. The manager is a client: it creates,
//! watches and deletes processes by name, and a manager that restarts or is replaced by a new version finds them
//! all still serving. The instance manager keeps its process table on disk ([`table`]) and re-adopts live
//! processes after its own restart (outside containers, where its children survive it).

pub mod build_info;
pub mod error;
pub mod metrics;
pub mod service;
pub mod table;

pub use error::ImError;

/// The instance API this build speaks. 1: ProcessCreate/Delete/Get/List/Watch/Log, VersionGet, ready-file
/// listeners, environment variables.
pub const API_VERSION: u32 = 1;
/// The oldest API a client may speak to this build.
pub const API_MIN_VERSION: u32 = 1;
