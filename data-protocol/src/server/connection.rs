//! One client connection, run to completion on its own OS thread.
//!
//! The thread reads whatever one `recv` brings (up to [`IN_BUF_LEN`]), runs every complete request in it
//! in order against the backend — a 4 KiB `pread`/`pwrite` that hits the page cache costs less than waking
//! another thread — appends each reply to one output buffer (read data is read straight into it) and
//! writes the batch with one `write`. Nothing is handed to another task or thread on the way, so a request
//! costs no wake-up beyond the socket's own. Write payloads are used where they sit in the input buffer;
//! only a payload larger than that buffer goes into a pooled buffer.
//!
//! Flushes are the exception: an `fdatasync` can take milliseconds, so they go to the connection's flusher
//! thread (started at the first flush) and answer out of order; reads and writes behind a flush do not
//! wait for it. That is safe because the client sends a flush only after the writes it covers were
//! acknowledged, i.e. after this thread ran them.
//!
//! Backpressure is the socket: while the thread runs a batch it does not read, and TCP pushes back on
//! the client. At most `window` requests run before their replies are written.
//!
//! With an IO pool ([`super::io_pool`]) the thread runs inline only what the backend can do without waiting
//! for the device and hands the rest to the connection's slots and the pool; a flush goes there only when the
//! backend says it will do more than sync ([`crate::BlockBackend::flush_at_pool`]), else to the flusher as without a
//! pool (at the pool each plain sync took a pool thread and waited for a wake-up: 0.8× the flusher on the
//! flush job of `bench/datapath`, while journaling flushes gained from sharing their work there).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;

use super::Shared;
use super::fence::{Admission, Fence, Refusal};
use super::io_pool::{Inflight, poolable};
use super::request::{Executor, Reply, ReplyBody, failure, truncate_utf8};
use super::stream::Stream;
use crate::backend::{BackendError, ErrorKind, VolumeInfo};
use crate::codec::{DecodeError, FrameHeader, FrameKind, HEADER_LEN, MAX_NAME_LEN, VERSION};

/// Input buffer: requests (with their write payloads) that fit in it are run without another copy.
const IN_BUF_LEN: usize = 256 << 10;
/// Replies gathered beyond this size are written before the batch ends.
const OUT_FLUSH_LEN: usize = 1 << 20;
/// Output capacity kept between batches (a 16 MiB read grows it; it shrinks back afterwards).
const OUT_KEEP_LEN: usize = 4 << 20;

/// How the connection stopped.
enum End {
    /// Peer closed cleanly between frames (or the server shut the read side down).
    PeerClosed,
    /// Hello was refused (version mismatch, backend not ready, stale generation); the refusal was sent.
    Refused,
    /// A higher engine generation connected after this connection's `Hello`: it runs no more requests.
    Fenced,
    /// The backend asked for the connection to be dropped without an answer.
    Dropped,
    /// The peer broke the protocol: drop without answering.
    Violation(String),
    /// The socket failed (including a peer that took no replies for `shutdown_grace`).
    Io(io::Error),
}

impl From<DecodeError> for End {
    fn from(e: DecodeError) -> Self {
        Self::Violation(format!("protocol violation: {e}"))
    }
}

