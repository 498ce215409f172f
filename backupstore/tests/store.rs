//! Backup store behaviour against real object stores: `LocalFileSystem` through a `file://` target and
//! `InMemory`. A backup source is an in-memory volume; the sink is an in-memory volume that records holes.

#![allow(clippy::cast_possible_truncation, clippy::single_range_in_vec_init)]

mod common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use backupstore::lock::LockKind;
use backupstore::{
    BackupMode, BackupSource, BackupState, BackupStore, BackupUrl, Changes, ErrorKind, FullReason, Progress,
    RestoreOptions, SnapshotInfo,
};
use common::*;
use object_store::ObjectStoreExt;

#[tokio::test]
async fn incremental_uploads_only_changed_blocks_and_both_backups_restore_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let v1 = pattern(1);
    let b1 = backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(v1.clone()),
            changed: None,
        },
    )
    .await;
    assert!(!b1.is_incremental);
    assert_eq!(b1.full_reason, Some(FullReason::FirstBackup));
    assert_eq!(b1.stats.new_blocks, 13, "zero blocks are not stored");
    assert_eq!(b1.stats.zero_blocks, 4);
    assert_eq!(stored_blocks(&s).await, 13);

    // Change 2 blocks, zero a third: only 2 uploads, the zeroed block leaves the map.
    let mut v2 = v1.clone();
    v2[(BS + 10) as usize] ^= 0xFF;
    v2[(5 * BS) as usize..(6 * BS) as usize].fill(7);
    v2[(9 * BS) as usize..(10 * BS) as usize].fill(0);
    let changed = vec![BS + 10..BS + 11, 5 * BS..6 * BS, 9 * BS..10 * BS];
    let b2 = backup(
        &s,
        "b2",
        &Snap {
            name: "s2".into(),
            data: Arc::new(v2.clone()),
            changed: Some(changed),
        },
    )
    .await;
    assert!(b2.is_incremental);
    assert_eq!((b2.chain_position, b2.base_backup.as_str()), (1, "b1"));
    assert_eq!(b2.stats.new_blocks, 2);
    assert_eq!(b2.stats.read_bytes, 3 * BS);
    assert_eq!(b2.blocks.len(), 12);

    assert_eq!(restored(&s, "b1").await, v1);
    assert_eq!(restored(&s, "b2").await, v2);

    // Incremental restore from b1 to b2 writes 2 blocks and zeroes 1.
    let sink = MemSink::new(0);
    let ro = RestoreOptions::default();
    s.restore("vol", "b1", sink.clone(), &ro, &Progress::default())
        .await
        .unwrap();
    let inc = RestoreOptions {
        since: Some("b1".into()),
        ..ro
    };
    let out = s
        .restore("vol", "b2", sink.clone(), &inc, &Progress::default())
        .await
        .unwrap();
    assert!(out.incremental);
    assert_eq!((out.blocks_written, out.zeroed_bytes), (2, BS));
    assert_eq!(*sink.data.lock().unwrap(), v2);

    let vol = s.volume_config("vol").await.unwrap();
    assert_eq!((vol.last_backup_name.as_str(), vol.block_size), ("b2", BS));
}

/// A snapshot whose last backed-up snapshot was deleted locally: the ranges are relative to a surviving
/// ancestor (here: they name only the block written since that ancestor).
struct FromAncestor(Snap);

impl BackupSource for FromAncestor {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn snapshot(&self) -> SnapshotInfo {
        self.0.snapshot()
    }
    fn allocated(&self) -> std::io::Result<Vec<Range<u64>>> {
        // Only the blocks the snapshot's layers hold (the base snapshot's data was reverted away).
        Ok(self.0.changed.clone().unwrap_or_default())
    }
    fn changes_since(&self, _base: &str, _anc: &[String]) -> std::io::Result<Changes> {
        Ok(Changes::Since {
            diff_from: "ancestor".into(),
            ranges: self.0.changed.clone().unwrap_or_default(),
        })
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(offset, buf)
    }
}

