//! Corral manager: the control plane of a Corral cluster. It owns the state store (embedded redb or etcd, typed
//! spec/status documents with optimistic concurrency and watches), the resources (nodes and disks, volumes,
//! engines, replicas, settings, snapshots), the controllers that turn volume specs into running `corral-replica`
//! and `corral-engine` processes on each node (supervised, restarted, re-adopted after a manager restart), the REST
//! API (`/v1/...`, every call authenticated by a bearer token with a role: [`token`]), the web UI at `/` ([`ui`])
//! and the user CLI `corral` (its REST client is [`client`]).

pub mod api;
pub mod backing_image;
pub mod backup;
pub mod backup_target;
pub mod client;
pub mod clone;
pub mod context;
pub mod controller;
pub mod data_engine;
pub mod data_plane;
pub mod engine_generation;
pub mod error;
pub mod instance_manager;
pub mod job;
pub mod metrics;
pub mod model;
pub mod node;
pub mod pki;
pub mod process;
pub mod runtime;
pub mod scheduler;
pub mod server;
pub mod setting;
pub mod snapshot;
pub mod store;
pub mod token;
pub mod ui;
pub mod v2;
pub mod volume;
pub mod volume_engine;