/// Serves one connection until it ends; runs on the connection's own thread.
pub(crate) fn serve(shared: &Arc<Shared>, stream: Stream) {
    let out: Arc<Mutex<Stream>> = match stream.try_clone() {
        Ok(s) => Arc::new(Mutex::new(s)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone the connection's socket; dropping it");
            return;
        }
    };
    let inflight = shared
        .cfg
        .io_pool
        .as_ref()
        .map(|_| Inflight::new(shared.exec.clone(), out.clone(), shared.cfg.io_depth));
    let mut conn = Connection {
        exec: &shared.exec,
        pool: shared.cfg.io_pool.as_deref(),
        window: shared.cfg.window.max(1),
        input: stream,
        out,
        replies: Vec::with_capacity(64 << 10),
        hello_done: false,
        fence: &shared.fence,
        fence_wait: shared.cfg.shutdown_grace + FENCE_WAIT_MARGIN,
        admission: None,
        generation: 0,
        flusher: None,
        inflight,
    };
    let mut end = conn.run();
    if conn.admission.is_some() && conn.fence.is_stale(conn.generation) {
        // Whatever stopped the thread (its socket shut down by the newer Hello, a request refused), tell the
        // client why before closing.
        end = End::Fenced;
    }
    match &end {
        End::PeerClosed => tracing::debug!("peer closed the connection"),
        End::Refused => tracing::info!("hello refused; closing connection"),
        End::Fenced => {
            let current = conn.fence.current();
            tracing::warn!(
                generation = conn.generation,
                current,
                "a newer engine generation connected; closing this connection"
            );
            let notice = BackendError::new(
                ErrorKind::Fenced,
                format!(
                    "fenced by generation {current} > {}: a newer engine took over this replica",
                    conn.generation
                ),
            );
            Reply::fenced(0, notice, current).encode_into(&mut conn.replies);
        }
        End::Dropped => tracing::warn!("backend asked to drop the connection"),
        End::Violation(why) => {
            shared.exec.metrics.protocol_violations.fetch_add(1, Relaxed);
            tracing::warn!(reason = %why, "protocol violation; dropping connection");
        }
        End::Io(err) => tracing::info!(error = %err, "connection failed; dropping connection"),
    }
    let graceful = matches!(end, End::PeerClosed | End::Refused | End::Fenced);
    if graceful && let Err(e) = conn.send() {
        tracing::debug!(error = %e, "final replies not delivered");
    }
    if graceful
        && let Err(e) = conn
            .out
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .close_notify()
    {
        tracing::debug!(error = %e, "TLS close_notify not delivered");
    }
    if !graceful {
        // Unblocks a flusher writing to a peer that does not read, and tells the peer at once.
        conn.input.shutdown(Shutdown::Both);
    }
    if let Some(f) = conn.flusher.take() {
        drop(f.jobs);
        let _ = f.thread.join();
    }
    if let Some(inflight) = conn.inflight.take() {
        // Requests at the pool finish and write their replies (a dead socket fails those writes at once).
        inflight.drain();
    }
    conn.input.shutdown(Shutdown::Both);
    if let Some(a) = conn.admission.take() {
        // Only now: a newer Hello waits for this, and nothing of this connection may run after it.
        conn.fence.leave(&a);
    }
}

/// How much longer than `shutdown_grace` a newer generation's `Hello` waits for older connections to end.
const FENCE_WAIT_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

struct Flusher {
    jobs: mpsc::SyncSender<u64>,
    thread: JoinHandle<()>,
}

struct Connection<'a> {
    exec: &'a Arc<Executor>,
    /// The server's IO pool, when it has one.
    pool: Option<&'a super::IoPool>,
    window: usize,
    input: Stream,
    /// The socket's write side, shared with the flusher; locked for one batch write at a time.
    out: Arc<Mutex<Stream>>,
    /// Encoded replies of the current batch.
    replies: Vec<u8>,
    hello_done: bool,
    fence: &'a Fence,
    /// How long a `Hello` raising the generation waits for older connections to end.
    fence_wait: std::time::Duration,
    /// Set at an accepted `Hello`.
    admission: Option<Admission>,
    /// The engine generation this connection presented (0: none).
    generation: u64,
    flusher: Option<Flusher>,
    /// With an IO pool: the slots this connection's requests wait in for a pool thread.
    inflight: Option<Arc<Inflight>>,
}

