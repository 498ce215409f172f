//! The rules every Corral crate that keeps data on a disk follows, at the bottom of the crate graph so that any
//! crate can use them without depending on a daemon: the block size volumes and replica files are addressed in
//! ([`BLOCK_SIZE`]), the one crash-safe way to replace or publish a file ([`durable`]), a disk's identity and the
//! rule for names that become path components ([`identity`]), and the sparse-file primitives every reader and
//! writer of volume data shares ([`sparse`]).

pub mod durable;
pub mod identity;
pub mod sparse;

/// The block of a Corral volume, in bytes: volume sizes are multiples of it, a replica's location map and hole
/// punching work in it, and zero detection keeps holes at its granularity.
pub const BLOCK_SIZE: u64 = 4096;

/// [`BLOCK_SIZE`] as a buffer length.
#[allow(clippy::cast_possible_truncation)] // 4096 fits in every usize
pub const BLOCK_BYTES: usize = BLOCK_SIZE as usize;
