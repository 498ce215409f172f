//! The block data protocol between a Corral engine (client) and its replicas (server).
//!
//! This crate owns the wire format (a fixed 32-byte little-endian frame header plus payload, see
//! [`codec`] and `README.md`), the replica-side server that serves any [`BlockBackend`] over TCP or a
//! unix socket, and the engine-side [`DataClient`]. Both sides are pipelined: many requests in flight
//! per connection, replies matched by id and allowed out of order, bounded windows instead of
//! unbounded queues, payload buffers from a reusable [`BufferPool`], and blocking backend IO run to
//! completion on each connection's own thread (optionally beside an [`IoPool`] for a backend that waits for the
//! device). Failure handling follows the engine's needs: a client that sees a timeout,
//! a protocol violation or a lost connection fails as a whole so the engine can mark the replica ERR;
//! a server that sees a protocol violation drops only that connection. What the replica stores and how
//! the engine fans IO out over replicas live in the `replica` and `engine` crates.

pub mod backend;
pub mod client;
pub mod codec;
pub mod io_counters;
pub mod metrics;
pub mod pool;
pub mod server;
mod transport;

pub use backend::{BackendError, BlockBackend, ErrorKind, VolumeInfo};
pub use client::{BlockStatus, ClientConfig, ClientError, DataClient};
pub use codec::{
    BLOCK_STATUS_RANGE_LEN, DecodeError, Decoded, FrameDecoder, FrameHeader, FrameKind, HEADER_LEN, MAGIC,
    MAX_BLOCK_STATUS_RANGES, MAX_IO, MAX_MESSAGE_LEN, MAX_NAME_LEN, RangeListError, VERSION, decode_ranges,
    encode_range,
};
pub use metrics::{ServerMetrics, ServerMetricsSnapshot};
pub use pool::{BufferPool, PooledBuf};
pub use server::{DataServer, IoPool, ServerConfig, serve_tcp, serve_unix};
