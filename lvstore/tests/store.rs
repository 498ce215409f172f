//! Behaviour of the store on a preallocated file and on a loop device: O(1) snapshots, 4 KiB sub-cluster
//! writes, clones, xattrs, rename, resize, delete (with merge), decouple, the space report, the offline CLI, and
//! bad input (not an lvstore, newer version, truncated superblock, a full store, path-trick names).

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use std::path::{Path, PathBuf};
use std::process::Command;

use lvstore::{ErrorKind, FormatOptions, LvStore, OpenMode};

const MIB: u64 = 1 << 20;

fn small_opts() -> FormatOptions {
    FormatOptions {
        cluster_size: 64 << 10,
        meta_area: Some(512 << 10),
        journal_len: 256 << 10,
        force: false,
    }
}

fn disk_file(dir: &Path, len: u64) -> PathBuf {
    let p = dir.join("disk");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(len).unwrap();
    p
}

fn digest(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn a_snapshot_freezes_the_data_and_a_4k_write_after_it_allocates_one_cluster_and_writes_4k() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    let lv = s.create_lvol("vol", 4 * MIB).unwrap();
    let full: Vec<u8> = (0..4 * MIB).map(|i| (i % 251) as u8).collect();
    s.write_at(lv, 0, &full).unwrap();
    s.flush().unwrap();
    let used_before = s.space().used_clusters;
    s.snapshot("vol", "snap1").unwrap();
    // O(1): no cluster was allocated or copied by the snapshot.
    assert_eq!(s.space().used_clusters, used_before);
    assert_eq!(s.info("vol").unwrap().allocated_bytes, 0);
    assert_eq!(s.info("snap1").unwrap().allocated_bytes, 4 * MIB);
    s.write_at(lv, 8192, &[0xee; 4096]).unwrap();
    // One new cluster, and only the 4 KiB written is the lvol's: the rest still reads from the snapshot.
    assert_eq!(s.space().used_clusters, used_before + 1);
    assert_eq!(s.info("vol").unwrap().allocated_bytes, 4096);
    let mut got = vec![0u8; 64 << 10];
    s.read_at(lv, 0, &mut got).unwrap();
    let mut want = full[..64 << 10].to_vec();
    want[8192..12288].fill(0xee);
    assert_eq!(got, want);
    let snap = s.lookup("snap1").unwrap();
    s.read_at(snap, 0, &mut got).unwrap();
    assert_eq!(got, full[..64 << 10]);
    assert_eq!(
        s.write_at(snap, 0, &[1; 4096]).unwrap_err().kind(),
        ErrorKind::Invalid
    );
    assert_eq!(s.info("vol").unwrap().parent.as_deref(), Some("snap1"));
}

#[test]
fn clones_xattrs_rename_resize_delete_and_decouple() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    let lv = s.create_lvol("base", MIB).unwrap();
    s.write_at(lv, 0, &[7u8; 1 << 20]).unwrap();
    s.snapshot("base", "gold").unwrap();
    let c = s.clone_snapshot("gold", "c1").unwrap();
    s.write_at(c, 4096, &[9u8; 4096]).unwrap();
    s.set_xattr("c1", "revision", b"42").unwrap();
    s.rename("c1", "clone-one").unwrap();
    assert_eq!(
        s.xattr("clone-one", "revision").unwrap().as_deref(),
        Some(&b"42"[..])
    );
    // gold has two clones now (base and clone-one): deleting it is refused and changes nothing.
    assert_eq!(s.delete("gold").unwrap_err().kind(), ErrorKind::Invalid);
    // Shrink then grow: the regrown range reads zeros, not the snapshot's old data.
    s.resize("clone-one", 64 << 10).unwrap();
    s.resize("clone-one", MIB).unwrap();
    let mut b = vec![0u8; 4096];
    s.read_at(c, 512 << 10, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 0));
    s.read_at(c, 0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 7));
    // Decouple: the clone holds its data itself and has no parent.
    s.decouple("clone-one").unwrap();
    assert_eq!(s.info("clone-one").unwrap().parent, None);
    s.read_at(c, 4096, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 9));
    // Now gold has one clone (base): deleting it merges into base.
    s.delete("gold").unwrap();
    assert_eq!(s.info("base").unwrap().parent, None);
    s.read_at(lv, 100 << 10, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 7));
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    let names: Vec<String> = s.list().into_iter().map(|l| l.name).collect();
    assert_eq!(names, ["base", "clone-one"]);
}

