//! Conversion: any [`SparseRead`] (an image, a flattened volume snapshot) to a sparse raw file or to a qcow2 v3
//! image. Only data ranges are read; all-zero blocks stay holes (raw) or unallocated clusters (qcow2). The output
//! is written to a temporary file beside the destination, fsynced and renamed over it, then the directory is
//! fsynced: a crash or a cancellation never leaves a partial destination.
//!
//! The qcow2 writer streams: data clusters are appended as they are read, then the L2 tables, the L1 table and
//! the refcount structures are written behind them and the header last. Every cluster has refcount 1, so the
//! result passes `qemu-img check` without leaks.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use corral_disk::BLOCK_BYTES;
use corral_disk::sparse::SparseRead;

use crate::ImageFormat;
use crate::error::{ImageError, IoContext};
use crate::image::DiskImage;

/// Cluster size of qcow2 images written here (qemu's default).
pub const QCOW2_CLUSTER_BITS: u32 = 16;
const QCOW2_COPIED: u64 = 1 << 63;
/// Raw output is written (and zero-checked) in blocks of this size; zero blocks stay holes.
/// Bytes read from the source per step.
const CHUNK: u64 = 1 << 20;

/// Converts the image at `src` (raw or qcow2, over its backing chain) to `dst` in format `to`.
/// `progress(done, total)` is called as bytes of the virtual size are covered; `cancel` stops it (the
/// destination is then left untouched and [`ImageError::Cancelled`] returned).
pub fn convert(
    src: &Path,
    dst: &Path,
    to: ImageFormat,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let image = DiskImage::open(src)?;
    convert_content(&image, dst, to, progress, cancel)
}

/// Writes any sparse content (an open image, a flattened snapshot of a volume) to `dst` in format `to`; see
/// [`convert`].
pub fn convert_content(
    src: &dyn SparseRead,
    dst: &Path,
    to: ImageFormat,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let tmp = temp_path(dst)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&tmp)
        .ctx("create", &tmp)?;
    let result = match to {
        ImageFormat::Raw => write_raw(src, &file, &tmp, progress, cancel),
        ImageFormat::Qcow2 => write_qcow2(src, &file, &tmp, progress, cancel),
    }
    .and_then(|()| corral_disk::durable::publish(&file, &tmp, dst).ctx("publish", dst));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn temp_path(dst: &Path) -> Result<PathBuf, ImageError> {
    let name = dst
        .file_name()
        .ok_or_else(|| ImageError::InvalidArgument(format!("{} names no file", dst.display())))?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(dst.with_file_name(tmp))
}

fn check_cancel(cancel: &AtomicBool) -> Result<(), ImageError> {
    if cancel.load(Ordering::Relaxed) {
        Err(ImageError::Cancelled)
    } else {
        Ok(())
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

fn read_src(src: &dyn SparseRead, buf: &mut [u8], at: u64, tmp: &Path) -> Result<(), ImageError> {
    src.read_exact_at(buf, at).map_err(|e| ImageError::Io {
        op: "read source for",
        path: tmp.to_owned(),
        source: e,
    })
}

fn write_raw(
    src: &dyn SparseRead,
    file: &File,
    tmp: &Path,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let size = src.size();
    file.set_len(size).ctx("truncate", tmp)?;
    let mut buf = vec![0u8; to_usize(CHUNK)];
    for r in src.data_ranges(0..size) {
        let r = r.map_err(|e| ImageError::Io {
            op: "list data ranges for",
            path: tmp.to_owned(),
            source: e,
        })?;
        let mut pos = r.start;
        while pos < r.end {
            check_cancel(cancel)?;
            let n = (r.end - pos).min(CHUNK);
            let chunk = &mut buf[..to_usize(n)];
            read_src(src, chunk, pos, tmp)?;
            write_nonzero_blocks(file, chunk, pos).ctx("write", tmp)?;
            pos += n;
            progress(pos, size);
        }
    }
    progress(size, size);
    Ok(())
}

/// Writes the runs of `data` (at file offset `at`) that are not all zeros, in [`BLOCK_BYTES`] granularity.
fn write_nonzero_blocks(file: &File, data: &[u8], at: u64) -> io::Result<()> {
    let mut run_start: Option<usize> = None;
    let mut i = 0;
    while i < data.len() {
        let end = (i + BLOCK_BYTES).min(data.len());
        let zero = data[i..end].iter().all(|&b| b == 0);
        match (zero, run_start) {
            (false, None) => run_start = Some(i),
            (true, Some(s)) => {
                file.write_all_at(&data[s..i], at + s as u64)?;
                run_start = None;
            }
            _ => {}
        }
        i = end;
    }
    if let Some(s) = run_start {
        file.write_all_at(&data[s..], at + s as u64)?;
    }
    Ok(())
}

fn be_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_be_bytes()).collect()
}

