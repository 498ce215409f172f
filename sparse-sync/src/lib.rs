//! sparse-sync owns everything about moving sparse files: discovering which ranges of a file hold data
//! ([`layout`]), describing any sparse source that can list its data and read at offsets ([`SyncContent`]; a
//! replica snapshot flattened over its chain is one), local sparse copy, fold and prune ([`local`]), copy on one
//! host by `copy_file_range` ([`extent_copy`]), and the HTTP
//! sync protocol ([`wire`], [`receiver`], [`sender`]) used by replica rebuild, snapshot export and backing-image
//! delivery, with delta sync, whole-file skip through recorded checksums ([`record`]) and resumable transfers.
//! Holes are always kept as holes: a layer of a snapshot chain means "not written here" where it has a hole.

mod aligned;
pub mod content;
pub mod extent_copy;
pub mod layout;
pub mod local;
mod plan;
pub mod progress;
pub mod receiver;
pub mod record;
pub mod sender;
pub mod wire;

pub use aligned::{AlignedBuf, DIRECT_IO_ALIGN};
pub use content::{FileContent, SyncContent};
pub use extent_copy::{ExtentCopyOptions, ExtentCopySummary, FileExtents, Pace, SMALL_EXTENT, copy_extents};
pub use layout::{DataExtents, DataRanges, LayoutMode, data_extents, data_ranges, punch_hole};
pub use local::{LocalError, LocalSummary, copy, fold, prune};
pub use plan::DEFAULT_BATCH_SIZE;
pub use progress::Progress;
pub use receiver::{ReceiveError, ReceiveOutcome, ReceiveSink, ReceiveSummary, Receiver, ReceiverConfig};
pub use sender::{SendError, SendOptions, SendSummary, send};
pub use tokio_util::sync::CancellationToken;
pub use wire::FileChecksum;
