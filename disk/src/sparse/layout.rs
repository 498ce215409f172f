//! Data/hole layout of a file through `SEEK_DATA`/`SEEK_HOLE`, or FIEMAP ([`LayoutMode`]).
//!
//! `SEEK_DATA` reports ranges the filesystem holds as data. On ext4 and xfs, fallocated-but-unwritten extents
//! are reported as holes when no dirty page covers them; callers that need unwritten extents to count as data
//! (Longhorn's restore relies on that) use [`LayoutMode::Fiemap`], or write real zeros instead of fallocating.

mod fiemap;

pub use fiemap::FiemapExtents;

use std::fs::File;
use std::io;
use std::ops::Range;

use rustix::fs::{FallocateFlags, SeekFrom, fallocate, seek};
use rustix::io::Errno;

/// Iterator over the data ranges of a file within a byte range, in ascending order.
///
/// Ranges are exactly what the filesystem reports (usually block-aligned), clipped to the requested range.
pub struct DataExtents<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

/// Data ranges of `file` within `range` (clipped to the file size at the time of each seek).
pub fn data_extents(file: &File, range: Range<u64>) -> DataExtents<'_> {
    DataExtents {
        file,
        pos: range.start,
        end: range.end,
    }
}

impl Iterator for DataExtents<'_> {
    type Item = io::Result<Range<u64>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.end {
            return None;
        }
        let start = match seek(self.file, SeekFrom::Data(self.pos)) {
            Ok(s) => s,
            // ENXIO: no data at or after pos (or pos at/after EOF).
            Err(Errno::NXIO) => {
                self.pos = self.end;
                return None;
            }
            Err(e) => {
                self.pos = self.end;
                return Some(Err(e.into()));
            }
        };
        if start >= self.end {
            self.pos = self.end;
            return None;
        }
        let hole = match seek(self.file, SeekFrom::Hole(start)) {
            Ok(h) => h,
            Err(e) => {
                self.pos = self.end;
                return Some(Err(e.into()));
            }
        };
        let stop = hole.min(self.end);
        self.pos = stop;
        Some(Ok(start..stop))
    }
}

/// How the data ranges of a file are discovered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LayoutMode {
    /// `SEEK_DATA`/`SEEK_HOLE`: works on every Linux filesystem (tmpfs included); unwritten extents count as holes.
    #[default]
    SeekData,
    /// `FS_IOC_FIEMAP`: every allocated extent, written, unwritten or delayed, counts as data. Not on tmpfs.
    Fiemap,
}

/// Boxed iterator over ascending, non-overlapping data ranges (what [`SparseRead`](super::SparseRead) hands out).
pub type DataRanges<'a> = Box<dyn Iterator<Item = io::Result<Range<u64>>> + Send + 'a>;

/// Data ranges of `file` within `range`, discovered the way `mode` says. Adjacent extents are merged.
pub fn data_ranges(file: &File, range: Range<u64>, mode: LayoutMode) -> DataRanges<'_> {
    match mode {
        LayoutMode::SeekData => Box::new(data_extents(file, range)),
        LayoutMode::Fiemap => Box::new(FiemapExtents::new(file, range)),
    }
}

/// Punches a hole in `file` over `[offset, offset+len)` keeping the file size; the range reads as zeros after.
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    fallocate(
        file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    )?;
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
    use std::os::unix::fs::FileExt;

    #[test]
    fn reports_only_written_ranges_and_clips_to_the_request() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 1 << 20).unwrap();
        f.write_all_at(&[2u8; 8192], 8 << 20).unwrap();
        let all: Vec<_> = data_extents(&f, 0..16 << 20).map(Result::unwrap).collect();
        assert_eq!(
            all,
            vec![(1 << 20)..(1 << 20) + 4096, (8 << 20)..(8 << 20) + 8192]
        );
        let clipped: Vec<_> = data_extents(&f, (8 << 20) + 4096..16 << 20)
            .map(Result::unwrap)
            .collect();
        assert_eq!(clipped, vec![(8 << 20) + 4096..(8 << 20) + 8192]);
    }

    #[test]
    fn fiemap_mode_counts_unwritten_extents_as_data_and_seek_mode_does_not() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        // Unwritten (preallocated) extent in the middle.
        rustix::fs::fallocate(&f, FallocateFlags::KEEP_SIZE, 4 << 20, 1 << 20).unwrap();
        f.sync_all().unwrap();
        let seek: Vec<_> = data_ranges(&f, 0..8 << 20, LayoutMode::SeekData)
            .map(Result::unwrap)
            .collect();
        assert_eq!(seek, vec![0..4096]);
        let fiemap: Vec<_> = data_ranges(&f, 0..8 << 20, LayoutMode::Fiemap)
            .map(Result::unwrap)
            .collect();
        assert_eq!(fiemap, vec![0..4096, (4 << 20)..(5 << 20)]);
        let clipped: Vec<_> = data_ranges(&f, (4 << 20) + 4096..8 << 20, LayoutMode::Fiemap)
            .map(Result::unwrap)
            .collect();
        assert_eq!(clipped, vec![(4 << 20) + 4096..(5 << 20)]);
    }

    #[test]
    fn fiemap_merges_adjacent_extents_across_many_ioctl_calls() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        // 1000 separate 4 KiB pieces: more than one FIEMAP call's worth of extents.
        let mut expect = Vec::new();
        for i in 0..1000u64 {
            f.write_all_at(&[3u8; 4096], i * 12288).unwrap();
            expect.push(i * 12288..i * 12288 + 4096);
        }
        let got: Vec<_> = data_ranges(&f, 0..u64::MAX, LayoutMode::Fiemap)
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, expect);
        let seek: Vec<_> = data_ranges(&f, 0..u64::MAX, LayoutMode::SeekData)
            .map(Result::unwrap)
            .collect();
        assert_eq!(seek, expect);
    }

    #[test]
    fn punched_range_reads_as_zero_and_is_no_longer_data() {
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(&[7u8; 3 * 4096], 0).unwrap();
        punch_hole(&f, 4096, 4096).unwrap();
        let mut buf = [9u8; 4096];
        f.read_exact_at(&mut buf, 4096).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        let ext: Vec<_> = data_extents(&f, 0..3 * 4096).map(Result::unwrap).collect();
        assert_eq!(ext, vec![0..4096, 8192..3 * 4096]);
    }
}
