//! A plain file as a backup source (its data extents found with SEEK_DATA/SEEK_HOLE) and as a restore sink
//! (ranges without blocks punched as holes). Used by benchmarks, and by anything that restores a backup into a
//! file (a data source of type `restore`).

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::create::{BackupSource, Changes, SnapshotInfo};
use crate::restore::RestoreSink;

/// A file read as one snapshot. Without change tracking, an incremental re-reads everything and relies on
/// deduplication: only blocks the store does not hold are uploaded.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    size: u64,
    name: String,
}

impl FileSource {
    /// Opens `path`; `snapshot` names it in the backup record.
    pub fn open(path: &Path, snapshot: &str) -> io::Result<Self> {
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        Ok(Self {
            file,
            size,
            name: snapshot.to_owned(),
        })
    }
}

impl BackupSource for FileSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn snapshot(&self) -> SnapshotInfo {
        SnapshotInfo {
            name: self.name.clone(),
            ..SnapshotInfo::default()
        }
    }

    fn allocated(&self) -> io::Result<Vec<Range<u64>>> {
        corral_disk::sparse::data_extents(&self.file, 0..self.size).collect()
    }

    fn changes_since(&self, _base: &str, _ancestors: &[String]) -> io::Result<Changes> {
        Ok(Changes::Since {
            diff_from: String::new(),
            ranges: self.allocated()?,
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
}

/// A file written by a restore; created (or truncated) to the backup's size, so untouched ranges are holes.
/// Writes whose buffer, offset and length are 4 KiB-aligned (every whole block a restore writes) go through a
/// second descriptor opened with `O_DIRECT` where the file system takes it: no copy into the page cache (half the
/// CPU of a buffered restore) and no queueing of the writers on the page-cache copy under the inode lock.
#[derive(Debug)]
pub struct FileSink {
    file: File,
    direct: Option<File>,
}

impl FileSink {
    /// Creates `path` with `size` bytes, all holes.
    pub fn create(path: &Path, size: u64) -> io::Result<Self> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len(size)?;
        Ok(Self::with_direct(path, file))
    }

    /// `file` plus an `O_DIRECT` descriptor of `path` when the file system takes one (tmpfs does not).
    fn with_direct(path: &Path, file: File) -> Self {
        use std::os::unix::fs::OpenOptionsExt;
        let direct = File::options()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        Self { file, direct }
    }

    /// Opens an existing file (a volume's image) to restore into; it keeps its size, and a restore makes what
    /// lies past the backup's end read as zeros.
    pub fn open_existing(path: &Path) -> io::Result<Self> {
        let file = File::options().read(true).write(true).open(path)?;
        Ok(Self::with_direct(path, file))
    }

    /// Makes the restored data durable.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_all()
    }
}

impl RestoreSink for FileSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let align = corral_disk::sparse::DIRECT_IO_ALIGN;
        if let Some(d) = &self.direct
            && (data.as_ptr() as usize).is_multiple_of(align)
            && data.len().is_multiple_of(align)
            && offset.is_multiple_of(align as u64)
        {
            // Allocated first (unwritten extents, a metadata-only call): ext4 then lets aligned direct writes
            // into the range run concurrently (shared inode lock) instead of one at a time.
            let _ = rustix::fs::fallocate(
                d,
                rustix::fs::FallocateFlags::KEEP_SIZE,
                offset,
                data.len() as u64,
            );
            match d.write_all_at(data, offset) {
                // A file system that opened O_DIRECT but refuses this write: the buffered descriptor writes it.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                r => return r,
            }
        }
        self.file.write_all_at(data, offset)
    }

    fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        corral_disk::sparse::punch_hole(&self.file, offset, len)
    }

    fn size(&self) -> Option<u64> {
        self.file.metadata().ok().map(|m| m.len())
    }
}
