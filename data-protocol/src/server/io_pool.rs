//! The optional IO pool ([`crate::ServerConfig::io_pool`]): several requests of one connection at the
//! device at once.
//!
//! Without a pool a connection runs its requests one after another on its own thread, which is right when a
//! request costs a few µs (page-cache hits). A backend whose reads go to the device (a v2 lvstore opened with
//! `O_DIRECT`: ~40–70 µs per 4 KiB here) would then have at most one request per connection at the device,
//! whatever the client's queue depth. With a pool, the connection thread still decodes every request and runs
//! inline what the backend can answer without waiting ([`BlockBackend::read_at_nowait`],
//! [`BlockBackend::write_at_nowait`]); everything else goes to a free *slot* of the connection (a fixed set of
//! `io_depth` slots, each with its header and a 4 KiB-aligned payload buffer reused from request to request)
//! and from there to the pool's threads, which run it and write its reply as soon as it completes, out of
//! order (the protocol matches replies by id).
//!
//! Replies of the workers are gathered in one buffer per connection: the first worker to find no write in
//! progress becomes the sender and writes what has gathered, in a loop, until the buffer is empty; the others
//! only append. So replies that complete together leave in one `write`, and no thread waits for another's
//! write. Writes to the socket (the connection thread's inline replies, the sender's batches) are whole
//! frames under the socket's lock.
//!
//! Bounds: a connection has at most `io_depth` requests at the pool; the connection thread waits for a free
//! slot (after writing its own pending replies) and does not read the socket meanwhile, so TCP pushes back
//! on the client. The pool's queue therefore never holds more than the slots of its connections, and
//! nothing on this path allocates once the slot buffers have grown to the request size.
//!
//! Ordering: requests in flight at once on a connection complete in any order (as they do across the
//! client's several connections); a flush (run by the connection's flusher, not here) covers every write
//! acknowledged before the flush was received, which is what the client relies on (it sends a flush only
//! after the writes it covers were acknowledged).

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::Shutdown;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::request::{Executor, Reply, ReplyBody, failure};
use super::stream::Stream;
use crate::codec::{FrameHeader, FrameKind};

/// Memory alignment of slot buffers (what `O_DIRECT` needs, so a backend can use them without a bounce).
const ALIGN: usize = 4096;
/// A slot buffer grown past this by a large request is shrunk back after it.
const SLOT_KEEP_LEN: usize = 1 << 20;
/// Gathered-reply capacity kept between batches.
const OUT_KEEP_LEN: usize = 4 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A fixed set of threads running connections' requests; shared by every connection of every server it is
/// given to (the v2 daemon gives one pool to all the replicas of its disk).
pub struct IoPool {
    shared: Arc<PoolShared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoPool")
            .field("threads", &lock(&self.threads).len())
            .finish_non_exhaustive()
    }
}

struct PoolShared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// Slot `slot` of connection `conn` holds a request to run.
pub(crate) struct Job {
    conn: Arc<Inflight>,
    slot: usize,
}

impl IoPool {
    /// Starts `threads` IO threads (at least one), named `dp-io-N`.
    pub fn new(threads: usize) -> io::Result<Arc<Self>> {
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::with_capacity(256),
                closed: false,
            }),
            ready: Condvar::new(),
        });
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("dp-io-{i}"))
                .spawn(move || worker(&s));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    close(&shared, handles);
                    return Err(e);
                }
            }
        }
        Ok(Arc::new(Self {
            shared,
            threads: Mutex::new(handles),
        }))
    }

    /// The number of threads.
    pub fn threads(&self) -> usize {
        lock(&self.threads).len()
    }

    fn submit(&self, job: Job) {
        lock(&self.shared.queue).jobs.push_back(job);
        self.shared.ready.notify_one();
    }
}

impl Drop for IoPool {
    /// Stops the threads once the queue is empty (every connection holds the pool, so none is left).
    fn drop(&mut self) {
        let handles = std::mem::take(&mut *lock(&self.threads));
        close(&self.shared, handles);
    }
}

