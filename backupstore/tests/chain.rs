//! The chain policy (seed 004): `backup-delta-max` counts the backups of a chain including its full one, every
//! record says full or incremental and why, the last backup of a chain records `endOfChain`, and a chain ends
//! on request (`--full`), after a restore into the volume, or when incrementals are turned off. Deleting a backup
//! never breaks another, and garbage collection never takes a block a running backup needs.

#![allow(clippy::cast_possible_truncation, clippy::single_range_in_vec_init)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use backupstore::{
    BackupConfig, BackupMode, BackupSource, BackupState, BackupStore, Changes, CreateOptions, FullReason,
    Progress, SnapshotInfo,
};
use common::*;

/// Writes one byte into block `i` of `data` and returns a snapshot that names that block as changed.
fn step(data: &mut [u8], i: u8) -> Snap {
    let o = u64::from(i % 13) * BS;
    data[o as usize] = data[o as usize].wrapping_add(i).wrapping_add(1);
    Snap {
        name: format!("s{i}"),
        data: Arc::new(data.to_vec()),
        changed: Some(vec![o..o + 1]),
    }
}

async fn create(s: &BackupStore, o: &CreateOptions, snap: &Snap) -> BackupConfig {
    s.create_backup(Arc::new(snap.clone()), o, &Progress::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn delta_max_five_puts_five_backups_in_a_chain_and_the_sixth_starts_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(1);
    let mut got = Vec::new();
    for i in 1..=7u8 {
        let mut o = opts(&format!("b{i}"));
        o.delta_max = 5;
        let b = create(&s, &o, &step(&mut data, i)).await;
        got.push((b.is_incremental, b.chain_position));
    }
    assert_eq!(
        got,
        [
            (false, 0),
            (true, 1),
            (true, 2),
            (true, 3),
            (true, 4),
            (false, 0),
            (true, 1)
        ]
    );
    let all = s.list_backups("vol").await.unwrap();
    let ends: Vec<bool> = all.iter().map(|b| b.end_of_chain).collect();
    assert_eq!(ends, [false, false, false, false, true, false, false]);
    assert_eq!(all[0].full_reason, Some(FullReason::FirstBackup));
    assert_eq!(all[5].full_reason, Some(FullReason::DeltaMaxReached(5)));
    assert!(
        all[5]
            .full_reason
            .as_ref()
            .unwrap()
            .to_string()
            .contains("5 backups")
    );
    assert!(all[1..5].iter().all(|b| b.full_reason.is_none()));
    assert_eq!(all[4].base_backup, "b4");
}

#[tokio::test]
async fn a_forced_full_ends_the_previous_chain_and_says_it_was_requested() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(2);
    create(&s, &opts("b1"), &step(&mut data, 1)).await;
    create(&s, &opts("b2"), &step(&mut data, 2)).await;
    let mut o = opts("b3");
    o.mode = BackupMode::Full;
    let b3 = create(&s, &o, &step(&mut data, 3)).await;
    assert_eq!((b3.is_incremental, b3.chain_position), (false, 0));
    assert_eq!(b3.full_reason, Some(FullReason::Requested));
    let b2 = s.backup_config("vol", "b2").await.unwrap();
    assert!(b2.end_of_chain, "the backup before a forced full ends its chain");
    assert_eq!(b2.chain_end_reason, Some(FullReason::Requested));
    let b4 = create(&s, &opts("b4"), &step(&mut data, 4)).await;
    assert_eq!((b4.is_incremental, b4.base_backup.as_str()), (true, "b3"));
}

#[tokio::test]
async fn ending_the_chain_after_a_restore_makes_the_next_backup_full_with_that_reason() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(3);
    create(&s, &opts("b1"), &step(&mut data, 1)).await;
    let marked = s
        .end_chain("vol", "backup b1 was restored into the volume")
        .await
        .unwrap();
    assert_eq!(marked.as_deref(), Some("b1"));
    assert!(s.backup_config("vol", "b1").await.unwrap().end_of_chain);
    // `incremental` mode cannot go past a chain ended by a restore.
    let mut o = opts("b2");
    o.mode = BackupMode::Incremental;
    let err = s
        .create_backup(Arc::new(step(&mut data, 2)), &o, &Progress::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("restored into the volume"), "{err}");
    let b2 = create(&s, &opts("b2"), &step(&mut data, 2)).await;
    assert_eq!(
        b2.full_reason,
        Some(FullReason::ChainEnded(
            "backup b1 was restored into the volume".into()
        ))
    );
    assert_eq!(b2.full_reason.as_ref().unwrap().kind(), "chain-ended");
}

