//! lvstore micro-benchmark (`bench/lvstore/run.sh`): single-threaded 4 KiB random writes on a thin lvol and on a
//! plain preallocated file (the peer, same loop, same `O_DIRECT` pwrite), then on the lvol right after a
//! snapshot of it fully written (the copy-on-write path: each first write to a cluster takes a new cluster and
//! writes 4 KiB), and the time of a snapshot of a fully written 1 GiB lvol vs a 64 GiB thin one.
//! `--snapshot-sizes 1,64` measures only snapshot time, of lvols of those sizes each fully written first (one
//! store at a time, of the lvol's size: 64 GiB of disk for 64).
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
    /// `--snapshot-sizes`: only the snapshot time of fully written lvols of these sizes (GiB).
    snapshot_sizes: Vec<u64>,
    /// `--written-out`: the store file of `--snapshot-sizes` is written with zeros first instead of fallocated
    /// (no unwritten extents for ext4 to convert, as on a raw device).
    written_out: bool,
    /// `--warm-flush`: in `--snapshot-sizes`, a 4 KiB overwrite and a flush between the fill and the first snapshot.
    warm_flush: bool,
    /// `--flush-job THREADS`: the flush job of `bench/datapath` without the engine, the data protocol or the
    /// replica: THREADS threads each writing 32 random 4 KiB blocks then flushing, through the store (page cache)
    /// against a plain file (`pwrite` + `fdatasync`).
    flush_job: usize,
}