fn close(shared: &PoolShared, handles: Vec<JoinHandle<()>>) {
    lock(&shared.queue).closed = true;
    shared.ready.notify_all();
    for h in handles {
        let _ = h.join();
    }
}

fn worker(shared: &PoolShared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.closed {
                    return;
                }
                q = shared.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        job.conn.run(job.slot);
    }
}

/// A 4 KiB-aligned buffer carved out of a larger `Vec` (safe code, no custom allocator); grows to the
/// largest request seen, shrinks back after a large one.
struct AlignedBuf {
    v: Vec<u8>,
    off: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let mut b = Self {
            v: Vec::new(),
            off: 0,
        };
        b.reserve(len);
        b
    }

    fn capacity(&self) -> usize {
        self.v.len() - self.off
    }

    fn reserve(&mut self, len: usize) {
        if self.v.is_empty() || self.capacity() < len {
            self.v = vec![0u8; len + ALIGN];
            self.off = self.v.as_ptr().align_offset(ALIGN);
        }
    }

    fn get_mut(&mut self, len: usize) -> &mut [u8] {
        self.reserve(len);
        &mut self.v[self.off..self.off + len]
    }

    fn get(&self, len: usize) -> &[u8] {
        &self.v[self.off..self.off + len]
    }

    fn trim(&mut self) {
        if self.capacity() > SLOT_KEEP_LEN {
            *self = Self::new(64 << 10);
        }
    }
}

/// One request handed to the pool: its header and payload (a write's data in, a read's data out).
struct Slot {
    header: FrameHeader,
    buf: AlignedBuf,
}

/// What the workers share with one connection: its slots, its gathered replies and its socket.
pub(crate) struct Inflight {
    exec: Arc<Executor>,
    /// The socket's write side, shared with the connection thread (and locked for one whole write).
    out: Arc<Mutex<Stream>>,
    slots: Box<[Mutex<Slot>]>,
    free: Mutex<Vec<usize>>,
    freed: Condvar,
    replies: Mutex<Gathered>,
}

struct Gathered {
    buf: Vec<u8>,
    /// The buffer the sender writes from (swapped with `buf`, so neither is reallocated).
    spare: Vec<u8>,
    /// A worker is writing `spare`; others only append to `buf`.
    sending: bool,
    /// A write failed: the socket is shut down, later replies are dropped.
    failed: bool,
}

impl Inflight {
    pub(crate) fn new(exec: Arc<Executor>, out: Arc<Mutex<Stream>>, depth: usize) -> Arc<Self> {
        let depth = depth.max(1);
        Arc::new(Self {
            exec,
            out,
            slots: (0..depth)
                .map(|_| {
                    Mutex::new(Slot {
                        header: FrameHeader::new(FrameKind::Ping, 0, 0, 0),
                        buf: AlignedBuf::new(64 << 10),
                    })
                })
                .collect(),
            free: Mutex::new((0..depth).rev().collect()),
            freed: Condvar::new(),
            replies: Mutex::new(Gathered {
                buf: Vec::with_capacity(64 << 10),
                spare: Vec::with_capacity(64 << 10),
                sending: false,
                failed: false,
            }),
        })
    }

    /// A free slot, or `None` when every slot is in use (the caller writes its replies, then [`Self::wait_slot`]).
    pub(crate) fn try_slot(&self) -> Option<usize> {
        lock(&self.free).pop()
    }