#[tokio::test]
async fn an_incremental_from_a_surviving_ancestor_drops_what_the_deleted_base_wrote() {
    // b1 backs up s1 (= ancestor + 13 blocks of data); the volume is reverted to the empty ancestor, s1 deleted,
    // one block written and s2 taken. The diff from the ancestor names only that block, yet b2 must not keep s1's
    // blocks.
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let v1 = pattern(1);
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(v1.clone()),
            changed: None,
        },
    )
    .await;
    let mut v2 = vec![0u8; SIZE as usize];
    v2[(2 * BS) as usize..(3 * BS) as usize].copy_from_slice(&v1[(2 * BS) as usize..(3 * BS) as usize]);
    v2[(14 * BS) as usize..(15 * BS) as usize].fill(9);
    let src = FromAncestor(Snap {
        name: "s2".into(),
        data: Arc::new(v2.clone()),
        changed: Some(vec![2 * BS..3 * BS, 14 * BS..15 * BS]),
    });
    let b2 = s
        .create_backup(Arc::new(src), &opts("b2"), &Progress::default())
        .await
        .unwrap();
    assert!(b2.is_incremental);
    assert_eq!(b2.diff_from_snapshot, "ancestor");
    assert_eq!(b2.stats.new_blocks, 1, "only the new block is uploaded");
    assert_eq!(b2.blocks.len(), 2);
    assert_eq!(restored(&s, "b2").await, v2);
}

#[tokio::test]
async fn a_malformed_block_map_from_the_store_is_refused_by_restore_and_the_next_incremental() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let v1 = pattern(1);
    let snap = Snap {
        name: "s1".into(),
        data: Arc::new(v1),
        changed: None,
    };
    backup(&s, "b1", &snap).await;
    let p = object_store::path::Path::from("volumes/vol/backups/backup_b1.cfg");
    let raw = s.object_store().get(&p).await.unwrap().bytes().await.unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    cfg["blocks"][1]["offset"] = serde_json::json!(u64::MAX - 7);
    s.object_store()
        .put(&p, serde_json::to_vec(&cfg).unwrap().into())
        .await
        .unwrap();
    let err = s
        .restore(
            "vol",
            "b1",
            MemSink::new(0),
            &RestoreOptions::default(),
            &Progress::default(),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("block offset"), "{err}");
    let mut o = opts("b2");
    o.mode = BackupMode::Incremental;
    let snap2 = Snap {
        changed: Some(vec![0..BS]),
        ..snap
    };
    let err = s
        .create_backup(Arc::new(snap2), &o, &Progress::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("block offset"), "{err}");
}

#[tokio::test]
async fn delta_max_three_gives_full_inc_inc_full_inc_inc_and_deleting_ancestors_keeps_the_third_restorable() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(2);
    let mut kinds = Vec::new();
    let mut contents = Vec::new();
    for i in 1..=6u8 {
        data[(u64::from(i) * BS) as usize] = i;
        let snap = Snap {
            name: format!("s{i}"),
            data: Arc::new(data.clone()),
            changed: Some(vec![u64::from(i) * BS..u64::from(i) * BS + 1]),
        };
        let b = backup(&s, &format!("b{i}"), &snap).await;
        kinds.push((b.is_incremental, b.chain_position));
        contents.push(data.clone());
    }
    assert_eq!(
        kinds,
        [(false, 0), (true, 1), (true, 2), (false, 0), (true, 1), (true, 2)]
    );
    let b4 = s.backup_config("vol", "b4").await.unwrap();
    assert_eq!(b4.full_reason, Some(FullReason::DeltaMaxReached(3)));
    // The third backup ended its chain (delta-max 3 counts the full one).
    let b3 = s.backup_config("vol", "b3").await.unwrap();
    assert!(b3.end_of_chain, "{b3:?}");
    assert_eq!(b4.stats.reuploaded_blocks, 12, "a full uploads every block again");

    for victim in ["b1", "b2"] {
        let out = s.delete_backup("vol", victim, &gc0()).await.unwrap();
        assert!(out.skipped.is_empty(), "{}", out.skipped);
    }
    assert_eq!(restored(&s, "b3").await, contents[2]);
    assert_eq!(
        s.chain_of("vol", "b3").await.unwrap(),
        ["b2 (deleted)", "b3"].map(String::from)
    );
    // Blocks only b1/b2 referenced are gone; every remaining backup still restores.
    for (i, c) in contents.iter().enumerate().skip(2) {
        assert_eq!(&restored(&s, &format!("b{}", i + 1)).await, c);
    }
    let err = s.delete_backup("vol", "b1", &gc0()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
}

