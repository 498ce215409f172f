//! Raw and qcow2 images made by qemu as the replica's backing file: the volume reads byte for byte what
//! `qemu-img convert -O raw` gives (and zeros past the image), before and after writes, snapshots, write-zeroes,
//! unmap and a reopen; block status follows the image's data; raw and qcow2 of one image give the same volume;
//! a bad image is refused before anything is created.

#![allow(clippy::cast_possible_truncation)] // test sizes are a few MiB

use std::path::Path;

use disk_image::fixtures::{Fixture, build_all};
use replica::backing::BackingImageId;
use replica::backup::SnapshotSource;
use replica::{Replica, ReplicaOptions, SnapshotRequest};
use sha2::{Digest, Sha512};

const EXTRA: u64 = 1 << 20;

fn opts(backing: &Path) -> ReplicaOptions {
    ReplicaOptions {
        backing_file: Some(backing.to_owned()),
        disable_revision_counter: Some(true),
        backing_image: None,
    }
}

/// The volume's expected content: the reference raw image, zero-padded to the volume size.
fn model_of(f: &Fixture, size: u64) -> Vec<u8> {
    let mut m = std::fs::read(&f.reference).unwrap();
    let image_size = disk_image::probe(&f.path).unwrap().virtual_size as usize;
    m.truncate(image_size); // qemu pads a raw file to 512 bytes; the padding is zeros
    m.resize(size as usize, 0);
    m
}

fn volume_size(f: &Fixture) -> u64 {
    disk_image::probe(&f.path).unwrap().virtual_size.div_ceil(4096) * 4096 + EXTRA
}

fn read_all(r: &Replica) -> Vec<u8> {
    let mut v = vec![0xeeu8; r.size() as usize];
    r.read_at(0, &mut v).unwrap();
    v
}

fn check(r: &Replica, model: &[u8], what: &str) {
    let got = read_all(r);
    if let Some(i) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#x}, want {:#x}",
            got[i], model[i]
        );
    }
    // Block status: everything outside the allocated ranges reads as zeros.
    let ranges = r.allocated_ranges(0, r.size()).unwrap();
    let mut prev = 0usize;
    for rg in &ranges {
        assert!(
            model[prev..rg.start as usize].iter().all(|&b| b == 0),
            "{what}: data in a hole before {rg:?}"
        );
        prev = rg.end as usize;
    }
    assert!(
        model[prev..].iter().all(|&b| b == 0),
        "{what}: data after the last range"
    );
}

fn write(r: &Replica, model: &mut [u8], off: u64, data: &[u8]) {
    r.write_at(off, data).unwrap();
    model[off as usize..off as usize + data.len()].copy_from_slice(data);
}

#[test]
fn every_image_reads_as_qemu_converts_it_through_writes_snapshots_and_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    for f in build_all(&images) {
        let dir = tmp.path().join(f.name);
        let size = volume_size(&f);
        let mut model = model_of(&f, size);
        let r = Replica::create(&dir, size, &opts(&f.path)).unwrap();
        check(&r, &model, &format!("{} fresh", f.name));
        // Holes of the image stay holes in block status (every fixture is sparse).
        let allocated: u64 = r
            .allocated_ranges(0, size)
            .unwrap()
            .iter()
            .map(|x| x.end - x.start)
            .sum();
        assert!(
            allocated < size - EXTRA,
            "{}: {allocated} bytes allocated",
            f.name
        );

        write(&r, &mut model, 4096 + 100, &[0x11; 300]); // partial block over image data: read-modify-write
        write(&r, &mut model, 65536 * 3 + 512, &[0x22; 70_000]);
        r.snapshot(&SnapshotRequest {
            name: "s1".into(),
            user_created: true,
            ..Default::default()
        })
        .unwrap();
        write(&r, &mut model, size - EXTRA - 4096, &[0x33; 8192]); // across the image's end
        r.write_zeroes(0, 8192).unwrap();
        model[..8192].fill(0);
        r.write_zeroes(1536 << 10, 128 << 10).unwrap(); // over image data no layer holds
        model[(1536 << 10)..(1664 << 10)].fill(0);
        // Unmap what only the head holds: the image's data shows through again.
        let lo = (2 << 20) + 8192;
        r.write_at(lo as u64, &[0x44; 16384]).unwrap();
        r.unmap(lo as u64, 16384).unwrap();
        check(&r, &model, &format!("{} after writes", f.name));

        r.close().unwrap();
        drop(r);
        // Reopen without naming the image: volume.meta remembers it.
        let r = Replica::open(&dir, &ReplicaOptions::default()).unwrap();
        let recorded = r.status().unwrap().backing_file;
        assert_eq!(
            Path::new(&recorded),
            std::fs::canonicalize(&f.path).unwrap(),
            "{}",
            f.name
        );
        check(&r, &model, &format!("{} reopened", f.name));
        r.revert("s1", "").unwrap();
        let mut at_s1 = model_of(&f, size);
        at_s1[4196..4496].fill(0x11);
        at_s1[65536 * 3 + 512..65536 * 3 + 512 + 70_000].fill(0x22);
        check(&r, &at_s1, &format!("{} reverted", f.name));
    }
}

