//! The per-disk v2 daemon as a resource: one [`LvstoreDaemon`] document per v2 disk, named
//! `<node>.<disk>` ([`daemon_name`]), written by the node's own manager ([`super::controller`]).

use serde::{Deserialize, Serialize};

use crate::model::{ProcessRecord, ProcessState};
use crate::store::Resource;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LvstoreDaemon {
    pub node_id: String,
    pub disk: String,
    /// The store device (`<disk path>/lvstore.img`).
    pub device: String,
    pub state: ProcessState,
    pub process: Option<ProcessRecord>,
    /// `HOST:PORT` of its gRPC `LvstoreService` once it reported ready.
    pub address: String,
    /// Why it does not run (the device holds foreign data, cannot be created, ...), empty when it runs.
    pub message: String,
}

impl Resource for LvstoreDaemon {
    const KIND: &'static str = "lvstore";
}

/// The document (and supervised daemon) name of the store of `disk` on `node`.
pub fn daemon_name(node: &str, disk: &str) -> String {
    format!("{node}.{disk}")
}
