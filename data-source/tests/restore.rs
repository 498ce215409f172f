//! `restore`: a sparse raw file backed up with the backup store library to a `file://` target (also served as S3
//! by `rclone serve s3`), restored by a real `corral-datasource` process; a missing backup, a corrupted block and
//! an unreachable S3 target fail the job with a message and leave nothing in `<disk>/tmp`; SIGTERM mid-restore
//! stops it and removes the partial file.

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use backupstore::file::FileSource;
use backupstore::{BackupStore, BackupUrl, CreateOptions, Progress};
use common::*;
use data_source::FileState;
use testkit::servers::{S3_ENV, S3Server};
use testkit::wait_for;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Block size of the test backups: the data ranges below are aligned to it, so holes map to whole blocks.
const BLOCK: u64 = 64 * KIB;

/// A raw file of 6 MiB with data in a few block-aligned ranges and holes elsewhere (the tail is a hole too).
fn sparse_source(path: &Path) -> Vec<Range<u64>> {
    let data = [0..MIB, 2 * MIB + 3 * BLOCK..3 * MIB, 4 * MIB..4 * MIB + BLOCK];
    let f = std::fs::File::create(path).unwrap();
    f.set_len(6 * MIB).unwrap();
    let mut x: u32 = 0x9e37_79b9;
    for r in &data {
        let buf: Vec<u8> = (r.start..r.end)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 24) as u8 | 1
            })
            .collect();
        f.write_all_at(&buf, r.start).unwrap();
    }
    f.sync_all().unwrap();
    data.to_vec()
}

fn extents(path: &Path) -> Vec<Range<u64>> {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    corral_disk::sparse::data_extents(&f, 0..len)
        .collect::<std::io::Result<_>>()
        .unwrap()
}

/// Backs `file` up as backup `b1` of volume `vol1` on `file://<dir>`; returns the store and the backup URL.
fn back_up(file: &Path, dir: &Path) -> (BackupStore, String) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = BackupStore::open(
        &BackupUrl::parse(&format!("file://{}", dir.display())).unwrap(),
        &BTreeMap::new(),
    )
    .unwrap();
    let opts = CreateOptions {
        volume: "vol1".into(),
        name: "b1".into(),
        block_size: Some(BLOCK),
        ..CreateOptions::default()
    };
    let src = Arc::new(FileSource::open(file, "snap1").unwrap());
    rt.block_on(store.create_backup(src, &opts, &Progress::default()))
        .unwrap();
    let url = store.backup_url("vol1", "b1");
    (store, url)
}

struct Fixture {
    _dir: tempfile::TempDir,
    src: PathBuf,
    data: Vec<Range<u64>>,
    target: PathBuf,
    store: BackupStore,
    url: String,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let src = dir.path().join("src.raw");
    let data = sparse_source(&src);
    let target = dir.path().join("target");
    std::fs::create_dir_all(&target).unwrap();
    let (store, url) = back_up(&src, &target);
    Fixture {
        _dir: dir,
        src,
        data,
        target,
        store,
        url,
    }
}

#[test]
fn restore_rebuilds_the_backed_up_file_with_its_holes() {
    let fx = fixture();
    assert_eq!(extents(&fx.src), fx.data, "the source is not sparse as built");
    let want = sha512_file(&fx.src);
    let disk = disk();
    let param = format!("backup-url={}", fx.url);
    let ds = DataSourceProc::start(
        disk.path(),
        "restore",
        &["--param", &param, "--expected-checksum", &want],
    );
    let i = ds.expect_ready(&want);
    assert_eq!((i.size, i.virtual_size), (6 * MIB, 6 * MIB));
    assert_eq!(i.processed_size, 6 * MIB);
    // Holes stayed holes: the restored file has data exactly where the source has.
    assert_eq!(extents(Path::new(&i.file_path)), fx.data);
    // Allocation is the data plus file-system metadata: the restore writes blocks out of order with O_DIRECT, so
    // ext4 may hold the file's extents in more pieces than the sequentially written source and add an extent-tree
    // block (4 KiB) for them. A filled hole would add at least 1 MiB here; the extents above are exact already.
    let slack = 16 * 4096;
    assert!(
        i.real_size <= allocated(&fx.src) + slack,
        "{} > {} + {slack}",
        i.real_size,
        allocated(&fx.src)
    );
    assert_eq!(i.parameters.get("backup-url"), Some(&fx.url));

    // The file can be handed over like any other.
    assert!(ds.post("action=transfer").status().is_success());
    assert_eq!(ds.info().state, FileState::Ready);
}

