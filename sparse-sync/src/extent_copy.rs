//! Copy on one host by the kernel: a [`FileExtents`] source (data ranges, each backed by an open file at the same
//! offsets) copied into a destination file with `copy_file_range`, which shares the blocks on a reflink file system
//! (XFS, btrfs) and copies in the kernel elsewhere (no user-space buffer, two copies fewer than a read/write loop).
//! Holes stay holes; small pieces (below [`SMALL_EXTENT`]) are read in coalesced spans and written, which beats
//! one `copy_file_range` each; pieces no file backs (a backing image read through a format) and file systems that
//! refuse `copy_file_range` fall back to reads and writes. Progress in logical bytes, cancellation between steps, a
//! rate limit (fixed, and/or asked of a [`Pace`] after every unit), writeback started as it goes, and one
//! `fdatasync` at the end, like [`crate::local::copy`].

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::local::{LocalError, LocalSummary, write_pieces};
use crate::plan::{Work, plan};
use crate::progress::Progress;
use corral_disk::sparse::{FileContent, SparseRead, read_ranges};

/// A [`SparseRead`] whose data lives in files at the same offsets, so it can be copied by the kernel.
pub trait FileExtents: SparseRead {
    /// Appends to `out` the pieces of `range` (a data range of this content), in order and covering it exactly:
    /// each with the file that holds those bytes at the same offsets, or `None` for a piece only
    /// [`SparseRead::read_exact_at`] can read.
    fn files_of<'a>(&'a self, range: Range<u64>, out: &mut Vec<(Range<u64>, Option<&'a File>)>);
}

impl FileExtents for FileContent {
    fn files_of<'a>(&'a self, range: Range<u64>, out: &mut Vec<(Range<u64>, Option<&'a File>)>) {
        out.push((range, Some(self.file())));
    }
}

/// Tells a running copy how fast it may go now; asked after every unit of work. Lets the owner of the copy back
/// off while foreground IO is busy (see the replica's rebuild).
pub trait Pace: Send + Sync + std::fmt::Debug {
    /// Upper bound of data bytes per second from now on (`None`: unlimited).
    fn rate(&self) -> Option<u64>;
}

/// Settings of [`copy_extents`].
#[derive(Debug, Clone, Default)]
pub struct ExtentCopyOptions {
    /// Upper bound of data bytes copied per second (`None` or 0: unlimited).
    pub max_rate: Option<u64>,
    /// A rate that changes during the copy; the lower of it and `max_rate` applies.
    pub pace: Option<std::sync::Arc<dyn Pace>>,
}

/// What [`copy_extents`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ExtentCopySummary {
    /// Data and holes, as [`crate::local::copy`] counts them.
    #[serde(flatten)]
    pub local: LocalSummary,
    /// Data bytes the kernel copied (`copy_file_range`, pieces of at least [`SMALL_EXTENT`]); the rest of
    /// `data_bytes` was read and written.
    pub kernel_bytes: u64,
}

/// Data bytes per unit of work: large, since no buffer is involved; small enough that cancellation, progress and
/// the rate limit act several times a second.
const BATCH: u64 = 16 << 20;
/// Data bytes per unit of work under a rate limit: a tenth of a second of the rate, within these bounds, so the
/// copy does not write a 16 MiB burst and then pause (which foreground IO would feel as stalls).
const PACED_BATCH: std::ops::RangeInclusive<u64> = (1 << 20)..=BATCH;
/// Pieces shorter than this are read (neighbours coalesced into one read) and written with `pwrite` instead of one
/// `copy_file_range` each: for a 4 KiB extent the kernel's splice set-up costs more than the copy (measured:
/// 4 KiB data / 4 KiB hole copied at 0.78x `cp --sparse=always` one `copy_file_range` per extent, `bench/rebuild`).
/// This is what cp does: big reads, and writes of the data only.
pub const SMALL_EXTENT: u64 = 64 << 10;
/// Small pieces gathered before they are read and written, bounding the buffer.
const SMALL_RUN: u64 = 1 << 20;
/// Longest single sleep of the rate limit, so cancellation is seen promptly.
const PACE_STEP: Duration = Duration::from_millis(100);

