//! SHA-512 of an image file as stored (not of its virtual content): the identity backing images are verified by.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha512};

use crate::error::{ImageError, IoContext};

/// Bytes hashed per step (and between progress calls).
const CHUNK: usize = 1 << 20;

/// Hex SHA-512 of the bytes of `path`. `progress(done, total)` is called per MiB; `cancel` stops it.
///
/// The digest is of the whole logical file, holes included, but holes are not read: the file's data ranges come
/// from `SEEK_DATA`/`SEEK_HOLE`, and the ranges between them are hashed as zeros from memory. A sparse image is
/// thus read from disk once per verification for its data only (a 2 GiB image with 1 GiB of holes reads 1 GiB).
pub fn sha512_file(
    path: &Path,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<String, ImageError> {
    let f = File::open(path).ctx("open", path)?;
    let total = f.metadata().ctx("stat", path)?.len();
    let mut hash = RangeHasher {
        path,
        file: &f,
        total,
        done: 0,
        sha: Sha512::new(),
        buf: vec![0u8; CHUNK],
        zeros: vec![0u8; CHUNK],
        progress,
        cancel,
    };
    for data in corral_disk::sparse::data_extents(&f, 0..total) {
        let data = data.ctx("seek data", path)?;
        hash.zeros_until(data.start)?;
        hash.data(data)?;
    }
    hash.zeros_until(total)?;
    Ok(hex::encode(hash.sha.finalize()))
}

/// The running hash of one file, fed in ascending order.
struct RangeHasher<'a> {
    path: &'a Path,
    file: &'a File,
    total: u64,
    done: u64,
    sha: Sha512,
    buf: Vec<u8>,
    zeros: Vec<u8>,
    progress: &'a dyn Fn(u64, u64),
    cancel: &'a AtomicBool,
}

impl RangeHasher<'_> {
    fn step(&mut self, n: usize) -> Result<(), ImageError> {
        self.done += n as u64;
        (self.progress)(self.done, self.total);
        if self.cancel.load(Ordering::Relaxed) {
            return Err(ImageError::Cancelled);
        }
        Ok(())
    }

    /// A hole up to `end`: zeros, not read.
    fn zeros_until(&mut self, end: u64) -> Result<(), ImageError> {
        while self.done < end {
            let n = usize::try_from((end - self.done).min(CHUNK as u64)).unwrap_or(CHUNK);
            self.sha.update(&self.zeros[..n]);
            self.step(n)?;
        }
        Ok(())
    }

    /// A data range, read. The file shorter than when it was opened is an error (it changed while hashed).
    fn data(&mut self, range: Range<u64>) -> Result<(), ImageError> {
        while self.done < range.end {
            let n = usize::try_from((range.end - self.done).min(CHUNK as u64)).unwrap_or(CHUNK);
            self.file
                .read_exact_at(&mut self.buf[..n], self.done)
                .ctx("read", self.path)?;
            self.sha.update(&self.buf[..n]);
            self.step(n)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn sum(path: &Path) -> String {
        sha512_file(path, &|_, _| {}, &AtomicBool::new(false)).unwrap()
    }

    #[test]
    fn sparse_files_hash_like_their_full_content_with_holes_unread() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let p = dir.path().join("img");
        // Data, a hole, data not aligned to anything, a hole at the end (the unaligned tail is in the hole).
        let f = File::create(&p).unwrap();
        let size = (5 << 20) + 1234;
        f.set_len(size).unwrap();
        f.write_all_at(&[7u8; 70_000], 0).unwrap();
        f.write_all_at(&[9u8; 3000], (2 << 20) + 17).unwrap();
        drop(f);
        let content = std::fs::read(&p).unwrap();
        assert_eq!(sum(&p), hex::encode(Sha512::digest(&content)));
        let last = Cell::new((0, 0));
        sha512_file(&p, &|d, t| last.set((d, t)), &AtomicBool::new(false)).unwrap();
        assert_eq!(last.get(), (size, size));
        // All hole, all data, empty.
        let holes = dir.path().join("holes");
        File::create(&holes).unwrap().set_len(3 << 20).unwrap();
        assert_eq!(sum(&holes), hex::encode(Sha512::digest(vec![0u8; 3 << 20])));
        let data = dir.path().join("data");
        std::fs::write(&data, b"abc").unwrap();
        assert!(sum(&data).starts_with("ddaf35a193617aba"));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(sum(&empty), hex::encode(Sha512::digest(b"")));
    }

    #[test]
    fn cancel_stops_hashing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        File::create(&p).unwrap().set_len(4 << 20).unwrap();
        let r = sha512_file(&p, &|_, _| {}, &AtomicBool::new(true));
        assert!(matches!(r, Err(ImageError::Cancelled)), "{r:?}");
    }
}
