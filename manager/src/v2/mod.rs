//! The v2 data engine in the control plane (issue 20 item 3). A disk declares its engine when it is added
//! (`--disk-engine v2`); a v2 disk is a directory holding the identity file (as a v1 disk) and the store device
//! `lvstore.img`: a preallocated file the manager creates and formats on first use ([`crate::data_engine::device`]),
//! or a block device the administrator links there. Each node's manager runs one `corral-replica serve-lvstore` per
//! v2 disk of the node ([`controller`], a [`model::LvstoreDaemon`] document per disk, supervised like every daemon);
//! a v2 replica is added to and removed from that daemon over gRPC `LvstoreService` ([`replica`]) instead of
//! getting its own process, and serves the ordinary replica address, so engines and snapshots have one code
//! path. What the v2 replica cannot do yet is refused in one place: [`support`]; [`service`] picks a new volume's
//! engine, [`routes`] the REST API; what differs per engine is [`crate::data_engine`]'s.

pub mod cli;
pub mod controller;
pub mod model;
pub mod replica;
pub mod routes;
pub mod service;
pub mod support;
