//! Block IO on an open replica: positional reads that follow the location map down the chain, writes to the head
//! (read-modify-write only for partial blocks the head does not hold yet), unmap, write-zeroes, flush, and the
//! allocation map the engine answers NBD `BLOCK_STATUS` with.
//!
//! Locking: IO holds the chain's structure lock shared for its duration (shape changes wait for in-flight IO);
//! the location map is locked only to look up or record runs, never across file IO. Partial-block writes are
//! serialised per block by a striped lock so two sub-block writes to one block cannot lose each other's bytes.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use corral_disk::{BLOCK_BYTES, BLOCK_SIZE};

use crate::chain::Chain;
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::LayerIndex;
use crate::locks::{lock, read_lock, write_lock};
use crate::replica::{RMW_STRIPES, Replica};

/// Pieces looked up per map lock acquisition; bounds stack use and lock hold time.
const PIECES: usize = 32;
/// Zeros for write-zeroes; static so the hot path allocates nothing.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Reads `buf.len()` bytes at `offset`; bytes past the file's end read as zeros (older layers are shorter after an
/// expansion).
pub(crate) fn pread_full(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    data_protocol::io_counters::kernel(buf.len());
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => {
                buf.fill(0);
                return Ok(());
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Replica {
    fn check_range(chain: &Chain, offset: u64, len: u64) -> Result<()> {
        let size = chain.info.size;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(ReplicaError::OutOfRange { offset, len, size });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        data_protocol::io_counters::lock();
        let chain = self.chain_read_open()?;
        Self::check_range(&chain, offset, buf.len() as u64)?;
        self.read_locked(&chain, offset, buf)
    }

    pub(crate) fn read_locked(&self, chain: &Chain, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let last = end.div_ceil(BLOCK_SIZE);
        let mut cursor = offset / BLOCK_SIZE;
        let mut pieces = [(0u64, 0u64, None::<LayerIndex>); PIECES];
        while cursor < last {
            let mut n = 0;
            data_protocol::io_counters::lock();
            read_lock(&self.map).visit(cursor, last, |s, e, l| {
                pieces[n] = (s, e, l);
                n += 1;
                n < PIECES
            });
            for &(s, e, l) in &pieces[..n] {
                let bs = (s * BLOCK_SIZE).max(offset);
                let be = (e * BLOCK_SIZE).min(end);
                let dst = &mut buf[to_usize(bs - offset)..to_usize(be - offset)];
                self.read_piece(chain, l, bs, dst)?;
                cursor = e;
            }
        }
        Ok(())
    }

    fn read_piece(
        &self,
        chain: &Chain,
        layer: Option<LayerIndex>,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<()> {
        match layer {
            Some(i) => {
                let l = &chain.layers[to_usize(u64::from(i))];
                // The error's path is joined only on error: this is the read path of every request.
                pread_full(&l.file, dst, offset)
                    .map_err(|e| ReplicaError::io("read", self.dir.join(&l.name), e))
            }
            None => match &chain.backing {
                Some(b) => b.read(dst, offset),
                None => {
                    dst.fill(0);
                    Ok(())
                }
            },
        }
    }

    /// Writes `data` at `offset` (any 512-byte-aligned or unaligned range inside the volume).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        data_protocol::io_counters::lock();
        let chain = self.chain_read_open()?;
        Self::check_range(&chain, offset, data.len() as u64)?;
        if let Some(c) = &self.counter {
            c.bump();
        }
        self.write_locked(&chain, offset, data)
    }

    fn write_locked(&self, chain: &Chain, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset + data.len() as u64;
        let mut pos = offset;
        while pos < end {
            let block = pos / BLOCK_SIZE;
            let block_start = block * BLOCK_SIZE;
            let seg_end = if pos == block_start && end - pos >= BLOCK_SIZE {
                end - (end % BLOCK_SIZE) // the whole aligned middle at once
            } else {
                (block_start + BLOCK_SIZE).min(end)
            };
            let src = &data[to_usize(pos - offset)..to_usize(seg_end - offset)];
            if pos == block_start && seg_end.is_multiple_of(BLOCK_SIZE) {
                self.write_full_blocks(chain, pos, src)?;
            } else {
                self.write_partial_block(chain, pos, src)?;
            }
            pos = seg_end;
        }
        Ok(())
    }

    fn write_full_blocks(&self, chain: &Chain, offset: u64, data: &[u8]) -> Result<()> {
        let head = chain.head();
        data_protocol::io_counters::kernel(data.len());
        head.file
            .write_all_at(data, offset)
            .map_err(|e| ReplicaError::io("write", self.dir.join(&head.name), e))?;
        let (first, last) = (offset / BLOCK_SIZE, (offset + data.len() as u64) / BLOCK_SIZE);
        let head_idx = chain.head_index();
        // Overwrites of blocks the head already holds (the common case once warm) leave the map alone:
        // checked under the shared lock, so concurrent writers do not queue on the exclusive one.
        let mut in_head = true;
        data_protocol::io_counters::lock();
        read_lock(&self.map).visit(first, last, |_, _, l| {
            in_head = l == Some(head_idx);
            in_head
        });
        if !in_head {
            data_protocol::io_counters::lock();
            write_lock(&self.map).set(first, last, head_idx);
        }
        Ok(())
    }

    /// A write covering part of one block: if the head does not hold the block yet, its current contents (from
    /// a lower layer or the backing file) are merged in first, since a partial write to a hole in the head would
    /// otherwise hide the rest of the block behind zeros.
    fn write_partial_block(&self, chain: &Chain, offset: u64, data: &[u8]) -> Result<()> {
        let block = offset / BLOCK_SIZE;
        let head = chain.head();
        let head_idx = chain.head_index();
        data_protocol::io_counters::lock();
        let _stripe = lock(&self.rmw[to_usize(block % RMW_STRIPES as u64)]);
        data_protocol::io_counters::lock();
        if read_lock(&self.map).layer_of(block) == Some(head_idx) {
            data_protocol::io_counters::kernel(data.len());
            return head
                .file
                .write_all_at(data, offset)
                .map_err(|e| ReplicaError::io("write", self.dir.join(&head.name), e));
        }
        let start = block * BLOCK_SIZE;
        let mut buf = [0u8; BLOCK_BYTES];
        self.read_locked(chain, start, &mut buf)?;
        let at = to_usize(offset - start);
        data_protocol::io_counters::copy(data.len());
        buf[at..at + data.len()].copy_from_slice(data);
        data_protocol::io_counters::kernel(buf.len());
        head.file
            .write_all_at(&buf, start)
            .ctx("write", self.dir.join(&head.name))?;
        write_lock(&self.map).set(block, block + 1, head_idx);
        Ok(())
    }

    /// Discards whole 4 KiB blocks inside the range from the head (holes punched). What lower layers hold there
    /// shows through again: unmap is advisory, use [`Replica::write_zeroes`] to guarantee zeros.
    pub fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        let chain = self.chain_read_open()?;
        Self::check_range(&chain, offset, len)?;
        if let Some(c) = &self.counter {
            c.bump();
        }
        let (first, last) = (offset.div_ceil(BLOCK_SIZE), (offset + len) / BLOCK_SIZE);
        if first < last {
            self.discard_head(&chain, first, last)?;
        }
        Ok(())
    }

    /// Punches the head's blocks in `[first, last)` and re-derives, from the lower layers, where those blocks
    /// now live.
    fn discard_head(&self, chain: &Chain, first: u64, last: u64) -> Result<()> {
        let head = chain.head();
        let head_idx = chain.head_index();
        let mut map = write_lock(&self.map);
        let mut punched = Vec::new();
        map.visit_layer(head_idx, first, last, |s, e| {
            punched.push((s, e));
            true
        });
        for &(s, e) in &punched {
            corral_disk::sparse::punch_hole(&head.file, s * BLOCK_SIZE, (e - s) * BLOCK_SIZE)
                .ctx("punch hole", self.dir.join(&head.name))?;
            map.clear(s, e);
        }
        // Top-down: the first lower layer with data in a block that is now unmapped owns it.
        for (i, l) in chain.layers[..chain.layers.len() - 1].iter().enumerate().rev() {
            let idx = LayerIndex::try_from(i).unwrap_or(LayerIndex::MAX);
            for &(s, e) in &punched {
                for r in corral_disk::sparse::data_extents(&l.file, s * BLOCK_SIZE..e * BLOCK_SIZE) {
                    let r = r.ctx("seek data", self.dir.join(&l.name))?;
                    let (rs, re) = ((r.start / BLOCK_SIZE).max(s), r.end.div_ceil(BLOCK_SIZE).min(e));
                    let mut gaps = Vec::new();
                    map.visit(rs, re, |gs, ge, gl| {
                        if gl.is_none() {
                            gaps.push((gs, ge));
                        }
                        true
                    });
                    for (gs, ge) in gaps {
                        map.set(gs, ge, idx);
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes the range read as zeros: partial blocks are written with zeros, whole blocks are punched from the
    /// head and, where a lower layer or the backing file would show through, written with zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let chain = self.chain_read_open()?;
        Self::check_range(&chain, offset, len)?;
        if let Some(c) = &self.counter {
            c.bump();
        }
        let end = offset + len;
        let (first, last) = (offset.div_ceil(BLOCK_SIZE), end / BLOCK_SIZE);
        if first >= last {
            return self.write_locked(&chain, offset, &ZEROS[..to_usize(len)]);
        }
        if offset < first * BLOCK_SIZE {
            self.write_locked(&chain, offset, &ZEROS[..to_usize(first * BLOCK_SIZE - offset)])?;
        }
        if last * BLOCK_SIZE < end {
            self.write_locked(
                &chain,
                last * BLOCK_SIZE,
                &ZEROS[..to_usize(end - last * BLOCK_SIZE)],
            )?;
        }
        self.discard_head(&chain, first, last)?;
        let mut shows_through = Vec::new();
        read_lock(&self.map).visit(first, last, |s, e, l| {
            match (l, &chain.backing) {
                (Some(_), _) => shows_through.push((s, e)),
                (None, Some(b)) => b.data_blocks(s, e, |bs, be| shows_through.push((bs, be))),
                (None, None) => {}
            }
            true
        });
        for (s, e) in shows_through {
            let mut pos = s * BLOCK_SIZE;
            while pos < e * BLOCK_SIZE {
                let n = (e * BLOCK_SIZE - pos).min(ZEROS.len() as u64);
                self.write_full_blocks(&chain, pos, &ZEROS[..to_usize(n)])?;
                pos += n;
            }
        }
        Ok(())
    }

    /// The allocated byte ranges of `[offset, offset + len)`, ascending, merged and clipped to the request. A 4 KiB
    /// block is allocated when any layer of the chain holds it, or when no layer does and the backing image holds
    /// data there (raw: its `SEEK_DATA` layout; qcow2: its allocated clusters); anything else reads as zeros.
    /// Answered from the location map alone, without touching the files.
    pub fn allocated_ranges(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>> {
        let chain = self.chain_read_open()?;
        Self::check_range(&chain, offset, len)?;
        let end = offset + len;
        let mut out: Vec<Range<u64>> = Vec::new();
        let mut add = |first: u64, last: u64| {
            let (s, e) = ((first * BLOCK_SIZE).max(offset), (last * BLOCK_SIZE).min(end));
            match out.last_mut() {
                Some(prev) if prev.end == s => prev.end = e,
                _ if s < e => out.push(s..e),
                _ => {}
            }
        };
        read_lock(&self.map).visit(offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE), |s, e, layer| {
            match (layer, &chain.backing) {
                (Some(_), _) => add(s, e),
                (None, Some(b)) => b.data_blocks(s, e, &mut add),
                (None, None) => {}
            }
            true
        });
        Ok(out)
    }

    /// Makes every acknowledged write durable: `fdatasync` of the head, then the revision counter.
    pub fn flush(&self) -> Result<()> {
        let chain = self.chain_read_open()?;
        self.flush_locked(&chain)
    }

    pub(crate) fn flush_locked(&self, chain: &Chain) -> Result<()> {
        let head = chain.head();
        head.file
            .sync_data()
            .ctx("fdatasync", self.dir.join(&head.name))?;
        if let Some(c) = &self.counter {
            c.persist()?;
        }
        Ok(())
    }
}
