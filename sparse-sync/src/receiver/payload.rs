//! Writes a `data` body to the partial file as it arrives, chunk by chunk, at the offsets its range table names:
//! the body is never gathered in memory, so a receiver holds at most the HTTP layer's read buffer per request
//! (plus one [`DIRECT_CHUNK`] staging buffer with `O_DIRECT`), whatever the batch size.
//!
//! A body cut short leaves the ranges it covered partly written. That is safe: nothing is committed until every
//! request of the transfer succeeded, the sender retries the same ranges with the same bytes, and a resumed
//! transfer compares checksums before trusting any batch.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::ReceiveError;
use crate::wire::{MAX_PAYLOAD, RANGES_HEADER, RangeError, decode_table, table_len};
use corral_disk::sparse::{AlignedBuf, DIRECT_IO_ALIGN};

/// Bytes staged in the aligned buffer before one `O_DIRECT` write.
pub(super) const DIRECT_CHUNK: usize = 1 << 20;

/// Where a body's payload goes.
#[derive(Clone, Copy)]
pub(super) enum Out<'a> {
    /// The partial file; `direct` (the same file opened with `O_DIRECT`) takes the ranges whose offset and
    /// length are 4 KiB-aligned.
    File {
        file: &'a File,
        direct: Option<&'a File>,
    },
    /// A sink: every range staged in [`DIRECT_CHUNK`] steps, as for `O_DIRECT`.
    Sink(&'a dyn super::ReceiveSink),
}

/// The state of one streamed `data` body: gathering its range table, then writing its payload.
pub(super) struct PayloadWriter<'a> {
    out: Out<'a>,
    path: &'a Path,
    size: u64,
    /// Header and range table, gathered until complete.
    table: Vec<u8>,
    /// Decoded once `table` is complete.
    ranges: Option<Vec<Range<u64>>>,
    announced: u64,
    /// Index of the range the next payload byte belongs to, and that byte's offset in the file.
    next: usize,
    at: u64,
    /// `O_DIRECT` staging: the buffer, its filled length, and the file offset of its first byte.
    aligned: Option<AlignedBuf>,
    fill: usize,
    fill_at: u64,
    received: u64,
    written: u64,
}

impl<'a> PayloadWriter<'a> {
    /// A writer into `out` of `size` bytes. `path` names it in errors.
    pub(super) fn new(out: Out<'a>, path: &'a Path, size: u64) -> Self {
        PayloadWriter {
            out,
            path,
            size,
            table: Vec::with_capacity(RANGES_HEADER),
            ranges: None,
            announced: 0,
            next: 0,
            at: 0,
            aligned: None,
            fill: 0,
            fill_at: 0,
            received: 0,
            written: 0,
        }
    }

    /// Payload bytes taken so far.
    pub(super) fn received(&self) -> u64 {
        self.received
    }

    /// Payload bytes written to the file so far.
    pub(super) fn written(&self) -> u64 {
        self.written
    }

    /// Takes the next chunk of the body, of any size, and writes the payload bytes it holds.
    pub(super) fn feed(&mut self, mut chunk: &[u8]) -> Result<(), ReceiveError> {
        while self.ranges.is_none() {
            let need = if self.table.len() < RANGES_HEADER {
                RANGES_HEADER
            } else {
                table_len(&self.table)?
            };
            let take = (need - self.table.len()).min(chunk.len());
            self.table.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.table.len() < need {
                return Ok(());
            }
            if self.table.len() == RANGES_HEADER && table_len(&self.table)? > RANGES_HEADER {
                continue;
            }
            let (ranges, announced) = decode_table(&self.table, self.size)?;
            if announced > MAX_PAYLOAD {
                return Err(ReceiveError::BadRequest(format!(
                    "the ranges announce {announced} payload bytes, at most {MAX_PAYLOAD} allowed in one request"
                )));
            }
            self.at = ranges.first().map_or(0, |r| r.start);
            self.ranges = Some(ranges);
            self.announced = announced;
        }
        while !chunk.is_empty() {
            let Some(range) = self.ranges.as_ref().and_then(|r| r.get(self.next)).cloned() else {
                return Err(RangeError::PayloadLength {
                    announced: self.announced,
                    actual: self.received + chunk.len() as u64,
                }
                .into());
            };
            let n = usize::try_from(range.end - self.at).map_or(chunk.len(), |left| left.min(chunk.len()));
            let (piece, rest) = chunk.split_at(n);
            self.write(piece, &range)?;
            chunk = rest;
            self.received += n as u64;
            self.at += n as u64;
            if self.at == range.end {
                self.next += 1;
                if let Some(r) = self.ranges.as_ref().and_then(|r| r.get(self.next)) {
                    self.at = r.start;
                }
            }
        }
        Ok(())
    }

