//! Defects found in review, each pinned by a test that fails without its fix: a lost lock stops the backup, two
//! processes creating the same backup name cannot both succeed, deleting a backup volume leaves other processes'
//! locks alone, and a restore into a larger volume clears what lies past the backup's end. Every store here is a
//! real `file://` target; "another process" is a second `BackupStore` opened on the same directory.

#![allow(clippy::cast_possible_truncation, clippy::single_range_in_vec_init)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use backupstore::lock::{LockKind, LockTiming};
use backupstore::{
    BackupSource, BackupState, BackupStoreError, Changes, ErrorKind, Progress, RestoreOptions, SnapshotInfo,
};
use common::*;

/// A snapshot read slowly (one block per `delay`), so a test can act while its backup runs.
struct SlowSnap {
    inner: Snap,
    delay: Duration,
}

impl BackupSource for SlowSnap {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn snapshot(&self) -> SnapshotInfo {
        self.inner.snapshot()
    }
    fn allocated(&self) -> std::io::Result<Vec<std::ops::Range<u64>>> {
        self.inner.allocated()
    }
    fn changes_since(&self, base: &str, anc: &[String]) -> std::io::Result<Changes> {
        self.inner.changes_since(base, anc)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        std::thread::sleep(self.delay);
        self.inner.read_at(offset, buf)
    }
}

fn slow(name: &str, seed: u8, delay_ms: u64) -> Arc<SlowSnap> {
    Arc::new(SlowSnap {
        inner: Snap {
            name: name.into(),
            data: Arc::new(pattern(seed)),
            changed: None,
        },
        delay: Duration::from_millis(delay_ms),
    })
}

fn lock_files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("volumes/vol/locks"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_whose_lock_was_removed_stops_instead_of_completing() {
    let dir = tempfile::tempdir().unwrap();
    let timing = LockTiming {
        refresh: Duration::from_millis(100),
        expiry: Duration::from_secs(2),
    };
    let s = store(dir.path()).with_lock_timing(timing);
    // 17 blocks at 60 ms each, one at a time: about a second of reading.
    let mut o = opts("b1");
    o.concurrency = 1;
    let s2 = s.clone();
    let job = tokio::spawn(async move {
        s2.create_backup(slow("s1", 1, 60), &o, &Progress::default())
            .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Once the in-progress record exists, the lock is held and blocks are being uploaded.
    let lock = loop {
        if s.backup_config("vol", "b1").await.is_ok() {
            break lock_files(dir.path()).remove(0);
        }
        assert!(tokio::time::Instant::now() < deadline, "the backup did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Another process removes it (what `backup volume rm` used to do): the backup must notice and stop.
    std::fs::remove_file(dir.path().join("volumes/vol/locks").join(&lock)).unwrap();
    let err = job.await.unwrap().unwrap_err();
    assert!(matches!(err, BackupStoreError::LockLost { .. }), "{err}");
    assert!(err.to_string().contains("removed by another process"), "{err}");
    assert_eq!(
        s.backup_config("vol", "b1").await.unwrap().state,
        BackupState::InProgress,
        "a backup that lost its lock must not commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_creating_the_same_backup_name_cannot_both_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (store(dir.path()), store(dir.path()));
    let mut oa = opts("same");
    let mut ob = opts("same");
    oa.lock_wait = Duration::from_secs(5);
    ob.lock_wait = Duration::from_secs(5);
    let (pa, pb) = (Progress::default(), Progress::default());
    let (ra, rb) = tokio::join!(
        a.create_backup(slow("s1", 1, 5), &oa, &pa),
        b.create_backup(slow("s2", 2, 5), &ob, &pb),
    );
    let oks = [ra.is_ok(), rb.is_ok()];
    assert_eq!(
        oks.iter().filter(|&&x| x).count(),
        1,
        "exactly one may pass: {ra:?} / {rb:?}"
    );
    let err = ra.err().or(rb.err()).unwrap();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    // The record is the winner's, complete, and restores to the winner's data.
    let winner = if oks[0] { pattern(1) } else { pattern(2) };
    let cfg = a.backup_config("vol", "same").await.unwrap();
    assert_eq!(cfg.state, BackupState::Complete);
    assert_eq!(restored(&a, "same").await, winner);
}

#[tokio::test]
async fn deleting_a_backup_volume_leaves_other_processes_locks_alone() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(pattern(1)),
            changed: None,
        },
    )
    .await;
    // Another process holds a lock that coexists with the deletion (deletions do not exclude each other).
    let other = store(dir.path());
    let held = other
        .lock("vol", LockKind::Deletion, Duration::ZERO)
        .await
        .unwrap();
    let before = lock_files(dir.path());
    assert_eq!(before.len(), 1);
    s.delete_volume("vol", &gc0()).await.unwrap();
    assert_eq!(
        lock_files(dir.path()),
        before,
        "volume rm removed another process's lock"
    );
    held.check().unwrap();
    held.release().await.unwrap();
    assert!(lock_files(dir.path()).is_empty());
}

#[tokio::test]
async fn a_smaller_backup_restored_into_a_larger_volume_reads_zeros_past_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(pattern(1)),
            changed: None,
        },
    )
    .await;
    /// A volume twice the backup's size, full of old data.
    struct Bigger(MemSink);
    impl backupstore::RestoreSink for Bigger {
        fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.0.write_at(offset, data)
        }
        fn zero_range(&self, offset: u64, len: u64) -> std::io::Result<()> {
            self.0.zero_range(offset, len)
        }
        fn size(&self) -> Option<u64> {
            Some(self.0.data.lock().unwrap().len() as u64)
        }
    }
    let sink = Arc::new(Bigger(MemSink {
        data: std::sync::Mutex::new(vec![0xAA; 2 * SIZE as usize]),
        zeroed: std::sync::Mutex::default(),
    }));
    s.restore(
        "vol",
        "b1",
        sink.clone(),
        &RestoreOptions::default(),
        &Progress::default(),
    )
    .await
    .unwrap();
    let got = sink.0.data.lock().unwrap().clone();
    assert_eq!(&got[..SIZE as usize], &pattern(1)[..]);
    assert!(
        got[SIZE as usize..].iter().all(|&b| b == 0),
        "the volume's old data past the backup's end survived the restore"
    );
}

