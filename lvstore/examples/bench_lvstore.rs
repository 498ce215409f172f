//! lvstore micro-benchmark (`bench/lvstore/run.sh`): single-threaded 4 KiB random writes on a thin lvol and on a
//! plain preallocated file (the peer, same loop, same `O_DIRECT` pwrite), then on the lvol right after a
//! snapshot of it fully written (the copy-on-write path: each first write to a cluster takes a new cluster and
//! writes 4 KiB), and the time of a snapshot of a fully written 1 GiB lvol vs a 64 GiB thin one.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lvstore::{FormatOptions, LvStore};

const GIB: u64 = 1 << 30;

struct Args {
    dir: PathBuf,
    seconds: f64,
    size: u64,
}

fn args() -> Args {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp"),
        seconds: 5.0,
        size: GIB,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        match v[i].as_str() {
            "--dir" => a.dir = PathBuf::from(&v[i + 1]),
            "--seconds" => a.seconds = v[i + 1].parse().expect("--seconds N"),
            "--size-gib" => a.size = v[i + 1].parse::<u64>().expect("--size-gib N") * GIB,
            "--help" | "-h" => {
                println!("bench_lvstore [--dir DIR (/var/tmp)] [--seconds N (5)] [--size-gib N (1)]");
                std::process::exit(0);
            }
            o => panic!("unknown argument {o}"),
        }
        i += 2;
    }
    a
}

fn prealloc(path: &Path, len: u64) {
    let st = Command::new("fallocate")
        .arg("-l")
        .arg(len.to_string())
        .arg(path)
        .status()
        .expect("fallocate");
    assert!(st.success(), "fallocate {}", path.display());
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 4 KiB random writes over `[0, size)` for `secs`, with a flush at the end; IOPS.
fn iops(secs: f64, size: u64, mut write: impl FnMut(u64, &[u8])) -> f64 {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let buf = vec![0x5au8; 4096];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        for _ in 0..64 {
            write(rng.below(size / 4096) * 4096, &buf);
            n += 1;
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let a = args();
    let dir = tempfile::Builder::new()
        .prefix("bench-lvstore")
        .tempdir_in(&a.dir)
        .expect("scratch dir");
    let meta = 64 << 20;

    // Peer: a plain preallocated file, O_DIRECT pwrite.
    let plain = dir.path().join("plain");
    prealloc(&plain, a.size);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&plain)
        .expect("open plain");
    let mut aligned = vec![0u8; 8192];
    let off = aligned.as_ptr().align_offset(4096);
    let plain_iops = {
        let b = &mut aligned[off..off + 4096];
        b.fill(0x5a);
        let b = &*b;
        let r = iops(a.seconds, a.size, |o, _| f.write_all_at(b, o).expect("pwrite"));
        f.sync_data().expect("fdatasync");
        r
    };
    drop(f);
    std::fs::remove_file(&plain).ok();

    // The store on a preallocated file twice the lvol's size (room for the copy-on-write phase) plus metadata.
    let disk = dir.path().join("disk");
    prealloc(&disk, 2 * a.size + meta);
    let s = LvStore::format(&disk, &FormatOptions::default()).expect("format");
    assert!(
        s.direct_io(),
        "the benchmark wants a file system that takes O_DIRECT ({} does not)",
        a.dir.display()
    );
    let lv = s.create_lvol("vol", a.size).expect("create");
    let thin_iops = iops(a.seconds, a.size, |o, b| s.write_at(lv, o, b).expect("write"));
    s.flush().expect("flush");
    // Fill the lvol, then overwrite in place.
    let chunk = vec![0x33u8; 1 << 20];
    for o in (0..a.size).step_by(1 << 20) {
        s.write_at(lv, o, &chunk).expect("fill");
    }
    s.flush().expect("flush");
    let full_iops = iops(a.seconds, a.size, |o, b| s.write_at(lv, o, b).expect("write"));
    s.flush().expect("flush");
    let t = Instant::now();
    s.snapshot("vol", "snap-full").expect("snapshot");
    let snap_full_once = t.elapsed();
    // Copy-on-write path: each first write to a cluster takes a free one (the store has an lvol's worth free).
    let cow_iops = iops(a.seconds, a.size, |o, b| {
        s.write_at(lv, o, b).expect("write after snapshot");
    });
    s.flush().expect("flush");

    // Snapshot time vs size: the fully written lvol again (its head now partly written), and a 64 GiB thin lvol.
    let mut t_full = Vec::new();
    let mut t_thin = Vec::new();
    s.create_lvol("thin64", 64 * GIB).expect("create thin");
    let thin = s.lookup("thin64").expect("lookup");
    for i in 0..20 {
        s.write_at(lv, 0, &chunk[..4096]).expect("write");
        s.write_at(thin, i * 4096, &chunk[..4096]).expect("write");
        let t = Instant::now();
        s.snapshot("vol", &format!("v{i}")).expect("snapshot");
        t_full.push(t.elapsed());
        let t = Instant::now();
        s.snapshot("thin64", &format!("t{i}")).expect("snapshot");
        t_thin.push(t.elapsed());
    }
    let (mf, mt) = (median(t_full), median(t_thin));
    let gib = a.size / GIB;
    println!("| measure | figure | ratio |");
    println!("|---|---|---|");
    println!("| plain file, 4 KiB random write, O_DIRECT pwrite (peer) | {plain_iops:.0} IOPS | 1.00 |");
    println!(
        "| lvstore thin {gib} GiB lvol, first writes (allocating) | {thin_iops:.0} IOPS | {:.2} |",
        thin_iops / plain_iops
    );
    println!(
        "| lvstore fully written lvol, overwrite in place | {full_iops:.0} IOPS | {:.2} |",
        full_iops / plain_iops
    );
    println!(
        "| lvstore right after a snapshot of it (COW path) | {cow_iops:.0} IOPS | {:.2} |",
        cow_iops / plain_iops
    );
    println!(
        "| snapshot of the fully written {gib} GiB lvol (first) | {:.2} ms | |",
        snap_full_once.as_secs_f64() * 1e3
    );
    println!(
        "| snapshot, {gib} GiB written lvol (median of 20) | {:.2} ms | 1.00 |",
        mf.as_secs_f64() * 1e3
    );
    println!(
        "| snapshot, 64 GiB thin lvol (median of 20) | {:.2} ms | {:.2} |",
        mt.as_secs_f64() * 1e3,
        mt.as_secs_f64() / mf.as_secs_f64()
    );
}
