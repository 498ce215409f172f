//! The store device of a v2 disk: `<disk path>/lvstore.img`, a regular file or a block device (or a symlink to
//! one). The manager formats it on first use, and only when that cannot destroy data:
//!
//! - missing, or an empty (0-byte) file: a store file of the disk's `lvstoreSize` ([`DEFAULT_SIZE`] when not
//!   set) is built beside it as `.lvstore.img.tmp` — preallocated (`posix_fallocate`, so the store never meets
//!   ENOSPC from the file system under it), formatted, fsynced — then renamed over the name and the directory
//!   fsynced: a crash leaves either no store or a whole one, never a half-formatted file that would pass for
//!   foreign data;
//! - a block device whose first 8 KiB (both superblock slots) read zeros: formatted in place;
//! - an lvstore (its magic in a superblock slot): used as it is (the daemon checks the rest);
//! - anything else: refused, nothing written ("not an lvstore and not empty").

use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// The device's file name under the disk path.
pub const DEVICE_FILE: &str = "lvstore.img";
/// Size of a store file the manager creates when the disk sets no `lvstoreSize`: 10 GiB.
pub const DEFAULT_SIZE: u64 = 10 << 30;
/// Smallest `lvstoreSize` accepted: room for the metadata areas and journal plus some clusters.
pub const MIN_SIZE: u64 = 64 << 20;
/// `lvstoreSize` is a whole number of these (the default cluster size).
pub const SIZE_MULTIPLE: u64 = 1 << 20;

/// Bytes read to tell what a device holds: both superblock slots.
const HEAD: usize = 2 * lvstore::format::SB_SLOT_BYTES;

pub fn device_path(disk_path: &Path) -> PathBuf {
    disk_path.join(DEVICE_FILE)
}

/// What a device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    Missing,
    /// A regular file of 0 bytes: an empty new file.
    EmptyFile,
    /// A block device that reads zeros where the superblocks go.
    BlankDevice,
    Lvstore,
    /// Not an lvstore and not empty: never formatted over.
    Foreign(String),
}

/// Looks at `dev` without changing it (and without the store's lock: a running daemon does not disturb it).
pub fn probe(dev: &Path) -> Probe {
    let md = match std::fs::metadata(dev) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Probe::Missing,
        Err(e) => return Probe::Foreign(format!("cannot stat {}: {e}", dev.display())),
    };
    let block = md.file_type().is_block_device();
    if !block && !md.is_file() {
        return Probe::Foreign(format!(
            "{} is neither a regular file nor a block device",
            dev.display()
        ));
    }
    if !block && md.len() == 0 {
        return Probe::EmptyFile;
    }
    let mut head = vec![0u8; HEAD];
    let got = match std::fs::File::open(dev).and_then(|mut f| read_up_to(&mut f, &mut head)) {
        Ok(n) => n,
        Err(e) => return Probe::Foreign(format!("cannot read {}: {e}", dev.display())),
    };
    let magic = &lvstore::format::MAGIC[..];
    let slot2 = lvstore::format::SB_SLOT_BYTES;
    if head[..8] == *magic || head.get(slot2..slot2 + 8) == Some(magic) {
        return Probe::Lvstore;
    }
    if block && got == HEAD && head.iter().all(|b| *b == 0) {
        return Probe::BlankDevice;
    }
    Probe::Foreign(format!(
        "{} is not an lvstore and not empty ({} bytes): refusing to format over it; remove it, or format it \
         with `corral-lvstore format` if its data may go",
        dev.display(),
        md.len()
    ))
}

