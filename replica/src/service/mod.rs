//! The replica as a network service: the gRPC services in [`grpc`], over a [`crate::host::ReplicaHost`].

pub mod grpc;