impl Connection<'_> {
    fn run(&mut self) -> End {
        let mut input = vec![0u8; IN_BUF_LEN];
        let (mut start, mut end) = (0usize, 0usize);
        loop {
            let mut ran = 0usize;
            // Every complete request the last reads brought.
            while end - start >= HEADER_LEN {
                let h = match FrameHeader::decode_slice(&input[start..end]) {
                    Ok(h) => h,
                    Err(e) => return e.into(),
                };
                let frame_len = HEADER_LEN + h.payload_usize();
                if end - start < frame_len {
                    if frame_len <= input.len() {
                        break; // the rest arrives with the next read
                    }
                    // A payload larger than the input buffer: into a pooled buffer, the rest straight from
                    // the socket.
                    if let Err(e) = self.send() {
                        return End::Io(e);
                    }
                    let mut payload = self.exec.buffers.get(h.payload_usize());
                    let have = end - start - HEADER_LEN;
                    crate::io_counters::copy(have);
                    crate::io_counters::kernel(payload.len() - have);
                    payload[..have].copy_from_slice(&input[start + HEADER_LEN..end]);
                    (start, end) = (0, 0);
                    if let Err(e) = self.input.read_exact(&mut payload[have..]) {
                        return match e.kind() {
                            io::ErrorKind::UnexpectedEof => {
                                End::Violation("connection closed in the middle of a frame".to_owned())
                            }
                            _ => End::Io(e),
                        };
                    }
                    if let Some(end) = self.handle(h, &payload) {
                        return end;
                    }
                    continue;
                }
                let payload = &input[start + HEADER_LEN..start + frame_len];
                start += frame_len;
                if let Some(end) = self.handle(h, payload) {
                    return end;
                }
                ran += 1;
                if ran >= self.window || self.replies.len() >= OUT_FLUSH_LEN {
                    if let Err(e) = self.send() {
                        return End::Io(e);
                    }
                    ran = 0;
                }
            }
            if let Err(e) = self.send() {
                return End::Io(e);
            }
            // Keep the partial frame at the front so the next read can complete it.
            if start > 0 {
                crate::io_counters::copy(end - start);
                input.copy_within(start..end, 0);
                (start, end) = (0, end - start);
            }
            match self.input.read(&mut input[end..]) {
                Ok(0) if end == 0 => return End::PeerClosed,
                Ok(0) => return End::Violation("connection closed in the middle of a frame".to_owned()),
                Ok(n) => {
                    crate::io_counters::kernel(n);
                    end += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return End::Io(e),
            }
        }
    }

    /// Writes the gathered replies with one call (under the write lock the flusher shares).
    fn send(&mut self) -> io::Result<()> {
        if self.replies.is_empty() {
            return Ok(());
        }
        crate::io_counters::lock();
        crate::io_counters::kernel(self.replies.len());
        let result = self
            .out
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(&self.replies);
        self.replies.clear();
        if self.replies.capacity() > OUT_KEEP_LEN {
            self.replies.shrink_to(64 << 10);
        }
        result
    }

    /// Runs one request and queues its reply; `Some` ends the connection.
    fn handle(&mut self, h: FrameHeader, payload: &[u8]) -> Option<End> {
        if !h.kind.is_request() {
            return Some(End::Violation(format!("client sent a {:?} reply", h.kind)));
        }
        if !self.hello_done {
            if h.kind != FrameKind::Hello {
                return Some(End::Violation(format!("{:?} before Hello", h.kind)));
            }
            return self.hello(&h, payload);
        }
        // One atomic load per request: nothing runs once a newer engine generation took over.
        if self.fence.is_stale(self.generation) {
            return Some(End::Fenced);
        }
        self.exec.metrics.requests.fetch_add(1, Relaxed);
        if self.inflight.is_some()
            && (poolable(h.kind) || (h.kind == FrameKind::Flush && self.exec.flush_at_pool()))
        {
            return self.pooled(h, payload);
        }
        match h.kind {
            FrameKind::Hello => Some(End::Violation("second Hello".to_owned())),
            FrameKind::Ping => {
                Reply::empty(FrameKind::Ok, h.id).encode_into(&mut self.replies);
                None
            }
            FrameKind::Read => self.read(&h),
            FrameKind::Flush => self.flush(h.id),
            _ => {
                let reply = match self.exec.run(&h, payload) {
                    Ok((body, length)) => {
                        let mut reply = Reply::empty(FrameKind::Ok, h.id);
                        reply.header.length = length;
                        reply.body = body;
                        reply
                    }
                    Err(err) => failure(self.exec, &h, err),
                };
                self.queue(&reply)
            }
        }
    }

    /// Reads the data straight into the output buffer, behind its reply header.
    fn read(&mut self, h: &FrameHeader) -> Option<End> {
        let at = self.replies.len();
        let len = h.length_usize();
        self.replies.resize(at + HEADER_LEN + len, 0);
        match self.exec.read(h, &mut self.replies[at + HEADER_LEN..]) {
            Ok(()) => {
                let mut header = FrameHeader::new(FrameKind::Ok, h.id, 0, 0);
                header.payload_len = h.length;
                self.replies[at..at + HEADER_LEN].copy_from_slice(&header.encode());
                None
            }
            Err(err) => {
                self.replies.truncate(at);
                self.queue(&failure(self.exec, h, err))
            }
        }
    }

    /// With an IO pool: runs inline what the backend can do without waiting for the device, hands the rest
    /// to a free slot (waiting for one, after writing the pending replies, when all are in use).
    fn pooled(&mut self, h: FrameHeader, payload: &[u8]) -> Option<End> {
        match h.kind {
            FrameKind::Read => {
                let at = self.replies.len();
                let len = h.length_usize();
                self.replies.resize(at + HEADER_LEN + len, 0);
                match self.exec.read_nowait(&h, &mut self.replies[at + HEADER_LEN..]) {
                    Ok(true) => {
                        let mut header = FrameHeader::new(FrameKind::Ok, h.id, 0, 0);
                        header.payload_len = h.length;
                        self.replies[at..at + HEADER_LEN].copy_from_slice(&header.encode());
                        return None;
                    }
                    Ok(false) => self.replies.truncate(at),
                    Err(err) => {
                        self.replies.truncate(at);
                        return self.queue(&failure(self.exec, &h, err));
                    }
                }
            }
            FrameKind::Write => match self.exec.write_nowait(&h, payload) {
                Ok(true) => return self.queue(&Reply::empty(FrameKind::Ok, h.id)),
                Ok(false) => {}
                Err(err) => return self.queue(&failure(self.exec, &h, err)),
            },
            _ => {}
        }
        let inflight = self.inflight.clone()?;
        let slot = match inflight.try_slot() {
            Some(s) => s,
            None => {
                if let Err(e) = self.send() {
                    return Some(End::Io(e));
                }
                inflight.wait_slot()
            }
        };
        let pool = self.pool?;
        let payload = if h.kind == FrameKind::Write { payload } else { &[] };
        inflight.submit(pool, slot, h, payload);
        None
    }

    fn queue(&mut self, reply: &Reply) -> Option<End> {
        if matches!(reply.body, ReplyBody::DropConnection) {
            return Some(End::Dropped);
        }
        reply.encode_into(&mut self.replies);
        None
    }

    /// Hands a flush to the flusher thread, starting it at the first flush.
    fn flush(&mut self, id: u64) -> Option<End> {
        if self.flusher.is_none() {
            match spawn_flusher(self.exec.clone(), self.out.clone(), self.window) {
                Ok(f) => self.flusher = Some(f),
                Err(e) => {
                    let err = BackendError::new(ErrorKind::Io, format!("cannot start the flusher: {e}"));
                    return self.queue(&Reply::failure(id, err, false));
                }
            }
        }
        let jobs = &self.flusher.as_ref()?.jobs;
        // Waits while `window` flushes are queued; fails only when the flusher dropped the connection.
        match jobs.send(id) {
            Ok(()) => None,
            Err(_) => Some(End::Dropped),
        }
    }

    fn hello(&mut self, h: &FrameHeader, name: &[u8]) -> Option<End> {
        let client = String::from_utf8_lossy(name);
        tracing::debug!(client = %client, version = h.length, generation = h.offset, "hello");
        if h.length != u32::from(VERSION) {
            let err = BackendError::new(
                ErrorKind::Invalid,
                format!(
                    "protocol version {} not supported; this server speaks {VERSION}",
                    h.length
                ),
            );
            self.queue(&Reply::failure(h.id, err, false));
            return Some(End::Refused);
        }
        let info = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.exec.backend.info()))
            .unwrap_or_else(|_| Err(BackendError::new(ErrorKind::Unavailable, "volume info panicked")));
        match info {
            Ok(VolumeInfo {
                size,
                sector_size,
                mut name,
            }) => {
                truncate_utf8(&mut name, MAX_NAME_LEN);
                let backend = self.exec.backend.as_ref();
                match self.fence.admit(backend, h.offset, &self.input, self.fence_wait) {
                    Ok(a) => {
                        self.generation = a.generation;
                        self.admission = Some(a);
                    }
                    Err(Refusal::Stale { replica, message }) => {
                        let err = BackendError::new(ErrorKind::Fenced, message);
                        self.queue(&Reply::fenced(h.id, err, replica));
                        return Some(End::Refused);
                    }
                    Err(Refusal::Backend(err)) => {
                        self.queue(&Reply::failure(h.id, err, false));
                        return Some(End::Refused);
                    }
                }
                self.hello_done = true;
                self.queue(&Reply {
                    header: FrameHeader::new(FrameKind::Ok, h.id, size, sector_size),
                    body: ReplyBody::Text(name),
                })
            }
            Err(err) => {
                self.queue(&Reply::failure(h.id, err, false));
                Some(End::Refused)
            }
        }
    }
}

