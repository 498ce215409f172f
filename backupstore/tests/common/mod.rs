//! Shared by the backup store tests: an in-memory snapshot as the source, an in-memory volume as the sink, a
//! `file://` store, and the options the tests use.

#![allow(dead_code, clippy::cast_possible_truncation, clippy::single_range_in_vec_init)]

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backupstore::{
    BackupSource, BackupStore, BackupUrl, Changes, CreateOptions, GcOptions, Progress, RestoreOptions,
    RestoreSink, SnapshotInfo,
};

pub const BS: u64 = 64 << 10;
pub const SIZE: u64 = 16 * BS + 4096;

#[derive(Clone)]
pub struct Snap {
    pub name: String,
    pub data: Arc<Vec<u8>>,
    /// What `changes_since` answers: ranges, or `None` for "chain ended".
    pub changed: Option<Vec<Range<u64>>>,
}

impl BackupSource for Snap {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn snapshot(&self) -> SnapshotInfo {
        SnapshotInfo {
            name: self.name.clone(),
            created: "2026-01-01T00:00:00Z".into(),
            ancestors: Vec::new(),
        }
    }
    fn allocated(&self) -> std::io::Result<Vec<Range<u64>>> {
        Ok(vec![0..self.size()])
    }
    fn changes_since(&self, base: &str, _anc: &[String]) -> std::io::Result<Changes> {
        Ok(match &self.changed {
            Some(r) => Changes::Since {
                diff_from: base.into(),
                ranges: r.clone(),
            },
            None => Changes::ChainEnded("reverted".into()),
        })
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let o = offset as usize;
        buf.copy_from_slice(&self.data[o..o + buf.len()]);
        Ok(())
    }
}

#[derive(Default)]
pub struct MemSink {
    pub data: Mutex<Vec<u8>>,
    pub zeroed: Mutex<Vec<Range<u64>>>,
}

impl MemSink {
    pub fn new(fill: u8) -> Arc<Self> {
        Arc::new(Self {
            data: Mutex::new(vec![fill; SIZE as usize]),
            zeroed: Mutex::default(),
        })
    }
}

impl RestoreSink for MemSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn zero_range(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.data.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        self.zeroed.lock().unwrap().push(offset..offset + len);
        Ok(())
    }
}

pub fn pattern(seed: u8) -> Vec<u8> {
    // Incompressible-ish, distinct per block and seed; the last 3 whole blocks stay zero.
    let mut v = vec![0u8; SIZE as usize];
    let mut x = u32::from(seed) * 7919 + 1;
    for b in v.iter_mut().take((13 * BS) as usize) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
    v
}

pub fn store(dir: &std::path::Path) -> BackupStore {
    let url = BackupUrl::parse(&format!("file://{}", dir.display())).unwrap();
    BackupStore::open(&url, &BTreeMap::new()).unwrap()
}

pub fn opts(name: &str) -> CreateOptions {
    CreateOptions {
        volume: "vol".into(),
        name: name.into(),
        block_size: Some(BS),
        delta_max: 3,
        concurrency: 4,
        gc: GcOptions {
            margin: Duration::ZERO,
            lock_wait: Duration::from_secs(2),
        },
        ..Default::default()
    }
}

pub fn gc0() -> GcOptions {
    opts("x").gc
}

pub async fn backup(s: &BackupStore, name: &str, snap: &Snap) -> backupstore::BackupConfig {
    s.create_backup(Arc::new(snap.clone()), &opts(name), &Progress::default())
        .await
        .unwrap()
}

pub async fn restored(s: &BackupStore, name: &str) -> Vec<u8> {
    let sink = MemSink::new(0xAA);
    s.restore(
        "vol",
        name,
        sink.clone(),
        &RestoreOptions::default(),
        &Progress::default(),
    )
    .await
    .unwrap();
    sink.data.lock().unwrap().clone()
}

/// Block files written under a `file://` target's directory, those a running backup has staged but not yet
/// published (`<hash>.blk#<digits>`, invisible to listings) included.
pub fn written_block_files(dir: &std::path::Path) -> usize {
    fn walk(p: &std::path::Path) -> usize {
        std::fs::read_dir(p).map_or(0, |d| {
            d.map(|e| {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    walk(&e.path())
                } else {
                    1
                }
            })
            .sum()
        })
    }
    walk(&dir.join("volumes/vol/blocks"))
}

pub async fn stored_blocks(s: &BackupStore) -> usize {
    let p = object_store::path::Path::from("volumes/vol/blocks");
    use futures::TryStreamExt;
    let v: Vec<_> = s.object_store().list(Some(&p)).try_collect().await.unwrap();
    v.len()
}
