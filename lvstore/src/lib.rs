//! The v2 data engine's store: one logical-volume store (lvstore) per disk, on a raw block device or a
//! preallocated file, holding many thin lvols — each replica a chain of them — the way SPDK's blobstore does for
//! Longhorn's v2 engine, without hugepages or polling cores.
//!
//! The crate owns the on-disk format ([`format`](mod@format), documented in `docs/formats.md`, "lvstore"), the metadata and
//! its crash-atomic updates (a journal of [`meta::Op`]s with shadow-paged checkpoints), cluster allocation with
//! 4 KiB sub-cluster state (a 4 KiB write into a snapshotted cluster writes 4 KiB and copies nothing), and the
//! positional data IO a replica backend serves ([`LvStore::read_at`], [`LvStore::write_at`], [`LvStore::unmap`],
//! [`LvStore::write_zeroes`], [`LvStore::flush`], [`LvStore::allocated_ranges`]). The `corral-lvstore` binary
//! is its offline tool (`info`, `check`, `ls`, ...).

mod alloc;
mod codec;
mod device;
mod error;
pub mod format;
pub mod meta;
mod store;
#[doc(hidden)]
pub mod workload;

pub use device::DataIo;
pub use error::{Error, ErrorKind, FormatError, Result};
pub use meta::{BlobId, BlobKind};
pub use store::{CheckReport, FormatOptions, LvStore, LvolInfo, OpenMode, SpaceReport};

/// Parses untrusted metadata bytes the way open does (a checkpoint image, then a journal payload), for the fuzz
/// target: must never panic, whatever the input.
pub fn parse_metadata(image: &[u8], journal_payload: &[u8], cluster_size: u64) -> Result<(), FormatError> {
    let mut meta = meta::Meta::decode(image, cluster_size)?;
    for op in meta::decode_ops(journal_payload, cluster_size)? {
        meta.apply(op, cluster_size)?;
    }
    meta.check(cluster_size, 1 << 20).map(drop)
}
