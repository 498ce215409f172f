//! Read-only qcow2 (v2 and v3): header and L1 validated at open, L2 tables loaded on demand into a bounded
//! cache, data clusters read with positional reads (host-contiguous clusters merged into one read), zlib
//! (raw deflate) compressed clusters decompressed into a small cache. Every offset taken from the file is checked
//! against the file's length before it is used; nothing is ever read outside the file and no input panics.
//! Unallocated clusters are reported to the caller, which reads them from the backing image (or as zeros).

pub(crate) mod header;

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::LruCache;
use crate::error::{ImageError, IoContext};
pub(crate) use header::Header;
use header::Refusal;

/// Host offset bits of L1 and standard L2 entries (bits 9–55).
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L2_COMPRESSED: u64 = 1 << 62;
/// Version 3: the cluster reads as zeros.
const L2_ZERO: u64 = 1;
/// Budget of cached L2 tables, and of cached decompressed clusters.
const L2_CACHE_BYTES: u64 = 8 << 20;
const CLUSTER_CACHE_BYTES: u64 = 4 << 20;

/// Where one guest cluster's data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// Not in this image: the backing image's data, or zeros.
    Unallocated,
    /// Reads as zeros (v3 zero flag).
    Zero,
    /// A data cluster at this host offset (checked to start inside the file).
    Data(u64),
    /// A compressed cluster: raw deflate stream at `offset`, at most `len` bytes (clipped to the file).
    Compressed { offset: u64, len: u64 },
}

/// An open qcow2 file (one layer; the backing chain is held by [`crate::DiskImage`]).
pub(crate) struct Qcow2 {
    path: PathBuf,
    file: File,
    file_len: u64,
    header: Header,
    /// L2 table host offsets per L1 index, 0 where none; validated at open.
    l1: Box<[u64]>,
    l2_cache: LruCache<[u64]>,
    cluster_cache: LruCache<[u8]>,
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("path", &self.path)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

fn refusal(path: &Path, r: Refusal) -> ImageError {
    match r {
        Refusal::Corrupt(reason) => ImageError::Corrupt {
            path: path.to_owned(),
            reason,
        },
        Refusal::Unsupported(feature) => ImageError::UnsupportedFeature {
            path: path.to_owned(),
            feature,
        },
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Reads up to `buf.len()` bytes at `offset`; bytes past the end of the file read as zeros.
pub(crate) fn pread_zero_padded(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
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

fn be_u64s(bytes: &[u8]) -> Box<[u64]> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_be_bytes(b)
        })
        .collect()
}

impl Qcow2 {
    /// Opens `file` (known to start with the qcow2 magic) and validates its header, L1 table and refcount table.
    pub(crate) fn open(file: File, path: &Path) -> Result<Self, ImageError> {
        let file_len = file.metadata().ctx("stat", path)?.len();
        let mut start = vec![0u8; to_usize(file_len.min(header::V3_HEADER_LEN as u64))];
        file.read_exact_at(&mut start, 0).ctx("read header of", path)?;
        let bits = if start.len() >= header::V2_HEADER_LEN {
            header::cluster_bits_of(&start).map_err(|r| refusal(path, r))?
        } else {
            header::MIN_CLUSTER_BITS
        };
        let mut first = vec![0u8; to_usize(file_len.min(1 << bits))];
        file.read_exact_at(&mut first, 0).ctx("read header of", path)?;
        let header = header::parse(&first, file_len).map_err(|r| refusal(path, r))?;
        let cs = header.cluster_size();
        let corrupt = |reason: String| ImageError::Corrupt {
            path: path.to_owned(),
            reason,
        };

        let mut l1_bytes = vec![0u8; header.l1_size as usize * 8];
        file.read_exact_at(&mut l1_bytes, header.l1_table_offset)
            .ctx("read L1 table of", path)?;
        let mut l1 = be_u64s(&l1_bytes);
        for (i, e) in l1.iter_mut().enumerate() {
            let off = *e & OFFSET_MASK;
            if off == 0 {
                *e = 0;
                continue;
            }
            if !off.is_multiple_of(cs) {
                return Err(corrupt(format!(
                    "L1 entry {i}: L2 table offset {off} is not cluster aligned"
                )));
            }
            if off.checked_add(cs).is_none_or(|end| end > file_len) {
                return Err(corrupt(format!(
                    "L1 entry {i}: L2 table at offset {off} lies past the end of the file ({file_len} bytes)"
                )));
            }
            *e = off;
        }
        // An L2 table used by two L1 entries is never valid in the active table, and would let a small file
        // describe an unbounded amount of data (the layout walk is bounded by the file's size only without it).
        let mut l2s: Vec<u64> = l1.iter().copied().filter(|&o| o != 0).collect();
        l2s.sort_unstable();
        if let Some(w) = l2s.windows(2).find(|w| w[0] == w[1]) {
            return Err(corrupt(format!(
                "L2 table at offset {} is referenced by two L1 entries",
                w[0]
            )));
        }
        check_refcount_table(&file, path, &header, file_len)?;

        let l2_cap = to_usize((L2_CACHE_BYTES / cs).clamp(4, 1024));
        let cl_cap = to_usize((CLUSTER_CACHE_BYTES / cs).clamp(2, 64));
        Ok(Qcow2 {
            path: path.to_owned(),
            file,
            file_len,
            header,
            l1,
            l2_cache: LruCache::new(l2_cap),
            cluster_cache: LruCache::new(cl_cap),
        })
    }

