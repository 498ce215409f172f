//! Corral's wire types: every gRPC service and message of package `corral.v1`, generated from the `.proto` files
//! in `proto/corral/v1` with protox (no system `protoc`). Messages derive serde so CLIs can print them as JSON.
//! Also the client side of etcd v3's API (`proto/etcd`, trimmed to what the manager's etcd store uses), so no
//! crate needs a `protoc`-built etcd client. This crate holds no logic beyond small conversions, the text form of a
//! replica's address ([`ReplicaAddress`]) and the one way clients open a gRPC channel ([`grpc`]). [`backing_image`]
//! holds the backing-image JSON types (data source file, file states) shared by the data source, the backing-image
//! manager and the manager. [`data_plane`] names what a node's data plane can do (the features `VersionGet`
//! reports).

#![allow(clippy::pedantic, clippy::cast_possible_truncation)]

pub mod backing_image;
pub mod data_plane;

/// Package `corral.v1`.
pub mod v1 {
    tonic::include_proto!("corral.v1");
}

/// etcd v3's gRPC API, client side only, with etcd's own package names (the gRPC paths depend on them).
pub mod etcd {
    /// Package `etcdserverpb`: the KV, Watch and Lease services.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    /// Package `mvccpb`: stored key-values and watch events.
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
}

pub mod engine_generation;
pub mod grpc;
pub mod replica_address;

pub use replica_address::{Endpoint, ReplicaAddress};
