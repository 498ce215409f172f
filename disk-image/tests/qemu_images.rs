#![allow(clippy::cast_possible_truncation)] // test sizes are a few MiB
//! Images made by qemu-img/qemu-io read byte for byte as `qemu-img convert -O raw` says, report data layouts that
//! cover all their data, and convert to raw and qcow2 files that `qemu-img check` and `qemu-img compare` accept.

use std::sync::atomic::AtomicBool;

use corral_disk::sparse::SparseRead;
use disk_image::fixtures::{Fixture, build_all, run};
use disk_image::{DiskImage, ImageFormat, convert, probe};

/// The reference content cut to the image's size: qemu rounds a raw file's size up to 512 bytes, we read
/// exactly the file (the padding is zeros either way).
fn reference(f: &Fixture) -> Vec<u8> {
    let mut want = std::fs::read(&f.reference).unwrap();
    let size = probe(&f.path).unwrap().virtual_size as usize;
    assert!(want.len() >= size && want.len() - size < 512, "{}", f.name);
    assert!(want[size..].iter().all(|&b| b == 0));
    want.truncate(size);
    want
}

#[test]
fn every_fixture_reads_as_qemu_img_converts_it() {
    let dir = tempfile::tempdir().unwrap();
    for f in build_all(dir.path()) {
        let img = DiskImage::open(&f.path).unwrap();
        let want = reference(&f);
        assert_eq!(img.info().format, f.format, "{}", f.name);
        assert_eq!(img.size(), want.len() as u64, "{}", f.name);
        let mut all = vec![0xffu8; want.len()];
        img.read_exact_at(&mut all, 0).unwrap();
        assert!(all == want, "{}: full read differs", f.name);
        // Odd-sized reads at odd offsets, crossing cluster boundaries, and past the end (zeros).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..300 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = x % want.len() as u64;
            let len = (x >> 40) % 200_000 + 1;
            let mut buf = vec![0xeeu8; len as usize];
            img.read_exact_at(&mut buf, off).unwrap();
            let end = (off + len).min(want.len() as u64) as usize;
            assert!(
                buf[..end - off as usize] == want[off as usize..end],
                "{} read {off}+{len}",
                f.name
            );
            assert!(
                buf[end - off as usize..].iter().all(|&b| b == 0),
                "{} past end",
                f.name
            );
        }
        // Everything outside the allocated ranges is zero, and the ranges are sorted and disjoint.
        let ranges = img.allocated_ranges(0..img.size()).unwrap();
        let mut prev = 0;
        for r in &ranges {
            assert!(
                r.start >= prev && r.start < r.end && r.end <= img.size(),
                "{}: {ranges:?}",
                f.name
            );
            assert!(
                want[prev as usize..r.start as usize].iter().all(|&b| b == 0),
                "{}: data in hole before {r:?}",
                f.name
            );
            prev = r.end;
        }
        assert!(
            want[prev as usize..].iter().all(|&b| b == 0),
            "{}: data after last range",
            f.name
        );
        let allocated: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        assert!(
            allocated < img.size(),
            "{}: holes are reported ({allocated} of {})",
            f.name,
            img.size()
        );
    }
}

#[test]
fn conversions_pass_qemu_img_check_and_compare() {
    let dir = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    for f in build_all(dir.path()) {
        let q = dir.path().join(format!("{}.out.qcow2", f.name));
        let r = dir.path().join(format!("{}.out.raw", f.name));
        let last = std::sync::Mutex::new((0, 0));
        convert(
            &f.path,
            &q,
            ImageFormat::Qcow2,
            &|d, t| *last.lock().unwrap() = (d, t),
            &never,
        )
        .unwrap();
        let (d, t) = *last.lock().unwrap();
        assert_eq!(d, t, "{}: progress ends at the total", f.name);
        convert(&f.path, &r, ImageFormat::Raw, &|_, _| {}, &never).unwrap();
        run("qemu-img", &["check", "-f", "qcow2", q.to_str().unwrap()]);
        run(
            "qemu-img",
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "qcow2",
                f.reference.to_str().unwrap(),
                q.to_str().unwrap(),
            ],
        );
        assert!(
            std::fs::read(&r).unwrap() == reference(&f),
            "{}: raw output differs",
            f.name
        );
        // Sparse: the raw output occupies no more than the data it holds (plus filesystem rounding).
        let info = probe(&r).unwrap();
        let data: u64 = DiskImage::open(&f.path)
            .unwrap()
            .data_ranges(0..info.virtual_size)
            .map(|r| r.unwrap())
            .map(|r| r.end - r.start)
            .sum();
        assert!(
            info.allocated_size <= data + (64 << 10),
            "{}: {} allocated for {data} of data",
            f.name,
            info.allocated_size
        );
        // Our qcow2 reads back through our reader too.
        assert_eq!(probe(&q).unwrap().format, ImageFormat::Qcow2);
    }
}

#[test]
fn cancelled_conversion_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let fx = build_all(dir.path());
    let out = dir.path().join("out.raw");
    let cancel = AtomicBool::new(true);
    let e = convert(&fx[1].path, &out, ImageFormat::Raw, &|_, _| {}, &cancel).unwrap_err();
    assert_eq!(e.kind(), disk_image::ErrorKind::Cancelled);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("out.raw"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