/// A snapshot whose volume reports its chain ended (the replica's marker after a restore into it).
struct Restored(Snap);

impl BackupSource for Restored {
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
    fn chain_ended(&self) -> Option<String> {
        Some("backup x was restored into the volume".into())
    }
}

#[tokio::test]
async fn a_source_that_reports_its_chain_ended_gets_a_full_backup() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(4);
    create(&s, &opts("b1"), &step(&mut data, 1)).await;
    let b2 = s
        .create_backup(
            Arc::new(Restored(step(&mut data, 2))),
            &opts("b2"),
            &Progress::default(),
        )
        .await
        .unwrap();
    assert!(!b2.is_incremental);
    assert!(
        matches!(&b2.full_reason, Some(FullReason::ChainEnded(w)) if w.contains("restored")),
        "{:?}",
        b2.full_reason
    );
    assert!(s.backup_config("vol", "b1").await.unwrap().end_of_chain);
}

#[tokio::test]
async fn with_incrementals_disabled_every_backup_is_full_and_turning_them_on_again_starts_a_chain() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(5);
    create(&s, &opts("b1"), &step(&mut data, 1)).await;
    for i in 2..=3u8 {
        let mut o = opts(&format!("b{i}"));
        o.incremental = false;
        let b = create(&s, &o, &step(&mut data, i)).await;
        assert_eq!(b.full_reason, Some(FullReason::IncrementalDisabled));
        assert!(b.end_of_chain, "a full with incrementals off is a chain of one");
    }
    assert!(s.backup_config("vol", "b1").await.unwrap().end_of_chain);
    // Toggling back on: the chain ended with the last full, so this one is full too (and says why)...
    let b4 = create(&s, &opts("b4"), &step(&mut data, 4)).await;
    assert_eq!(b4.full_reason, Some(FullReason::IncrementalDisabled));
    assert!(!b4.end_of_chain);
    // ...and the next continues it.
    let b5 = create(&s, &opts("b5"), &step(&mut data, 5)).await;
    assert_eq!((b5.is_incremental, b5.chain_position), (true, 1));
}

#[tokio::test]
async fn a_format_1_record_keeps_its_position_and_the_chain_continues_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(6);
    let b1 = create(&s, &opts("b1"), &step(&mut data, 1)).await;
    // Rewrite b1 as a format-1 record at position 4 of its chain, with the old fields only.
    let p = dir.path().join("volumes/vol/backups/backup_b1.cfg");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    for k in [
        "endOfChain",
        "chainEndReason",
        "backingImageName",
        "backingImageChecksum",
    ] {
        o.remove(k);
    }
    o.insert("formatVersion".into(), 1.into());
    o.insert("chainPosition".into(), 4.into());
    o.insert("isIncremental".into(), true.into());
    o.insert("fullReason".into(), serde_json::Value::Null);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let old = s.backup_config("vol", "b1").await.unwrap();
    assert_eq!((old.chain_position, old.end_of_chain), (4, false));
    assert_eq!(old.blocks, b1.blocks);
    // With delta-max 6 the next one is the 6th of the chain (position 5) and ends it; the one after is full.
    let mut o = opts("b2");
    o.delta_max = 6;
    let b2 = create(&s, &o, &step(&mut data, 2)).await;
    assert_eq!(
        (b2.is_incremental, b2.chain_position, b2.end_of_chain),
        (true, 5, true)
    );
    let mut o = opts("b3");
    o.delta_max = 6;
    let b3 = create(&s, &o, &step(&mut data, 3)).await;
    assert_eq!(b3.full_reason, Some(FullReason::DeltaMaxReached(6)));
}