#[test]
fn bad_input_gets_clear_errors_and_changes_nothing() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    // Not an lvstore.
    let other = dir.path().join("other");
    std::fs::write(&other, vec![0x5a; 1 << 20]).unwrap();
    let e = LvStore::open(&other, OpenMode::ReadWrite).err().unwrap();
    assert!(e.to_string().contains("not an lvstore"), "{e}");
    assert_eq!(std::fs::read(&other).unwrap(), vec![0x5a; 1 << 20]);

    let path = disk_file(dir.path(), 32 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    let lv = s.create_lvol("vol", 8 * MIB).unwrap();
    // Path tricks in names.
    for bad in ["../x", "a/b", "", ".hidden", "x\0y", &"n".repeat(201)] {
        let e = s.create_lvol(bad, MIB).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{bad:?}: {e}");
        assert_eq!(s.rename("vol", bad).unwrap_err().kind(), ErrorKind::Invalid);
    }
    // A second format without force is refused.
    assert!(LvStore::format(&path, &small_opts()).is_err());
    // A full store: ENOSPC to the writer, and what was written before stays readable.
    let big = s.create_lvol("big", 64 * MIB).unwrap();
    let chunk = vec![0xab; 1 << 20];
    let mut off = 0;
    let err = loop {
        match s.write_at(big, off, &chunk) {
            Ok(()) => off += 1 << 20,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    assert!(off > 0);
    s.flush().unwrap();
    let mut b = vec![0u8; 1 << 20];
    s.read_at(big, 0, &mut b).unwrap();
    assert_eq!(b, chunk);
    assert_eq!(
        s.write_at(lv, 0, &[1; 4096]).unwrap_err().kind(),
        ErrorKind::NoSpace
    );
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    s.delete("big").unwrap();
    s.write_at(lv, 0, &[1; 4096]).unwrap();
    drop(s);
    let before = digest(&path);

    // A newer version.
    let newer = dir.path().join("newer");
    std::fs::copy(&path, &newer).unwrap();
    let mut bytes = std::fs::read(&newer).unwrap();
    for slot in [0usize, 4096] {
        if bytes[slot..slot + 8] == lvstore::format::MAGIC {
            bytes[slot + 8..slot + 12].copy_from_slice(&(lvstore::format::VERSION + 1).to_le_bytes());
        }
    }
    std::fs::write(&newer, &bytes).unwrap();
    let e = LvStore::open(&newer, OpenMode::ReadWrite).err().unwrap();
    assert!(e.to_string().contains("newer"), "{e}");
    assert_eq!(e.kind(), ErrorKind::BadStore);
    assert_eq!(std::fs::read(&newer).unwrap(), bytes);

    // A truncated superblock, and a truncated device.
    for len in [100u64, 6000, 20 * MIB] {
        let t = dir.path().join(format!("trunc{len}"));
        std::fs::write(&t, &before[..len as usize]).unwrap();
        let e = LvStore::open(&t, OpenMode::ReadWrite).err().unwrap();
        assert!(e.to_string().contains("truncated"), "{len}: {e}");
        assert_eq!(std::fs::read(&t).unwrap(), &before[..len as usize]);
    }
    // Both superblocks damaged.
    let damaged = dir.path().join("damaged");
    let mut bytes = before.clone();
    bytes[40] ^= 0xff;
    bytes[4096 + 40] ^= 0xff;
    std::fs::write(&damaged, &bytes).unwrap();
    let e = LvStore::open(&damaged, OpenMode::ReadWrite).err().unwrap();
    assert!(e.to_string().contains("damaged"), "{e}");
    assert_eq!(
        digest(&path),
        before,
        "the store itself was never touched by the failed opens"
    );
}

#[test]
fn the_store_works_on_a_loop_device() {
    let dir = testkit::scratch::disk_tempdir("lvstore-loop");
    let backing = disk_file(dir.path(), 64 * MIB);
    let out = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&backing)
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        Ok(o) => {
            eprintln!(
                "SKIP: losetup cannot attach a loop device: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("SKIP: losetup unavailable: {e}");
            return;
        }
    };
    struct Detach(PathBuf);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
        }
    }
    let _detach = Detach(dev.clone());
    let s = LvStore::format(
        &dev,
        &FormatOptions {
            cluster_size: 1 << 20,
            meta_area: None,
            journal_len: 1 << 20,
            force: true,
        },
    )
    .unwrap();
    assert!(s.direct_io(), "a block device takes O_DIRECT");
    let lv = s.create_lvol("vol", 16 * MIB).unwrap();
    let data: Vec<u8> = (0..3 * MIB + 5000).map(|i| (i * 7 % 253) as u8).collect();
    s.write_at(lv, 12345, &data).unwrap();
    s.snapshot("vol", "s1").unwrap();
    s.write_at(lv, 12345, &[1u8; 100]).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = LvStore::open(&dev, OpenMode::ReadOnly).unwrap();
    let mut got = vec![0u8; data.len()];
    s.read_at(s.lookup("s1").unwrap(), 12345, &mut got).unwrap();
    assert_eq!(got, data);
    s.read_at(s.lookup("vol").unwrap(), 12345, &mut got).unwrap();
    assert_eq!(&got[..100], &[1u8; 100]);
    assert_eq!(&got[100..], &data[100..]);
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
}