#[test]
fn raw_and_qcow2_of_one_image_give_identical_volumes() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = build_all(tmp.path());
    let overlay = fx.iter().find(|f| f.name == "qcow2-overlay").unwrap();
    let compressed = fx.iter().find(|f| f.name == "qcow2-compressed").unwrap();
    let mut sums = Vec::new();
    for (name, image) in [
        ("qcow2", overlay.path.clone()),
        ("raw", overlay.reference.clone()),
        ("compressed", compressed.path.clone()),
        ("compressed-raw", compressed.reference.clone()),
    ] {
        let size = 6 << 20;
        let r = Replica::create(&tmp.path().join(name), size, &opts(&image)).unwrap();
        r.write_at(12_345, &[0x77; 9000]).unwrap();
        sums.push((name, hex::encode(Sha512::digest(read_all(&r)))));
    }
    assert_eq!(sums[0].1, sums[1].1, "{sums:?}");
    assert_eq!(sums[2].1, sums[3].1, "{sums:?}");
}

#[test]
fn a_directory_holding_one_image_is_its_backing_file() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = build_all(&tmp.path().join("all").tap_mkdir());
    let plain = fx.iter().find(|f| f.name == "qcow2-plain").unwrap();
    let managed = tmp.path().join("backing-images/golden-1234");
    std::fs::create_dir_all(&managed).unwrap();
    std::fs::copy(&plain.path, managed.join("backing")).unwrap();
    std::fs::write(managed.join("backing.cfg"), "{}").unwrap();
    let size = volume_size(plain);
    let r = Replica::create(&tmp.path().join("r"), size, &opts(&managed)).unwrap();
    check(&r, &model_of(plain, size), "managed directory");
    assert!(r.status().unwrap().backing_file.ends_with("golden-1234/backing"));

    let two = tmp.path().join("two");
    std::fs::create_dir(&two).unwrap();
    std::fs::copy(&plain.path, two.join("a.qcow2")).unwrap();
    std::fs::copy(&plain.path, two.join("b.qcow2")).unwrap();
    let e = Replica::create(&tmp.path().join("r2"), size, &opts(&two)).unwrap_err();
    assert!(e.to_string().contains("name one"), "{e}");
}

#[test]
fn a_backup_records_the_image_name_and_sha512_the_control_plane_gave() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = build_all(&tmp.path().join("all").tap_mkdir());
    let plain = fx.iter().find(|f| f.name == "qcow2-plain").unwrap();
    let size = volume_size(plain);
    let snap = |r: &Replica| {
        r.snapshot(&SnapshotRequest {
            name: "s1".into(),
            ..Default::default()
        })
        .unwrap();
    };
    let sum = hex::encode(Sha512::digest(std::fs::read(&plain.path).unwrap()));
    let mut o = opts(&plain.path);
    o.backing_image = Some(BackingImageId::new("golden", &sum.to_uppercase()).unwrap());
    let r = std::sync::Arc::new(Replica::create(&tmp.path().join("r"), size, &o).unwrap());
    snap(&r);
    let src = SnapshotSource::open(&r, "s1").unwrap();
    assert_eq!(
        src.backing_image().unwrap(),
        Some(("golden".to_owned(), sum)),
        "the name and SHA-512 given, not the file's name"
    );

    // Started with a bare file, it can only name the file.
    let r = std::sync::Arc::new(Replica::create(&tmp.path().join("r2"), size, &opts(&plain.path)).unwrap());
    snap(&r);
    let (name, _) = SnapshotSource::open(&r, "s1")
        .unwrap()
        .backing_image()
        .unwrap()
        .unwrap();
    assert_eq!(
        Some(name.as_str()),
        plain.path.file_name().and_then(|n| n.to_str())
    );
}

#[test]
fn bad_backing_images_are_refused_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = build_all(&tmp.path().join("all").tap_mkdir());
    let plain = fx.iter().find(|f| f.name == "qcow2-plain").unwrap();
    let vmdk = tmp.path().join("disk.vmdk");
    std::fs::write(&vmdk, b"KDMV\x01\0\0\0 rest of a vmdk header").unwrap();
    let cases: [(&Path, u64, &str); 3] = [
        (&vmdk, 4 << 20, "VMDK"),
        (&plain.path, 1 << 20, "larger than the volume"),
        (Path::new("/nonexistent/image.qcow2"), 4 << 20, "nonexistent"),
    ];
    for (image, size, want) in cases {
        let dir = tmp.path().join("r");
        let e = Replica::create(&dir, size, &opts(image)).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
        assert!(!dir.exists(), "{want}: the replica directory was created");
    }
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for std::path::PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}
