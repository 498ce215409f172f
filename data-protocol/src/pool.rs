//! Reusable IO buffers for payloads, so the data path does not allocate per request once warm.
//!
//! The server takes a buffer for every write payload and every read reply; the client for every write
//! it sends and every read reply it receives. A returned buffer keeps its capacity and its length, so
//! a later request of the same or smaller size reuses it without reallocating or re-zeroing. The pool
//! retains at most `max_retained_bytes` of capacity: bursts beyond that allocate and free normally,
//! which bounds idle memory while the in-flight windows bound busy memory.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

/// A bounded free list of byte buffers. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    free: Mutex<FreeList>,
    max_retained_bytes: usize,
}

#[derive(Debug, Default)]
struct FreeList {
    bufs: Vec<Vec<u8>>,
    retained_bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `max_retained_bytes` of idle buffer capacity.
    pub fn new(max_retained_bytes: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                free: Mutex::new(FreeList {
                    bufs: Vec::with_capacity(64),
                    retained_bytes: 0,
                }),
                max_retained_bytes,
            }),
        }
    }

    /// A buffer of exactly `len` bytes. Its contents are unspecified (left over from earlier use, or
    /// zeros); callers overwrite all of it.
    pub fn get(&self, len: usize) -> PooledBuf {
        let reused = {
            crate::io_counters::lock();
            let mut free = self.inner.free.lock().unwrap_or_else(PoisonError::into_inner);
            // Best effort fit: prefer the most recently returned buffer that is already large enough.
            let pos = free.bufs.iter().rposition(|b| b.len() >= len);
            let buf = match pos {
                Some(i) => Some(free.bufs.swap_remove(i)),
                None => free.bufs.pop(),
            };
            if let Some(b) = &buf {
                free.retained_bytes -= b.capacity();
            }
            buf
        };
        let mut data = reused.unwrap_or_default();
        if data.len() < len {
            // Only while warming up (or for a size never seen before).
            data.resize(len, 0);
        }
        PooledBuf {
            data,
            len,
            pool: Some(self.inner.clone()),
        }
    }

    /// Idle capacity currently retained (for tests and metrics).
    pub fn retained_bytes(&self) -> usize {
        self.inner
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retained_bytes
    }
}

impl PoolInner {
    fn put(&self, buf: Vec<u8>) {
        crate::io_counters::lock();
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if free.retained_bytes + buf.capacity() <= self.max_retained_bytes {
            free.retained_bytes += buf.capacity();
            free.bufs.push(buf);
        }
    }
}

/// A buffer borrowed from a [`BufferPool`]; derefs to exactly the requested length and goes back to the
/// pool on drop.
#[derive(Debug)]
pub struct PooledBuf {
    data: Vec<u8>,
    len: usize,
    pool: Option<Arc<PoolInner>>,
}

impl PooledBuf {
    /// Shortens the visible length (e.g. a reply that turned out shorter). Never grows.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data[..self.len]
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.put(std::mem::take(&mut self.data));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returned_buffers_are_reused_without_reallocating() {
        let pool = BufferPool::new(1 << 20);
        let ptr = {
            let mut b = pool.get(4096);
            b.fill(7);
            b.as_ptr()
        };
        let b = pool.get(1024);
        assert_eq!(b.len(), 1024);
        assert_eq!(b.as_ptr(), ptr);
    }

    #[test]
    fn retains_no_more_than_its_budget() {
        let pool = BufferPool::new(10_000);
        let a = pool.get(8192);
        let b = pool.get(8192);
        drop(a);
        drop(b);
        assert!(pool.retained_bytes() <= 10_000);
        assert!(pool.retained_bytes() >= 8192);
    }
}