#[tokio::test]
async fn deleting_the_middle_backup_of_a_chain_keeps_the_later_ones_exact_and_gc_takes_only_its_own_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(7);
    let mut contents = Vec::new();
    // b1 changes block 1, b2 block 2, b3 block 2 again (15 % 13): b2's version of block 2 is its alone.
    for (n, i) in [1u8, 2, 15].into_iter().enumerate() {
        create(&s, &opts(&format!("b{}", n + 1)), &step(&mut data, i)).await;
        contents.push(data.clone());
    }
    let blocks = |c: &[u8]| -> std::collections::BTreeSet<String> {
        c.chunks(BS as usize)
            .filter(|b| b.iter().any(|&x| x != 0))
            .map(backupstore::block::block_hash)
            .collect()
    };
    let (h1, h2, h3) = (blocks(&contents[0]), blocks(&contents[1]), blocks(&contents[2]));
    let only_b2: Vec<&String> = h2
        .iter()
        .filter(|h| !h1.contains(*h) && !h3.contains(*h))
        .collect();
    assert_eq!(only_b2.len(), 1, "b2 changed one block that b3 changed again");
    // What a backup killed between staging a block and publishing it leaves (`local.rs`): invisible to listings,
    // collected by GC.
    let staged = dir.path().join("volumes/vol/blocks/ff/ee/ffee.blk#1234");
    std::fs::create_dir_all(staged.parent().unwrap()).unwrap();
    std::fs::write(&staged, b"half a block").unwrap();
    let out = s.delete_backup("vol", "b2", &gc0()).await.unwrap();
    assert!(out.skipped.is_empty(), "{}", out.skipped);
    assert_eq!(out.deleted_blocks, 1, "GC took exactly b2's own block");
    assert_eq!(out.removed_staged, 1, "GC removed the staged leftover");
    assert!(!staged.exists());
    assert!(
        !dir.path()
            .join(format!(
                "volumes/vol/blocks/{}/{}/{}.blk",
                &only_b2[0][..2],
                &only_b2[0][2..4],
                only_b2[0]
            ))
            .exists()
    );
    assert_eq!(restored(&s, "b1").await, contents[0]);
    assert_eq!(
        restored(&s, "b3").await,
        contents[2],
        "b3 after deleting its base"
    );
    assert_eq!(stored_blocks(&s).await, h1.union(&h3).count());
}

/// A snapshot read slowly, so garbage collection can be started while its backup uploads.
struct Slow(Snap);

impl BackupSource for Slow {
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
        std::thread::sleep(Duration::from_millis(40));
        self.0.read_at(o, buf)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_started_during_a_running_backup_keeps_every_block_that_backup_needs() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let mut data = pattern(8);
    create(&s, &opts("b1"), &step(&mut data, 1)).await;
    // b2 rewrites every data block; b1 is deleted while b2 runs, so everything b2 deduplicated against b1
    // (nothing) or uploaded (all) must survive the GC that the deletion triggers.
    for (i, b) in data.iter_mut().enumerate().take((13 * BS) as usize) {
        *b = b.wrapping_add((i % 251) as u8 | 1);
    }
    let snap = Snap {
        name: "s2".into(),
        data: Arc::new(data.clone()),
        changed: Some(vec![0..13 * BS]),
    };
    let mut o = opts("b2");
    o.concurrency = 1;
    let s2 = s.clone();
    let job = tokio::spawn(async move {
        s2.create_backup(Arc::new(Slow(snap)), &o, &Progress::default())
            .await
    });
    // Wait until b2 is visibly in progress with some of its blocks uploaded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let inprog = s
            .backup_config("vol", "b2")
            .await
            .is_ok_and(|c| c.state == BackupState::InProgress);
        // b2's blocks are staged under hidden names until a group of them is durable (src/local.rs): count
        // the files on disk.
        if inprog && written_block_files(dir.path()) > 13 + 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "b2 did not start uploading"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Margin 0: only the lock protects b2's fresh, not yet referenced blocks. The deletion waits for it.
    let mut gc = gc0();
    gc.lock_wait = Duration::from_secs(30);
    let out = s.delete_backup("vol", "b1", &gc).await.unwrap();
    let b2 = job.await.unwrap().unwrap();
    assert_eq!(b2.state, BackupState::Complete);
    assert!(out.deleted_blocks > 0, "b1's blocks were collected: {out:?}");
    assert_eq!(restored(&s, "b2").await, data);
    assert!(s.verify("vol", "b2", 4).await.unwrap().bad.is_empty());
}
