//! Test fixtures (feature `fixtures`, for tests of this crate, the replica and the engine): small real images made
//! by `qemu-img`/`qemu-io` in a directory, each with the reference raw content `qemu-img convert -O raw` gives.
//! Panics on failure: it is test code.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ImageFormat;

/// One image and what it must read as.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// Short name (`raw-odd-size`, `qcow2-compressed`, ...).
    pub name: &'static str,
    /// The image (a qcow2 overlay's base lies beside it).
    pub path: PathBuf,
    /// Its format.
    pub format: ImageFormat,
    /// `qemu-img convert -O raw` of the image.
    pub reference: PathBuf,
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} cannot run: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

fn qemu_io(fmt: &str, path: &Path, cmds: &[&str]) {
    let mut args = vec!["-f", fmt];
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    args.push(p(path));
    run("qemu-io", &args);
}

/// `qemu-img convert -O raw` of `image` into `out`.
pub fn reference_raw(image: &Path, out: &Path) {
    run("qemu-img", &["convert", "-O", "raw", p(image), p(out)]);
}

/// Writes made on every qcow2 fixture: aligned and unaligned data, data written then zeroed, a lone sector.
const QCOW2_WRITES: &[&str] = &[
    "write -P 0xa1 0 64k",
    "write -P 0xb2 100k 10k",
    "write -P 0xc3 1M 512",
    "write -P 0xd4 1536k 256k",
    "write -z 1600k 64k",
    "write -P 0xe5 3M 4k",
];

fn qcow2(dir: &Path, name: &str, size: &str, opts: &str, writes: &[&str]) -> PathBuf {
    let path = dir.join(name);
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-o", opts, p(&path), size],
    );
    qemu_io("qcow2", &path, writes);
    path
}

/// Builds every fixture in `dir`: raw with a size not a multiple of 4 KiB; qcow2 plain (64 KiB clusters, v3);
/// qcow2 v2; zlib-compressed; an overlay (larger than its base, with zero clusters hiding base data and partial
/// cluster writes) over a qcow2 base; 2 MiB clusters. Each is a few MiB.
pub fn build_all(dir: &Path) -> Vec<Fixture> {
    let mut out = Vec::new();
    let mut add = |name: &'static str, path: PathBuf, format: ImageFormat| {
        let reference = dir.join(format!("{name}.reference.raw"));
        reference_raw(&path, &reference);
        out.push(Fixture {
            name,
            path,
            format,
            reference,
        });
    };

    // Raw, 3 MiB + 1000 bytes, sparse, data up to the last byte.
    let raw = dir.join("odd.raw");
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&raw)
        .expect("create raw fixture");
    let len = (3 << 20) + 1000;
    f.set_len(len).expect("size raw fixture");
    for (at, n, byte) in [
        (0u64, 8192usize, 0x5au8),
        (70_000, 5000, 0x6b),
        (2 << 20, 65536, 0x7c),
        (len - 700, 700, 0x8d),
    ] {
        f.write_all_at(&vec![byte; n], at).expect("write raw fixture");
    }
    drop(f);
    add("raw-odd-size", raw, ImageFormat::Raw);

    let plain = qcow2(dir, "plain.qcow2", "4M", "cluster_size=64k", QCOW2_WRITES);
    add("qcow2-plain", plain.clone(), ImageFormat::Qcow2);

    let v2 = qcow2(dir, "v2.qcow2", "4M", "compat=0.10", QCOW2_WRITES);
    add("qcow2-v2", v2, ImageFormat::Qcow2);

    let compressed = dir.join("compressed.qcow2");
    run(
        "qemu-img",
        &["convert", "-c", "-O", "qcow2", p(&plain), p(&compressed)],
    );
    add("qcow2-compressed", compressed, ImageFormat::Qcow2);

    let base = dir.join("base.qcow2");
    std::fs::copy(&plain, &base).expect("copy base");
    let overlay = dir.join("overlay.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            p(&overlay),
            "5M",
        ],
    );
    qemu_io(
        "qcow2",
        &overlay,
        &[
            "write -P 0x17 4k 4k",
            "write -z 1536k 64k",
            "write -P 0x28 3M 100",
            "write -P 0x39 4M 64k",
        ],
    );
    add("qcow2-overlay", overlay, ImageFormat::Qcow2);

    let big = qcow2(
        dir,
        "cluster2m.qcow2",
        "6M",
        "cluster_size=2M",
        &[
            "write -P 0x4a 0 4k",
            "write -P 0x5b 1023k 2k",
            "write -P 0x6c 5M 1M",
            "write -z 5M 4k",
        ],
    );
    add("qcow2-2m-clusters", big, ImageFormat::Qcow2);
    out
}