#[test]
fn a_wrong_expected_checksum_fails_the_restore_and_removes_the_file() {
    let fx = fixture();
    let disk = disk();
    let param = format!("backup-url={}", fx.url);
    let ds = DataSourceProc::start(
        disk.path(),
        "restore",
        &["--param", &param, "--expected-checksum", &"ab".repeat(64)],
    );
    let i = ds.wait_final(Duration::from_secs(60));
    assert_eq!(i.state, FileState::Failed, "{i:?}");
    assert!(i.message.contains("checksum mismatch"), "{}", i.message);
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn a_missing_backup_fails_with_a_message_and_leaves_no_file() {
    let fx = fixture();
    let disk = disk();
    let url = fx.url.replace("backup=b1", "backup=nope");
    assert_ne!(url, fx.url);
    let param = format!("backup-url={url}");
    let ds = DataSourceProc::start(disk.path(), "restore", &["--param", &param]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::Failed, "{i:?}");
    assert!(
        i.message.contains("backup nope of volume vol1 not found"),
        "{}",
        i.message
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn a_corrupted_block_fails_the_restore_and_leaves_no_file() {
    let fx = fixture();
    // Flip one byte in the middle of one stored block.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = rt.block_on(fx.store.backup_config("vol1", "b1")).unwrap();
    let victim = &cfg.blocks[cfg.blocks.len() / 2];
    let obj = fx.store.block_object("vol1", &victim.hash);
    let path = fx.target.join(obj.as_ref());
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();

    let disk = disk();
    let param = format!("backup-url={}", fx.url);
    let ds = DataSourceProc::start(disk.path(), "restore", &["--param", &param]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::Failed, "{i:?}");
    assert!(i.message.contains("corrupt"), "{}", i.message);
    assert!(
        i.message.contains(&format!("volume offset {}", victim.offset)),
        "{}",
        i.message
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn an_unreachable_s3_target_fails_instead_of_hanging() {
    let disk = disk();
    let dead = testkit::ports::RefusedAddr::new();
    let param = format!(
        "backup-url=s3://bucket/backups?endpoint=http://{}&region=us-east-1&backup=b1&volume=vol1",
        dead.addr
    );
    let ds = DataSourceProc::start_with_env(
        disk.path(),
        "restore",
        &["--param", &param, "--no-data-timeout", "3"],
        &[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")],
    );
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::Failed, "{i:?}");
    assert!(
        i.message.contains("restore of s3://bucket/backups"),
        "{}",
        i.message
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

/// A backup written to `file://<root>/bk/backups`, served as `s3://bk/backups` by rclone over `<root>`.
fn s3_fixture(rclone_args: &[&str]) -> (tempfile::TempDir, PathBuf, S3Server, String) {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let src = dir.path().join("src.raw");
    sparse_source(&src);
    let root = dir.path().join("s3");
    let target = root.join("bk/backups");
    std::fs::create_dir_all(&target).unwrap();
    back_up(&src, &target);
    let s3 = S3Server::start(&root, rclone_args);
    let url = format!(
        "s3://bk/backups?endpoint={}&region=us-east-1&backup=b1&volume=vol1",
        s3.endpoint
    );
    (dir, src, s3, url)
}

#[test]
fn restore_from_an_s3_target_is_ready_with_the_right_checksum() {
    let (_dir, src, _s3, url) = s3_fixture(&[]);
    let want = sha512_file(&src);
    let disk = disk();
    let param = format!("backup-url={url}");
    let ds = DataSourceProc::start_with_env(disk.path(), "restore", &["--param", &param], &S3_ENV);
    let i = ds.expect_ready(&want);
    assert_eq!(extents(Path::new(&i.file_path)), extents(&src));
}

#[test]
fn restore_from_an_s3_target_reads_its_credentials_from_the_file_it_is_given() {
    let (dir, src, _s3, url) = s3_fixture(&[]);
    let want = sha512_file(&src);
    let disk = disk();
    let param = format!("backup-url={url}");
    // No keys in the environment: without the file the store refuses to open the target.
    let without = DataSourceProc::start(disk.path(), "restore", &["--param", &param]);
    let i = without.wait_final(Duration::from_secs(60));
    assert_eq!(i.state, FileState::Failed, "{i:?}");
    assert!(i.message.contains("credentials"), "{i:?}");
    drop(without);
    let creds = dir.path().join("creds");
    let text: String = S3_ENV.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    std::fs::write(&creds, text).unwrap();
    let file = creds.display().to_string();
    let ds = DataSourceProc::start(
        disk.path(),
        "restore",
        &["--param", &param, "--backup-credentials-file", &file],
    );
    let i = ds.expect_ready(&want);
    assert_eq!(extents(Path::new(&i.file_path)), extents(&src));
}

#[test]
fn sigterm_during_a_slow_s3_restore_stops_it_and_removes_the_partial_file() {
    // 2 MiB of data at 128 KiB/s: about 15 s unless stopped.
    let (_dir, _src, _s3, url) = s3_fixture(&["--bwlimit", "128K"]);
    let disk = disk();
    let param = format!("backup-url={url}");
    let mut ds = DataSourceProc::start_with_env(disk.path(), "restore", &["--param", &param], &S3_ENV);
    let i = wait_for("restore progress", Duration::from_secs(20), || {
        let i = ds.info();
        assert!(!i.state.is_final(), "finished before the signal: {i:?}");
        (i.state == FileState::InProgress && i.progress > 0).then_some(i)
    });
    assert!(i.progress < 80, "{i:?}");
    assert_eq!(i.size, 6 * MIB);
    assert!(i.processed_size > 0 && i.processed_size < 6 * MIB, "{i:?}");
    assert_eq!(tmp_entries(disk.path()), vec!["img-u1.tmp".to_owned()]);
    let status = ds.terminate(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.success()),
        "not a clean exit within 10 s of SIGTERM: {status:?}"
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}
