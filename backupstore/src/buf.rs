//! Block buffers reused across the blocks of one backup or restore: 4 KiB-aligned (so a block can be written with
//! `O_DIRECT` from where it lies) and allocated once per block in flight instead of once per block, which spared
//! the page faults and zeroing of a fresh multi-MiB allocation for every block.

use std::sync::{Arc, Mutex, PoisonError};

use corral_disk::sparse::{AlignedBuf, DIRECT_IO_ALIGN};

/// Room before a block's data in a buffer: a stored block's 52-byte header is read or assembled just in front of
/// its data, which then starts 4 KiB-aligned.
pub(crate) const DATA_AT: usize = DIRECT_IO_ALIGN;

/// A pool of equally sized aligned buffers, at most `keep` of them kept between uses.
pub(crate) struct BufPool {
    len: usize,
    keep: usize,
    free: Mutex<Vec<AlignedBuf>>,
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("len", &self.len)
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

impl BufPool {
    /// Buffers of at least `len` bytes; `keep` bounds what stays allocated (the blocks in flight).
    pub(crate) fn new(len: usize, keep: usize) -> Arc<Self> {
        Arc::new(Self {
            len,
            keep,
            free: Mutex::new(Vec::new()),
        })
    }

    /// A buffer from the pool (a new one when none is free); it goes back when dropped.
    pub(crate) fn get(self: &Arc<Self>) -> PooledBuf {
        let b = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .unwrap_or_else(|| AlignedBuf::new(self.len));
        PooledBuf {
            buf: Some(b),
            pool: self.clone(),
        }
    }
}

/// A buffer on loan from a [`BufPool`].
pub(crate) struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufPool>,
}

impl PooledBuf {
    pub(crate) fn as_slice(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], AlignedBuf::as_slice)
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], AlignedBuf::as_mut_slice)
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut free = self.pool.free.lock().unwrap_or_else(PoisonError::into_inner);
            if free.len() < self.pool.keep {
                free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_reused_and_bounded() {
        let pool = BufPool::new(10_000, 1);
        let mut a = pool.get();
        assert!(a.as_slice().len() >= 10_000);
        assert_eq!(a.as_slice().as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        a.as_mut_slice()[0] = 7;
        let ptr = a.as_slice().as_ptr();
        let b = pool.get();
        drop(a);
        drop(b); // beyond `keep`: freed
        let c = pool.get();
        assert_eq!(c.as_slice().as_ptr(), ptr, "the kept buffer is handed out again");
        assert_eq!(pool.free.lock().unwrap().len(), 0);
    }
}
