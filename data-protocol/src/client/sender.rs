//! A connection's send side: the caller writes its own frame.
//!
//! A request whose connection has nothing queued is written by the calling task itself, with one
//! non-blocking `writev` of header and payload, under a short (non-async) lock: no hand-off to a writer task,
//! so a queue-depth-1 IO costs one wake-up fewer. Only when the socket is full (a partial or `WouldBlock`
//! write, e.g. a 1 MiB payload) does the frame's remainder, and every frame after it, go to the backlog,
//! which the connection's writer task drains in batches of up to [`MAX_IOV`] slices per `writev` as the
//! socket becomes writable again. Frames leave in the order they were handed in; nothing awaits under the
//! lock, so a caller that is cancelled can never leave half a frame behind.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::{Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::sync::Notify;

use crate::codec::{FrameHeader, HEADER_LEN};
use crate::transport::RawWrite;

/// Slices per `writev` when the writer task drains the backlog (two per frame).
const MAX_IOV: usize = 64;

/// One connection's write half and its backlog.
pub(super) struct Sender {
    sock: RawWrite,
    backlog: Mutex<Backlog>,
    /// Wakes the writer task when the backlog turns non-empty.
    wake: Notify,
}

#[derive(Default)]
struct Backlog {
    frames: VecDeque<Queued>,
    /// Bytes of `frames[0]` already written.
    sent: usize,
}

struct Queued {
    header: [u8; HEADER_LEN],
    /// A write's data: one buffer shared by every replica the write goes to.
    payload: Option<Bytes>,
}

impl Queued {
    fn len(&self) -> usize {
        HEADER_LEN + self.payload.as_ref().map_or(0, Bytes::len)
    }

    /// The unsent part of this frame, `skip` bytes in, as up to two slices.
    fn slices(&self, skip: usize) -> [&[u8]; 2] {
        let payload = self.payload.as_deref().unwrap_or(&[]);
        if skip < HEADER_LEN {
            [&self.header[skip..], payload]
        } else {
            [&[], &payload[skip - HEADER_LEN..]]
        }
    }
}

impl Sender {
    pub(super) fn new(sock: RawWrite) -> Self {
        Self {
            sock,
            backlog: Mutex::new(Backlog {
                frames: VecDeque::with_capacity(64),
                sent: 0,
            }),
            wake: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Backlog> {
        self.backlog.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends one frame: written now when the connection is idle and the socket takes it, otherwise queued
    /// for the writer task. Never waits. An error means the connection is broken.
    pub(super) fn send(&self, header: &FrameHeader, payload: Option<Bytes>) -> io::Result<()> {
        let frame = Queued {
            header: header.encode(),
            payload,
        };
        let mut backlog = self.lock();
        if !backlog.frames.is_empty() {
            // The writer task was woken when the backlog turned non-empty and drains it to the end.
            backlog.frames.push_back(frame);
            return Ok(());
        }
        let total = frame.len();
        let mut sent = 0;
        while sent < total {
            let [a, b] = frame.slices(sent);
            match self.sock.try_write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if sent < total {
            backlog.sent = sent;
            backlog.frames.push_back(frame);
            drop(backlog);
            self.wake.notify_one();
        }
        Ok(())
    }

    /// The writer task: drains the backlog whenever it is non-empty, waiting for writability when the
    /// socket is full. Returns only on a socket error.
    pub(super) async fn drain(&self) -> io::Result<()> {
        loop {
            self.wake.notified().await;
            // `notify_one` keeps a permit when nobody waits, so a frame queued between the last drain and
            // this wait is not missed.
            while !self.write_backlog()? {
                self.sock.writable().await?;
            }
        }
    }

    /// Writes as much of the backlog as the socket takes. True when it is empty.
    fn write_backlog(&self) -> io::Result<bool> {
        let mut backlog = self.lock();
        loop {
            if backlog.frames.is_empty() {
                return Ok(true);
            }
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut used = 0;
            let mut skip = backlog.sent;
            for frame in &backlog.frames {
                if used + 2 > MAX_IOV {
                    break;
                }
                for s in frame.slices(skip) {
                    if !s.is_empty() {
                        iov[used] = IoSlice::new(s);
                        used += 1;
                    }
                }
                skip = 0;
            }
            let mut n = match self.sock.try_write_vectored(&iov[..used]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            // Retire the frames that are now fully written.
            while n > 0 {
                let left = backlog.frames[0].len() - backlog.sent;
                if n < left {
                    backlog.sent += n;
                    break;
                }
                n -= left;
                backlog.sent = 0;
                backlog.frames.pop_front();
            }
        }
    }

    /// Handshake writes, before any request: all of `header` and `payload`, waiting as needed.
    pub(super) async fn write_now(&self, header: &FrameHeader, payload: &[u8]) -> io::Result<()> {
        self.sock.write_all(&header.encode()).await?;
        self.sock.write_all(payload).await
    }

    /// Drops the queued frames and shuts the sending direction down (the replica sees end of stream).
    pub(super) fn shutdown(&self) {
        self.lock().frames.clear();
        self.sock.shutdown_write();
    }
}