/// Copies `src` into `dst` (truncated first, then sized to `src`): large data pieces by `copy_file_range` where a
/// file backs them, small ones read in coalesced spans and written with `pwrite`, holes left as holes, then
/// `fdatasync`. On error or cancellation `dst` holds part of the result: the caller writes to a temporary name and
/// removes it.
pub fn copy_extents(
    src: &dyn FileExtents,
    dst: &File,
    opts: &ExtentCopyOptions,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<ExtentCopySummary, LocalError> {
    let size = src.size();
    dst.set_len(0)
        .map_err(|source| LocalError::Resize { size: 0, source })?;
    dst.set_len(size)
        .map_err(|source| LocalError::Resize { size, source })?;
    progress.start(size);
    let max_rate = opts.max_rate.filter(|r| *r > 0);
    let batch = match (max_rate, &opts.pace) {
        (Some(r), _) => (r / 10).clamp(*PACED_BATCH.start(), *PACED_BATCH.end()),
        // The pace may drop to a busy rate at any unit: the smallest unit keeps a slowed copy to short, even
        // steps (at 32 MiB/s, 1 MiB every 31 ms) instead of 4 MiB bursts that foreground IO feels as stalls; when
        // the pace lets the copy run free, 1 MiB per `copy_file_range` still costs next to nothing per byte.
        (None, Some(_)) => *PACED_BATCH.start(),
        (None, None) => BATCH,
    };
    let mut summary = ExtentCopySummary::default();
    let mut kernel = true;
    let mut small = SmallRun::default();
    let mut pieces = Vec::new();
    // The earliest time the next batch may start under the rate limit.
    let mut paced_until = Instant::now();
    plan(
        src,
        batch,
        |work| {
            if cancel.is_cancelled() {
                return Err(LocalError::Cancelled);
            }
            match &work {
                Work::Data { ranges, bytes } => {
                    let batch_started = Instant::now();
                    for r in ranges {
                        pieces.clear();
                        src.files_of(r.clone(), &mut pieces);
                        for (piece, file) in &pieces {
                            let len = piece.end - piece.start;
                            if kernel
                                && len >= SMALL_EXTENT
                                && let Some(f) = file
                            {
                                if copy_range(f, dst, piece.clone())? {
                                    summary.kernel_bytes += len;
                                    continue;
                                }
                                // This file system cannot copy by the kernel: read and write the rest.
                                kernel = false;
                            }
                            small.push(piece.clone());
                            if small.bytes >= SMALL_RUN {
                                small.flush(src, dst)?;
                            }
                        }
                    }
                    small.flush(src, dst)?;
                    start_writeback(dst, ranges);
                    summary.local.data_bytes += bytes;
                    summary.local.data_ranges += ranges.len() as u64;
                    let rate = match (max_rate, opts.pace.as_ref().and_then(|p| p.rate())) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    if let Some(rate) = rate.filter(|r| *r > 0) {
                        paced_until = paced_until.max(batch_started)
                            + Duration::from_secs_f64(*bytes as f64 / rate as f64);
                        pace_until(paced_until, cancel)?;
                    }
                }
                Work::Holes { ranges, bytes } => {
                    summary.local.hole_bytes += bytes;
                    summary.local.holes += ranges.len() as u64;
                }
            }
            progress.add(work.covers());
            Ok(())
        },
        LocalError::Layout,
    )?;
    if cancel.is_cancelled() {
        return Err(LocalError::Cancelled);
    }
    dst.sync_data().map_err(LocalError::Flush)?;
    Ok(summary)
}

/// Sleeps until `until`, in steps, stopping early on cancellation.
fn pace_until(until: Instant, cancel: &CancellationToken) -> Result<(), LocalError> {
    loop {
        if cancel.is_cancelled() {
            return Err(LocalError::Cancelled);
        }
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            return Ok(());
        };
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(PACE_STEP));
    }
}

/// Small data pieces waiting to be read (neighbours with one read, as the network sender does) and written. The
/// buffers are kept between runs: no allocation per run once they have grown.
#[derive(Default)]
struct SmallRun {
    ranges: Vec<Range<u64>>,
    bytes: u64,
    buf: Vec<u8>,
    scratch: Vec<u8>,
}

impl SmallRun {
    fn push(&mut self, r: Range<u64>) {
        self.bytes += r.end - r.start;
        match self.ranges.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => self.ranges.push(r),
        }
    }

    fn flush(&mut self, src: &dyn FileExtents, dst: &File) -> Result<(), LocalError> {
        if self.ranges.is_empty() {
            return Ok(());
        }
        self.buf.clear();
        read_ranges(src, &self.ranges, &mut self.buf, &mut self.scratch).map_err(LocalError::Read)?;
        write_pieces(dst, &self.ranges, &self.buf)?;
        self.ranges.clear();
        self.bytes = 0;
        Ok(())
    }
}

