//! Data-path benchmark: 4 KiB random and 1 MiB sequential reads and writes through the real `corral-replica
//! serve` daemon over the data protocol on loopback, against plain positional IO (`pwrite`/`pread`) on a file
//! of the same size in the same directory, measured in the same run with the same concurrency, patterns and
//! duration. Prints a table with the ratio Corral/peer and the daemon's memory.
//!
//! ```sh
//! bench/replica/run.sh                     # builds release and runs this with the defaults
//! bench/replica/run.sh --seconds 5 --size 1073741824
//! ```
//!
//! Both sides go through the page cache (the replica does buffered `pwrite`/`pread` on its layer files), so
//! the table shows what the protocol, the client and the replica's block map cost on top of the system call.
//! Each phase starts after a flush of the side it measures; the write phases' final flush (`Flush` request /
//! `fdatasync`) is timed separately and printed beside the table.

mod common;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use common::{Daemon, XorShift, command_line, default_daemon_binary, mib};
use data_protocol::{ClientConfig, DataClient};

#[derive(Parser, Debug)]
#[command(about = "Corral replica data path (data protocol over loopback) vs pwrite/pread on a file")]
struct Args {
    /// Benchmark directory, on the disk to measure. A fresh `replica/` and `peer.img` are made in it and
    /// removed at the end (unless --keep).
    #[arg(long, default_value = "/var/tmp/corral-bench-replica")]
    dir: PathBuf,
    /// Volume size in bytes (and size of the peer's file).
    #[arg(long, default_value_t = 2 << 30)]
    size: u64,
    /// Duration of each timed phase, per side.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Requests in flight: concurrent tasks on the Corral side, threads on the peer side.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// The `corral-replica` binary (default: next to this example in the target directory).
    #[arg(long, env = "CORRAL_REPLICA_BIN")]
    bin: Option<PathBuf>,
    /// Rounds per workload, alternating Corral and peer; the table shows each side's median round (by IOPS).
    /// More rounds damp the noise of a shared machine.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Keep the replica directory and the peer file.
    #[arg(long)]
    keep: bool,
}

/// One access pattern.
#[derive(Debug, Clone, Copy)]
struct Workload {
    name: &'static str,
    block: u64,
    random: bool,
    write: bool,
    /// Sequential pass over the whole volume once, instead of running for a duration.
    once: bool,
}

const FILL: Workload = Workload {
    name: "fill 1 MiB seq write",
    block: 1 << 20,
    random: false,
    write: true,
    once: true,
};
const WORKLOADS: [Workload; 4] = [
    Workload {
        name: "4 KiB random write",
        block: 4096,
        random: true,
        write: true,
        once: false,
    },
    Workload {
        name: "4 KiB random read",
        block: 4096,
        random: true,
        write: false,
        once: false,
    },
    Workload {
        name: "1 MiB seq write",
        block: 1 << 20,
        random: false,
        write: true,
        once: false,
    },
    Workload {
        name: "1 MiB seq read",
        block: 1 << 20,
        random: false,
        write: false,
        once: false,
    },
];

/// Where each request of a phase goes: random blocks from a per-stream generator (the same streams on both
/// sides), or the next block of one shared sequential cursor (`depth` requests in flight walk the volume in
/// order, wrapping around).
struct Offsets {
    w: Workload,
    blocks: u64,
    cursor: AtomicU64,
    deadline: Instant,
}

impl Offsets {
    fn new(w: Workload, size: u64, dur: Duration) -> Self {
        Self {
            w,
            blocks: size / w.block,
            cursor: AtomicU64::new(0),
            deadline: Instant::now() + dur,
        }
    }

    fn next(&self, rng: &mut XorShift) -> Option<u64> {
        if self.w.random {
            return (Instant::now() < self.deadline).then(|| rng.below(self.blocks) * self.w.block);
        }
        let n = self.cursor.fetch_add(1, Ordering::Relaxed);
        let more = if self.w.once {
            n < self.blocks
        } else {
            Instant::now() < self.deadline
        };
        more.then(|| (n % self.blocks) * self.w.block)
    }
}

/// What one side did in one phase.
#[derive(Debug, Clone, Copy)]
struct Phase {
    ops: u64,
    block: u64,
    elapsed: Duration,
    flush: Option<Duration>,
}

