//! The fixed pool of IO worker threads that run blocking [`BlockBackend`] calls.
//!
//! Connection readers submit [`Job`]s into one bounded channel shared by all connections; a full channel
//! makes readers wait (backpressure), it never grows. Each job carries its connection's reply sender and
//! window permit, so the worker hands the finished reply straight to that connection's writer.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::backend::{BackendError, BlockBackend, ErrorKind};
use crate::codec::{
    BLOCK_STATUS_RANGE_LEN, FrameHeader, FrameKind, MAX_BLOCK_STATUS_RANGES, MAX_IO, MAX_MESSAGE_LEN,
    encode_range,
};
use crate::metrics::ServerMetrics;
use crate::pool::{BufferPool, PooledBuf};

/// A reply on its way to a connection's writer. The window permit is released once it was written.
pub(crate) struct Reply {
    pub(crate) header: FrameHeader,
    pub(crate) body: ReplyBody,
    /// Held, not read: dropping it (after the write) reopens the window slot.
    pub(crate) _permit: Option<OwnedSemaphorePermit>,
}

pub(crate) enum ReplyBody {
    Empty,
    Data(PooledBuf),
    /// Error messages and the volume name; allocated only off the data path.
    Text(String),
    /// Not a frame: the backend asked ([`ErrorKind::DropConnection`]) for the connection to be dropped
    /// without an answer. The writer stops at this marker and the connection dies.
    DropConnection,
}

impl Reply {
    pub(crate) fn empty(kind: FrameKind, id: u64, permit: Option<OwnedSemaphorePermit>) -> Self {
        Self {
            header: FrameHeader::new(kind, id, 0, 0),
            body: ReplyBody::Empty,
            _permit: permit,
        }
    }

    /// An `Error`, `Eof` or `NoSpace` reply for a failed request.
    pub(crate) fn failure(
        id: u64,
        err: BackendError,
        is_read: bool,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        match err.kind {
            ErrorKind::DropConnection => Self {
                header: FrameHeader::new(FrameKind::Error, id, 0, 0),
                body: ReplyBody::DropConnection,
                _permit: permit,
            },
            ErrorKind::NoSpace => Self::empty(FrameKind::NoSpace, id, permit),
            ErrorKind::OutOfRange if is_read => Self::empty(FrameKind::Eof, id, permit),
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
                    _permit: permit,
                }
            }
        }
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

/// One request for a worker.
pub(crate) struct Job {
    pub(crate) header: FrameHeader,
    /// The write payload (exactly `header.length` bytes); `None` for other kinds.
    pub(crate) payload: Option<PooledBuf>,
    pub(crate) reply_to: mpsc::Sender<Reply>,
    pub(crate) permit: OwnedSemaphorePermit,
}

pub(crate) struct IoPool {
    jobs: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

struct WorkerCtx {
    backend: Arc<dyn BlockBackend>,
    buffers: BufferPool,
    metrics: Arc<ServerMetrics>,
}

impl IoPool {
    pub(crate) fn start(
        backend: Arc<dyn BlockBackend>,
        buffers: BufferPool,
        metrics: Arc<ServerMetrics>,
        threads: usize,
        queue: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>(queue.max(1));
        // Workers take turns waiting on the one receiver; the lock is held only while idle.
        let rx = Arc::new(Mutex::new(rx));
        let ctx = Arc::new(WorkerCtx {
            backend,
            buffers,
            metrics,
        });
        let mut handles = Vec::with_capacity(threads.max(1));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let ctx = ctx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("dp-io-{i}"))
                .spawn(move || {
                    loop {
                        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).blocking_recv();
                        match job {
                            Some(job) => ctx.run(job),
                            None => break,
                        }
                    }
                })?;
            handles.push(handle);
        }
        Ok(Self {
            jobs: Some(tx),
            threads: handles,
        })
    }

    /// Queues a job, waiting while the queue is full. Fails only after [`IoPool::close`].
    pub(crate) async fn submit(&self, job: Job) -> Result<(), Job> {
        match &self.jobs {
            Some(tx) => tx.send(job).await.map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// Stops accepting jobs; workers finish what is queued, then exit. Returns their handles to join.
    pub(crate) fn close(&mut self) -> Vec<JoinHandle<()>> {
        self.jobs = None;
        std::mem::take(&mut self.threads)
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        // Closing is enough: workers exit on their own once the queue is drained. Joining here could
        // block a reactor thread; `DataServer::shutdown` joins explicitly.
        drop(self.close());
    }
}

impl WorkerCtx {
    fn run(&self, job: Job) {
        let Job {
            header,
            payload,
            reply_to,
            permit,
        } = job;
        let outcome = catch_unwind(AssertUnwindSafe(|| self.execute(&header, payload)));
        let body = outcome.unwrap_or_else(|_| {
            Err(BackendError::new(
                ErrorKind::Io,
                format!("backend panicked during {:?}", header.kind),
            ))
        });
        let reply = match body {
            Ok((body, length)) => {
                let mut reply = Reply::empty(FrameKind::Ok, header.id, Some(permit));
                reply.header.length = length;
                if let ReplyBody::Data(buf) = &body {
                    // At most MAX_IO bytes: a read's length or a range list cut to fit.
                    reply.header.payload_len = u32::try_from(buf.len()).unwrap_or(MAX_IO);
                    if header.kind == FrameKind::Read {
                        self.metrics.bytes_read.fetch_add(buf.len() as u64, Relaxed);
                    }
                }
                reply.body = body;
                reply
            }
            Err(err) => {
                self.metrics.errors.fetch_add(1, Relaxed);
                tracing::debug!(kind = ?header.kind, offset = header.offset, length = header.length, error = %err, "request failed");
                Reply::failure(header.id, err, header.kind == FrameKind::Read, Some(permit))
            }
        };
        // The writer is gone when the connection was dropped; the reply (and its permit) just drop.
        let _ = reply_to.blocking_send(reply);
    }

    /// Runs one request; returns the reply body and the reply's `length` field.
    fn execute(&self, h: &FrameHeader, payload: Option<PooledBuf>) -> Result<(ReplyBody, u32), BackendError> {
        let len = u64::from(h.length);
        if h.offset.checked_add(len).is_none() {
            return Err(BackendError::new(
                ErrorKind::Invalid,
                format!("range {}+{} overflows", h.offset, h.length),
            ));
        }
        let body = match h.kind {
            FrameKind::Read => {
                let mut buf = self.buffers.get(h.length_usize());
                self.backend.read_at(h.offset, &mut buf)?;
                ReplyBody::Data(buf)
            }
            FrameKind::Write => {
                let data =
                    payload.ok_or_else(|| BackendError::new(ErrorKind::Invalid, "write without payload"))?;
                self.backend.write_at(h.offset, &data)?;
                self.metrics.bytes_written.fetch_add(data.len() as u64, Relaxed);
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
