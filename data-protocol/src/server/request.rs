//! Running one request against the [`BlockBackend`] and encoding its reply.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use crate::backend::{BackendError, BlockBackend, ErrorKind};
use crate::codec::{
    BLOCK_STATUS_RANGE_LEN, FrameHeader, FrameKind, MAX_BLOCK_STATUS_RANGES, MAX_IO, MAX_MESSAGE_LEN,
    encode_range,
};
use crate::metrics::ServerMetrics;
use crate::pool::{BufferPool, PooledBuf};

fn panicked(kind: FrameKind) -> BackendError {
    BackendError::new(ErrorKind::Io, format!("backend panicked during {kind:?}"))
}

/// Refuses a range whose end overflows.
fn check_span(h: &FrameHeader) -> Result<(), BackendError> {
    if h.offset.checked_add(u64::from(h.length)).is_none() {
        return Err(BackendError::new(
            ErrorKind::Invalid,
            format!("range {}+{} overflows", h.offset, h.length),
        ));
    }
    Ok(())
}

/// A reply (other than a read's data, which is read in place into the output buffer).
pub(crate) struct Reply {
    pub(crate) header: FrameHeader,
    pub(crate) body: ReplyBody,
}

pub(crate) enum ReplyBody {
    Empty,
    Data(PooledBuf),
    /// Error messages and the volume name; allocated only off the data path.
    Text(String),
    /// Not a frame: the backend asked ([`ErrorKind::DropConnection`]) for the connection to be dropped
    /// without an answer. The connection stops at this marker and dies.
    DropConnection,
}

impl Reply {
    pub(crate) fn empty(kind: FrameKind, id: u64) -> Self {
        Self {
            header: FrameHeader::new(kind, id, 0, 0),
            body: ReplyBody::Empty,
        }
    }

    /// An `Error`, `Eof` or `NoSpace` reply for a failed request.
    /// The `Fenced` error reply (or, with id 0, the notice before closing): the replica's generation in `offset`.
    pub(crate) fn fenced(id: u64, err: BackendError, replica_generation: u64) -> Self {
        let mut reply = Self::failure(id, err, false);
        reply.header.offset = replica_generation;
        reply
    }

    pub(crate) fn failure(id: u64, err: BackendError, is_read: bool) -> Self {
        match err.kind {
            ErrorKind::DropConnection => Self {
                header: FrameHeader::new(FrameKind::Error, id, 0, 0),
                body: ReplyBody::DropConnection,
            },
            ErrorKind::NoSpace => Self::empty(FrameKind::NoSpace, id),
            ErrorKind::OutOfRange if is_read => Self::empty(FrameKind::Eof, id),
            kind => {
                let mut message = err.message;
                truncate_utf8(&mut message, MAX_MESSAGE_LEN);
                let header = FrameHeader {
                    kind: FrameKind::Error,
                    id,
                    offset: 0,
                    length: kind.code(),
                    payload_len: u32::try_from(message.len()).unwrap_or(MAX_MESSAGE_LEN),
                };
                Self {
                    header,
                    body: ReplyBody::Text(message),
                }
            }
        }
    }

