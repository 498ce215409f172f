//! Volumes over a backing image: a block the volume zeroed over backing data is recorded as a zero marker
//! (format 2) and restores as zeros, not as a hole through which the backing image would show again.

#![allow(clippy::cast_possible_truncation, clippy::single_range_in_vec_init)]

mod common;

use std::sync::{Arc, Mutex};

use backupstore::{BackupSource, Changes, Progress, RestoreOptions, RestoreSink, SnapshotInfo, ZERO_MARKER};
use common::*;

/// A snapshot over a backing image: all of it is in the volume's layers (so every block is read).
struct OverBacking(Snap);

impl BackupSource for OverBacking {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn snapshot(&self) -> SnapshotInfo {
        self.0.snapshot()
    }
    fn allocated(&self) -> std::io::Result<Vec<std::ops::Range<u64>>> {
        self.0.allocated()
    }
    fn changes_since(&self, b: &str, a: &[String]) -> std::io::Result<Changes> {
        self.0.changes_since(b, a)
    }
    fn read_at(&self, o: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(o, buf)
    }
    fn zero_hides_backing(&self) -> bool {
        true
    }
}

/// A fresh volume over the backing image (all 0xBB): a hole shows the backing data, explicit zeros hide it.
struct BackedVolume(Mutex<Vec<u8>>);

impl RestoreSink for BackedVolume {
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let o = offset as usize;
        self.0.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn zero_range(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.0.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0xBB);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.0.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

#[tokio::test]
async fn a_block_zeroed_over_backing_data_restores_as_zeros_not_as_the_backing_image() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut v = pattern(1);
    v[(2 * BS) as usize..(3 * BS) as usize].fill(0); // zeroed over backing data
    let snap = Snap {
        name: "s1".into(),
        data: Arc::new(v.clone()),
        changed: None,
    };
    let b = s
        .create_backup(Arc::new(OverBacking(snap)), &opts("b1"), &Progress::default())
        .await
        .unwrap();
    assert_eq!(b.format_version, 2);
    let markers: Vec<u64> = b
        .blocks
        .iter()
        .filter(|x| x.is_zero())
        .map(|x| x.offset)
        .collect();
    assert_eq!(markers, [2 * BS, 13 * BS, 14 * BS, 15 * BS, 16 * BS]);
    assert_eq!(b.stats.new_blocks, 12, "zero markers store nothing");
    let raw = std::fs::read_to_string(dir.path().join("volumes/vol/backups/backup_b1.cfg")).unwrap();
    assert!(raw.contains(&format!("\"hash\": \"{ZERO_MARKER}\"")), "{raw}");

    let sink = Arc::new(BackedVolume(Mutex::new(vec![0xBB; SIZE as usize])));
    s.restore(
        "vol",
        "b1",
        sink.clone(),
        &RestoreOptions::default(),
        &Progress::default(),
    )
    .await
    .unwrap();
    assert!(
        *sink.0.lock().unwrap() == v,
        "the restored volume differs: zeroed blocks must not show the backing image"
    );
    // Zero markers are not blocks: verify and GC leave them alone.
    assert!(s.verify("vol", "b1", 4).await.unwrap().bad.is_empty());
    s.gc("vol", &gc0()).await.unwrap();
    assert_eq!(stored_blocks(&s).await, 12);
}

#[tokio::test]
async fn without_a_backing_image_zero_blocks_stay_out_of_the_map() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let b = backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(pattern(2)),
            changed: None,
        },
    )
    .await;
    assert!(b.blocks.iter().all(|x| !x.is_zero()));
    assert_eq!(b.blocks.len(), 13);
}

#[tokio::test]
async fn a_backing_image_backed_up_into_its_area_restores_from_its_url_and_a_second_backup_uploads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(&dir.path().join("target"));
    // 5 MiB: data, a hole, data (2 MiB blocks: the file's blocks 0, 2 hold data; block 1 is half hole).
    let image = dir.path().join("backing");
    let mut data = vec![0u8; 5 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    }
    data[(3 << 20)..(4 << 20)].fill(0);
    std::fs::write(&image, &data).unwrap();
    let sum = "ab".repeat(64);

    let b1 = s
        .backup_backing_image("base", &image, &sum, "bi1", 0, &Progress::default())
        .await
        .unwrap();
    assert_eq!(
        (b1.backing_image_name.as_str(), b1.backing_image_checksum.as_str()),
        ("base", sum.as_str())
    );
    assert!(b1.stats.new_blocks > 0);
    assert!(
        dir.path()
            .join("target/backing-images/volumes/base/backups/backup_bi1.cfg")
            .exists()
    );
    assert!(
        s.list_volumes().await.unwrap().is_empty(),
        "images are not backup volumes"
    );
    let b2 = s
        .backup_backing_image("base", &image, &sum, "bi2", 0, &Progress::default())
        .await
        .unwrap();
    assert_eq!(
        b2.stats.new_blocks, 0,
        "an unchanged image uploads nothing: {:?}",
        b2.stats
    );

    // Restored through its URL alone (what the data source's restore gets), into a file: the same bytes.
    let url = s.backing_images().backup_url("base", "bi2");
    assert!(url.contains("/backing-images?"), "{url}");
    let url = backupstore::BackupUrl::parse(&url).unwrap();
    let (vol, name) = (url.volume.clone().unwrap(), url.backup.clone().unwrap());
    let other = backupstore::BackupStore::open(&url, &std::collections::BTreeMap::new()).unwrap();
    let out = dir.path().join("restored");
    let sink = Arc::new(backupstore::file::FileSink::create(&out, b2.size).unwrap());
    other
        .restore(
            &vol,
            &name,
            sink.clone(),
            &RestoreOptions::default(),
            &Progress::default(),
        )
        .await
        .unwrap();
    sink.sync().unwrap();
    assert!(std::fs::read(&out).unwrap() == data, "the restored image differs");
}
