//! Corral's wire types: every gRPC service and message of package `corral.v1`, generated from the `.proto` files
//! in `proto/corral/v1` with protox (no system `protoc`). Messages derive serde so CLIs can print them as JSON.
//! This crate holds no logic beyond small conversions.

#![allow(clippy::pedantic, clippy::cast_possible_truncation)]

/// Package `corral.v1`.
pub mod v1 {
    tonic::include_proto!("corral.v1");
}

/// Offset between a replica's gRPC control port (P) and its data-protocol port.
pub const REPLICA_DATA_PORT_OFFSET: u16 = 1;
/// Offset between a replica's gRPC control port (P) and its sync-agent gRPC port.
pub const REPLICA_SYNC_AGENT_PORT_OFFSET: u16 = 2;
