//! sparse-sync owns moving sparse content: local sparse copy, fold and prune ([`local`]), copy on one host by
//! `copy_file_range` ([`extent_copy`]), and the HTTP sync protocol ([`wire`], [`receiver`], [`sender`]) used by replica rebuild, snapshot export and backing-image
//! delivery, with delta sync, whole-file skip through recorded checksums ([`record`]) and resumable transfers.
//! The HTTP side runs under mutual TLS when given the cluster's configs ([`ReceiverConfig::tls`],
//! [`SendOptions::tls`], by default the process's, [`corral_tls::installed`]); [`tls`] builds every HTTP client of
//! a Corral endpoint.
//! What it moves is any [`corral_disk::sparse::SparseRead`] (a file, a replica snapshot flattened over its chain, an
//! image); discovering a file's data ranges and punching holes are `corral_disk::sparse`'s. Holes are always kept as holes: a layer of a snapshot chain means "not written here" where it has a hole.

pub mod extent_copy;
pub mod local;
mod plan;
pub mod progress;
pub mod receiver;
pub mod record;
pub mod sender;
pub mod tls;
pub mod wire;

pub use extent_copy::{ExtentCopyOptions, ExtentCopySummary, FileExtents, Pace, SMALL_EXTENT, copy_extents};
pub use local::{LocalError, LocalSummary, copy, fold, prune};
pub use plan::DEFAULT_BATCH_SIZE;
pub use progress::Progress;
pub use receiver::{ReceiveError, ReceiveOutcome, ReceiveSink, ReceiveSummary, Receiver, ReceiverConfig};
pub use sender::{SendError, SendOptions, SendSummary, send};
pub use tls::{http_base, reqwest_tls};
pub use tokio_util::sync::CancellationToken;
pub use wire::FileChecksum;