#[test]
fn the_cli_shows_lvols_snapshots_clones_xattrs_and_space_and_checks_offline() {
    let bin = env!("CARGO_BIN_EXE_corral-lvstore");
    let dir = testkit::scratch::disk_tempdir("lvstore-cli");
    let path = disk_file(dir.path(), 64 * MIB);
    let run = |args: &[&str]| {
        let o = Command::new(bin).args(args).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    let p = path.to_str().unwrap();
    run(&["format", p, "--cluster-size", "64K", "--journal", "256K"]);
    run(&["create", p, "vol", "--size", "8M"]);
    run(&["snapshot", p, "vol", "s1"]);
    run(&["clone", p, "s1", "c1"]);
    run(&["set-xattr", p, "c1", "owner", "replica-a"]);
    let ls: serde_json::Value = serde_json::from_str(&run(&["ls", p, "--json"])).unwrap();
    let names: Vec<&str> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["c1", "s1", "vol"]);
    assert_eq!(ls[1]["kind"], "snapshot");
    assert_eq!(ls[1]["children"], serde_json::json!(["c1", "vol"]));
    assert_eq!(ls[0]["xattrs"]["owner"], "replica-a");
    let table = run(&["ls", p]);
    assert!(table.contains("NAME") && table.contains("c1,vol"), "{table}");
    let info: serde_json::Value = serde_json::from_str(&run(&["info", p, "--json"])).unwrap();
    assert_eq!(info["snapshots"], 1);
    assert_eq!(info["space"]["clusterSize"], 65536);
    let check = run(&["check", p]);
    assert!(check.contains("ok"), "{check}");
    // Damage: check fails with the reason and exit status 1.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[40] ^= 0xff;
    bytes[4096 + 40] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let o = Command::new(bin).args(["check", p]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("damaged"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_forced_format_never_replays_the_journal_of_the_store_it_replaced() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 32 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    for i in 0..5 {
        s.create_lvol(&format!("old{i}"), MIB).unwrap();
    }
    drop(s);
    let opts = FormatOptions {
        force: true,
        ..small_opts()
    };
    let s = LvStore::format(&path, &opts).unwrap();
    assert!(s.list().is_empty());
    s.create_lvol("new", MIB).unwrap();
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    let names: Vec<String> = s.list().into_iter().map(|l| l.name).collect();
    assert_eq!(names, ["new"]);
}

#[test]
fn a_full_metadata_area_refuses_new_lvols_and_xattrs_and_keeps_the_store_sound() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 16 * MIB);
    // 64 KiB clusters: ~230 clusters of 24-byte entries plus 64 KiB for lvols and xattrs.
    let opts = FormatOptions {
        meta_area: Some(72 << 10),
        journal_len: 16 << 10,
        ..small_opts()
    };
    let s = LvStore::format(&path, &opts).unwrap();
    let lv = s.create_lvol("vol", 4 * MIB).unwrap();
    s.write_at(lv, 0, &[3u8; 1 << 20]).unwrap();
    let big = vec![b'x'; 32 << 10];
    let mut set = 0;
    let err = loop {
        match s.set_xattr("vol", &format!("k{set}"), &big) {
            Ok(()) => set += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    assert!(err.to_string().contains("metadata area"), "{err}");
    assert!(set >= 1);
    // Snapshots and IO still work through checkpoints (the journal is tiny), and a reopen finds it all.
    for i in 0..10 {
        s.write_at(lv, i * 4096, &[i as u8; 4096]).unwrap();
        s.flush().unwrap();
    }
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    assert_eq!(s.info("vol").unwrap().xattrs.len(), set);
    let mut b = vec![0u8; 4096];
    s.read_at(lv, 9 * 4096, &mut b).unwrap();
    assert_eq!(b, [9u8; 4096]);
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    // While it is open, nobody else opens it; a metadata area too small for the cluster maps is refused at format.
    let e = LvStore::open(&path, OpenMode::ReadOnly).err().unwrap();
    assert!(e.to_string().contains("in use"), "{e}");
    drop(s);
    let opts = FormatOptions {
        meta_area: Some(8 << 10),
        force: true,
        ..small_opts()
    };
    let e = LvStore::format(&path, &opts).err().unwrap();
    assert!(e.to_string().contains("cannot map"), "{e}");
    assert_eq!(LvStore::open(&path, OpenMode::ReadOnly).unwrap().list().len(), 1);
}

#[test]
fn concurrent_writers_flushes_unmaps_and_snapshots_keep_every_lvol_exact() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = std::sync::Arc::new(LvStore::format(&path, &small_opts()).unwrap());
    let size = 2 * MIB;
    for t in 0..4 {
        s.create_lvol(&format!("lv{t}"), size).unwrap();
    }
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let s = std::sync::Arc::clone(&s);
            std::thread::spawn(move || {
                let id = s.lookup(&format!("lv{t}")).unwrap();
                let mut want = vec![0u8; size as usize];
                let mut rng = testkit::rng::TestRng::new(t + 1);
                for i in 0..600u64 {
                    let blk = rng.below(size / 4096);
                    let n = (1 + rng.below(8)).min(size / 4096 - blk);
                    let range = (blk * 4096) as usize..((blk + n) * 4096) as usize;
                    if i % 7 == 3 {
                        s.unmap(id, blk * 4096, n * 4096).unwrap();
                        // Unmap is advisory: what shows is the snapshot's data or zeros; read it back.
                        s.read_at(id, blk * 4096, &mut want[range]).unwrap();
                    } else {
                        let data = vec![(t * 50 + i % 50) as u8 + 1; (n * 4096) as usize];
                        s.write_at(id, blk * 4096, &data).unwrap();
                        want[range].copy_from_slice(&data);
                    }
                    if i % 25 == 0 {
                        s.flush().unwrap();
                    }
                }
                s.flush().unwrap();
                want
            })
        })
        .collect();
    for i in 0..10 {
        s.snapshot(&format!("lv{}", i % 4), &format!("snap{i}")).unwrap();
    }
    let wants: Vec<Vec<u8>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    drop(std::sync::Arc::try_unwrap(s).ok().unwrap());
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    for (t, want) in wants.iter().enumerate() {
        let mut got = vec![0u8; size as usize];
        s.read_at(s.lookup(&format!("lv{t}")).unwrap(), 0, &mut got)
            .unwrap();
        assert!(got == *want, "lv{t} differs after reopen");
    }
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
}

