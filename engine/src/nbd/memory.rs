//! [`MemoryDevice`]: an in-memory [`BlockDevice`] that tracks allocation per 4 KiB block, for tests, examples
//! and for measuring the frontend without storage underneath.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use corral_disk::{BLOCK_BYTES, BLOCK_SIZE};

use super::{Allocation, BlockDevice, DeviceError};

/// Allocation granularity of the memory device: the volume block.
const MEMORY_BLOCK: u64 = BLOCK_SIZE;

/// A sparse-looking device in RAM. Fully covered blocks become holes on trim (and on write-zeroes that may
/// trim), written blocks become data, so `base:allocation` answers are predictable in tests.
#[derive(Debug)]
pub struct MemoryDevice {
    size: u64,
    state: Mutex<State>,
    flushes: AtomicU64,
}

#[derive(Debug)]
struct State {
    data: Vec<u8>,
    blocks: Vec<Allocation>,
    failing: Option<Range<u64>>,
}

impl MemoryDevice {
    /// A device of `size` bytes that is one hole (all zeros). Panics if `size` does not fit in memory's
    /// address space (tests choose small sizes).
    pub fn new(size: u64) -> Self {
        let len = usize::try_from(size).expect("memory device size fits in usize");
        let blocks = usize::try_from(size.div_ceil(MEMORY_BLOCK)).expect("block count fits in usize");
        Self {
            size,
            state: Mutex::new(State {
                data: vec![0; len],
                blocks: vec![Allocation::Hole; blocks],
                failing: None,
            }),
            flushes: AtomicU64::new(0),
        }
    }

    /// Makes reads and writes touching `range` fail with an IO error (`None` heals the device).
    pub fn fail_range(&self, range: Option<Range<u64>>) {
        self.lock().failing = range;
    }

    /// A copy of the whole content.
    pub fn snapshot(&self) -> Vec<u8> {
        self.lock().data.clone()
    }

    /// Flushes completed so far.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn span(&self, offset: u64, len: u64) -> Result<Range<usize>, DeviceError> {
        let end = offset.checked_add(len).filter(|&e| e <= self.size);
        match (end, usize::try_from(offset)) {
            (Some(end), Ok(start)) => {
                Ok(start..usize::try_from(end).map_err(|e| DeviceError::invalid(e.to_string()))?)
            }
            _ => Err(DeviceError::invalid(format!(
                "range {offset}+{len} outside device of {} bytes",
                self.size
            ))),
        }
    }
}

impl State {
    fn check(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        match &self.failing {
            Some(f) if offset < f.end && f.start < offset + len => {
                Err(DeviceError::io(format!("injected failure at {offset}+{len}")))
            }
            _ => Ok(()),
        }
    }

    /// Zeroes `range`; blocks it covers completely take `full`, partly covered ones keep their state (they
    /// read as zeros where cleared either way).
    fn zero(&mut self, range: Range<usize>, full: Allocation) {
        self.data[range.clone()].fill(0);
        let block = BLOCK_BYTES;
        let first_full = range.start.div_ceil(block);
        let end_full = range.end / block;
        let last_partial_end = if range.end == self.data.len() {
            range.end.div_ceil(block)
        } else {
            end_full
        };
        for b in first_full..last_partial_end.max(first_full) {
            self.blocks[b] = full;
        }
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        let range = self.span(offset, buf.len() as u64)?;
        let state = self.lock();
        state.check(offset, buf.len() as u64)?;
        buf.copy_from_slice(&state.data[range]);
        Ok(())
    }

    async fn write(&self, offset: u64, data: bytes::Bytes, _fua: bool) -> Result<(), DeviceError> {
        let range = self.span(offset, data.len() as u64)?;
        let mut state = self.lock();
        state.check(offset, data.len() as u64)?;
        let block = BLOCK_BYTES;
        for b in range.start / block..range.end.div_ceil(block) {
            state.blocks[b] = Allocation::Data;
        }
        state.data[range].copy_from_slice(&data);
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let range = self.span(offset, len)?;
        self.lock().zero(range, Allocation::Hole);
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), DeviceError> {
        let range = self.span(offset, len)?;
        let mut state = self.lock();
        state.check(offset, len)?;
        state.zero(
            range,
            if may_trim {
                Allocation::Hole
            } else {
                Allocation::Zero
            },
        );
        Ok(())
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<(u64, Allocation)>, DeviceError> {
        let range = self.span(offset, len)?;
        let state = self.lock();
        let mut pieces: Vec<(u64, Allocation)> = Vec::new();
        let mut pos = range.start as u64;
        let end = range.end as u64;
        while pos < end {
            let b = pos / MEMORY_BLOCK;
            let alloc = state.blocks[usize::try_from(b).map_err(|e| DeviceError::invalid(e.to_string()))?];
            let next = ((b + 1) * MEMORY_BLOCK).min(end);
            match pieces.last_mut() {
                Some((l, a)) if *a == alloc => *l += next - pos,
                _ => pieces.push((next - pos, alloc)),
            }
            pos = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn allocation_follows_writes_trims_and_zeroes() {
        let dev = MemoryDevice::new(8 * MEMORY_BLOCK);
        dev.write(MEMORY_BLOCK + 10, bytes::Bytes::from_static(&[1; 10]), false)
            .await
            .unwrap();
        dev.write_zeroes(4 * MEMORY_BLOCK, 2 * MEMORY_BLOCK, false)
            .await
            .unwrap();
        let map = dev.block_status(0, 8 * MEMORY_BLOCK).await.unwrap();
        assert_eq!(
            map,
            vec![
                (MEMORY_BLOCK, Allocation::Hole),
                (MEMORY_BLOCK, Allocation::Data),
                (2 * MEMORY_BLOCK, Allocation::Hole),
                (2 * MEMORY_BLOCK, Allocation::Zero),
                (2 * MEMORY_BLOCK, Allocation::Hole),
            ]
        );
        dev.trim(MEMORY_BLOCK, MEMORY_BLOCK).await.unwrap();
        let map = dev.block_status(100, 2 * MEMORY_BLOCK).await.unwrap();
        assert_eq!(map, vec![(2 * MEMORY_BLOCK, Allocation::Hole)]);
        let mut buf = [9u8; 20];
        dev.read(MEMORY_BLOCK + 5, &mut buf).await.unwrap();
        assert_eq!(buf, [0; 20]);
    }
}
