//! Fixtures shared by the integration tests: generated sparse files and ways to compare them.
#![allow(dead_code)]

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sparse_sync::{LayoutMode, data_ranges};

/// A directory on a disk filesystem (not tmpfs), removed on drop.
pub fn scratch_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("sparse-sync-test")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// Small deterministic PRNG (xorshift64*), so failures reproduce from the seed.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Writes a file of `size` bytes with random data pieces (4 KiB-aligned, 4 KiB to `max_piece` long) separated by
/// holes, a final unaligned tail piece when `size` is not a multiple of 4 KiB, and returns the data ranges written.
pub fn random_sparse_file(path: &Path, size: u64, max_piece: u64, seed: u64) -> Vec<Range<u64>> {
    let f = File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut rng = Rng::new(seed);
    let mut ranges = Vec::new();
    let mut pos = rng.below(4) * 4096;
    let mut buf = Vec::new();
    while pos < size {
        let len = ((rng.below(max_piece / 4096) + 1) * 4096).min(size - pos);
        buf.resize(usize::try_from(len).unwrap(), 0);
        rng.fill(&mut buf);
        f.write_all_at(&buf, pos).unwrap();
        ranges.push(pos..pos + len);
        pos += len + (rng.below(max_piece / 4096) + 1) * 4096;
    }
    f.sync_all().unwrap();
    ranges
}

/// Data ranges of a file as the filesystem reports them (SEEK_DATA).
pub fn layout_of(path: &Path) -> Vec<Range<u64>> {
    let f = File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    data_ranges(&f, 0..size, LayoutMode::SeekData)
        .map(Result::unwrap)
        .collect()
}

/// xxh3-128 of the whole logical content (holes as zeros) and the size.
pub fn content_hash(path: &Path) -> (u64, u128) {
    let f = File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0;
    while pos < size {
        let n = usize::try_from((size - pos).min(1 << 20)).unwrap();
        f.read_exact_at(&mut buf[..n], pos).unwrap();
        h.update(&buf[..n]);
        pos += n as u64;
    }
    (size, h.digest128())
}

pub fn data_bytes(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|r| r.end - r.start).sum()
}

/// Polls `f` every 10 ms until it returns `Some`, failing the test after `deadline`.
pub fn poll_until<T>(deadline: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn path_with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}