/// The connection's flusher: runs queued flushes in order and writes each reply under the write lock.
/// A backend asking to drop the connection, or a failed write, shuts the socket down, which ends the
/// connection thread too.
fn spawn_flusher(exec: Arc<Executor>, out: Arc<Mutex<Stream>>, window: usize) -> io::Result<Flusher> {
    let (jobs, rx) = mpsc::sync_channel::<u64>(window);
    let span = tracing::Span::current();
    let thread = std::thread::Builder::new()
        .name("dp-flush".to_owned())
        .spawn(move || {
            let _span = span.enter();
            let mut buf = Vec::with_capacity(HEADER_LEN);
            for id in rx {
                let h = FrameHeader::new(FrameKind::Flush, id, 0, 0);
                let reply = match exec.run(&h, &[]) {
                    Ok(_) => Reply::empty(FrameKind::Ok, id),
                    Err(err) => failure(&exec, &h, err),
                };
                crate::io_counters::lock();
                let mut out = out.lock().unwrap_or_else(PoisonError::into_inner);
                if matches!(reply.body, ReplyBody::DropConnection) {
                    tracing::warn!(id, "backend asked to drop the connection");
                    out.shutdown(Shutdown::Both);
                    return;
                }
                buf.clear();
                reply.encode_into(&mut buf);
                if let Err(e) = out.write_all(&buf) {
                    tracing::debug!(error = %e, "flush reply not delivered");
                    out.shutdown(Shutdown::Both);
                    return;
                }
            }
        })?;
    Ok(Flusher { jobs, thread })
}