#[test]
fn on_tmpfs_which_refuses_o_direct_the_store_falls_back_to_buffered_io() {
    let fs = Command::new("findmnt")
        .args(["-no", "FSTYPE", "--target", "/dev/shm"])
        .output();
    if !fs
        .as_ref()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "tmpfs")
    {
        eprintln!("SKIP: /dev/shm is not a tmpfs here ({fs:?})");
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = disk_file(dir.path(), 16 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    assert!(!s.direct_io());
    let lv = s.create_lvol("vol", MIB).unwrap();
    s.write_at(lv, 4096, &[5u8; 8192]).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    let mut b = vec![0u8; 8192];
    s.read_at(s.lookup("vol").unwrap(), 4096, &mut b).unwrap();
    assert_eq!(b, [5u8; 8192]);
}

#[test]
#[allow(clippy::single_range_in_vec_init)] // expected range lists of one range
fn reparent_puts_a_written_lvol_over_another_snapshot_and_own_ranges_list_only_a_blobs_own_blocks() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    // The head: empty snapshot under it, then 4 KiB written at 8 KiB (what a rebuilding head holds).
    let head = s.create_lvol("head", MIB).unwrap();
    s.snapshot("head", "old").unwrap();
    s.write_at(head, 8192, &[0xee; 4096]).unwrap();
    // The received chain: base (1 at 0..64K) <- top (2 at 4K..8K).
    let w = s.create_lvol("w", MIB).unwrap();
    s.write_at(w, 0, &[1; 64 << 10]).unwrap();
    s.snapshot("w", "base").unwrap();
    s.write_at(w, 4096, &[2; 4096]).unwrap();
    s.snapshot("w", "top").unwrap();
    s.delete("w").unwrap();
    let top = s.lookup("top").unwrap();
    assert_eq!(s.own_ranges(top, 0, MIB).unwrap(), [4096..8192]);
    assert_eq!(
        s.own_ranges(s.lookup("base").unwrap(), 0, MIB).unwrap(),
        [0..65536]
    );
    assert_eq!(s.own_ranges(top, 6000, 100).unwrap(), [6000..6100]);
    // Only an lvol goes over a snapshot.
    assert_eq!(s.reparent("top", "base").unwrap_err().kind(), ErrorKind::Invalid);
    assert_eq!(s.reparent("head", "head").unwrap_err().kind(), ErrorKind::Invalid);
    s.reparent("head", "top").unwrap();
    s.delete("old").unwrap();
    let mut got = vec![0u8; 16384];
    s.read_at(head, 0, &mut got).unwrap();
    let mut want = vec![1u8; 16384];
    want[4096..8192].fill(2);
    want[8192..12288].fill(0xee);
    assert_eq!(got, want);
    // It survives a reopen (journal replay) and the store checks clean.
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    assert_eq!(s.info("head").unwrap().parent.as_deref(), Some("top"));
    let mut again = vec![0u8; 16384];
    s.read_at(s.lookup("head").unwrap(), 0, &mut again).unwrap();
    assert_eq!(again, want);
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
}

