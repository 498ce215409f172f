//! A snapshot lvol read as sparse content ([`LvolSnapshot`]): what a v2 source sends where a v1 source sends a
//! snapshot file. A leaf under `lvol` (which hands it out) and `rebuild` (which sends it).

use std::io;
use std::ops::Range;
use std::sync::Arc;

use corral_disk::sparse::{DataRanges, SparseRead};
use lvstore::{BlobId, LvStore};

/// A snapshot lvol as sparse content: its own blocks are data, the rest (what it reads through to its parent, or
/// zeros) holes — the layout of a v1 snapshot file.
pub struct LvolSnapshot {
    store: Arc<LvStore>,
    id: BlobId,
    size: u64,
    /// Data is what the snapshot reads, through its parents too (an export's flattened view).
    flattened: bool,
}

impl LvolSnapshot {
    pub fn new(store: Arc<LvStore>, id: BlobId, size: u64) -> Self {
        Self {
            store,
            id,
            size,
            flattened: false,
        }
    }

    /// The snapshot flattened over its parents: data is every block it reads that some snapshot of its chain
    /// holds (what an export sends), not only its own.
    #[must_use]
    pub fn flattened(self) -> Self {
        Self {
            flattened: true,
            ..self
        }
    }
}

fn io_err(e: &lvstore::Error) -> io::Error {
    io::Error::other(e.to_string())
}

impl SparseRead for LvolSnapshot {
    fn size(&self) -> u64 {
        self.size
    }

    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        let end = range.end.min(self.size);
        if range.start >= end {
            return Box::new(std::iter::empty());
        }
        let ranges = if self.flattened {
            self.store
                .allocated_ranges(self.id, range.start, end - range.start)
        } else {
            self.store.own_ranges(self.id, range.start, end - range.start)
        };
        match ranges {
            Ok(v) => Box::new(v.into_iter().map(Ok)),
            Err(e) => Box::new(std::iter::once(Err(io_err(&e)))),
        }
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.store.read_at(self.id, offset, buf).map_err(|e| io_err(&e))
    }
}
