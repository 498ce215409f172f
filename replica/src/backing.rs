//! The replica's read-only bottom layer: a raw or qcow2 image (through `disk-image`), shared by every replica on
//! the disk that uses it. Blocks no layer of the chain holds read from it; past its virtual size they read as
//! zeros, so the volume may be larger than the image. Its data layout (which 4 KiB blocks hold data) is taken
//! once at open and answers block status, write-zeroes and export without touching the image again.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use disk_image::DiskImage;

use corral_disk::BLOCK_SIZE;

use crate::error::{IoContext, ReplicaError, Result};

/// File name the backing-image manager gives an image inside its directory
/// (`<disk>/backing-images/<name>-<uuid>/backing`).
pub const MANAGED_IMAGE_NAME: &str = "backing";

/// What the control plane calls the backing image: its name and the SHA-512 of the file it verified. The replica
/// is told both (`--backing-image-name`, `--backing-image-checksum`) rather than deriving them from the file, so a
/// backup records the image as the manager knows it (the file's basename is always `backing`, and hashing it again
/// would read the whole image at every backup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingImageId {
    pub name: String,
    /// SHA-512 of the whole file, 128 lower-case hex digits.
    pub checksum: String,
}

impl BackingImageId {
    /// Checks the name (non-empty, printable) and the checksum (a SHA-512 in hex, optionally as `sha512:HEX`;
    /// stored as bare lower-case hex, the form the control plane shows an image's checksum in, so a backup
    /// records it alike whichever engine or caller made it).
    pub fn new(name: &str, checksum: &str) -> Result<Self> {
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(ReplicaError::InvalidArgument(format!(
                "backing image name {name:?} is empty or holds control characters"
            )));
        }
        let hex = checksum.strip_prefix("sha512:").unwrap_or(checksum);
        if hex.len() != 128 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ReplicaError::InvalidArgument(format!(
                "backing image checksum {checksum:?} is not a SHA-512 (128 hex digits, optionally as sha512:HEX)"
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            checksum: hex.to_ascii_lowercase(),
        })
    }
}

/// The open backing image of a replica.
#[derive(Debug)]
pub(crate) struct Backing {
    /// Resolved path of the image file (what `volume.meta` records).
    pub(crate) path: PathBuf,
    /// Name and SHA-512 as the control plane gave them (None when the replica was started with a bare file).
    pub(crate) id: Option<BackingImageId>,
    /// Virtual size in bytes.
    pub(crate) size: u64,
    pub(crate) image: Arc<DiskImage>,
    /// 4 KiB blocks `[start, end)` holding data, ascending and merged.
    blocks: Vec<Range<u64>>,
}

/// Resolves `--backing-file`: an image file, or a directory holding exactly one image (the backing-image
/// manager's `backing` file when present; metadata, hidden and temporary files are not images).
pub fn resolve_image_path(path: &Path) -> Result<PathBuf> {
    let md = fs::metadata(path).ctx("stat backing file", path)?;
    if !md.is_dir() {
        return fs::canonicalize(path).ctx("resolve backing file", path);
    }
    let managed = path.join(MANAGED_IMAGE_NAME);
    if managed.is_file() {
        return fs::canonicalize(&managed).ctx("resolve backing file", &managed);
    }
    let mut images = Vec::new();
    for e in fs::read_dir(path).ctx("list backing directory", path)? {
        let e = e.ctx("list backing directory", path)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let skip = name.starts_with('.')
            || [".cfg", ".json", ".meta", ".tmp", ".part", ".checksum"]
                .iter()
                .any(|s| name.ends_with(s));
        if !skip && e.file_type().ctx("stat", e.path())?.is_file() {
            images.push(e.path());
        }
    }
    match images.as_slice() {
        [one] => fs::canonicalize(one).ctx("resolve backing file", one),
        [] => Err(ReplicaError::InvalidArgument(format!(
            "backing directory {} holds no image file",
            path.display()
        ))),
        many => Err(ReplicaError::InvalidArgument(format!(
            "backing directory {} holds {} files that could be the image ({}): name one",
            path.display(),
            many.len(),
            many.iter()
                .filter_map(|p| p.file_name())
                .map(|n| n.to_string_lossy())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

impl Backing {
    /// Opens the image at `path` (a file or a directory, see [`resolve_image_path`]) and records its layout.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let path = resolve_image_path(path)?;
        let image = DiskImage::open(&path)?;
        let size = image.size();
        let mut blocks: Vec<Range<u64>> = Vec::new();
        for r in image
            .allocated_ranges(0..size)
            .ctx("read the data layout of", &path)?
        {
            let b = r.start / BLOCK_SIZE..r.end.div_ceil(BLOCK_SIZE);
            match blocks.last_mut() {
                Some(last) if last.end >= b.start => last.end = last.end.max(b.end),
                _ => blocks.push(b),
            }
        }
        tracing::info!(
            path = %path.display(), format = %image.info().format, virtual_size = size,
            data_runs = blocks.len(), "backing image opened"
        );
        Ok(Backing {
            path,
            id: None,
            size,
            image: Arc::new(image),
            blocks,
        })
    }

    /// Names the image as the control plane knows it.
    pub(crate) fn with_id(mut self, id: Option<BackingImageId>) -> Self {
        self.id = id;
        self
    }

    /// Refuses an image larger than the volume (its end would be cut off).
    pub(crate) fn fits(self, volume_size: u64) -> Result<Self> {
        if self.size > volume_size {
            return Err(ReplicaError::InvalidArgument(format!(
                "backing image {} has a virtual size of {} bytes, larger than the volume ({volume_size} bytes)",
                self.path.display(),
                self.size
            )));
        }
        Ok(self)
    }

    /// Reads `dst` at `offset`; past the image's virtual size it reads zeros.
    pub(crate) fn read(&self, dst: &mut [u8], offset: u64) -> Result<()> {
        self.image.read_exact_at(dst, offset).ctx("read", &self.path)
    }

    /// Calls `f(start, end)` for the runs of 4 KiB blocks within `[first, last)` that hold data in the image.
    pub(crate) fn data_blocks(&self, first: u64, last: u64, mut f: impl FnMut(u64, u64)) {
        let i = self.blocks.partition_point(|r| r.end <= first);
        for r in &self.blocks[i..] {
            if r.start >= last {
                break;
            }
            f(r.start.max(first), r.end.min(last));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_id_needs_a_name_and_a_sha512() {
        let sum = "AB".repeat(64);
        let id = BackingImageId::new("base", &sum).unwrap();
        assert_eq!(id.checksum, "ab".repeat(64), "stored lower case");
        assert!(BackingImageId::new("", &sum).is_err());
        assert!(BackingImageId::new("a\nb", &sum).is_err());
        assert!(
            BackingImageId::new("base", &"ab".repeat(32)).is_err(),
            "a SHA-256 is refused"
        );
        assert!(BackingImageId::new("base", &"zz".repeat(64)).is_err());
        // `sha512:HEX` is the same checksum, stored bare; another algorithm's prefix is not.
        let prefixed = BackingImageId::new("base", &format!("sha512:{sum}")).unwrap();
        assert_eq!(prefixed, id);
        assert!(BackingImageId::new("base", &format!("sha256:{}", "ab".repeat(64))).is_err());
        assert!(BackingImageId::new("base", &format!("sha512:{}", "ab".repeat(32))).is_err());
    }
}