// ---- one-`fdatasync` flushes (records carrying block checksums) and group commit ----

/// A store on a file through the page cache, holding `vol` (1 MiB of 0xaa) under snapshot `base` and flushed, so
/// a write to `vol` now maps new blocks over the snapshot (the copy-on-write path of a v2 head).
fn buffered_store_over_a_snapshot(path: &Path) -> (LvStore, lvstore::BlobId) {
    drop(LvStore::format(path, &small_opts()).unwrap());
    let s = LvStore::open_with(path, OpenMode::ReadWrite, lvstore::DataIo::Buffered).unwrap();
    assert!(!s.direct_io());
    let lv = s.create_lvol("vol", MIB).unwrap();
    s.write_at(lv, 0, &vec![0xaa; MIB as usize]).unwrap();
    s.flush().unwrap();
    s.snapshot("vol", "base").unwrap();
    (s, lv)
}

/// 4 KiB blocks of `vol` written by the tests below, each with its own content (so it can be found in the file).
const NEW_BLOCKS: [u64; 4] = [1, 5, 40, 200];

fn block_of(tag: u8, block: u64) -> Vec<u8> {
    let mut b = vec![tag; 4096];
    b[..8].copy_from_slice(&block.to_le_bytes());
    b
}

fn read_block(s: &LvStore, lv: lvstore::BlobId, block: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    s.read_at(lv, block * 4096, &mut b).unwrap();
    b
}

/// Byte offset in the file of the only 4 KiB-aligned block equal to `want`.
fn find_block(path: &Path, want: &[u8]) -> u64 {
    let all = digest(path);
    let hits: Vec<usize> = (0..all.len() / 4096)
        .filter(|i| &all[i * 4096..(i + 1) * 4096] == want)
        .collect();
    assert_eq!(hits.len(), 1, "block found {} times", hits.len());
    hits[0] as u64 * 4096
}