    /// Ends the body: fails unless the table was complete and the payload filled every range.
    pub(super) fn finish(&self) -> Result<(), ReceiveError> {
        let Some(ranges) = &self.ranges else {
            let need = table_len(&self.table)?;
            return Err(RangeError::Truncated {
                need: need as u64,
                have: self.table.len() as u64,
            }
            .into());
        };
        if self.next < ranges.len() {
            return Err(RangeError::PayloadLength {
                announced: self.announced,
                actual: self.received,
            }
            .into());
        }
        Ok(())
    }

    /// Starts writeback of the span this body wrote, without waiting for it: the disk works while later batches
    /// cross the network, and the `fsync` at `close` finds little left to flush. Advisory only: a write error
    /// surfaces at that `fsync`, which still decides whether the transfer commits.
    pub(super) fn start_writeback(&self) {
        let Out::File { file, direct: None } = self.out else {
            return;
        };
        let Some(ranges) = &self.ranges else { return };
        let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
            return;
        };
        let (Ok(offset), Ok(len)) = (i64::try_from(first.start), i64::try_from(last.end - first.start))
        else {
            return;
        };
        // SAFETY: a plain syscall on a descriptor `file` keeps open for the call; no memory is passed.
        let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE) };
    }

    /// Writes `piece`, which lands at `self.at` inside `range`.
    fn write(&mut self, piece: &[u8], range: &Range<u64>) -> Result<(), ReceiveError> {
        let aligned = range.start.is_multiple_of(DIRECT_IO_ALIGN as u64)
            && range.end.is_multiple_of(DIRECT_IO_ALIGN as u64);
        let staged = match self.out {
            Out::File { direct: Some(d), .. } if aligned => Out::File {
                file: d,
                direct: None,
            },
            Out::File { file, .. } => {
                crate::local::write_chunked(file, piece, self.at)
                    .map_err(|e| ReceiveError::io("writing", self.path, self.at, e))?;
                self.written += piece.len() as u64;
                return Ok(());
            }
            sink @ Out::Sink(_) => sink,
        };
        // Staged writes start at the range's start or a DIRECT_CHUNK step after it and end at a step or the
        // range's end, so every one is 4 KiB-aligned in offset and length when the range is.
        let (mut piece, mut at) = (piece, self.at);
        while !piece.is_empty() {
            let buf = self.aligned.get_or_insert_with(|| AlignedBuf::new(DIRECT_CHUNK));
            if self.fill == 0 {
                self.fill_at = at;
            }
            let n = (DIRECT_CHUNK - self.fill).min(piece.len());
            buf.as_mut_slice()[self.fill..self.fill + n].copy_from_slice(&piece[..n]);
            self.fill += n;
            at += n as u64;
            piece = &piece[n..];
            if self.fill == DIRECT_CHUNK || at == range.end {
                let staged_bytes = &buf.as_mut_slice()[..self.fill];
                match staged {
                    Out::File { file, .. } => file.write_all_at(staged_bytes, self.fill_at),
                    Out::Sink(sink) => sink.write_at(staged_bytes, self.fill_at),
                }
                .map_err(|e| ReceiveError::io("writing", self.path, self.fill_at, e))?;
                self.written += self.fill as u64;
                self.fill = 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init, clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use crate::wire::encode_ranges;

    fn body(ranges: &[Range<u64>], payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        encode_ranges(ranges, &mut b);
        b.extend_from_slice(payload);
        b
    }

    /// Feeds `body` in chunks of the sizes `cuts` cycles through and returns the file's content.
    fn stream(body: &[u8], size: u64, cuts: &[usize], direct: bool) -> Result<Vec<u8>, ReceiveError> {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(size).unwrap();
        let d = direct.then(|| {
            use std::os::unix::fs::OpenOptionsExt;
            File::options()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(f.path())
                .unwrap()
        });
        let out = Out::File {
            file: f.as_file(),
            direct: d.as_ref(),
        };
        let mut w = PayloadWriter::new(out, f.path(), size);
        let mut rest = body;
        for &cut in cuts.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (c, r) = rest.split_at(cut.min(rest.len()));
            w.feed(c)?;
            rest = r;
        }
        w.finish()?;
        assert_eq!(w.received(), w.written());
        Ok(std::fs::read(f.path()).unwrap())
    }

    /// A sink in memory that records the size of every write.
    struct MemSink(std::sync::Mutex<(Vec<u8>, Vec<usize>)>);

    impl super::super::ReceiveSink for MemSink {
        fn size(&self) -> u64 {
            self.0.lock().unwrap().0.len() as u64
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            let mut m = self.0.lock().unwrap();
            m.0[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
            m.1.push(buf.len());
            Ok(())
        }
        fn commit(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    #[test]
    fn a_body_streamed_in_odd_sized_chunks_lands_at_its_ranges() {
        let size = 5 << 20;
        let ranges = [3..4100, 8192..(8192 + (2 << 20) + 7), (4 << 20)..(5 << 20)];
        let mut payload = Vec::new();
        let mut expect = vec![0u8; size as usize];
        for (i, r) in ranges.iter().enumerate() {
            let p = pattern((r.end - r.start) as usize, i as u8 + 1);
            expect[r.start as usize..r.end as usize].copy_from_slice(&p);
            payload.extend_from_slice(&p);
        }
        let b = body(&ranges, &payload);
        for cuts in [
            &[1usize][..],
            &[3, 7, 13],
            &[8, 40, 65_537],
            &[1 << 20],
            &[b.len()],
        ] {
            // Single-byte feeding of megabytes is slow; it is exercised on the table only.
            let cuts: Vec<usize> = if cuts == [1] {
                vec![1; 60].into_iter().chain([999_983]).collect()
            } else {
                cuts.to_vec()
            };
            assert!(stream(&b, size, &cuts, false).unwrap() == expect, "cuts {cuts:?}");
            assert!(
                stream(&b, size, &cuts, true).unwrap() == expect,
                "direct, cuts {cuts:?}"
            );
            // A sink gets every range in staged writes of at most DIRECT_CHUNK, however the body was cut.
            let sink = MemSink(std::sync::Mutex::new((vec![0; size as usize], Vec::new())));
            let mut w = PayloadWriter::new(Out::Sink(&sink), Path::new("sink"), size);
            let mut rest = &b[..];
            for &cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (c, r) = rest.split_at(cut.min(rest.len()));
                w.feed(c).unwrap();
                rest = r;
            }
            w.finish().unwrap();
            let (got, writes) = sink.0.into_inner().unwrap();
            assert!(got == expect, "sink, cuts {cuts:?}");
            assert!(
                writes.len() <= 5 && writes.iter().all(|&n| n <= DIRECT_CHUNK),
                "{writes:?}"
            );
        }
    }

    #[test]
    fn short_long_and_malformed_bodies_are_refused() {
        let b = body(&[0..4096, 8192..8200], &pattern(4104, 1));
        let err = |r: Result<Vec<u8>, ReceiveError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(stream(&b[..b.len() - 1], 1 << 20, &[100], false)).contains("payload holds 4103 bytes"));
        let mut long = b.clone();
        long.push(0);
        assert!(err(stream(&long, 1 << 20, &[4096], false)).contains("payload holds 4105 bytes"));
        assert!(err(stream(&b[..20], 1 << 20, &[7], false)).contains("shorter than its range table"));
        assert!(err(stream(&b[..5], 1 << 20, &[7], false)).contains("shorter than its range table"));
        assert!(err(stream(b"XXXX\0\0\0\0", 1 << 20, &[3], false)).contains("magic"));
        assert!(err(stream(&b, 8196, &[64], false)).contains("past the file size"));
        let huge = body(&[0..(MAX_PAYLOAD + 1)], b"");
        assert!(err(stream(&huge, MAX_PAYLOAD * 2, &[64], false)).contains("at most"));
    }
}
