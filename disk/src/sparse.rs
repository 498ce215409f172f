//! Sparse files: which ranges of a file hold data ([`data_extents`], [`data_ranges`], [`LayoutMode`]), punching
//! holes ([`punch_hole`]), 4 KiB-aligned buffers for `O_DIRECT` ([`AlignedBuf`]), and [`SparseRead`], anything that
//! reports its size, lists its data ranges and reads at offsets (a plain file through [`FileContent`], a replica
//! snapshot flattened over its chain, a qcow2 image). Copy, sync, export and backup code reads through it; the
//! transports (`sparse-sync`) and formats (`disk-image`, `backupstore`) build on it.

mod aligned;
mod content;
mod layout;

pub use aligned::{AlignedBuf, DIRECT_IO_ALIGN};
pub use content::{FileContent, SparseRead, read_ranges, read_ranges_into};
pub use layout::{DataExtents, DataRanges, FiemapExtents, LayoutMode, data_extents, data_ranges, punch_hole};
