//! Level-triggered controllers of the data-plane processes and nodes, on the [`crate::runtime`]: node-local ones
//! (replicas, engines, the node heartbeat, orphans) act only on this node's daemons; the node failure detector runs
//! on the leader only. The volume controller is in [`crate::volume`].

pub mod engine;
pub mod maintenance;
pub mod node;
pub mod orphans;
pub mod replica;