    pub(crate) fn header(&self) -> &Header {
        &self.header
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    fn corrupt_io(&self, reason: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: corrupt image: {reason}", self.path.display()),
        )
    }

    /// The L2 table for an L1 index, `None` when the L1 entry is empty (or past the L1 table).
    fn l2_table(&self, l1_index: u64) -> io::Result<Option<Arc<[u64]>>> {
        let Some(&off) = self.l1.get(to_usize(l1_index)) else {
            return Ok(None);
        };
        if off == 0 {
            return Ok(None);
        }
        if let Some(t) = self.l2_cache.get(off) {
            return Ok(Some(t));
        }
        let mut bytes = vec![0u8; to_usize(self.header.cluster_size())];
        // In range: checked against the file length at open.
        self.file.read_exact_at(&mut bytes, off)?;
        let table: Arc<[u64]> = Arc::from(be_u64s(&bytes));
        self.l2_cache.insert(off, Arc::clone(&table));
        Ok(Some(table))
    }

    /// Decodes one L2 entry, checking every offset against the file.
    fn decode(&self, entry: u64) -> io::Result<Mapping> {
        let h = &self.header;
        let cs = h.cluster_size();
        if entry & L2_COMPRESSED != 0 {
            let csize_shift = 62 - (h.cluster_bits - 8);
            let offset = entry & ((1u64 << csize_shift) - 1);
            let sectors = ((entry >> csize_shift) & ((1u64 << (h.cluster_bits - 8)) - 1)) + 1;
            let len = sectors * 512 - (offset & 511);
            if offset < cs || offset >= self.file_len {
                return Err(self.corrupt_io(&format!(
                    "compressed cluster at offset {offset} is outside the file's data area (file is {} bytes)",
                    self.file_len
                )));
            }
            return Ok(Mapping::Compressed {
                offset,
                len: len.min(self.file_len - offset),
            });
        }
        if h.version >= 3 && entry & L2_ZERO != 0 {
            return Ok(Mapping::Zero);
        }
        let off = entry & OFFSET_MASK;
        if off == 0 {
            return Ok(Mapping::Unallocated);
        }
        if !off.is_multiple_of(cs) {
            return Err(self.corrupt_io(&format!("data cluster offset {off} is not cluster aligned")));
        }
        if off >= self.file_len {
            return Err(self.corrupt_io(&format!(
                "data cluster offset {off} lies past the end of the file ({} bytes)",
                self.file_len
            )));
        }
        Ok(Mapping::Data(off))
    }

    /// Where guest cluster `vcluster` is.
    pub(crate) fn mapping(&self, vcluster: u64) -> io::Result<Mapping> {
        let l2_bits = self.header.l2_bits();
        match self.l2_table(vcluster >> l2_bits)? {
            None => Ok(Mapping::Unallocated),
            Some(t) => {
                let e = t[to_usize(vcluster & ((1u64 << l2_bits) - 1))];
                self.decode(e)
            }
        }
    }

    /// A compressed cluster, decompressed (cached).
    fn decompressed(&self, offset: u64, len: u64) -> io::Result<Arc<[u8]>> {
        if let Some(c) = self.cluster_cache.get(offset) {
            return Ok(c);
        }
        let cs = to_usize(self.header.cluster_size());
        let mut input = vec![0u8; to_usize(len)];
        pread_zero_padded(&self.file, &mut input, offset)?;
        let mut out = vec![0u8; cs];
        let mut d = flate2::Decompress::new(false);
        let status = d.decompress(&input, &mut out, flate2::FlushDecompress::Finish);
        let produced = d.total_out();
        match status {
            Ok(_) if produced == cs as u64 => {}
            Ok(_) => {
                return Err(self.corrupt_io(&format!(
                    "compressed cluster at offset {offset} inflates to {produced} bytes, not {cs}"
                )));
            }
            Err(e) => {
                return Err(self.corrupt_io(&format!(
                    "compressed cluster at offset {offset} does not inflate: {e}"
                )));
            }
        }
        let c: Arc<[u8]> = Arc::from(out);
        self.cluster_cache.insert(offset, Arc::clone(&c));
        Ok(c)
    }

