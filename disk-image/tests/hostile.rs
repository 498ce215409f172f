//! Hostile and damaged images: hand-corrupted qemu images, backing chains that escape their directory or loop, and
//! formats we do not read. Each is refused with an error that says what is wrong; nothing panics, and reads never
//! return data from outside the image.

#![allow(clippy::cast_possible_truncation)] // offsets inside small test files

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use disk_image::fixtures::run;
use disk_image::{DiskImage, ErrorKind, ImageFormat, probe};

fn be64(f: &Path, at: u64) -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open(f).unwrap().read_exact_at(&mut b, at).unwrap();
    u64::from_be_bytes(b)
}

fn put64(f: &Path, at: u64, v: u64) {
    let file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
    file.write_all_at(&v.to_be_bytes(), at).unwrap();
}

/// A 4 MiB qcow2 (64 KiB clusters) with data in its first and third MiB.
fn image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let s = p.to_str().unwrap();
    run("qemu-img", &["create", "-q", "-f", "qcow2", s, "4M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x61 0 128k",
            "-c",
            "write -P 0x62 2M 64k",
            s,
        ],
    );
    p
}

fn open_err(p: &Path) -> disk_image::ImageError {
    DiskImage::open(p).expect_err("a hostile image was accepted")
}

fn assert_refused(p: &Path, kind: ErrorKind, words: &str) {
    let e = open_err(p);
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.to_string().contains(words), "{e}");
    assert!(
        e.to_string().contains(p.file_name().unwrap().to_str().unwrap()),
        "the file is named: {e}"
    );
}

const L1_OFFSET: u64 = 40;
const REFTABLE_OFFSET: u64 = 48;

#[test]
fn l1_table_past_the_end_of_the_file_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = image(t.path(), "l1.qcow2");
    put64(&p, L1_OFFSET, 1 << 40);
    assert_refused(&p, ErrorKind::Corrupt, "L1 table");
    assert_eq!(probe(&p).unwrap_err().kind(), ErrorKind::Corrupt);
}

#[test]
fn l2_table_past_the_end_of_the_file_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = image(t.path(), "l2.qcow2");
    let l1 = be64(&p, L1_OFFSET);
    put64(&p, l1, (1 << 63) | (1 << 36));
    assert_refused(&p, ErrorKind::Corrupt, "L2 table");
}

#[test]
fn l1_entries_sharing_an_l2_table_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = image(t.path(), "shared.qcow2");
    // Grow the virtual size so the L1 table has room, then point entry 1 at entry 0's L2 table.
    run("qemu-img", &["resize", "-q", p.to_str().unwrap(), "2G"]);
    let l1 = be64(&p, L1_OFFSET);
    put64(&p, l1 + 8, be64(&p, l1));
    assert_refused(&p, ErrorKind::Corrupt, "referenced by two L1 entries");
}

#[test]
fn refcount_loops_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = image(t.path(), "self.qcow2");
    let reftable = be64(&p, REFTABLE_OFFSET);
    put64(&p, reftable, reftable); // the refcount table's first block is the table itself
    assert_refused(&p, ErrorKind::Corrupt, "loop");

    let p = image(t.path(), "twice.qcow2");
    let reftable = be64(&p, REFTABLE_OFFSET);
    let block = be64(&p, reftable);
    put64(&p, reftable + 8, block); // two entries, one block
    assert_refused(&p, ErrorKind::Corrupt, "referenced twice");
}

#[test]
fn cluster_offsets_beyond_the_file_fail_the_read_not_the_process() {
    let t = tempfile::tempdir().unwrap();
    let p = image(t.path(), "cluster.qcow2");
    let l2 = be64(&p, be64(&p, L1_OFFSET)) & 0x00ff_ffff_ffff_fe00;
    put64(&p, l2, (1 << 63) | (1 << 40)); // guest cluster 0 → 1 TiB into a ~400 KiB file
    put64(&p, l2 + 8, (1 << 63) | 12_288); // guest cluster 1 → not cluster aligned
    let img = DiskImage::open(&p).unwrap(); // L2 entries are checked when used
    let mut buf = vec![0u8; 4096];
    let e = img.read_exact_at(&mut buf, 0).unwrap_err();
    assert!(e.to_string().contains("past the end of the file"), "{e}");
    let e = img.read_exact_at(&mut buf, 65536).unwrap_err();
    assert!(e.to_string().contains("not cluster aligned"), "{e}");
    assert!(img.allocated_ranges(0..img.size()).is_err());
    // The rest of the image still reads.
    img.read_exact_at(&mut buf, 2 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0x62));
}

