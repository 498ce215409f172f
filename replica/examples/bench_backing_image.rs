//! Backing-image read benchmark: 4 KiB random and 1 MiB sequential reads of a qcow2 backing file through the
//! replica (`Replica::read_at` on a fresh replica whose every block comes from the image: location map miss,
//! then `disk-image`'s qcow2 reader) against `qemu-io -c read` on the same file, in the same run, with the same
//! offsets. Prints both and the ratio Corral/qemu-io.
//!
//! ```sh
//! bench/image/run.sh                        # builds release and runs this with the defaults
//! bench/image/run.sh --size 2147483648 --compressed
//! ```
//!
//! Both sides are one thread issuing one read at a time (qemu-io executes its commands serially), both go
//! through the page cache, and the image is read once before timing so neither side pays for the disk. qemu-io
//! parses one command line per read; with `-q` it prints nothing per read.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use common::{XorShift, command_line, mib};
use replica::{Replica, ReplicaOptions};

#[derive(Parser, Debug)]
#[command(about = "qcow2 backing file read through the replica vs qemu-io on the same file")]
struct Args {
    /// Benchmark directory (removed at the end unless --keep).
    #[arg(long, default_value = "/var/tmp/corral-bench-image")]
    dir: PathBuf,
    /// Virtual size of the image (all of it written, so every read hits data).
    #[arg(long, default_value_t = 1 << 30)]
    size: u64,
    /// qcow2 cluster size.
    #[arg(long, default_value = "64k")]
    cluster_size: String,
    /// Write the image with zlib-compressed clusters (`qemu-img convert -c`).
    #[arg(long)]
    compressed: bool,
    /// Number of 4 KiB random reads per side.
    #[arg(long, default_value_t = 200_000)]
    random_reads: u64,
    /// Rounds, alternating Corral and qemu-io; the table shows each side's best round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long)]
    keep: bool,
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Runs `qemu-io -r -f qcow2 IMAGE` with one `read -q` command per (offset, len) on stdin; returns its time.
fn qemu_io_reads(image: &Path, reads: &[(u64, u64)]) -> anyhow::Result<Duration> {
    let mut script = String::with_capacity(reads.len() * 32);
    for (off, len) in reads {
        script.push_str(&format!("read -q {off} {len}\n"));
    }
    let start = Instant::now();
    let mut child = Command::new("qemu-io")
        .args(["-r", "-f", "qcow2"])
        .arg(image)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start qemu-io (apt-get install qemu-utils)")?;
    child
        .stdin
        .take()
        .context("qemu-io stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    let took = start.elapsed();
    if !out.status.success() || !out.stderr.is_empty() {
        bail!("qemu-io failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

/// Runs `qemu-img bench` (in-process, no command parsing): `count` sequential reads of `len` bytes from offset 0,
/// one in flight, page cache; returns the time it reports.
fn qemu_img_bench(image: &Path, count: usize, len: u64) -> anyhow::Result<Duration> {
    let out = Command::new("qemu-img")
        .args(["bench", "-f", "qcow2", "-t", "writeback", "-d", "1"])
        .args(["-c", &count.to_string(), "-s", &len.to_string()])
        .arg(image)
        .output()
        .context("run qemu-img bench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let secs: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("Run completed in ")?
                .strip_suffix(" seconds.")?
                .parse()
                .ok()
        })
        .with_context(|| {
            format!(
                "qemu-img bench said: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    Ok(Duration::from_secs_f64(secs))
}

fn corral_reads(r: &Replica, reads: &[(u64, u64)]) -> anyhow::Result<Duration> {
    let mut buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    for &(off, len) in reads {
        r.read_at(off, &mut buf[..usize::try_from(len)?])?;
    }
    Ok(start.elapsed())
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    println!("# {}", command_line());
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir)?;
    let image = a.dir.join("image.qcow2");
    let plain = a.dir.join("plain.qcow2");
    let size_s = a.size.to_string();
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o"])
        .arg(format!("cluster_size={}", a.cluster_size))
        .arg(&plain)
        .arg(&size_s))?;
    // Distinct bytes per MiB so nothing can shortcut a constant pattern.
    let mut io = Command::new("qemu-io");
    io.args(["-f", "qcow2"]);
    for m in 0..a.size >> 20 {
        io.arg("-c").arg(format!("write -q -P {} {}M 1M", m % 251 + 1, m));
    }
    run(io.arg(&plain))?;
    if a.compressed {
        run(Command::new("qemu-img")
            .args(["convert", "-c", "-O", "qcow2", "-o"])
            .arg(format!("cluster_size={}", a.cluster_size))
            .arg(&plain)
            .arg(&image))?;
        std::fs::remove_file(&plain)?;
    } else {
        std::fs::rename(&plain, &image)?;
    }
    let file_size = std::fs::metadata(&image)?.len();
    let _ = std::fs::read(&image)?; // into the page cache for both sides

    let opts = ReplicaOptions {
        backing_file: Some(image.clone()),
        disable_revision_counter: Some(true),
        backing_image: None,
    };
    let open_start = Instant::now();
    let r = Replica::create(&a.dir.join("replica"), a.size, &opts)?;
    let open = open_start.elapsed();

    let mut rng = XorShift::new(7);
    let random: Vec<(u64, u64)> = (0..a.random_reads)
        .map(|_| (rng.below(a.size / 4096) * 4096, 4096))
        .collect();
    let seq: Vec<(u64, u64)> = (0..a.size >> 20).map(|m| (m << 20, 1 << 20)).collect();
    let seq4k: Vec<(u64, u64)> = (0..a.random_reads.min(a.size / 4096))
        .map(|b| (b * 4096, 4096))
        .collect();
    // qemu-io's own start (process, image open) is measured with no reads and taken off its times.
    let startup = (0..3)
        .map(|_| qemu_io_reads(&image, &[]))
        .collect::<anyhow::Result<Vec<_>>>()?
        .into_iter()
        .min()
        .unwrap_or_default();
    let mut rows = Vec::new();
    for (name, reads) in [("4 KiB random read", &random), ("1 MiB seq read", &seq)] {
        let (mut best_c, mut best_q) = (Duration::MAX, Duration::MAX);
        for _ in 0..a.rounds {
            best_c = best_c.min(corral_reads(&r, reads)?);
            best_q = best_q.min(qemu_io_reads(&image, reads)?.saturating_sub(startup));
        }
        let bytes: u64 = reads.iter().map(|x| x.1).sum();
        let n = reads.len() as f64;
        rows.push((
            name,
            n / best_c.as_secs_f64(),
            n / best_q.as_secs_f64(),
            bytes as f64 / best_c.as_secs_f64(),
            bytes as f64 / best_q.as_secs_f64(),
        ));
    }
    // The same sequential reads against qemu's in-process `qemu-img bench` (no per-read command parsing).
    let mut bench_rows = Vec::new();
    for (name, reads) in [("4 KiB seq read", &seq4k), ("1 MiB seq read", &seq)] {
        let (mut best_c, mut best_q) = (Duration::MAX, Duration::MAX);
        for _ in 0..a.rounds {
            best_c = best_c.min(corral_reads(&r, reads)?);
            best_q = best_q.min(qemu_img_bench(&image, reads.len(), reads[0].1)?);
        }
        let n = reads.len() as f64;
        bench_rows.push((name, n / best_c.as_secs_f64(), n / best_q.as_secs_f64()));
    }
    println!(
        "image: qcow2 {}, cluster {}, {}file {}, replica open {:.1} ms, qemu-io start {:.1} ms (subtracted)",
        mib(a.size),
        a.cluster_size,
        if a.compressed { "zlib-compressed, " } else { "" },
        mib(file_size),
        open.as_secs_f64() * 1e3,
        startup.as_secs_f64() * 1e3
    );
    println!(
        "{:<20} {:>14} {:>14} {:>12} {:>12} {:>7}",
        "workload", "corral IOPS", "qemu-io IOPS", "corral MiB/s", "qemu MiB/s", "ratio"
    );
    for (name, ci, qi, cb, qb) in rows {
        println!(
            "{name:<20} {ci:>14.0} {qi:>14.0} {:>12.1} {:>12.1} {:>7.2}",
            cb / 1_048_576.0,
            qb / 1_048_576.0,
            ci / qi
        );
    }
    println!(
        "{:<20} {:>14} {:>20} {:>7}",
        "workload", "corral IOPS", "qemu-img bench IOPS", "ratio"
    );
    for (name, ci, qi) in bench_rows {
        println!("{name:<20} {ci:>14.0} {qi:>20.0} {:>7.2}", ci / qi);
    }
    drop(r);
    if !a.keep {
        std::fs::remove_dir_all(&a.dir)?;
    }
    Ok(())
}
