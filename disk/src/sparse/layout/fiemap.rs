//! FIEMAP (`FS_IOC_FIEMAP`) extent discovery, in which unwritten and delayed-allocation extents count as data.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;

/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: u64 = 0xC020_660B;
/// Flush dirty pages first so delayed allocations show up as extents.
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Extents fetched per ioctl call.
const EXTENTS_PER_CALL: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

#[repr(C)]
struct FiemapRequest {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
    extents: [FiemapExtent; EXTENTS_PER_CALL],
}

const _: () = assert!(size_of::<FiemapExtent>() == 56);
const _: () = assert!(size_of::<FiemapRequest>() == 32 + 56 * EXTENTS_PER_CALL);

/// Iterator over the allocated extents of a file within a byte range, merged when adjacent and clipped to the range.
pub struct FiemapExtents<'a> {
    file: &'a File,
    /// Next logical offset to ask the kernel about.
    pos: u64,
    end: u64,
    fetched: std::collections::VecDeque<Range<u64>>,
    exhausted: bool,
    pending: Option<Range<u64>>,
    request: Box<FiemapRequest>,
}

impl<'a> FiemapExtents<'a> {
    /// Allocated extents of `file` within `range`.
    pub fn new(file: &'a File, range: Range<u64>) -> Self {
        let request = Box::new(FiemapRequest {
            fm_start: 0,
            fm_length: 0,
            fm_flags: 0,
            fm_mapped_extents: 0,
            fm_extent_count: 0,
            fm_reserved: 0,
            extents: [FiemapExtent::default(); EXTENTS_PER_CALL],
        });
        FiemapExtents {
            file,
            pos: range.start,
            end: range.end,
            fetched: std::collections::VecDeque::new(),
            exhausted: range.start >= range.end,
            pending: None,
            request,
        }
    }

    fn fetch(&mut self) -> io::Result<()> {
        let req = &mut *self.request;
        req.fm_start = self.pos;
        req.fm_length = self.end - self.pos;
        req.fm_flags = FIEMAP_FLAG_SYNC;
        req.fm_mapped_extents = 0;
        req.fm_extent_count = u32::try_from(EXTENTS_PER_CALL).unwrap_or(u32::MAX);
        req.fm_reserved = 0;
        // SAFETY: `req` is a live, exclusively borrowed `struct fiemap` header followed by room for exactly
        // `fm_extent_count` extents, the layout FS_IOC_FIEMAP reads and fills; the fd is open for the call.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), FS_IOC_FIEMAP as _, std::ptr::from_mut(req)) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mapped = usize::try_from(req.fm_mapped_extents)
            .unwrap_or(usize::MAX)
            .min(EXTENTS_PER_CALL);
        if mapped == 0 {
            self.exhausted = true;
            return Ok(());
        }
        for ext in &req.extents[..mapped] {
            let start = ext.fe_logical.max(self.pos);
            let stop = ext.fe_logical.saturating_add(ext.fe_length).min(self.end);
            if start < stop {
                self.fetched.push_back(start..stop);
            }
        }
        let last = &req.extents[mapped - 1];
        let last_end = last.fe_logical.saturating_add(last.fe_length);
        if last.fe_flags & FIEMAP_EXTENT_LAST != 0 || last_end >= self.end || last_end <= self.pos {
            self.exhausted = true;
        } else {
            self.pos = last_end;
        }
        Ok(())
    }

    fn pull(&mut self) -> io::Result<Option<Range<u64>>> {
        while self.fetched.is_empty() && !self.exhausted {
            self.fetch()?;
        }
        Ok(self.fetched.pop_front())
    }
}

impl Iterator for FiemapExtents<'_> {
    type Item = io::Result<Range<u64>>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let next = match self.pull() {
                Ok(n) => n,
                Err(e) => {
                    self.exhausted = true;
                    self.fetched.clear();
                    self.pending = None;
                    return Some(Err(e));
                }
            };
            match (self.pending.take(), next) {
                (None, None) => return None,
                (Some(cur), None) => return Some(Ok(cur)),
                (None, Some(n)) => self.pending = Some(n),
                (Some(cur), Some(n)) if n.start <= cur.end => {
                    self.pending = Some(cur.start..n.end.max(cur.end));
                }
                (Some(cur), Some(n)) => {
                    self.pending = Some(n);
                    return Some(Ok(cur));
                }
            }
        }
    }
}
