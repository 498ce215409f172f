//! The engine owns one volume: it serves the volume to users through a frontend (NBD), fans every write out to the
//! volume's replicas and reads from one of them, tracks replica modes (RW, WO, ERR), checks revision counters or
//! salvages at start, orchestrates snapshots, revert, expansion and rebuild, and exposes gRPC
//! `ControllerService` plus an operator CLI.

pub mod cli;
pub mod clone;
pub mod daemon;
pub mod device;
pub mod epoch;
pub mod error;
pub mod export;
pub mod frontend;
pub mod io_runtime;
pub mod metrics;
pub mod metrics_http;
pub mod nbd;
pub mod ops;
pub mod rebuild;
pub mod remote_engine;
pub mod replica_client;
pub mod service;
pub mod start;
pub mod volume;
#[cfg(test)]
mod volume_model_tests;