#[tokio::test]
async fn a_corrupt_block_fails_restore_and_verify_and_the_next_full_heals_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let v = pattern(3);
    let snap = Snap {
        name: "s".into(),
        data: Arc::new(v.clone()),
        changed: Some(vec![]),
    };
    let b1 = backup(&s, "b1", &snap).await;
    let victim = b1.blocks[4].clone();
    let p = s.block_object("vol", &victim.hash);
    let mut bytes = s
        .object_store()
        .get(&p)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let n = bytes.len();
    bytes[n - 5] ^= 1;
    s.object_store().put(&p, bytes.into()).await.unwrap();

    let sink = MemSink::new(0);
    let err = s
        .restore(
            "vol",
            "b1",
            sink,
            &RestoreOptions::default(),
            &Progress::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    assert!(
        err.to_string().contains(&format!("offset {}", victim.offset)),
        "{err}"
    );
    let ver = s.verify("vol", "b1", 4).await.unwrap();
    assert_eq!(ver.bad.len(), 1);
    assert_eq!(ver.bad[0].offset, victim.offset);

    // An incremental with no changes does not touch the block; a full re-uploads and heals it.
    let b2 = backup(&s, "b2", &snap).await;
    assert!(b2.is_incremental);
    assert_eq!(s.verify("vol", "b2", 4).await.unwrap().bad.len(), 1);
    let mut o = opts("b3");
    o.mode = BackupMode::Full;
    s.create_backup(Arc::new(snap.clone()), &o, &Progress::default())
        .await
        .unwrap();
    assert!(s.verify("vol", "b1", 4).await.unwrap().bad.is_empty());
    assert_eq!(restored(&s, "b1").await, v);
}

#[tokio::test]
async fn a_revert_ends_the_chain_and_incremental_mode_then_fails() {
    let s = BackupStore::with_store(
        Arc::new(object_store::memory::InMemory::new()),
        BackupUrl::parse("s3://mem/x").unwrap().target,
    );
    let v = pattern(4);
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(v.clone()),
            changed: None,
        },
    )
    .await;
    let reverted = Snap {
        name: "s2".into(),
        data: Arc::new(v),
        changed: None,
    };
    let mut o = opts("b2");
    o.mode = BackupMode::Incremental;
    let err = s
        .create_backup(Arc::new(reverted.clone()), &o, &Progress::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("reverted"), "{err}");
    let b2 = backup(&s, "b2", &reverted).await;
    assert_eq!(b2.full_reason, Some(FullReason::ChainEnded("reverted".into())));
    assert_eq!(
        b2.stats.new_blocks, 0,
        "same content: every block deduplicated but re-uploaded"
    );
}