#[test]
fn a_garbled_compressed_cluster_is_an_error() {
    let t = tempfile::tempdir().unwrap();
    let plain = image(t.path(), "plain.qcow2");
    let c = t.path().join("c.qcow2");
    run(
        "qemu-img",
        &[
            "convert",
            "-c",
            "-O",
            "qcow2",
            plain.to_str().unwrap(),
            c.to_str().unwrap(),
        ],
    );
    let img = DiskImage::open(&c).unwrap();
    let mut buf = vec![0u8; 65536];
    img.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 0x61));
    drop(img);
    // Overwrite the compressed data (it follows the metadata) with noise.
    let l2 = be64(&c, be64(&c, L1_OFFSET)) & 0x00ff_ffff_ffff_fe00;
    let entry = be64(&c, l2);
    assert!(entry & (1 << 62) != 0, "cluster 0 is compressed");
    let data = entry & ((1 << 54) - 1);
    let f = std::fs::OpenOptions::new().write(true).open(&c).unwrap();
    f.write_all_at(&[0xff; 64], data).unwrap();
    let img = DiskImage::open(&c).unwrap();
    let e = img.read_exact_at(&mut buf, 0).unwrap_err();
    assert!(e.to_string().contains("compressed cluster"), "{e}");
}

#[test]
fn backing_files_outside_the_image_directory_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let images = t.path().join("a/b/images");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::write(t.path().join("secret.raw"), vec![0x5e; 1 << 20]).unwrap();
    std::os::unix::fs::symlink(t.path().join("secret.raw"), images.join("link.raw")).unwrap();
    for (name, backing) in [
        ("up.qcow2", "../../etc/passwd".to_owned()),
        ("up2.qcow2", "../../../secret.raw".to_owned()),
        ("abs.qcow2", "/etc/passwd".to_owned()),
        ("link.qcow2", "link.raw".to_owned()),
    ] {
        let p = images.join(name);
        run(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-u",
                "-b",
                &backing,
                "-F",
                "raw",
                p.to_str().unwrap(),
                "1M",
            ],
        );
        let e = open_err(&p);
        assert_eq!(e.kind(), ErrorKind::BackingChain, "{name}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("outside the image's directory") || msg.contains("cannot be opened"),
            "{name}: {msg}"
        );
        // probe reports the recorded name without following it.
        assert_eq!(probe(&p).unwrap().backing_file.unwrap(), PathBuf::from(&backing));
    }
}

#[test]
fn backing_chains_that_loop_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let s = |n: &str| d.join(n).to_str().unwrap().to_owned();
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "self.qcow2",
            "-F",
            "qcow2",
            &s("self.qcow2"),
            "1M",
        ],
    );
    assert_refused(&d.join("self.qcow2"), ErrorKind::BackingChain, "loops");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "b.qcow2",
            "-F",
            "qcow2",
            &s("a.qcow2"),
            "1M",
        ],
    );
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "a.qcow2",
            "-F",
            "qcow2",
            &s("b.qcow2"),
            "1M",
        ],
    );
    assert_refused(&d.join("a.qcow2"), ErrorKind::BackingChain, "loops");
    // Without a recorded format the chain is probed: the loop is still found.
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "noformat.qcow2",
            "-F",
            "qcow2",
            &s("noformat.qcow2"),
            "1M",
        ],
    );
    // qemu-img insists on recording a format: rename its header extension to an unknown one (readers skip it).
    let p = d.join("noformat.qcow2");
    let mut bytes = std::fs::read(&p).unwrap();
    let at = bytes
        .windows(4)
        .position(|w| w == [0xe2, 0x79, 0x2a, 0xca])
        .unwrap();
    bytes[at..at + 4].copy_from_slice(&[0x12, 0x34, 0x56, 0x78]);
    std::fs::write(&p, bytes).unwrap();
    assert_eq!(probe(&p).unwrap().backing_format, None);
    assert_refused(&p, ErrorKind::BackingChain, "loops");
}

