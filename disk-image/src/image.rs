//! [`DiskImage`]: a read-only image (raw, or qcow2 over its backing chain) with positional reads from many
//! threads at once, and its data layout. [`probe`] inspects one file without opening its backing chain.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use corral_disk::sparse::{DataRanges, SparseRead};

use crate::detect::{self, Detected};
use crate::error::{ImageError, IoContext};
use crate::qcow2::{Mapping, Qcow2, pread_zero_padded};
use crate::{ImageFormat, ImageInfo};

/// Longest backing chain followed (qemu has no limit; a real chain is a handful of layers).
pub const MAX_CHAIN_DEPTH: usize = 16;

/// A read-only disk image. `Send + Sync`; reads take `&self`.
#[derive(Debug)]
pub struct DiskImage {
    path: PathBuf,
    info: ImageInfo,
    layer: Layer,
    backing: Option<Box<DiskImage>>,
}

#[derive(Debug)]
enum Layer {
    Raw(File),
    Qcow2(Box<Qcow2>),
}

enum Opened {
    Raw(File),
    Qcow2(Box<Qcow2>),
}

/// Opens one file and identifies it (`forced` skips detection, as a recorded backing format does).
fn open_file(path: &Path, forced: Option<ImageFormat>) -> Result<(Opened, ImageInfo), ImageError> {
    let file = File::open(path).ctx("open", path)?;
    let md = file.metadata().ctx("stat", path)?;
    if !md.is_file() {
        return Err(ImageError::InvalidArgument(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    let format = match forced {
        Some(f) => f,
        None => {
            let mut head = vec![0u8; detect::PROBE_LEN.min(usize::try_from(md.len()).unwrap_or(usize::MAX))];
            file.read_exact_at(&mut head, 0).ctx("read", path)?;
            match detect::detect(&head) {
                Detected::Raw => ImageFormat::Raw,
                Detected::Qcow2 => ImageFormat::Qcow2,
                Detected::Other(format) => {
                    return Err(ImageError::UnsupportedFormat {
                        path: path.to_owned(),
                        format,
                    });
                }
            }
        }
    };
    let mut info = ImageInfo {
        format,
        virtual_size: md.len(),
        file_size: md.len(),
        allocated_size: md.blocks() * 512,
        cluster_size: None,
        qcow2_version: None,
        backing_file: None,
        backing_format: None,
        dirty: false,
    };
    let opened = match format {
        ImageFormat::Raw => Opened::Raw(file),
        ImageFormat::Qcow2 => {
            let q = Qcow2::open(file, path)?;
            let h = q.header();
            info.virtual_size = h.size;
            info.cluster_size = Some(h.cluster_size());
            info.qcow2_version = Some(h.version);
            info.backing_file = h.backing_file.as_ref().map(PathBuf::from);
            info.backing_format.clone_from(&h.backing_format);
            info.dirty = h.incompatible & crate::qcow2::header::INCOMPAT_DIRTY != 0;
            Opened::Qcow2(Box::new(q))
        }
    };
    Ok((opened, info))
}

/// Detects the format of `path` and validates its metadata (for qcow2: header, features, L1 and refcount
/// tables). The backing chain is reported as recorded, not opened.
pub fn probe(path: &Path) -> Result<ImageInfo, ImageError> {
    open_file(path, None).map(|(_, info)| info)
}

impl DiskImage {
    /// Opens an image, detecting its format, and its whole backing chain. Backing files are resolved relative
    /// to the directory of the image naming them and must lie inside the top image's directory tree (after
    /// following symlinks); loops and chains deeper than [`MAX_CHAIN_DEPTH`] are refused.
    pub fn open(path: &Path) -> Result<Self, ImageError> {
        Self::open_with(path, None)
    }

    /// Opens an image as the given format without looking at its content (use when the format is known: a
    /// raw disk whose first sector happens to look like a qcow2 header stays raw).
    pub fn open_as(path: &Path, format: ImageFormat) -> Result<Self, ImageError> {
        Self::open_with(path, Some(format))
    }

    fn open_with(path: &Path, format: Option<ImageFormat>) -> Result<Self, ImageError> {
        let top = std::fs::canonicalize(path).ctx("resolve", path)?;
        let root = top.parent().unwrap_or(Path::new("/")).to_owned();
        let mut visited = Vec::new();
        Self::open_layer(&top, format, &root, &mut visited)
    }

    fn open_layer(
        path: &Path,
        format: Option<ImageFormat>,
        root: &Path,
        visited: &mut Vec<PathBuf>,
    ) -> Result<Self, ImageError> {
        visited.push(path.to_owned());
        let (opened, info) = open_file(path, format)?;
        let layer = match opened {
            Opened::Raw(f) => Layer::Raw(f),
            Opened::Qcow2(q) => Layer::Qcow2(q),
        };
        let backing = match &info.backing_file {
            None => None,
            Some(name) => {
                let refuse = |reason: String| ImageError::BackingChain {
                    path: path.to_owned(),
                    reason,
                };
                if visited.len() > MAX_CHAIN_DEPTH {
                    return Err(refuse(format!(
                        "backing chain deeper than {MAX_CHAIN_DEPTH} images"
                    )));
                }
                let dir = path.parent().unwrap_or(Path::new("/"));
                let joined = dir.join(name);
                let resolved = std::fs::canonicalize(&joined).map_err(|e| {
                    refuse(format!(
                        "backing file {} ({}) cannot be opened: {e}",
                        name.display(),
                        joined.display()
                    ))
                })?;
                if !resolved.starts_with(root) {
                    return Err(refuse(format!(
                        "backing file {} resolves to {}, outside the image's directory {}",
                        name.display(),
                        resolved.display(),
                        root.display()
                    )));
                }
                if visited.contains(&resolved) {
                    return Err(refuse(format!(
                        "backing file {} refers back to {} (the chain loops)",
                        name.display(),
                        resolved.display()
                    )));
                }
                let bformat = match info.backing_format.as_deref() {
                    None | Some("") => None,
                    Some("raw") => Some(ImageFormat::Raw),
                    Some("qcow2") => Some(ImageFormat::Qcow2),
                    Some(other) => {
                        return Err(ImageError::UnsupportedFeature {
                            path: path.to_owned(),
                            feature: format!("backing file format {other:?} (raw and qcow2 are read)"),
                        });
                    }
                };
                Some(Box::new(Self::open_layer(&resolved, bformat, root, visited)?))
            }
        };
        Ok(DiskImage {
            path: path.to_owned(),
            info,
            layer,
            backing,
        })
    }

    /// What the top file is (format, sizes, recorded backing file).
    pub fn info(&self) -> &ImageInfo {
        &self.info
    }

    /// The top file's resolved path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The backing image, if any.
    pub fn backing(&self) -> Option<&DiskImage> {
        self.backing.as_deref()
    }

    /// Virtual size in bytes.
    pub fn size(&self) -> u64 {
        self.info.virtual_size
    }

    /// Fills `buf` with the image content at `offset`: unallocated clusters come from the backing chain, bytes
    /// past the virtual size (and past a backing image's size) read as zeros.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let size = self.size();
        let n = usize::try_from(size.saturating_sub(offset).min(buf.len() as u64)).unwrap_or(0);
        let (inside, past) = buf.split_at_mut(n);
        past.fill(0);
        if inside.is_empty() {
            return Ok(());
        }
        match &self.layer {
            Layer::Raw(f) => pread_zero_padded(f, inside, offset),
            Layer::Qcow2(q) => q.read_at(inside, offset, &|dst, at| match &self.backing {
                Some(b) => b.read_exact_at(dst, at),
                None => {
                    dst.fill(0);
                    Ok(())
                }
            }),
        }
        .map_err(|e| io::Error::new(e.kind(), format!("read {} at {offset}: {e}", self.path.display())))
    }

    /// The ranges of `range` (clipped to the virtual size) that hold data anywhere in the chain, ascending,
    /// merged. Everything else reads as zeros. Raw files report their `SEEK_DATA` layout; qcow2 reports
    /// allocated (plain or compressed) clusters, zero clusters as holes, and the backing image's data under
    /// unallocated clusters.
    pub fn allocated_ranges(&self, range: Range<u64>) -> io::Result<Vec<Range<u64>>> {
        let mut out = Vec::new();
        self.collect_ranges(range, &mut out)?;
        Ok(out)
    }

    fn collect_ranges(&self, range: Range<u64>, out: &mut Vec<Range<u64>>) -> io::Result<()> {
        let end = range.end.min(self.size());
        if range.start >= end {
            return Ok(());
        }
        let push = |out: &mut Vec<Range<u64>>, r: Range<u64>| match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ if r.start < r.end => out.push(r),
            _ => {}
        };
        match &self.layer {
            Layer::Raw(f) => {
                for r in corral_disk::sparse::data_extents(f, range.start..end) {
                    push(out, r?);
                }
                Ok(())
            }
            Layer::Qcow2(q) => q.visit(range.start..end, &mut |r, m| {
                match m {
                    Mapping::Data(_) | Mapping::Compressed { .. } => push(out, r),
                    Mapping::Zero => {}
                    Mapping::Unallocated => {
                        if let Some(b) = &self.backing {
                            let mut sub = Vec::new();
                            b.collect_ranges(r, &mut sub)?;
                            for s in sub {
                                push(out, s);
                            }
                        }
                    }
                }
                Ok(())
            }),
        }
    }

    /// The underlying top file (for `fstat`, hashing).
    pub fn file(&self) -> &File {
        match &self.layer {
            Layer::Raw(f) => f,
            Layer::Qcow2(q) => q.file(),
        }
    }
}

impl SparseRead for DiskImage {
    fn size(&self) -> u64 {
        self.info.virtual_size
    }

    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        match self.allocated_ranges(range) {
            Ok(v) => Box::new(v.into_iter().map(Ok)),
            Err(e) => Box::new(std::iter::once(Err(e))),
        }
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.info.virtual_size)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "read of {} bytes at {offset} is past the virtual size {} of {}",
                    buf.len(),
                    self.info.virtual_size,
                    self.path.display()
                ),
            ));
        }
        DiskImage::read_exact_at(self, buf, offset)
    }
}