#[test]
fn a_flush_record_whose_checksummed_data_did_not_land_is_dropped_at_replay() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let (s, lv) = buffered_store_over_a_snapshot(&path);
    let (used, one_sync) = (s.space().used_clusters, s.space().one_sync_flushes);
    for b in NEW_BLOCKS {
        s.write_at(lv, b * 4096, &block_of(0x11, b)).unwrap();
    }
    s.flush().unwrap();
    // Data and record went out with one `fdatasync`: the record holds the blocks' checksums.
    assert_eq!(s.space().one_sync_flushes, one_sync + 1);
    assert!(s.space().used_clusters > used);
    drop(s);
    // Every block landed: the record stands (a read-only open verifies the same way, and changes nothing).
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    let lv = s.lookup("vol").unwrap();
    for b in NEW_BLOCKS {
        assert_eq!(read_block(&s, lv, b), block_of(0x11, b));
    }
    drop(s);
    // A crash inside that `fdatasync` that kept the record but not one block's data (here: the block is put
    // back to what the cluster held before): the flush was never acknowledged, so its whole record is dropped
    // and every block reads through to the snapshot again (never the cluster's old content).
    let off = find_block(&path, &block_of(0x11, 40));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; 4096], off).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    let lv = s.lookup("vol").unwrap();
    for b in NEW_BLOCKS {
        assert_eq!(read_block(&s, lv, b), vec![0xaa; 4096], "block {b}");
    }
    assert_eq!(s.info("vol").unwrap().allocated_bytes, 0);
    assert_eq!(
        s.space().used_clusters,
        used,
        "the clusters the record took are free again"
    );
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    // The store goes on: the next write and flush land, and survive a reopen.
    s.write_at(lv, 40 * 4096, &block_of(0x22, 40)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    assert_eq!(read_block(&s, s.lookup("vol").unwrap(), 40), block_of(0x22, 40));
}

#[test]
fn a_write_to_a_block_the_last_flush_record_checksummed_leaves_that_flush_durable() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let (s, lv) = buffered_store_over_a_snapshot(&path);
    let one_sync = s.space().one_sync_flushes;
    for b in NEW_BLOCKS {
        s.write_at(lv, b * 4096, &block_of(0x11, b)).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.space().one_sync_flushes, one_sync + 1);
    let commits = s.space().journal_commits;
    // Rewrite one of the blocks the record checksummed, and crash before any flush: the flushed writes must all
    // stay (the rewrite may or may not). The rewrite is let through only once a later record is durable, so the
    // checksummed record is no longer the journal's last and replay does not check it.
    s.write_at(lv, 5 * 4096, &block_of(0x33, 5)).unwrap();
    let sealed = s.space().journal_commits;
    // A second rewrite of it needs nothing more.
    s.write_at(lv, 5 * 4096, &block_of(0x44, 5)).unwrap();
    let again = s.space().journal_commits;
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    let lv = s.lookup("vol").unwrap();
    for b in NEW_BLOCKS {
        let got = read_block(&s, lv, b);
        if b == 5 {
            assert!(
                got == block_of(0x11, 5) || got == block_of(0x44, 5),
                "block 5 holds neither the flushed write nor the later one"
            );
        } else {
            assert_eq!(got, block_of(0x11, b), "flushed block {b} lost");
        }
    }
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    assert_eq!(sealed, commits + 1, "the rewrite sealed the record first");
    assert_eq!(again, sealed, "a second rewrite sealed again");
}

#[test]
fn concurrent_flushes_of_one_store_share_their_syncs() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let (s, lv) = buffered_store_over_a_snapshot(&path);
    let threads = 8u64;
    let rounds = 30u64;
    let barrier = std::sync::Barrier::new(threads as usize);
    std::thread::scope(|sc| {
        for t in 0..threads {
            let (s, barrier) = (&s, &barrier);
            sc.spawn(move || {
                barrier.wait();
                for r in 0..rounds {
                    let b = t * rounds + r;
                    s.write_at(lv, b * 4096, &block_of(0x55, b)).unwrap();
                    s.flush().unwrap();
                }
            });
        }
    });
    let shared = s.space().shared_flushes;
    assert!(shared > 0, "no flush was covered by a concurrent one");
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    for b in 0..threads * rounds {
        assert_eq!(read_block(&s, lv, b), block_of(0x55, b), "flushed block {b}");
    }
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
}