impl Phase {
    fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    fn mib_s(&self) -> f64 {
        (self.ops * self.block) as f64 / self.elapsed.as_secs_f64() / f64::from(1u32 << 20)
    }
}

fn seed(w: Workload, stream: usize) -> u64 {
    (w.block << 8) ^ (u64::from(w.write) << 4) ^ (stream as u64)
}

fn buf_len(w: Workload) -> anyhow::Result<usize> {
    usize::try_from(w.block).context("block size")
}

async fn corral_phase(
    client: &DataClient,
    w: Workload,
    size: u64,
    depth: usize,
    dur: Duration,
) -> anyhow::Result<Phase> {
    client.flush().await.context("flush before the phase")?;
    let offsets = Arc::new(Offsets::new(w, size, dur));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for stream in 0..depth {
        let (client, offsets) = (client.clone(), offsets.clone());
        let mut buf = vec![0u8; buf_len(w)?];
        tasks.spawn(async move {
            let mut rng = XorShift::new(seed(w, stream));
            rng.fill(&mut buf);
            let mut ops = 0u64;
            while let Some(off) = offsets.next(&mut rng) {
                if w.write {
                    client.write(off, &buf).await
                } else {
                    client.read(off, &mut buf).await
                }
                .with_context(|| format!("{} at {off}", w.name))?;
                ops += 1;
            }
            anyhow::Ok(ops)
        });
    }
    let mut ops = 0;
    while let Some(r) = tasks.join_next().await {
        ops += r??;
    }
    let elapsed = started.elapsed();
    let flush = if w.write {
        let t = Instant::now();
        client.flush().await.context("flush after the phase")?;
        Some(t.elapsed())
    } else {
        None
    };
    Ok(Phase {
        ops,
        block: w.block,
        elapsed,
        flush,
    })
}

fn peer_phase(file: &File, w: Workload, size: u64, depth: usize, dur: Duration) -> anyhow::Result<Phase> {
    file.sync_data().context("fdatasync before the phase")?;
    let offsets = Offsets::new(w, size, dur);
    let started = Instant::now();
    let ops = std::thread::scope(|s| -> anyhow::Result<u64> {
        let handles: Vec<_> = (0..depth)
            .map(|stream| {
                let offsets = &offsets;
                s.spawn(move || -> anyhow::Result<u64> {
                    let mut buf = vec![0u8; buf_len(w)?];
                    let mut rng = XorShift::new(seed(w, stream));
                    rng.fill(&mut buf);
                    let mut ops = 0u64;
                    while let Some(off) = offsets.next(&mut rng) {
                        if w.write {
                            file.write_all_at(&buf, off)
                        } else {
                            file.read_exact_at(&mut buf, off)
                        }
                        .with_context(|| format!("peer {} at {off}", w.name))?;
                        ops += 1;
                    }
                    Ok(ops)
                })
            })
            .collect();
        let mut ops = 0;
        for h in handles {
            ops += h.join().map_err(|_| anyhow::anyhow!("peer thread panicked"))??;
        }
        Ok(ops)
    })?;
    let elapsed = started.elapsed();
    let flush = if w.write {
        let t = Instant::now();
        file.sync_data().context("fdatasync after the phase")?;
        Some(t.elapsed())
    } else {
        None
    };
    Ok(Phase {
        ops,
        block: w.block,
        elapsed,
        flush,
    })
}

/// The round with the median IOPS (the upper one of the two middle rounds for an even count).
fn median(mut rounds: Vec<Phase>) -> Phase {
    rounds.sort_by(|a, b| a.iops().total_cmp(&b.iops()));
    rounds[rounds.len() / 2]
}