#[tokio::test]
async fn deletion_waits_for_a_running_backup_and_gc_spares_an_in_progress_backups_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let v = pattern(5);
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(v.clone()),
            changed: None,
        },
    )
    .await;
    let held = s.lock("vol", LockKind::Backup, Duration::ZERO).await.unwrap();
    let err = s.delete_backup("vol", "b1", &gc0()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    // Restores run beside backups.
    let r = s.lock("vol", LockKind::Restore, Duration::ZERO).await.unwrap();
    r.release().await.unwrap();
    held.release().await.unwrap();

    // A slow backup (rate-limited) is in progress: its record says so, and GC by another process skips.
    let mut v2 = pattern(6);
    v2[0] = 1;
    let snap = Snap {
        name: "s2".into(),
        data: Arc::new(v2),
        changed: None,
    };
    let mut o = opts("b2");
    o.mode = BackupMode::Full;
    o.max_upload_rate = 4 * BS;
    o.concurrency = 1;
    let s2 = s.clone();
    let job = tokio::spawn(async move { s2.create_backup(Arc::new(snap), &o, &Progress::default()).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while s.backup_config("vol", "b2").await.is_err() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        s.backup_config("vol", "b2").await.unwrap().state,
        BackupState::InProgress
    );
    let before = stored_blocks(&s).await;
    let e = s.gc("vol", &gc0()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    job.abort(); // like a killed process: the in-progress record and its lock stay behind
    let _ = job.await;
    assert!(stored_blocks(&s).await >= before);
    assert_eq!(
        s.backup_config("vol", "b2").await.unwrap().state,
        BackupState::InProgress
    );
}

#[tokio::test]
async fn retention_keeps_the_newest_backups_and_collects_their_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    for i in 0..4u8 {
        let snap = Snap {
            name: format!("s{i}"),
            data: Arc::new(pattern(10 + i)),
            changed: None,
        };
        let mut o = opts(&format!("b{i}"));
        o.retain = Some(2);
        s.create_backup(Arc::new(snap), &o, &Progress::default())
            .await
            .unwrap();
    }
    let names: Vec<String> = s
        .list_backups("vol")
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.name)
        .collect();
    assert_eq!(names, ["b2", "b3"]);
    assert_eq!(stored_blocks(&s).await, 26);
    assert_eq!(restored(&s, "b2").await, pattern(12));
    s.delete_volume("vol", &gc0()).await.unwrap();
    assert!(s.list_volumes().await.unwrap().is_empty());
    assert_eq!(
        s.volume_config("vol").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

mod model {
    //! Random create/delete sequences against a model: after every GC the store holds exactly the blocks the
    //! remaining backups reference, and every remaining backup restores to its content.
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Write value `v` into block `blk` (0 = zero it), then back up.
        Backup(Vec<(u8, u8)>, bool),
        Delete(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (prop::collection::vec((0u8..8, 0u8..4), 0..4), any::<bool>()).prop_map(|(w, f)| Op::Backup(w, f)),
            1 => (0usize..8).prop_map(Op::Delete),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn gc_keeps_exactly_the_referenced_blocks(ops in prop::collection::vec(op(), 1..10)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let s = BackupStore::with_store(
                    Arc::new(object_store::memory::InMemory::new()),
                    BackupUrl::parse("s3://mem").unwrap().target,
                );
                let mut vol = vec![0u8; SIZE as usize];
                let mut live: Vec<(String, Vec<u8>)> = Vec::new();
                // Ranges changed since the newest live backup (all of them once that one is deleted).
                let mut since_newest: Vec<Range<u64>> = Vec::new();
                for (i, op) in ops.into_iter().enumerate() {
                    match op {
                        Op::Backup(writes, full) => {
                            for (blk, v) in writes {
                                let o = u64::from(blk) * BS;
                                vol[o as usize..(o + BS) as usize].fill(v);
                                since_newest.push(o..o + BS);
                            }
                            let changed = std::mem::take(&mut since_newest);
                            let name = format!("b{i}");
                            let snap = Snap { name: name.clone(), data: Arc::new(vol.clone()), changed: Some(changed) };
                            let mut o = opts(&name);
                            if full { o.mode = BackupMode::Full; }
                            s.create_backup(Arc::new(snap), &o, &Progress::default()).await.unwrap();
                            live.push((name, vol.clone()));
                        }
                        Op::Delete(k) if !live.is_empty() => {
                            if k % live.len() == live.len() - 1 {
                                since_newest = vec![0..SIZE];
                            }
                            let (name, _) = live.remove(k % live.len());
                            s.delete_backup("vol", &name, &gc0()).await.unwrap();
                        }
                        Op::Delete(_) => {}
                    }
                    let mut want = std::collections::BTreeSet::new();
                    for (_, content) in &live {
                        for c in content.chunks(BS as usize) {
                            if c.iter().any(|&b| b != 0) { want.insert(backupstore::block::block_hash(c)); }
                        }
                    }
                    let deleted_any = i > 0 && !live.is_empty();
                    if deleted_any || live.is_empty() {
                        // Stored blocks ⊇ referenced; after a delete (GC) they are equal.
                        assert!(stored_blocks(&s).await >= want.len());
                    }
                }
                s.gc("vol", &gc0()).await.unwrap();
                let mut want = std::collections::BTreeSet::new();
                for (_, content) in &live {
                    for c in content.chunks(BS as usize) {
                        if c.iter().any(|&b| b != 0) { want.insert(backupstore::block::block_hash(c)); }
                    }
                }
                assert_eq!(stored_blocks(&s).await, want.len());
                for (name, content) in &live {
                    assert_eq!(&restored(&s, name).await, content, "{name}");
                }
            });
        }
    }
}

#[tokio::test]
async fn a_sparse_file_round_trips_through_file_source_and_sink_with_holes_kept() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let dir = tempfile::tempdir().unwrap();
    let s = store(&dir.path().join("store"));
    let src = dir.path().join("src.img");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(64 * BS).unwrap();
    let data = pattern(7);
    f.write_all_at(&data[..(2 * BS) as usize], 8 * BS).unwrap();
    f.write_all_at(&vec![0u8; BS as usize], 20 * BS).unwrap(); // allocated zeros: read, not stored
    f.sync_all().unwrap();
    let source = Arc::new(backupstore::file::FileSource::open(&src, "s").unwrap());
    let b = s
        .create_backup(source, &opts("f1"), &Progress::default())
        .await
        .unwrap();
    assert_eq!((b.stats.new_blocks, b.stats.zero_blocks), (2, 1));
    let out = dir.path().join("out.img");
    let sink = Arc::new(backupstore::file::FileSink::create(&out, b.size).unwrap());
    s.restore(
        "vol",
        "f1",
        sink.clone(),
        &RestoreOptions::default(),
        &Progress::default(),
    )
    .await
    .unwrap();
    sink.sync().unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&src).unwrap());
    assert!(
        std::fs::metadata(&out).unwrap().blocks() * 512 <= 2 * BS + 4096,
        "holes stay holes"
    );
}
