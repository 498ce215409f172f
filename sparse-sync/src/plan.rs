//! Cuts a [`SparseRead`]'s layout into units of work: batches of data ranges (at most `batch_size` bytes, large
//! extents split on a `batch_size` grid so a dense file batches identically from run to run) and runs of holes.
//! Used by local copy/fold/prune and by the sender; the cut depends only on the source's layout, which keeps
//! batches comparable between a transfer and its resumption.

use std::io;
use std::ops::Range;

use corral_disk::sparse::SparseRead;

/// Default bytes of data per batch.
pub const DEFAULT_BATCH_SIZE: u64 = 2 << 20;
/// Upper bound of ranges in one data batch (a batch of 512-byte pieces stops here before reaching 2 MiB).
pub const MAX_BATCH_RANGES: usize = 8192;
/// Upper bound of ranges in one run of holes.
pub const MAX_HOLE_RANGES: usize = 16384;

/// One unit of work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Work {
    /// Data ranges, ascending; `bytes` is their total length.
    Data { ranges: Vec<Range<u64>>, bytes: u64 },
    /// Hole ranges, ascending; `bytes` is their total length.
    Holes { ranges: Vec<Range<u64>>, bytes: u64 },
}

impl Work {
    /// Logical bytes this unit covers (for progress).
    pub(crate) fn covers(&self) -> u64 {
        match self {
            Work::Data { bytes, .. } | Work::Holes { bytes, .. } => *bytes,
        }
    }
}

/// Walks `src`'s layout over its whole size and hands each unit to `emit`, holes and data interleaved.
/// A source whose ranges are unsorted, overlapping or past its size is reported as `InvalidData`.
pub(crate) fn plan<E>(
    src: &dyn SparseRead,
    batch_size: u64,
    mut emit: impl FnMut(Work) -> Result<(), E>,
    layout_error: impl Fn(io::Error) -> E,
) -> Result<(), E> {
    let batch_size = batch_size.max(corral_disk::BLOCK_SIZE);
    let size = src.size();
    let mut pos = 0u64;
    let mut data: Vec<Range<u64>> = Vec::new();
    let mut data_bytes = 0u64;
    let mut holes: Vec<Range<u64>> = Vec::new();
    let mut hole_bytes = 0u64;

    let mut pending: Vec<Work> = Vec::new();
    for r in src.data_ranges(0..size) {
        let r = r.map_err(&layout_error)?;
        if r.start < pos || r.end > size || r.start >= r.end {
            return Err(layout_error(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "source layout range {}..{} is empty, out of order or past the size {size}",
                    r.start, r.end
                ),
            )));
        }
        if r.start > pos {
            hole_bytes += r.start - pos;
            holes.push(pos..r.start);
            if holes.len() >= MAX_HOLE_RANGES {
                pending.push(Work::Holes {
                    ranges: std::mem::take(&mut holes),
                    bytes: std::mem::take(&mut hole_bytes),
                });
            }
        }
        let mut s = r.start;
        while s < r.end {
            let grid_end = (s / batch_size + 1).saturating_mul(batch_size);
            let e = r.end.min(grid_end);
            if data_bytes + (e - s) > batch_size || data.len() >= MAX_BATCH_RANGES {
                pending.push(Work::Data {
                    ranges: std::mem::take(&mut data),
                    bytes: std::mem::take(&mut data_bytes),
                });
            }
            match data.last_mut() {
                Some(last) if last.end == s => last.end = e,
                _ => data.push(s..e),
            }
            data_bytes += e - s;
            s = e;
        }
        pos = r.end;
        for w in pending.drain(..) {
            emit(w)?;
        }
    }
    if pos < size {
        hole_bytes += size - pos;
        holes.push(pos..size);
    }
    if !data.is_empty() {
        emit(Work::Data {
            ranges: data,
            bytes: data_bytes,
        })?;
    }
    if !holes.is_empty() {
        emit(Work::Holes {
            ranges: holes,
            bytes: hole_bytes,
        })?;
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
    use corral_disk::sparse::DataRanges;

    struct Layout(u64, Vec<Range<u64>>);
    impl SparseRead for Layout {
        fn size(&self) -> u64 {
            self.0
        }
        fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
            Box::new(
                self.1
                    .clone()
                    .into_iter()
                    .filter(move |r| r.end > range.start && r.start < range.end)
                    .map(Ok),
            )
        }
        fn read_exact_at(&self, _buf: &mut [u8], _offset: u64) -> io::Result<()> {
            Ok(())
        }
    }

    fn units(src: &Layout, batch: u64) -> Vec<Work> {
        let mut out = Vec::new();
        plan::<io::Error>(
            src,
            batch,
            |w| {
                out.push(w);
                Ok(())
            },
            |e| e,
        )
        .unwrap();
        out
    }

    #[test]
    fn dense_extent_is_cut_on_the_batch_grid_and_units_cover_the_whole_size() {
        let src = Layout(10 << 20, vec![(1 << 20)..(9 << 20) + 5]);
        let u = units(&src, 2 << 20);
        let data: Vec<_> = u
            .iter()
            .filter_map(|w| match w {
                Work::Data { ranges, .. } => Some(ranges.clone()),
                Work::Holes { .. } => None,
            })
            .collect();
        assert_eq!(
            data,
            vec![
                vec![(1 << 20)..(2 << 20)],
                vec![(2 << 20)..(4 << 20)],
                vec![(4 << 20)..(6 << 20)],
                vec![(6 << 20)..(8 << 20)],
                vec![(8 << 20)..(9 << 20) + 5],
            ]
        );
        assert_eq!(u.iter().map(Work::covers).sum::<u64>(), 10 << 20);
    }

    #[test]
    fn small_pieces_share_a_batch_up_to_the_batch_size() {
        let ranges: Vec<_> = (0..1000u64).map(|i| i * 8192..i * 8192 + 4096).collect();
        let src = Layout(1000 * 8192, ranges);
        let u = units(&src, 1 << 20);
        let sizes: Vec<u64> = u
            .iter()
            .filter_map(|w| match w {
                Work::Data { bytes, .. } => Some(*bytes),
                Work::Holes { .. } => None,
            })
            .collect();
        assert!(sizes.iter().all(|&b| b <= 1 << 20));
        assert_eq!(sizes.iter().sum::<u64>(), 1000 * 4096);
        assert_eq!(u.iter().map(Work::covers).sum::<u64>(), 1000 * 8192);
    }

    #[test]
    fn source_with_overlapping_ranges_is_rejected() {
        let src = Layout(100, vec![0..10, 5..20]);
        let r = plan::<io::Error>(&src, 4096, |_| Ok(()), |e| e);
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