fn remove_if_exists(path: &Path) -> anyhow::Result<()> {
    let r = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

fn fmt_flush(p: &Phase) -> String {
    p.flush
        .map_or_else(|| "-".to_owned(), |d| format!("{:.2}", d.as_secs_f64()))
}

fn print_table(rows: &[(Workload, Phase, Phase)]) {
    println!();
    println!(
        "| {:<22} | {:>11} | {:>12} | {:>9} | {:>10} | {:>11} | {:>16} |",
        "workload",
        "Corral IOPS",
        "Corral MiB/s",
        "peer IOPS",
        "peer MiB/s",
        "Corral/peer",
        "flush s C / peer"
    );
    println!(
        "|{:-<24}|{:->13}|{:->14}|{:->11}|{:->12}|{:->13}|{:->18}|",
        "", "", "", "", "", "", ""
    );
    for (w, c, p) in rows {
        println!(
            "| {:<22} | {:>11.0} | {:>12.1} | {:>9.0} | {:>10.1} | {:>11.2} | {:>16} |",
            w.name,
            c.iops(),
            c.mib_s(),
            p.iops(),
            p.mib_s(),
            c.iops() / p.iops(),
            format!("{} / {}", fmt_flush(c), fmt_flush(p)),
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!("# {}", command_line());
    if args.size == 0 || args.size % (1 << 20) != 0 {
        bail!("--size must be a positive multiple of 1 MiB");
    }
    let bin = match args.bin.clone() {
        Some(b) => b,
        None => default_daemon_binary()?,
    };
    let dur = Duration::from_secs(args.seconds);
    std::fs::create_dir_all(&args.dir).with_context(|| format!("create {}", args.dir.display()))?;
    let (rdir, peer_path) = (args.dir.join("replica"), args.dir.join("peer.img"));
    remove_if_exists(&rdir)?;
    remove_if_exists(&peer_path)?;
    let st = rustix::fs::statvfs(&args.dir).context("statvfs")?;
    let free = st.f_bavail * st.f_frsize;
    if free < 2 * args.size + (1 << 30) {
        bail!(
            "{} has {} free; this run needs twice the volume size plus 1 GiB",
            args.dir.display(),
            mib(free)
        );
    }
    println!(
        "# dir {} ({} free), volume {}, {} in flight, {} s per phase per side, {} round(s), daemon {}",
        args.dir.display(),
        mib(free),
        mib(args.size),
        args.depth,
        args.seconds,
        args.rounds,
        bin.display()
    );

    let size_arg = ["--size".to_owned(), args.size.to_string()];
    let mut daemon = Daemon::start(
        &bin,
        &rdir,
        &size_arg,
        false,
        &args.dir.join("daemon.log"),
        Duration::from_secs(30),
    )?;
    println!(
        "# daemon pid {} ready in {:.0} ms",
        daemon.pid(),
        daemon.ready_after.as_secs_f64() * 1e3
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let client = rt.block_on(DataClient::connect(&daemon.data_addr(), ClientConfig::default()))?;
    if client.info().size != args.size {
        bail!(
            "daemon announced {} bytes, expected {}",
            client.info().size,
            args.size
        );
    }
    let peer = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&peer_path)
        .with_context(|| format!("create {}", peer_path.display()))?;
    peer.set_len(args.size)?;

    let mut rows = Vec::new();
    for w in std::iter::once(FILL).chain(WORKLOADS) {
        eprintln!("# {} ...", w.name);
        // The fill writes the whole volume once so that reads hit allocated data: one round is enough.
        let rounds = if w.once { 1 } else { args.rounds.max(1) };
        let (mut cs, mut ps) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let c = rt.block_on(corral_phase(&client, w, args.size, args.depth, dur))?;
            let p = peer_phase(&peer, w, args.size, args.depth, dur)?;
            eprintln!(
                "#   Corral {:.0} IOPS {:.1} MiB/s | peer {:.0} IOPS {:.1} MiB/s",
                c.iops(),
                c.mib_s(),
                p.iops(),
                p.mib_s()
            );
            cs.push(c);
            ps.push(p);
        }
        rows.push((w, median(cs), median(ps)));
    }
    let mem = daemon.memory()?;
    rt.block_on(client.close());
    print_table(&rows);
    println!();
    println!(
        "daemon memory at the end: VmRSS {}, VmHWM {} (pid {})",
        mib(mem.rss),
        mib(mem.hwm),
        daemon.pid()
    );
    let (took, clean) = daemon.stop(Duration::from_secs(30))?;
    println!(
        "daemon SIGTERM -> exit in {:.0} ms, clean: {clean}",
        took.as_secs_f64() * 1e3
    );
    drop(peer);
    if !args.keep {
        remove_if_exists(&rdir)?;
        remove_if_exists(&peer_path)?;
    }
    if !clean {
        bail!(
            "the daemon did not shut down cleanly; see {}",
            daemon.log.display()
        );
    }
    Ok(())
}