/// Flushes that must journal an xattr of their own (they lead a round each), flushes that set one only when
/// journaling anyway, and plain flushes, all at once with writes between: none waits forever (each round's
/// end wakes the flushes it covers and one to lead the next), every xattr a flush returned from is there after
/// a reopen, and so is every flushed block.
#[test]
fn flushes_with_and_without_xattrs_at_once_all_return_and_all_land() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let (s, lv) = buffered_store_over_a_snapshot(&path);
    let s = std::sync::Arc::new(s);
    let threads = 9u64;
    let rounds = 25u64;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads as usize));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for t in 0..threads {
        let (s, barrier, done_tx) = (s.clone(), barrier.clone(), done_tx.clone());
        std::thread::spawn(move || {
            barrier.wait();
            for r in 0..rounds {
                let b = t * rounds + r;
                s.write_at(lv, b * 4096, &block_of(0x66, b)).unwrap();
                let key = format!("t{t}");
                let value = r.to_le_bytes();
                match t % 3 {
                    0 => s.flush_with_xattr("vol", &key, &value).unwrap(),
                    1 => drop(s.flush_with_xattr_if_journaling("vol", &key, &value).unwrap()),
                    _ => s.flush().unwrap(),
                }
            }
            drop(s);
            done_tx.send(t).unwrap();
        });
    }
    drop(done_tx);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    for _ in 0..threads {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        done_rx
            .recv_timeout(left)
            .expect("a flusher did not return within 120 s: the flush rounds left it waiting");
    }
    let shared = s.space().shared_flushes;
    drop(std::sync::Arc::into_inner(s).expect("every flusher thread has ended"));
    let s = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
    for t in 0..threads {
        let got = s.xattr("vol", &format!("t{t}")).unwrap();
        match t % 3 {
            0 => assert_eq!(
                got,
                Some((rounds - 1).to_le_bytes().to_vec()),
                "xattr of thread {t}"
            ),
            1 => assert!(
                got.is_none_or(|v| v.len() == 8 && u64::from_le_bytes(v.try_into().unwrap()) < rounds),
                "xattr of thread {t}"
            ),
            _ => assert_eq!(got, None, "thread {t} set no xattr"),
        }
    }
    for b in 0..threads * rounds {
        assert_eq!(read_block(&s, lv, b), block_of(0x66, b), "flushed block {b}");
    }
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    // Not asserted (it depends on timing): how many plain flushes a round covered.
    eprintln!("shared flushes: {shared}");
}