fn read_up_to(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Size in bytes of a device (a file's length, a block device's size).
pub fn device_bytes(dev: &Path) -> Option<u64> {
    use std::io::Seek;
    let mut f = std::fs::File::open(dev).ok()?;
    f.seek(std::io::SeekFrom::End(0)).ok()
}

/// Makes sure `<disk_path>/lvstore.img` holds an lvstore, formatting it only as the module says; returns the
/// device path, or why it cannot be used (nothing was changed then).
pub fn prepare(disk_path: &Path, size: u64) -> Result<PathBuf, String> {
    let dev = device_path(disk_path);
    match probe(&dev) {
        Probe::Lvstore => Ok(dev),
        Probe::Foreign(why) => Err(why),
        Probe::BlankDevice => {
            tracing::info!(device = %dev.display(), "formatting the blank block device of a v2 disk");
            let store = lvstore::LvStore::format(&dev, &lvstore::FormatOptions::default())
                .map_err(|e| format!("format {}: {e}", dev.display()))?;
            store
                .flush()
                .map_err(|e| format!("flush {}: {e}", dev.display()))?;
            Ok(dev)
        }
        Probe::Missing | Probe::EmptyFile => {
            create_file_store(disk_path, &dev, if size == 0 { DEFAULT_SIZE } else { size })?;
            Ok(dev)
        }
    }
}

fn create_file_store(disk_path: &Path, dev: &Path, size: u64) -> Result<(), String> {
    let tmp = disk_path.join(format!(".{DEVICE_FILE}.tmp"));
    let ctx = |what: &str, e: &dyn std::fmt::Display| format!("{what} {}: {e}", tmp.display());
    std::fs::create_dir_all(disk_path).map_err(|e| format!("create {}: {e}", disk_path.display()))?;
    // A temporary file left by a crash is ours and incomplete.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(ctx("remove stale", &e)),
        _ => {}
    }
    tracing::info!(device = %dev.display(), size, "creating the store file of a v2 disk");
    let f = std::fs::File::create_new(&tmp).map_err(|e| ctx("create", &e))?;
    let len = i64::try_from(size).map_err(|e| ctx("size of", &e))?;
    if let Err(e) = nix::fcntl::posix_fallocate(&f, 0, len) {
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        return Err(ctx(&format!("preallocate {size} bytes for"), &e));
    }
    drop(f);
    let formatted = lvstore::LvStore::format(&tmp, &lvstore::FormatOptions::default())
        .and_then(|s| s.flush())
        .map_err(|e| ctx("format", &e));
    if let Err(e) = formatted {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| ctx("fsync", &e))?;
    std::fs::rename(&tmp, dev).map_err(|e| ctx("rename", &e))?;
    std::fs::File::open(disk_path)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("fsync {}: {e}", disk_path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_disk_gets_a_store_and_foreign_data_is_never_formatted() {
        let d = tempfile::tempdir().unwrap();
        let dev = prepare(d.path(), MIN_SIZE).unwrap();
        assert_eq!(probe(&dev), Probe::Lvstore);
        assert_eq!(device_bytes(&dev), Some(MIN_SIZE));
        assert!(!d.path().join(".lvstore.img.tmp").exists());
        // Prepared again: kept as it is (a store is never formatted over).
        let before = std::fs::metadata(&dev).unwrap().modified().unwrap();
        prepare(d.path(), MIN_SIZE * 2).unwrap();
        assert_eq!(std::fs::metadata(&dev).unwrap().modified().unwrap(), before);

        // An empty new file is formatted; one holding data is refused and left alone.
        let e = tempfile::tempdir().unwrap();
        std::fs::write(device_path(e.path()), b"").unwrap();
        prepare(e.path(), MIN_SIZE).unwrap();
        assert_eq!(probe(&device_path(e.path())), Probe::Lvstore);
        let f = tempfile::tempdir().unwrap();
        let junk = vec![0x5au8; 1 << 20];
        std::fs::write(device_path(f.path()), &junk).unwrap();
        let err = prepare(f.path(), MIN_SIZE).unwrap_err();
        assert!(err.contains("not an lvstore and not empty"), "{err}");
        assert_eq!(std::fs::read(device_path(f.path())).unwrap(), junk);
        // A file of zeros is not an empty new file either.
        std::fs::write(device_path(f.path()), vec![0u8; 1 << 20]).unwrap();
        assert!(matches!(probe(&device_path(f.path())), Probe::Foreign(_)));
        // Nor is a directory.
        let g = tempfile::tempdir().unwrap();
        std::fs::create_dir(device_path(g.path())).unwrap();
        assert!(prepare(g.path(), MIN_SIZE).is_err());
    }
}