#[tokio::test]
async fn a_file_restored_over_a_larger_file_is_cut_to_zeros_past_the_backup() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let s = store(&dir.path().join("store"));
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(pattern(3)),
            changed: None,
        },
    )
    .await;
    // A FileSink opened on an existing larger file with old data (not created: the file keeps its size).
    let out = dir.path().join("vol.img");
    let f = std::fs::File::create(&out).unwrap();
    f.write_all_at(&vec![0x55; 2 * SIZE as usize], 0).unwrap();
    drop(f);
    let sink = Arc::new(backupstore::file::FileSink::open_existing(&out).unwrap());
    s.restore(
        "vol",
        "b1",
        sink.clone(),
        &RestoreOptions::default(),
        &Progress::default(),
    )
    .await
    .unwrap();
    sink.sync().unwrap();
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), 2 * SIZE as usize);
    assert_eq!(&got[..SIZE as usize], &pattern(3)[..]);
    assert!(got[SIZE as usize..].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn a_backup_volume_at_its_max_count_refuses_a_new_backup_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    for i in 0..2u8 {
        backup(
            &s,
            &format!("b{i}"),
            &Snap {
                name: format!("s{i}"),
                data: Arc::new(pattern(i)),
                changed: None,
            },
        )
        .await;
    }
    let mut o = opts("b2");
    o.max_count = Some(2);
    let snap = Snap {
        name: "s2".into(),
        data: Arc::new(pattern(9)),
        changed: None,
    };
    let err = s
        .create_backup(Arc::new(snap.clone()), &o, &Progress::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition);
    assert!(err.to_string().contains("backup-max-count is 2"), "{err}");
    assert_eq!(
        s.backup_config("vol", "b2").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Retention runs before the limit: keeping 2 (this one and the newest) fits under a limit of 2.
    o.retain = Some(2);
    s.create_backup(Arc::new(snap), &o, &Progress::default())
        .await
        .unwrap();
    let names: Vec<String> = s
        .list_backups("vol")
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.name)
        .collect();
    assert_eq!(names, ["b1", "b2"]);
}

#[tokio::test]
async fn a_restore_keeps_running_only_while_it_holds_its_lock() {
    // The same watch covers restores: a removed restore lock stops it with LockLost.
    let dir = tempfile::tempdir().unwrap();
    let timing = LockTiming {
        refresh: Duration::from_millis(50),
        expiry: Duration::from_secs(2),
    };
    let s = store(dir.path()).with_lock_timing(timing);
    backup(
        &s,
        "b1",
        &Snap {
            name: "s1".into(),
            data: Arc::new(pattern(1)),
            changed: None,
        },
    )
    .await;
    let l = s.lock("vol", LockKind::Restore, Duration::ZERO).await.unwrap();
    l.check().unwrap();
    let name = lock_files(dir.path()).remove(0);
    std::fs::remove_file(dir.path().join("volumes/vol/locks").join(name)).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), l.lost())
        .await
        .expect("the lock's loss was not noticed");
    assert!(matches!(err, BackupStoreError::LockLost { .. }), "{err}");
    assert!(l.check().is_err());
}