    /// Appends the frame (header and payload) to `out`.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        let mut header = self.header;
        let payload = self.payload();
        header.payload_len = u32::try_from(payload.len()).unwrap_or(MAX_IO);
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(payload);
    }

    pub(crate) fn payload(&self) -> &[u8] {
        match &self.body {
            ReplyBody::Empty | ReplyBody::DropConnection => &[],
            ReplyBody::Data(buf) => buf,
            ReplyBody::Text(s) => s.as_bytes(),
        }
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate_utf8(s: &mut String, max: u32) {
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// Runs requests against the backend; shared by a connection's thread and its flusher.
pub(crate) struct Executor {
    pub(crate) backend: Arc<dyn BlockBackend>,
    pub(crate) buffers: BufferPool,
    pub(crate) metrics: Arc<ServerMetrics>,
}

impl Executor {
    /// Runs one request that is not a read (reads are answered in place by the connection), catching a
    /// backend panic as an IO error; returns the reply body and the reply's `length` field.
    pub(crate) fn run(&self, h: &FrameHeader, payload: &[u8]) -> Result<(ReplyBody, u32), BackendError> {
        catch_unwind(AssertUnwindSafe(|| self.execute(h, payload))).unwrap_or_else(|_| Err(panicked(h.kind)))
    }

    /// [`crate::BlockBackend::flush_at_pool`]; a backend panic counts as `false` (the flusher).
    pub(crate) fn flush_at_pool(&self) -> bool {
        catch_unwind(AssertUnwindSafe(|| self.backend.flush_at_pool())).unwrap_or(false)
    }

    /// Reads into `buf` (exactly `h.length` bytes), catching a backend panic as an IO error.
    pub(crate) fn read(&self, h: &FrameHeader, buf: &mut [u8]) -> Result<(), BackendError> {
        check_span(h)?;
        catch_unwind(AssertUnwindSafe(|| self.backend.read_at(h.offset, buf)))
            .unwrap_or_else(|_| Err(panicked(h.kind)))?;
        self.metrics.bytes_read.fetch_add(buf.len() as u64, Relaxed);
        Ok(())
    }

    /// A read done inline only if the backend needs no device wait for it ([`BlockBackend::read_at_nowait`]);
    /// `Ok(false)`: not done, run it on the IO pool.
    pub(crate) fn read_nowait(&self, h: &FrameHeader, buf: &mut [u8]) -> Result<bool, BackendError> {
        check_span(h)?;
        let done = catch_unwind(AssertUnwindSafe(|| self.backend.read_at_nowait(h.offset, buf)))
            .unwrap_or_else(|_| Err(panicked(h.kind)))?;
        if done {
            self.metrics.bytes_read.fetch_add(buf.len() as u64, Relaxed);
        }
        Ok(done)
    }

    /// A write done inline only if the backend needs no device wait for it ([`BlockBackend::write_at_nowait`]).
    pub(crate) fn write_nowait(&self, h: &FrameHeader, payload: &[u8]) -> Result<bool, BackendError> {
        check_span(h)?;
        let done = catch_unwind(AssertUnwindSafe(|| {
            self.backend.write_at_nowait(h.offset, payload)
        }))
        .unwrap_or_else(|_| Err(panicked(h.kind)))?;
        if done {
            self.metrics
                .bytes_written
                .fetch_add(payload.len() as u64, Relaxed);
        }
        Ok(done)
    }

    fn execute(&self, h: &FrameHeader, payload: &[u8]) -> Result<(ReplyBody, u32), BackendError> {
        check_span(h)?;
        let len = u64::from(h.length);
        let body = match h.kind {
            FrameKind::Write => {
                self.backend.write_at(h.offset, payload)?;
                self.metrics
                    .bytes_written
                    .fetch_add(payload.len() as u64, Relaxed);
                ReplyBody::Empty
            }
            FrameKind::Unmap => self.backend.unmap(h.offset, len).map(|()| ReplyBody::Empty)?,
            FrameKind::WriteZeroes => self
                .backend
                .write_zeroes(h.offset, len)
                .map(|()| ReplyBody::Empty)?,
            FrameKind::Flush => self.backend.flush().map(|()| ReplyBody::Empty)?,
            FrameKind::BlockStatus => return self.block_status(h.offset, len),
            other => {
                return Err(BackendError::new(
                    ErrorKind::Invalid,
                    format!("{other:?} is not an IO request"),
                ));
            }
        };
        Ok((body, 0))
    }

    /// Asks the backend and packs its answer: ranges clipped to the request, touching ones merged, the
    /// list cut after [`MAX_BLOCK_STATUS_RANGES`] ranges. The reply's `length` is the span covered: the
    /// whole request, or up to the end of the last range sent when the list was cut.
    fn block_status(&self, offset: u64, len: u64) -> Result<(ReplyBody, u32), BackendError> {
        if len == 0 {
            return Err(BackendError::new(ErrorKind::Invalid, "BlockStatus of zero bytes"));
        }
        let end = offset + len; // checked by `execute`
        let ranges = normalize_ranges(self.backend.block_status(offset, len)?, offset..end)?;
        let max = MAX_BLOCK_STATUS_RANGES as usize;
        let (ranges, covered_end) = match ranges.get(..max) {
            Some(head) if ranges.len() > max => (head, head[max - 1].end),
            _ => (&ranges[..], end),
        };
        let width = BLOCK_STATUS_RANGE_LEN as usize;
        let mut buf = self.buffers.get(ranges.len() * width);
        for (slot, r) in buf.chunks_exact_mut(width).zip(ranges) {
            slot.copy_from_slice(&encode_range(r));
        }
        // At most `len`, which came from a u32 header field.
        let covered = u32::try_from(covered_end - offset).unwrap_or(u32::MAX);
        Ok((ReplyBody::Data(buf), covered))
    }
}

/// Clips the backend's ranges to `span`, drops empty ones and merges touching ones, in place. Unsorted
/// or overlapping ranges are a backend bug, reported as an IO error rather than sent on.
fn normalize_ranges(mut ranges: Vec<Range<u64>>, span: Range<u64>) -> Result<Vec<Range<u64>>, BackendError> {
    let mut kept = 0usize;
    for i in 0..ranges.len() {
        let (start, end) = (ranges[i].start.max(span.start), ranges[i].end.min(span.end));
        if start >= end {
            continue;
        }
        if kept > 0 {
            let prev = &mut ranges[kept - 1];
            if start < prev.end {
                return Err(BackendError::new(
                    ErrorKind::Io,
                    format!(
                        "backend's allocated ranges are unsorted or overlap: {start}..{end} after {prev:?}"
                    ),
                ));
            }
            if start == prev.end {
                prev.end = end;
                continue;
            }
        }
        ranges[kept] = start..end;
        kept += 1;
    }
    ranges.truncate(kept);
    Ok(ranges)
}

/// The reply to a failed request, counted and logged.
pub(crate) fn failure(exec: &Executor, h: &FrameHeader, err: BackendError) -> Reply {
    exec.metrics.errors.fetch_add(1, Relaxed);
    tracing::debug!(kind = ?h.kind, offset = h.offset, length = h.length, error = %err, "request failed");
    Reply::failure(h.id, err, h.kind == FrameKind::Read)
}
