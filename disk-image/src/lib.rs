//! Corral's disk images: the raw and qcow2 files users hand us as backing images. This crate owns format detection
//! ([`probe`]; vmdk, vdi, vhdx, LUKS, qcow1 and compressed files are refused by name), a read-only image handle
//! ([`DiskImage`]: positional reads from many threads, qcow2 compressed clusters and backing chains, the data
//! layout so export and backup skip holes, and [`corral_disk::sparse::SparseRead`] so any sync/copy path can stream an
//! image), and conversion to sparse raw or to qcow2 ([`convert`], [`convert_content`]).
//!
//! Images are untrusted input on the read path of every replica that uses them. The qcow2 reader is our own,
//! synchronous and small: every offset read from the file is checked against the file before use, tables are
//! bounded, and the parser is fuzzed (`fuzz/`). Unsupported features (encryption, zstd compression, external data
//! files, extended L2, unknown incompatible bits) are refused at open with a message naming the feature.

mod cache;
mod checksum;
mod convert;
mod detect;
mod error;
#[cfg(feature = "fixtures")]
pub mod fixtures;
mod image;
pub mod qcow2;

use std::path::PathBuf;

pub use checksum::sha512_file;
pub use convert::{QCOW2_CLUSTER_BITS, convert, convert_content};
pub use error::{ErrorKind, ImageError};
pub use image::{DiskImage, MAX_CHAIN_DEPTH, probe};

/// An image format this crate reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// A plain disk: byte N of the file is byte N of the disk; holes read as zeros.
    Raw,
    /// QEMU copy-on-write v2/v3.
    Qcow2,
}

impl ImageFormat {
    /// The lower-case name used in APIs, CLIs and qemu (`raw`, `qcow2`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Qcow2 => "qcow2",
        }
    }
}

impl std::fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ImageFormat {
    type Err = ImageError;

    fn from_str(s: &str) -> Result<Self, ImageError> {
        match s {
            "raw" => Ok(Self::Raw),
            "qcow2" => Ok(Self::Qcow2),
            _ => Err(ImageError::InvalidArgument(format!(
                "unknown image format {s:?}: use raw or qcow2"
            ))),
        }
    }
}

/// What one image file is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageInfo {
    /// Detected (or given) format.
    pub format: ImageFormat,
    /// Size of the disk the image holds, in bytes (a raw file's length).
    pub virtual_size: u64,
    /// Length of the file in bytes.
    pub file_size: u64,
    /// Bytes the file occupies on disk (`st_blocks` × 512, qemu-img's "disk size").
    pub allocated_size: u64,
    /// qcow2 cluster size.
    pub cluster_size: Option<u64>,
    /// qcow2 version (2 or 3).
    pub qcow2_version: Option<u32>,
    /// Backing file name as recorded in the qcow2 header (relative to the image's directory).
    pub backing_file: Option<PathBuf>,
    /// Backing file format as recorded in the qcow2 header extension.
    pub backing_format: Option<String>,
    /// qcow2 "dirty" bit: refcounts may be stale (reads are unaffected).
    pub dirty: bool,
}