fn write_qcow2(
    src: &dyn SparseRead,
    file: &File,
    tmp: &Path,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let cluster_bits = QCOW2_CLUSTER_BITS;
    let cs: u64 = 1 << cluster_bits;
    let l2_entries: u64 = cs / 8;
    let src_size = src.size();
    // qemu counts virtual sizes in 512-byte sectors: a partial last sector would be cut off.
    let size = src_size.div_ceil(512) * 512;
    let l1_size = size.div_ceil(cs * l2_entries).max(1);
    let mut l2: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut next: u64 = 1; // host cluster index; cluster 0 is the header
    let mut buf = vec![0u8; to_usize(cs)];
    let mut last_cluster: Option<u64> = None;

    for r in src.data_ranges(0..src_size) {
        let r = r.map_err(|e| ImageError::Io {
            op: "list data ranges for",
            path: tmp.to_owned(),
            source: e,
        })?;
        let mut c = r.start / cs;
        if last_cluster == Some(c) {
            c += 1; // already written with the previous range
        }
        while c * cs < r.end {
            check_cancel(cancel)?;
            let start = c * cs;
            let n = (src_size - start).min(cs);
            buf.fill(0);
            read_src(src, &mut buf[..to_usize(n)], start, tmp)?;
            last_cluster = Some(c);
            if buf.iter().any(|&b| b != 0) {
                let host = next * cs;
                file.write_all_at(&buf, host).ctx("write", tmp)?;
                next += 1;
                let table = l2
                    .entry(c / l2_entries)
                    .or_insert_with(|| vec![0; to_usize(l2_entries)]);
                table[to_usize(c % l2_entries)] = host | QCOW2_COPIED;
            }
            progress(start + n, src_size);
            c += 1;
        }
    }

    let mut l1 = vec![0u64; to_usize(l1_size)];
    for (idx, table) in &l2 {
        let host = next * cs;
        file.write_all_at(&be_bytes(table), host)
            .ctx("write L2 table to", tmp)?;
        next += 1;
        l1[to_usize(*idx)] = host | QCOW2_COPIED;
    }
    let l1_offset = next * cs;
    file.write_all_at(&be_bytes(&l1), l1_offset)
        .ctx("write L1 table to", tmp)?;
    next += (l1_size * 8).div_ceil(cs);

    // Refcount structures cover every cluster including themselves: iterate to the fixed point.
    let refs_per_block = cs * 8 / 16;
    let base = next;
    let (mut blocks, mut table_clusters) = (1u64, 1u64);
    loop {
        let total = base + table_clusters + blocks;
        let nb = total.div_ceil(refs_per_block);
        let nt = (nb * 8).div_ceil(cs);
        if nb == blocks && nt == table_clusters {
            break;
        }
        (blocks, table_clusters) = (nb, nt);
    }
    let total = base + table_clusters + blocks;
    let reftable_offset = base * cs;
    let first_block = base + table_clusters;
    let reftable: Vec<u64> = (0..blocks).map(|i| (first_block + i) * cs).collect();
    file.write_all_at(&be_bytes(&reftable), reftable_offset)
        .ctx("write refcount table to", tmp)?;
    for i in 0..blocks {
        let covered = (total - i * refs_per_block).min(refs_per_block);
        let mut block = vec![0u8; to_usize(cs)];
        for e in block.chunks_exact_mut(2).take(to_usize(covered)) {
            e.copy_from_slice(&1u16.to_be_bytes());
        }
        file.write_all_at(&block, (first_block + i) * cs)
            .ctx("write refcount block to", tmp)?;
    }
    file.set_len(total * cs).ctx("truncate", tmp)?;

    let mut h = vec![0u8; crate::qcow2::header::V3_HEADER_LEN + 8];
    h[..4].copy_from_slice(&crate::qcow2::header::MAGIC);
    h[4..8].copy_from_slice(&3u32.to_be_bytes());
    h[20..24].copy_from_slice(&cluster_bits.to_be_bytes());
    h[24..32].copy_from_slice(&size.to_be_bytes());
    h[36..40].copy_from_slice(
        &u32::try_from(l1_size)
            .map_err(|_| ImageError::InvalidArgument(format!("size {size} too large for qcow2")))?
            .to_be_bytes(),
    );
    h[40..48].copy_from_slice(&l1_offset.to_be_bytes());
    h[48..56].copy_from_slice(&reftable_offset.to_be_bytes());
    h[56..60].copy_from_slice(
        &u32::try_from(table_clusters)
            .map_err(|_| ImageError::InvalidArgument(format!("size {size} too large for qcow2")))?
            .to_be_bytes(),
    );
    h[96..100].copy_from_slice(&4u32.to_be_bytes()); // 16-bit refcounts
    h[100..104].copy_from_slice(&104u32.to_be_bytes());
    // Bytes 104..112: the header extension end marker (zeros).
    file.write_all_at(&h, 0).ctx("write header to", tmp)?;
    progress(src_size, src_size);
    Ok(())
}