#[test]
fn other_formats_and_features_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let s = |n: &str| d.join(n).to_str().unwrap().to_owned();
    let src = image(d, "src.qcow2");
    for (fmt, name, words) in [
        ("vmdk", "x.vmdk", "VMDK"),
        ("vdi", "x.vdi", "VDI"),
        ("vhdx", "x.vhdx", "VHDX"),
        ("vpc", "x.vhd", "VHD"),
        ("qcow", "x.qcow", "qcow (version 1)"),
    ] {
        run(
            "qemu-img",
            &["convert", "-O", fmt, src.to_str().unwrap(), &s(name)],
        );
        assert_refused(&d.join(name), ErrorKind::Unsupported, words);
    }
    // qcow2 with LUKS encryption (crypt_method 2): qemu takes seconds to derive a key, so the header is patched.
    let enc = d.join("enc.qcow2");
    std::fs::copy(&src, &enc).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&enc)
        .unwrap()
        .write_all_at(&2u32.to_be_bytes(), 32)
        .unwrap();
    assert_refused(&d.join("enc.qcow2"), ErrorKind::Unsupported, "LUKS encryption");
    let raw_luks = [
        "create",
        "-q",
        "-f",
        "luks",
        "--object",
        "secret,id=s0,data=pw",
        "-o",
        "key-secret=s0,iter-time=10",
        &s("x.luks"),
        "1M",
    ];
    run("qemu-img", &raw_luks);
    assert_refused(&d.join("x.luks"), ErrorKind::Unsupported, "LUKS");
    // zstd clusters when qemu was built with zstd (Debian's is).
    let zstd = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "compression_type=zstd",
            &s("z.qcow2"),
            "1M",
        ])
        .status()
        .unwrap();
    if zstd.success() {
        assert_refused(&d.join("z.qcow2"), ErrorKind::Unsupported, "zstd");
    }
    let gz = d.join("disk.img.gz");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0]).unwrap();
    assert_refused(&gz, ErrorKind::Unsupported, "gzip");
    // Forcing raw reads such a file as plain bytes.
    assert_eq!(DiskImage::open_as(&gz, ImageFormat::Raw).unwrap().size(), 8);
}

/// A sweep of random byte damage over each qemu-made image's metadata: every outcome is an error or a read,
/// never a panic, and open never takes long.
#[test]
fn random_metadata_damage_never_panics() {
    let t = tempfile::tempdir().unwrap();
    let base = image(t.path(), "base.qcow2");
    let c = t.path().join("c.qcow2");
    run(
        "qemu-img",
        &[
            "convert",
            "-c",
            "-O",
            "qcow2",
            base.to_str().unwrap(),
            c.to_str().unwrap(),
        ],
    );
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut opened, mut refused) = (0, 0);
    for src in [&base, &c] {
        let pristine = std::fs::read(src).unwrap();
        let meta_len = (6 * 65536).min(pristine.len());
        for i in 0..300 {
            let mut bytes = pristine.clone();
            for _ in 0..(1 + rnd() % 8) {
                let at = if i % 2 == 0 {
                    rnd() as usize % 128
                } else {
                    rnd() as usize % meta_len
                };
                bytes[at] = rnd() as u8;
            }
            let p = t.path().join("damaged.qcow2");
            std::fs::write(&p, &bytes).unwrap();
            match DiskImage::open(&p) {
                Ok(img) => {
                    opened += 1;
                    let mut buf = vec![0u8; 256 << 10];
                    for off in [0, 1 << 20, 2 << 20, img.size().saturating_sub(4096)] {
                        let _ = img.read_exact_at(&mut buf, off);
                    }
                    let _ = img.allocated_ranges(0..img.size().min(8 << 20));
                }
                Err(_) => refused += 1,
            }
        }
    }
    assert!(opened > 0 && refused > 0, "opened {opened}, refused {refused}");
}