    /// Reads `buf` at guest `offset` (the whole range lies within the virtual size). Unallocated pieces are
    /// filled by `unallocated(piece, guest_offset)`.
    pub(crate) fn read_at(
        &self,
        buf: &mut [u8],
        offset: u64,
        unallocated: &dyn Fn(&mut [u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let cs = self.header.cluster_size();
        // A run of host-contiguous data clusters is read with one pread: (buffer start, host offset, length).
        let mut run: Option<(usize, u64, usize)> = None;
        let flush = |run: &mut Option<(usize, u64, usize)>, buf: &mut [u8]| -> io::Result<()> {
            if let Some((at, host, len)) = run.take() {
                pread_zero_padded(&self.file, &mut buf[at..at + len], host)?;
            }
            Ok(())
        };
        let mut pos = 0usize;
        while pos < buf.len() {
            let guest = offset + pos as u64;
            let in_cluster = guest % cs;
            let n = to_usize((cs - in_cluster).min((buf.len() - pos) as u64));
            let m = self.mapping(guest / cs)?;
            if let Mapping::Data(host) = m {
                let host = host + in_cluster;
                match &mut run {
                    Some((at, h, len)) if *h + *len as u64 == host && *at + *len == pos => *len += n,
                    _ => {
                        flush(&mut run, buf)?;
                        run = Some((pos, host, n));
                    }
                }
                pos += n;
                continue;
            }
            flush(&mut run, buf)?;
            let dst = &mut buf[pos..pos + n];
            match m {
                Mapping::Unallocated => unallocated(dst, guest)?,
                Mapping::Zero => dst.fill(0),
                Mapping::Compressed { offset: c, len } => {
                    let data = self.decompressed(c, len)?;
                    let s = to_usize(in_cluster);
                    dst.copy_from_slice(&data[s..s + n]);
                }
                Mapping::Data(_) => {}
            }
            pos += n;
        }
        flush(&mut run, buf)
    }

    /// Calls `visit(range, mapping)` for the guest ranges of `range` (clipped to the virtual size), merging
    /// neighbouring clusters of the same kind (data of any host offset, zero, unallocated).
    pub(crate) fn visit(
        &self,
        range: Range<u64>,
        visit: &mut dyn FnMut(Range<u64>, Mapping) -> io::Result<()>,
    ) -> io::Result<()> {
        let cs = self.header.cluster_size();
        let end = range.end.min(self.header.size);
        let mut pos = range.start;
        let mut pending: Option<(Range<u64>, Mapping)> = None;
        let kind = |m: Mapping| match m {
            Mapping::Data(_) | Mapping::Compressed { .. } => 0,
            Mapping::Zero => 1,
            Mapping::Unallocated => 2,
        };
        while pos < end {
            let l2_bits = self.header.l2_bits();
            let vcl = pos / cs;
            let (m, next) = match self.l2_table(vcl >> l2_bits)? {
                // A whole L2 span is unallocated.
                None => (
                    Mapping::Unallocated,
                    ((vcl >> l2_bits) + 1) << (l2_bits + self.header.cluster_bits),
                ),
                Some(t) => (
                    self.decode(t[to_usize(vcl & ((1u64 << l2_bits) - 1))])?,
                    (vcl + 1) * cs,
                ),
            };
            let piece = pos..next.min(end);
            match &mut pending {
                Some((r, pm)) if kind(*pm) == kind(m) && r.end == piece.start => r.end = piece.end,
                _ => {
                    if let Some((r, pm)) = pending.take() {
                        visit(r, pm)?;
                    }
                    pending = Some((piece.clone(), m));
                }
            }
            pos = piece.end;
        }
        if let Some((r, pm)) = pending {
            visit(r, pm)?;
        }
        Ok(())
    }
}

/// The refcount table is not needed to read, but entries that point at the header, into the refcount table or
/// L1 table, past the end of the file, or twice at one block (a loop) mean the metadata cannot be trusted.
fn check_refcount_table(file: &File, path: &Path, h: &Header, file_len: u64) -> Result<(), ImageError> {
    let cs = h.cluster_size();
    let mut bytes = vec![0u8; to_usize(u64::from(h.refcount_table_clusters) * cs)];
    file.read_exact_at(&mut bytes, h.refcount_table_offset)
        .ctx("read refcount table of", path)?;
    let reftable = h.refcount_table_offset..h.refcount_table_offset + bytes.len() as u64;
    let l1 = h.l1_table_offset..h.l1_table_offset + u64::from(h.l1_size) * 8;
    let mut seen: Vec<u64> = Vec::new();
    for (i, e) in be_u64s(&bytes).iter().enumerate() {
        let off = e & OFFSET_MASK;
        if off == 0 {
            continue;
        }
        let bad = if !off.is_multiple_of(cs) {
            Some("is not cluster aligned".to_owned())
        } else if off.checked_add(cs).is_none_or(|end| end > file_len) {
            Some(format!("lies past the end of the file ({file_len} bytes)"))
        } else if reftable.contains(&off) {
            Some("points into the refcount table itself (a loop)".to_owned())
        } else if l1.contains(&off) {
            Some("points into the L1 table".to_owned())
        } else {
            None
        };
        if let Some(why) = bad {
            return Err(ImageError::Corrupt {
                path: path.to_owned(),
                reason: format!("refcount table entry {i}: refcount block at offset {off} {why}"),
            });
        }
        seen.push(off);
    }
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(ImageError::Corrupt {
            path: path.to_owned(),
            reason: format!(
                "refcount block at offset {} is referenced twice by the refcount table (a loop)",
                w[0]
            ),
        });
    }
    Ok(())
}
