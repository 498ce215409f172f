//! The device under a store: a raw block device or a preallocated file, opened with `O_DIRECT` where the file
//! system allows it (data bypasses the page cache, as SPDK's does), else buffered. Every IO the store issues is
//! 4 KiB aligned in offset and length; a caller buffer that is not 4 KiB aligned in memory goes through an
//! aligned bounce buffer.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const ALIGN: usize = 4096;

/// How data IO reaches the device ([`crate::LvStore::open_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataIo {
    /// `O_DIRECT` where the file system allows it (the default of [`crate::LvStore::open`]): every read and
    /// write goes to the device, as SPDK's do.
    #[default]
    Direct,
    /// Through the page cache: a store on a file in a file system then caches like that file system's other
    /// files (a v1 replica's, for one). `fdatasync` at flush makes data durable all the same.
    Buffered,
    /// `Direct` on a block device, `Buffered` on a regular file.
    Auto,
}

impl std::str::FromStr for DataIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(Self::Direct),
            "buffered" => Ok(Self::Buffered),
            "auto" => Ok(Self::Auto),
            other => Err(format!(
                "{other:?} is not a data IO mode (direct, buffered or auto)"
            )),
        }
    }
}

/// An open device.
#[derive(Debug)]
pub struct Device {
    file: File,
    path: PathBuf,
    direct: bool,
    len: u64,
}

/// A 4 KiB aligned, zeroed buffer carved out of a slightly larger `Vec` (safe code, no custom allocator).
struct Aligned {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![0u8; len + ALIGN];
        let off = v.as_ptr().align_offset(ALIGN);
        Self { v, off, len }
    }
    fn as_slice(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

fn aligned(b: &[u8]) -> bool {
    (b.as_ptr() as usize).is_multiple_of(ALIGN)
}

impl Device {
    /// Opens `path` read-write (or read-only), with `O_DIRECT` unless the file system refuses it (tmpfs refuses
    /// the flag at open; some file systems accept it and fail the first IO with `EINVAL`: both fall back to
    /// buffered IO, reported by [`Device::direct`]).
    pub fn open(path: &Path, writable: bool) -> io::Result<Device> {
        Self::open_with(path, writable, DataIo::Direct)
    }

    /// As [`Device::open`], choosing `O_DIRECT` by `io` (`Auto`: only on a block device).
    pub fn open_with(path: &Path, writable: bool, io: DataIo) -> io::Result<Device> {
        let try_direct = match io {
            DataIo::Direct => true,
            DataIo::Buffered => false,
            DataIo::Auto => {
                use std::os::unix::fs::FileTypeExt;
                std::fs::metadata(path)?.file_type().is_block_device()
            }
        };
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(writable);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        let (file, mut direct) = match open(try_direct) {
            Ok(f) => (f, try_direct),
            Err(e) if try_direct && e.raw_os_error() == Some(libc::EINVAL) => (open(false)?, false),
            Err(e) => return Err(e),
        };
        // One writer per store, and no writer beside a reader (`check` of a store a daemon is using would read a
        // moving target): an advisory lock on the device, released by the kernel when the process dies.
        let op = if writable {
            rustix::fs::FlockOperation::NonBlockingLockExclusive
        } else {
            rustix::fs::FlockOperation::NonBlockingLockShared
        };
        if let Err(e) = rustix::fs::flock(&file, op) {
            return Err(if e == rustix::io::Errno::WOULDBLOCK {
                io::Error::new(io::ErrorKind::WouldBlock, "in use by another process (locked)")
            } else {
                io::Error::from(e)
            });
        }
        let len = device_len(&file)?;
        let mut file = file;
        if direct && len >= ALIGN as u64 {
            let mut probe = Aligned::new(ALIGN);
            if let Err(e) = file.read_exact_at(probe.as_mut_slice(), 0) {
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(e);
                }
                file = open(false)?;
                rustix::fs::flock(&file, op)?;
                direct = false;
            }
        }
        Ok(Device {
            file,
            path: path.to_owned(),
            direct,
            len,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether data IO bypasses the page cache.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Bytes on the device.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        debug_assert!(off.is_multiple_of(ALIGN as u64) && buf.len().is_multiple_of(ALIGN));
        if self.direct && !aligned(buf) {
            let mut b = Aligned::new(buf.len());
            self.file.read_exact_at(b.as_mut_slice(), off)?;
            buf.copy_from_slice(b.as_slice());
            return Ok(());
        }
        self.file.read_exact_at(buf, off)
    }

    /// Reads only if no wait for the device is needed (buffered and every byte in the page cache:
    /// `preadv2(RWF_NOWAIT)`); `Ok(false)`: nothing useful was read (always so with `O_DIRECT`).
    pub fn read_nowait(&self, buf: &mut [u8], off: u64) -> io::Result<bool> {
        if self.direct {
            return Ok(false);
        }
        let len = buf.len();
        match rustix::io::preadv2(
            &self.file,
            &mut [io::IoSliceMut::new(buf)],
            off,
            rustix::io::ReadWriteFlags::NOWAIT,
        ) {
            Ok(n) => Ok(n == len),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::OPNOTSUPP) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        debug_assert!(off.is_multiple_of(ALIGN as u64) && buf.len().is_multiple_of(ALIGN));
        if self.direct && !aligned(buf) {
            let mut b = Aligned::new(buf.len());
            b.as_mut_slice().copy_from_slice(buf);
            return self.file.write_all_at(b.as_slice(), off);
        }
        self.file.write_all_at(buf, off)
    }

    /// Makes completed writes durable (`fdatasync`; with `O_DIRECT` it also flushes the device's write cache).
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// The length of a regular file or a block device (`lseek(SEEK_END)` answers both).
fn device_len(file: &File) -> io::Result<u64> {
    use std::io::Seek;
    let mut f = file;
    let len = f.seek(io::SeekFrom::End(0))?;
    f.seek(io::SeekFrom::Start(0))?;
    Ok(len)
}
