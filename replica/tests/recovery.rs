//! Each intermediate state an interrupted snapshot, revert or purge can leave on disk is recognised at open and
//! finished or rolled back, with the volume's data intact; and the snapshot hash detects silent corruption.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use replica::jobs::JobControl;
use replica::meta::{DiskMeta, write_json_atomic};
use replica::{Replica, ReplicaOptions, SnapshotRequest};

const SIZE: u64 = 4 << 20;

fn snap(r: &Replica, name: &str) {
    r.snapshot(&SnapshotRequest {
        name: name.into(),
        user_created: true,
        ..Default::default()
    })
    .unwrap();
}

fn read_block(r: &Replica, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    r.read_at(b * 4096, &mut v).unwrap();
    v
}

fn reopen(dir: &Path) -> Replica {
    Replica::open(dir, &ReplicaOptions::default()).unwrap()
}

#[test]
fn snapshot_interrupted_before_commit_is_rolled_back() {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::create(t.path(), SIZE, &ReplicaOptions::default()).unwrap();
    r.write_at(0, &[1u8; 4096]).unwrap();
    r.flush().unwrap();
    drop(r);
    // State after "meta written, link made, new head created" but before volume.meta moved to it.
    let d = t.path();
    write_json_atomic(
        d,
        "volume-snap-x.img.meta",
        &DiskMeta {
            name: "volume-snap-x.img".into(),
            ..Default::default()
        },
    )
    .unwrap();
    std::fs::hard_link(d.join("volume-head-000.img"), d.join("volume-snap-x.img")).unwrap();
    std::fs::File::create(d.join("volume-head-001.img"))
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    std::fs::write(d.join("volume.meta.tmp"), b"{partial").unwrap();
    let r = reopen(d);
    let s = r.status().unwrap();
    assert_eq!(s.head, "volume-head-000.img");
    assert_eq!(s.chain, vec!["volume-head-000.img"]);
    for leftover in [
        "volume-snap-x.img",
        "volume-snap-x.img.meta",
        "volume-head-001.img",
        "volume.meta.tmp",
    ] {
        assert!(!d.join(leftover).exists(), "{leftover} left behind");
    }
    assert_eq!(read_block(&r, 0), vec![1u8; 4096]);
    // The name is free again.
    snap(&r, "x");
}

#[test]
fn snapshot_interrupted_after_commit_is_finished() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let r = Replica::create(d, SIZE, &ReplicaOptions::default()).unwrap();
    r.write_at(0, &[1u8; 4096]).unwrap();
    snap(&r, "a");
    r.write_at(4096, &[2u8; 4096]).unwrap();
    r.flush().unwrap();
    drop(r);
    // Recreate the old head's names as if the final unlink had not happened.
    std::fs::hard_link(d.join("volume-snap-a.img"), d.join("volume-head-000.img")).unwrap();
    std::fs::copy(
        d.join("volume-snap-a.img.meta"),
        d.join("volume-head-000.img.meta"),
    )
    .unwrap();
    let r = reopen(d);
    assert!(!d.join("volume-head-000.img").exists());
    assert_eq!(
        r.status().unwrap().chain,
        vec!["volume-head-001.img", "volume-snap-a.img"]
    );
    assert_eq!(read_block(&r, 0), vec![1u8; 4096]);
    assert_eq!(read_block(&r, 1), vec![2u8; 4096]);
}

#[test]
fn purge_interrupted_between_rename_and_repoint_is_finished() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let r = Replica::create(d, SIZE, &ReplicaOptions::default()).unwrap();
    r.write_at(0, &[1u8; 4096]).unwrap();
    snap(&r, "a");
    r.write_at(4096, &[2u8; 4096]).unwrap();
    snap(&r, "b");
    r.close().unwrap();
    drop(r);
    // Fold a into b by hand up to the crash point: b's data copied into a, a renamed over b, a's meta still there.
    let data = std::fs::read(d.join("volume-snap-b.img")).unwrap();
    let a = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("volume-snap-a.img"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&a, &data[4096..8192], 4096).unwrap();
    drop(a);
    let mut am: DiskMeta =
        serde_json::from_slice(&std::fs::read(d.join("volume-snap-a.img.meta")).unwrap()).unwrap();
    am.removed = true;
    write_json_atomic(d, "volume-snap-a.img.meta", &am).unwrap();
    std::fs::rename(d.join("volume-snap-a.img"), d.join("volume-snap-b.img")).unwrap();
    let r = reopen(d);
    let s = r.status().unwrap();
    assert_eq!(s.chain, vec!["volume-head-002.img", "volume-snap-b.img"]);
    assert!(!d.join("volume-snap-a.img.meta").exists());
    assert_eq!(s.disks["volume-snap-b.img"].parent, "");
    assert_eq!(read_block(&r, 0), vec![1u8; 4096]);
    assert_eq!(read_block(&r, 1), vec![2u8; 4096]);
}