/// Copies `range` of `src` to the same offsets of `dst` with `copy_file_range`. `Ok(false)` when the kernel refuses
/// the pair of files before anything was copied (other file systems on an old kernel, a file system without
/// support): the caller copies by hand.
fn copy_range(src: &File, dst: &File, range: Range<u64>) -> Result<bool, LocalError> {
    let (mut off_in, mut off_out) = (range.start, range.start);
    while off_in < range.end {
        let want = usize::try_from(range.end - off_in)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), want) {
            Ok(0) => {
                return Err(LocalError::Read(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the source ends at {off_in}, inside the data range {}..{}",
                        range.start, range.end
                    ),
                )));
            }
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::OPNOTSUPP
                | rustix::io::Errno::INVAL,
            ) if off_in == range.start => return Ok(false),
            Err(e) => {
                return Err(LocalError::Write {
                    offset: off_out,
                    len: range.end - off_in,
                    source: e.into(),
                });
            }
        }
    }
    Ok(true)
}

/// Starts writeback of the span just copied without waiting for it, so the final `fdatasync` finds little left
/// (see the receiver's `start_writeback`). Advisory: an error surfaces at that `fdatasync`.
fn start_writeback(dst: &File, ranges: &[Range<u64>]) {
    let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
        return;
    };
    let (Ok(offset), Ok(len)) = (i64::try_from(first.start), i64::try_from(last.end - first.start)) else {
        return;
    };
    // SAFETY: a plain syscall on a descriptor `dst` keeps open for the call; no memory is passed.
    let _ = unsafe { libc::sync_file_range(dst.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE) };
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use corral_disk::sparse::{LayoutMode, data_ranges};

    /// Alternating 4 KiB of data and a 4 KiB hole over `len` bytes, under /var/tmp (a disk file system).
    fn fragmented(len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        f.as_file().set_len(len).unwrap();
        for i in (0..len).step_by(8192) {
            f.as_file()
                .write_all_at(&[(i / 8192 % 251) as u8 + 1; 4096], i)
                .unwrap();
        }
        f
    }

    fn layout(f: &File) -> Vec<Range<u64>> {
        let len = f.metadata().unwrap().len();
        data_ranges(f, 0..len, LayoutMode::SeekData)
            .map(Result::unwrap)
            .collect()
    }

    /// The file's allocated blocks (`stat`) hold its data and no more than the file system's extent tree (a few
    /// blocks): a hole that became zeros would add 4 KiB each.
    fn assert_allocated(f: &File, data: u64) {
        use std::os::unix::fs::MetadataExt;
        let got = f.metadata().unwrap().blocks() * 512;
        assert!(
            (data..=data + (32 << 10)).contains(&got),
            "{got} bytes allocated for {data} of data"
        );
    }

    #[test]
    fn small_extents_are_batched_and_holes_stay_holes() {
        let src = fragmented(4 << 20);
        let dst = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        std::fs::write(dst.path(), vec![9u8; 8 << 20]).unwrap(); // longer, old content: truncated
        let content = FileContent::open(src.path(), LayoutMode::SeekData).unwrap();
        let progress = Progress::new();
        let s = copy_extents(
            &content,
            dst.as_file(),
            &ExtentCopyOptions::default(),
            &progress,
            &CancellationToken::new(),
        )
        .unwrap();
        assert_eq!(
            std::fs::read(dst.path()).unwrap(),
            std::fs::read(src.path()).unwrap()
        );
        assert_eq!(layout(dst.as_file()), layout(src.as_file()));
        assert_allocated(dst.as_file(), 2 << 20);
        assert_eq!(s.local.data_bytes, 2 << 20);
        assert_eq!(s.local.data_ranges, 512);
        // 4 KiB pieces are read and written, not copied by the kernel one syscall each.
        assert_eq!(s.kernel_bytes, 0);
        assert_eq!(progress.done(), 4 << 20);
    }

    #[test]
    fn large_extents_are_copied_by_the_kernel_and_small_ones_beside_them_are_written() {
        // 1 MiB of data, a 1 MiB hole, then 4 KiB pieces, then 3 MiB of data.
        let src = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let f = src.as_file();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(&vec![3u8; 1 << 20], 0).unwrap();
        for i in 0..64u64 {
            f.write_all_at(&[i as u8 + 1; 4096], (2 << 20) + i * 8192)
                .unwrap();
        }
        f.write_all_at(&vec![5u8; 3 << 20], 8 << 20).unwrap();
        let dst = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let content = FileContent::open(src.path(), LayoutMode::SeekData).unwrap();
        let s = copy_extents(
            &content,
            dst.as_file(),
            &ExtentCopyOptions::default(),
            &Progress::new(),
            &CancellationToken::new(),
        )
        .unwrap();
        assert_eq!(
            std::fs::read(dst.path()).unwrap(),
            std::fs::read(src.path()).unwrap()
        );
        assert_eq!(layout(dst.as_file()), layout(src.as_file()));
        assert_allocated(dst.as_file(), (4 << 20) + 64 * 4096);
        assert_eq!(s.kernel_bytes, 4 << 20);
        assert_eq!(s.local.data_bytes, (4 << 20) + 64 * 4096);
    }

    /// A content of two layers, the upper one winning where it has data, and a middle megabyte no file backs.
    struct Layered {
        lower: FileContent,
        upper: FileContent,
    }

    impl SparseRead for Layered {
        fn size(&self) -> u64 {
            self.lower.size()
        }
        fn data_ranges(&self, range: Range<u64>) -> corral_disk::sparse::DataRanges<'_> {
            Box::new(std::iter::once(Ok(range)))
        }
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            buf.fill(0x77);
            let _ = offset;
            Ok(())
        }
    }

    impl FileExtents for Layered {
        fn files_of<'a>(&'a self, range: Range<u64>, out: &mut Vec<(Range<u64>, Option<&'a File>)>) {
            const M: u64 = 1 << 20;
            for (r, f) in [
                (0..M, Some(self.lower.file())),
                (M..2 * M, None),
                (2 * M..4 * M, Some(self.upper.file())),
            ] {
                let r = r.start.max(range.start)..r.end.min(range.end);
                if r.start < r.end {
                    out.push((r, f));
                }
            }
        }
    }

    #[test]
    fn pieces_come_from_their_own_file_or_are_read() {
        let (lower, upper) = (
            fragmented(4 << 20),
            tempfile::NamedTempFile::new_in("/var/tmp").unwrap(),
        );
        upper.as_file().write_all_at(&vec![0x55; 4 << 20], 0).unwrap();
        let src = Layered {
            lower: FileContent::open(lower.path(), LayoutMode::SeekData).unwrap(),
            upper: FileContent::open(upper.path(), LayoutMode::SeekData).unwrap(),
        };
        let dst = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let s = copy_extents(
            &src,
            dst.as_file(),
            &ExtentCopyOptions::default(),
            &Progress::new(),
            &CancellationToken::new(),
        )
        .unwrap();
        let got = std::fs::read(dst.path()).unwrap();
        let low = std::fs::read(lower.path()).unwrap();
        assert_eq!(got[..1 << 20], low[..1 << 20]);
        assert!(got[1 << 20..2 << 20].iter().all(|b| *b == 0x77));
        assert!(got[2 << 20..].iter().all(|b| *b == 0x55));
        assert_eq!(s.kernel_bytes, 3 << 20);
    }

    #[test]
    fn a_cancelled_copy_stops_with_an_error() {
        let src = fragmented(1 << 20);
        let dst = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let cancel = CancellationToken::new();
        cancel.cancel();
        let content = FileContent::open(src.path(), LayoutMode::SeekData).unwrap();
        let e = copy_extents(
            &content,
            dst.as_file(),
            &ExtentCopyOptions::default(),
            &Progress::new(),
            &cancel,
        )
        .unwrap_err();
        assert!(matches!(e, LocalError::Cancelled), "{e}");
    }

    #[test]
    fn the_rate_limit_spreads_the_copy_over_time() {
        let src = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        src.as_file().write_all_at(&vec![1u8; 32 << 20], 0).unwrap();
        let dst = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let content = FileContent::open(src.path(), LayoutMode::SeekData).unwrap();
        let t = Instant::now();
        copy_extents(
            &content,
            dst.as_file(),
            &ExtentCopyOptions {
                max_rate: Some(64 << 20),
                ..Default::default()
            },
            &Progress::new(),
            &CancellationToken::new(),
        )
        .unwrap();
        // 32 MiB at 64 MiB/s: 6.4 MiB batches, the last one may end only after 0.5 s.
        assert!(t.elapsed() >= Duration::from_millis(450), "{:?}", t.elapsed());
    }
}
