//! The engine owns one volume: it serves the volume to users through a frontend (NBD), fans every write out to the
//! volume's replicas and reads from one of them, tracks replica modes (RW, WO, ERR), checks revision counters or
//! salvages at start, orchestrates snapshots, revert, expansion and rebuild, and exposes gRPC
//! `ControllerService` plus an operator CLI.

pub mod nbd;