    /// Waits for a free slot.
    pub(crate) fn wait_slot(&self) -> usize {
        let mut free = lock(&self.free);
        loop {
            if let Some(i) = free.pop() {
                return i;
            }
            free = self.freed.wait(free).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Fills slot `slot` with request `h` (copying a write's `payload` into the slot's buffer) and queues it
    /// on `pool`. (The connection holds the pool, not this state: a worker dropping the last job must never
    /// be the one that drops the pool and joins itself.)
    pub(crate) fn submit(self: &Arc<Self>, pool: &IoPool, slot: usize, h: FrameHeader, payload: &[u8]) {
        {
            let mut s = lock(&self.slots[slot]);
            s.header = h;
            if !payload.is_empty() {
                crate::io_counters::copy(payload.len());
                s.buf.get_mut(payload.len()).copy_from_slice(payload);
            }
        }
        self.exec.metrics.pooled.fetch_add(1, Relaxed);
        pool.submit(Job {
            conn: self.clone(),
            slot,
        });
    }

    /// Waits until no request of this connection is at the pool (every reply written or dropped).
    pub(crate) fn drain(&self) {
        let mut free = lock(&self.free);
        while free.len() < self.slots.len() {
            free = self.freed.wait(free).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Runs the request in `slot` (on a pool thread), writes its reply, frees the slot.
    fn run(&self, slot: usize) {
        {
            let mut guard = lock(&self.slots[slot]);
            let s = &mut *guard;
            let h = s.header;
            let exec = &*self.exec;
            if h.kind == FrameKind::Read {
                let len = h.length_usize();
                match exec.read(&h, s.buf.get_mut(len)) {
                    Ok(()) => {
                        let data = s.buf.get(len);
                        self.reply(|out| {
                            let mut header = FrameHeader::new(FrameKind::Ok, h.id, 0, 0);
                            header.payload_len = h.length;
                            out.extend_from_slice(&header.encode());
                            crate::io_counters::copy(data.len());
                            out.extend_from_slice(data);
                        });
                    }
                    Err(err) => self.queue(&failure(exec, &h, err)),
                }
            } else {
                let payload = if h.kind == FrameKind::Write {
                    s.buf.get(h.payload_usize())
                } else {
                    &[]
                };
                let reply = match exec.run(&h, payload) {
                    Ok((body, length)) => {
                        let mut reply = Reply::empty(FrameKind::Ok, h.id);
                        reply.header.length = length;
                        reply.body = body;
                        reply
                    }
                    Err(err) => failure(exec, &h, err),
                };
                self.queue(&reply);
            }
            s.buf.trim();
        }
        lock(&self.free).push(slot);
        self.freed.notify_all();
    }

    fn queue(&self, reply: &Reply) {
        if matches!(reply.body, ReplyBody::DropConnection) {
            tracing::warn!(id = reply.header.id, "backend asked to drop the connection");
            lock(&self.replies).failed = true;
            lock(&self.out).shutdown(Shutdown::Both);
            return;
        }
        self.reply(|out| reply.encode_into(out));
    }

    /// Appends a reply to the gathered ones; becomes the sender when no write is in progress.
    fn reply(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        let mut g = lock(&self.replies);
        if g.failed {
            return;
        }
        encode(&mut g.buf);
        if g.sending {
            return;
        }
        g.sending = true;
        loop {
            let mut batch = std::mem::take(&mut g.spare);
            std::mem::swap(&mut batch, &mut g.buf);
            drop(g);
            crate::io_counters::lock();
            crate::io_counters::kernel(batch.len());
            let res = {
                let mut out = lock(&self.out);
                let r = out.write_all(&batch);
                if r.is_err() {
                    out.shutdown(Shutdown::Both);
                }
                r
            };
            batch.clear();
            if batch.capacity() > OUT_KEEP_LEN {
                batch.shrink_to(64 << 10);
            }
            g = lock(&self.replies);
            g.spare = batch;
            if let Err(e) = res {
                tracing::debug!(error = %e, "replies not delivered; connection shut down");
                g.failed = true;
                g.sending = false;
                g.buf.clear();
                return;
            }
            if g.buf.is_empty() {
                g.sending = false;
                return;
            }
        }
    }
}

/// Whether requests of this kind go to the pool: everything but the connection's own Hello and Ping, and
/// flushes, which go there only when the backend asks ([`crate::BlockBackend::flush_at_pool`]; else to the
/// connection's flusher).
pub(crate) fn poolable(kind: FrameKind) -> bool {
    matches!(
        kind,
        FrameKind::Read
            | FrameKind::Write
            | FrameKind::Unmap
            | FrameKind::WriteZeroes
            | FrameKind::BlockStatus
    )
}