#[test]
fn rehash_is_skipped_while_ctime_is_unchanged_and_redone_after_a_purge() {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::create(t.path(), SIZE, &ReplicaOptions::default()).unwrap();
    r.write_at(8192, &[5u8; 4096]).unwrap();
    snap(&r, "a");
    let ctl = JobControl::default();
    let first = r.hash_snapshot("a", false, &ctl).unwrap();
    assert!(!first.skipped);
    let again = r.hash_snapshot("a", false, &ctl).unwrap();
    assert!(again.skipped && again.checksum == first.checksum);
    let forced = r.hash_snapshot("a", true, &ctl).unwrap();
    assert!(!forced.skipped && !forced.silently_corrupted && forced.checksum == first.checksum);
    // Same bytes, different allocation: in a chain layer allocated zeros hide the parent and a hole does not,
    // so the checksums must differ (a rebuild may not skip one for the other).
    let other = tempfile::tempdir().unwrap();
    let r2 = Replica::create(other.path(), SIZE, &ReplicaOptions::default()).unwrap();
    r2.write_at(0, &[0u8; 8192]).unwrap(); // allocated zeros
    r2.write_at(8192, &[5u8; 4096]).unwrap();
    snap(&r2, "a");
    assert_ne!(
        r2.hash_snapshot("a", false, &ctl).unwrap().checksum,
        first.checksum
    );
    // Same bytes and same allocation in another directory: equal.
    let third = tempfile::tempdir().unwrap();
    let r3 = Replica::create(third.path(), SIZE, &ReplicaOptions::default()).unwrap();
    r3.write_at(8192, &[5u8; 4096]).unwrap();
    snap(&r3, "a");
    assert_eq!(
        r3.hash_snapshot("a", false, &ctl).unwrap().checksum,
        first.checksum
    );
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Silent corruption is bit rot below the file system: the data changes, the inode (and its ctime) does not.
/// Reproduced by flipping a byte inside a loop-mounted ext4 image while it is unmounted.
#[test]
fn rehash_flags_silent_corruption_below_the_file_system() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (loop mount); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let img = t.path().join("fs.img");
    let mnt = t.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img));
    run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt));
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let guard = Unmount(&mnt);
    let dir = mnt.join("replica");
    let marker: Vec<u8> = (0..4096u32)
        .map(|i| u8::try_from((i * 7 + 3) % 251).unwrap())
        .collect();
    let recorded = {
        let r = Replica::create(&dir, SIZE, &ReplicaOptions::default()).unwrap();
        r.write_at(4096, &marker).unwrap();
        snap(&r, "a");
        let h = r.hash_snapshot("a", false, &JobControl::default()).unwrap();
        r.close().unwrap();
        h.checksum
    };
    let ctime_before = std::fs::metadata(dir.join("volume-snap-a.img"))
        .unwrap()
        .ctime_nsec();
    drop(guard);
    // Flip one byte of the marker inside the file system image.
    let mut raw = std::fs::read(&img).unwrap();
    let at = raw
        .windows(marker.len())
        .position(|w| w == marker.as_slice())
        .expect("marker on disk");
    raw[at + 100] ^= 0xff;
    std::fs::write(&img, &raw).unwrap();
    run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt));
    let _guard = Unmount(&mnt);
    assert_eq!(
        std::fs::metadata(dir.join("volume-snap-a.img"))
            .unwrap()
            .ctime_nsec(),
        ctime_before
    );
    let r = reopen(&dir);
    let skipped = r.hash_snapshot("a", false, &JobControl::default()).unwrap();
    assert!(skipped.skipped, "without rehash the recorded checksum is trusted");
    let h = r.hash_snapshot("a", true, &JobControl::default()).unwrap();
    assert!(h.silently_corrupted, "rehash must flag the flipped byte");
    assert_eq!(h.checksum, recorded, "the good checksum is kept");
    r.close().unwrap();
}
