//! What a file really stores: its data extents as the filesystem reports them (`SEEK_DATA`/`SEEK_HOLE`) and its
//! allocated bytes. An independent reading, so tests of Corral's own extent code compare against the kernel.

use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::fs::SeekFrom;
use rustix::io::Errno;

/// The data extents of the file at `path`, in order, merged where adjacent. A filesystem without hole reporting
/// gives one extent over the whole file.
///
/// # Panics
/// When the file cannot be opened or seeked.
pub fn data_extents(path: &Path) -> Vec<Range<u64>> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = f
        .metadata()
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .len();
    let mut extents = Vec::new();
    let mut pos = 0;
    while pos < size {
        let start = match rustix::fs::seek(&f, SeekFrom::Data(pos)) {
            Ok(s) => s,
            // No data at or after `pos`.
            Err(Errno::NXIO) => break,
            Err(e) => panic!("SEEK_DATA {} at {pos}: {e}", path.display()),
        };
        let end = rustix::fs::seek(&f, SeekFrom::Hole(start))
            .unwrap_or_else(|e| panic!("SEEK_HOLE {} at {start}: {e}", path.display()))
            .min(size);
        extents.push(start..end);
        pos = end;
    }
    extents
}

/// Bytes the filesystem has allocated to the file (`st_blocks` × 512).
///
/// # Panics
/// When the file cannot be stat'ed.
pub fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .blocks()
        * 512
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn extents_of_a_sparse_file_are_its_written_pieces() {
        // /var/tmp: a disk filesystem with hole reporting (tmpfs has it too, but not everywhere).
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let p = dir.path().join("sparse");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[1u8; 1 << 20], 1 << 20).unwrap();
        f.write_all_at(&[2u8; 1 << 20], 5 << 20).unwrap();
        f.sync_all().unwrap();
        assert_eq!(data_extents(&p), vec![(1 << 20)..(2 << 20), (5 << 20)..(6 << 20)]);
        assert_eq!(allocated_bytes(&p), 2 << 20);
        std::fs::File::create(dir.path().join("empty")).unwrap();
        assert!(data_extents(&dir.path().join("empty")).is_empty());
    }
}
