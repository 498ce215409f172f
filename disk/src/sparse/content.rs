//! [`SparseRead`]: anything that can report its size, list its data ranges and read at offsets. Plain files
//! implement it through [`FileContent`]; a replica implements it for a snapshot flattened over its chain, so the
//! same copy and sync code streams either without a temporary file.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::layout::{DataRanges, LayoutMode, data_ranges};

/// A source of sparse content: a logical size, the ranges that hold data, and positional reads.
///
/// Reads are blocking and take `&self`, so several worker threads read one source at once. Bytes outside the
/// data ranges (holes) read as zeros and are never transferred.
pub trait SparseRead: Send + Sync {
    /// Logical size in bytes; reads past it are out of range.
    fn size(&self) -> u64;

    /// Data ranges intersecting `range`, clipped to it, ascending and non-overlapping.
    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_>;

    /// Fills `buf` with the content at `offset` (holes read as zeros). Fails when `offset + buf.len()` is past
    /// [`size`](Self::size) or the source cannot be read.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl<T: SparseRead + ?Sized> SparseRead for Arc<T> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        (**self).data_ranges(range)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
}

impl<T: SparseRead + ?Sized> SparseRead for &T {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        (**self).data_ranges(range)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
}

/// A plain file as [`SparseRead`]; its size is taken once, when it is opened.
#[derive(Debug)]
pub struct FileContent {
    file: File,
    path: PathBuf,
    size: u64,
    mode: LayoutMode,
}

impl FileContent {
    /// Opens `path` read-only.
    pub fn open(path: &Path, mode: LayoutMode) -> io::Result<Self> {
        let file = File::open(path)?;
        Self::from_file(file, path, mode)
    }

    /// Wraps an already open file; `path` is kept for error messages only.
    pub fn from_file(file: File, path: &Path, mode: LayoutMode) -> io::Result<Self> {
        let size = file.metadata()?.len();
        Ok(FileContent {
            file,
            path: path.to_path_buf(),
            size,
            mode,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl SparseRead for FileContent {
    fn size(&self) -> u64 {
        self.size
    }

    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        let range = range.start.min(self.size)..range.end.min(self.size);
        data_ranges(&self.file, range, self.mode)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.size) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "read of {} bytes at {offset} is past the size {}",
                    buf.len(),
                    self.size
                ),
            ));
        }
        self.file.read_exact_at(buf, offset)
    }
}

/// Gaps up to this size between two ranges are read along with them: one larger read beats two syscalls.
const COALESCE_GAP: u64 = 64 << 10;
/// Upper bound of one coalesced read.
const COALESCE_SPAN: u64 = 1 << 20;

/// Appends the content of `ranges` (ascending, non-overlapping) to `out`, reading neighbouring small ranges with
/// one read. `scratch` is reused between calls.
pub fn read_ranges(
    src: &dyn SparseRead,
    ranges: &[Range<u64>],
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    let len: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let at = out.len();
    out.resize(at + usize::try_from(len).map_err(io::Error::other)?, 0);
    read_ranges_into(src, ranges, &mut out[at..], scratch)
}

/// Fills `out`, exactly as long as `ranges` (ascending, non-overlapping) together, with their content, reading
/// neighbouring small ranges with one read: a caller reusing a buffer of the right length pays no zeroing.
pub fn read_ranges_into(
    src: &dyn SparseRead,
    ranges: &[Range<u64>],
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    let total = out.len();
    let mut at = 0usize;
    // The next `len` bytes of `out`.
    let mut piece = |len: u64| -> io::Result<Range<usize>> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        let r = at..at + len;
        if r.end > total {
            return Err(io::Error::other("ranges are longer than the output buffer"));
        }
        at = r.end;
        Ok(r)
    };
    let mut i = 0;
    while i < ranges.len() {
        let first = &ranges[i];
        let mut j = i + 1;
        while j < ranges.len()
            && ranges[j].start.saturating_sub(ranges[j - 1].end) <= COALESCE_GAP
            && ranges[j].end - first.start <= COALESCE_SPAN
        {
            j += 1;
        }
        if j == i + 1 {
            let dst = piece(first.end - first.start)?;
            src.read_exact_at(&mut out[dst], first.start)
                .map_err(|e| io::Error::new(e.kind(), format!("read at offset {}: {e}", first.start)))?;
        } else {
            let span = first.start..ranges[j - 1].end;
            let span_len = usize::try_from(span.end - span.start).map_err(io::Error::other)?;
            scratch.resize(span_len, 0);
            src.read_exact_at(scratch, span.start)
                .map_err(|e| io::Error::new(e.kind(), format!("read at offset {}: {e}", span.start)))?;
            for r in &ranges[i..j] {
                let a = usize::try_from(r.start - span.start).map_err(io::Error::other)?;
                let b = usize::try_from(r.end - span.start).map_err(io::Error::other)?;
                let dst = piece(r.end - r.start)?;
                out[dst].copy_from_slice(&scratch[a..b]);
            }
        }
        i = j;
    }
    if piece(0)?.start != total {
        return Err(io::Error::other("ranges are shorter than the output buffer"));
    }
    Ok(())
}

#[cfg(test)]
// Fixtures spell ranges literally (single or reversed on purpose) and index small in-memory buffers.
#[allow(
    clippy::single_range_in_vec_init,
    clippy::reversed_empty_ranges,
    clippy::cast_possible_truncation
)]
mod tests {
    use super::*;

    #[test]
    fn coalesced_reads_return_exactly_the_requested_ranges() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        f.as_file().write_all_at(&data, 0).unwrap();
        let src = FileContent::open(f.path(), LayoutMode::SeekData).unwrap();
        let ranges = vec![0..10, 100..4096, 70_000..70_001, 299_000..300_000];
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        read_ranges(&src, &ranges, &mut out, &mut scratch).unwrap();
        let expect: Vec<u8> = ranges
            .iter()
            .flat_map(|r| data[r.start as usize..r.end as usize].iter().copied())
            .collect();
        assert_eq!(out, expect);
    }

    #[test]
    fn reading_past_the_size_fails() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(100).unwrap();
        let src = FileContent::open(f.path(), LayoutMode::SeekData).unwrap();
        let mut buf = [0u8; 10];
        assert!(src.read_exact_at(&mut buf, 95).is_err());
        assert!(src.read_exact_at(&mut buf, 90).is_ok());
    }
}