fn args() -> Args {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp"),
        seconds: 5.0,
        size: GIB,
        snapshot_sizes: Vec::new(),
        written_out: false,
        warm_flush: false,
        flush_job: 0,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        match v[i].as_str() {
            "--dir" => a.dir = PathBuf::from(&v[i + 1]),
            "--seconds" => a.seconds = v[i + 1].parse().expect("--seconds N"),
            "--size-gib" => a.size = v[i + 1].parse::<u64>().expect("--size-gib N") * GIB,
            "--snapshot-sizes" => {
                a.snapshot_sizes = v[i + 1]
                    .split(',')
                    .map(|n| n.parse().expect("--snapshot-sizes GIB,GIB,..."))
                    .collect();
            }
            "--flush-job" => a.flush_job = v[i + 1].parse().expect("--flush-job THREADS"),
            "--written-out" => {
                a.written_out = true;
                i += 1;
                continue;
            }
            "--warm-flush" => {
                a.warm_flush = true;
                i += 1;
                continue;
            }
            "--help" | "-h" => {
                println!(
                    "bench_lvstore [--dir DIR (/var/tmp)] [--seconds N (5)] [--size-gib N (1)] [--snapshot-sizes GIB,GIB,... [--written-out] [--warm-flush]] [--flush-job THREADS]"
                );
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

/// The process's peak resident set so far (`VmHWM`), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Metadata room added to a store file beyond its lvols' data.
const META: u64 = 64 << 20;

/// Snapshot time against size: for each size, a store of that size (plus metadata) whose one lvol is written end
/// to end with 1 MiB writes and flushed; then the first snapshot, and 20 more with one 4 KiB write before each
/// (median). One store on disk at a time, fallocated (or written out with zeros: `written_out`).
fn snapshot_sizes(dir: &Path, sizes: &[u64], written_out: bool, warm_flush: bool) {
    println!(
        "| lvol, fully written | fill (1 MiB writes + flush) | process peak RSS after the fill | clusters used | journal used before / after the first snapshot | a flush with nothing to journal, then | a 4 KiB overwrite + flush, then (`--warm-flush`) | first snapshot | snapshot, median of 20 (min, max) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let chunk = vec![0x33u8; 1 << 20];
    for &gib in sizes {
        let size = gib * GIB;
        let disk = dir.join(format!("disk-{gib}"));
        if written_out {
            let st = Command::new("dd")
                .args([
                    "if=/dev/zero",
                    "bs=1M",
                    "oflag=direct",
                    "conv=fsync",
                    "status=none",
                ])
                .arg(format!("of={}", disk.display()))
                .arg(format!("count={}", (size + META) >> 20))
                .status()
                .expect("dd");
            assert!(st.success(), "dd {}", disk.display());
        } else {
            prealloc(&disk, size + META);
        }
        let s = LvStore::format(&disk, &FormatOptions::default()).expect("format");
        let lv = s.create_lvol("vol", size).expect("create");
        let t = Instant::now();
        for o in (0..size).step_by(1 << 20) {
            s.write_at(lv, o, &chunk).expect("fill");
        }
        s.flush().expect("flush");
        let fill = t.elapsed();
        let rss = peak_rss_mib();
        let space = s.space();
        // A second flush, with nothing to journal: one `fdatasync` of the store file.
        let t = Instant::now();
        s.flush().expect("flush");
        let idle_flush = t.elapsed();
        // With `--warm-flush`: one 4 KiB overwrite of a mapped block and a flush (a data write and one
        // `fdatasync`, nothing journaled) before the first snapshot: the first device flush after the fill, apart.
        let warm = warm_flush.then(|| {
            let t = Instant::now();
            s.write_at(lv, 0, &chunk[..4096]).expect("write");
            s.flush().expect("flush");
            t.elapsed()
        });
        let t = Instant::now();
        s.snapshot("vol", "first").expect("snapshot");
        let first = t.elapsed();
        let after = s.space().journal_used_bytes;
        let mut times = Vec::new();
        for i in 0..20u64 {
            s.write_at(lv, (i * 7919 % (size >> 12)) << 12, &chunk[..4096])
                .expect("write");
            let t = Instant::now();
            s.snapshot("vol", &format!("s{i}")).expect("snapshot");
            times.push(t.elapsed());
        }
        let (lo, hi) = (*times.iter().min().unwrap(), *times.iter().max().unwrap());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {gib} GiB | {:.1} s | {rss:.1} MiB | {} of {} | {} / {} KiB of {} | {:.2} ms | {} | {:.2} ms | {:.2} ms ({:.2}, {:.2}) |",
            fill.as_secs_f64(),
            space.used_clusters,
            space.total_clusters,
            space.journal_used_bytes >> 10,
            after >> 10,
            space.journal_bytes >> 10,
            ms(idle_flush),
            warm.map_or_else(|| "-".to_owned(), |d| format!("{:.2} ms", ms(d))),
            ms(first),
            ms(median(times)),
            ms(lo),
            ms(hi)
        );
        drop(s);
        std::fs::remove_file(&disk).expect("remove store file");
    }
}

/// `threads` threads for `secs`, each looping over 32 writes of 4 KiB at random blocks of `[0, size)` then one
/// flush; writes per second over all threads.
fn flush_job(
    threads: usize,
    secs: f64,
    size: u64,
    write: &(dyn Fn(u64, &[u8]) + Sync),
    flush: &(dyn Fn() + Sync),
) -> f64 {
    let start = Instant::now();
    let total: u64 = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                sc.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1));
                    let buf = vec![0x6bu8; 4096];
                    let mut n = 0u64;
                    while start.elapsed().as_secs_f64() < secs {
                        for _ in 0..32 {
                            write(rng.below(size / 4096) * 4096, &buf);
                        }
                        flush();
                        n += 32;
                    }
                    n
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    total as f64 / start.elapsed().as_secs_f64()
}

/// The flush job on a plain file and on the store, each filled first with 1 MiB writes, twice, interleaved.
fn flush_jobs(dir: &Path, a: &Args) {
    let chunk = vec![0x33u8; 1 << 20];
    let plain = dir.join("plain");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&plain)
        .expect("open plain");
    for o in (0..a.size).step_by(1 << 20) {
        f.write_all_at(&chunk, o).expect("fill plain");
    }
    f.sync_data().expect("fdatasync");
    let disk = dir.join("disk");
    prealloc(&disk, 2 * a.size + META);
    drop(LvStore::format(&disk, &FormatOptions::default()).expect("format"));
    let s = LvStore::open_with(&disk, lvstore::OpenMode::ReadWrite, lvstore::DataIo::Buffered).expect("open");
    let lv = s.create_lvol("vol", a.size).expect("create");
    for o in (0..a.size).step_by(1 << 20) {
        s.write_at(lv, o, &chunk).expect("fill");
    }
    s.flush().expect("flush");
    println!("| round | plain file, pwrite + fdatasync | lvstore (page cache), write_at + flush | ratio |");
    println!("|---|---:|---:|---:|");
    for round in 1..=2 {
        let p = flush_job(
            a.flush_job,
            a.seconds,
            a.size,
            &|o, b| f.write_all_at(b, o).expect("pwrite"),
            &|| f.sync_data().expect("fdatasync"),
        );
        let l = flush_job(
            a.flush_job,
            a.seconds,
            a.size,
            &|o, b| s.write_at(lv, o, b).expect("write"),
            &|| s.flush().expect("flush"),
        );
        println!("| {round} | {p:.0} writes/s | {l:.0} writes/s | {:.2} |", l / p);
    }
}

fn main() {
    let a = args();
    let dir = tempfile::Builder::new()
        .prefix("bench-lvstore")
        .tempdir_in(&a.dir)
        .expect("scratch dir");
    if a.flush_job > 0 {
        flush_jobs(dir.path(), &a);
        return;
    }
    if !a.snapshot_sizes.is_empty() {
        snapshot_sizes(dir.path(), &a.snapshot_sizes, a.written_out, a.warm_flush);
        return;
    }
    let meta = META;

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