#[test]
fn a_snapshot_with_xattrs_is_one_commit_and_a_bad_xattr_refuses_all_of_it() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    let lv = s.create_lvol("head", MIB).unwrap();
    s.write_at(lv, 0, &[5u8; 4096]).unwrap();
    s.set_xattr("head", "index", b"1").unwrap();
    s.flush().unwrap();
    let commits = s.space().journal_commits;
    s.snapshot_with_xattrs(
        "head",
        "head.snap.a",
        &[("meta", b"snapshot a"), ("created", b"now")],
        &[("index", b"2")],
    )
    .unwrap();
    assert_eq!(s.space().journal_commits, commits + 1, "one journal record");
    // Refused whole, before anything is journaled: a value over the limit; two new keys past the 64th on the head
    // (each alone would fit); a snapshot name taken.
    for k in 0..62 {
        s.set_xattr("head", &format!("k{k}"), b"v").unwrap();
    }
    let big = vec![0u8; (64 << 10) + 1];
    type Xattrs<'a> = &'a [(&'a str, &'a [u8])];
    let bad: [(&str, Xattrs, Xattrs); 3] = [
        ("head.snap.b", &[("meta", &big)], &[("index", b"3")]),
        ("head.snap.b", &[], &[("x", b"1"), ("y", b"1")]),
        ("head.snap.a", &[], &[("index", b"3")]),
    ];
    let before = s.list().len();
    for (name, snap_x, head_x) in bad {
        assert!(
            s.snapshot_with_xattrs("head", name, snap_x, head_x).is_err(),
            "{name} {head_x:?}"
        );
        assert_eq!(s.list().len(), before);
        assert_eq!(s.xattr("head", "index").unwrap().as_deref(), Some(&b"2"[..]));
    }
    // An lvol created with its xattrs: one commit; refused whole with a bad one (no lvol left).
    let commits = s.space().journal_commits;
    s.create_lvol_with_xattrs("other", MIB, &[("volume", b"{}")])
        .unwrap();
    assert_eq!(s.space().journal_commits, commits + 1, "one journal record");
    assert!(s.create_lvol_with_xattrs("third", MIB, &[("", b"x")]).is_err());
    assert!(s.lookup("third").is_err());
    // A clone sized past its snapshot with its xattrs: one commit; it reads the snapshot, then zeros past its
    // end. Refused whole with a bad xattr or a bad size (no clone left); a snapshot cannot be resized this way.
    let commits = s.space().journal_commits;
    let c = s
        .clone_snapshot_with("head.snap.a", "grown", Some(2 * MIB), &[("volume", b"{}")])
        .unwrap();
    assert_eq!(s.space().journal_commits, commits + 1, "one journal record");
    let mut buf = vec![0u8; 8192];
    s.read_at(c, 0, &mut buf[..4096]).unwrap();
    assert_eq!(buf[..4096], [5u8; 4096]);
    s.read_at(c, MIB, &mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
    assert_eq!(s.info("grown").unwrap().size, 2 * MIB);
    assert_eq!(s.xattr("grown", "volume").unwrap().as_deref(), Some(&b"{}"[..]));
    assert!(
        s.clone_snapshot_with("head.snap.a", "bad", Some(2 * MIB), &[("", b"x")])
            .is_err()
    );
    assert!(
        s.clone_snapshot_with("head.snap.a", "bad", Some(MIB + 1), &[])
            .is_err()
    );
    assert!(s.lookup("bad").is_err());
    // One new key on the head still fits (64 in all).
    s.snapshot_with_xattrs("head", "head.snap.c", &[], &[("x", b"1")])
        .unwrap();
    drop(s);
    let s = LvStore::open(&path, OpenMode::ReadOnly).unwrap();
    assert_eq!(s.check().unwrap().leaked_clusters, 0);
    assert_eq!(
        s.xattr("head.snap.a", "meta").unwrap().as_deref(),
        Some(&b"snapshot a"[..])
    );
    assert_eq!(
        s.xattr("head.snap.a", "created").unwrap().as_deref(),
        Some(&b"now"[..])
    );
    assert_eq!(s.xattr("head", "index").unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(s.xattr("head", "x").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(s.xattr("other", "volume").unwrap().as_deref(), Some(&b"{}"[..]));
    assert_eq!(s.info("head").unwrap().parent.as_deref(), Some("head.snap.c"));
    assert_eq!(
        s.info("head.snap.c").unwrap().parent.as_deref(),
        Some("head.snap.a")
    );
    let mut b = vec![0u8; 4096];
    s.read_at(s.lookup("head.snap.a").unwrap(), 0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 5));
}

#[test]
fn a_filtered_listing_keeps_the_children_of_the_lvols_it_keeps() {
    let dir = testkit::scratch::disk_tempdir("lvstore");
    let path = disk_file(dir.path(), 64 * MIB);
    let s = LvStore::format(&path, &small_opts()).unwrap();
    s.create_lvol("a", MIB).unwrap();
    s.snapshot("a", "a.snap.1").unwrap();
    s.clone_snapshot("a.snap.1", "b").unwrap();
    s.create_lvol("c", MIB).unwrap();
    let kept = s.list_where(|n| n.starts_with("a"));
    let names: Vec<&str> = kept.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["a", "a.snap.1"]);
    // The snapshot's children include the clone the filter left out, as the full listing gives them.
    assert_eq!(kept[1].children, ["a", "b"]);
    let full = s.list();
    assert_eq!(
        full.iter().find(|l| l.name == "a.snap.1").unwrap().children,
        kept[1].children
    );
    assert_eq!(s.info("a.snap.1").unwrap().children, kept[1].children);
    assert!(full.iter().find(|l| l.name == "c").unwrap().children.is_empty());
}
