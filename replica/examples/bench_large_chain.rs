//! Large-chain benchmark: memory and open time of a replica with a 1 TiB sparse volume and 500 snapshots, each
//! holding a few thousand scattered 4 KiB writes (issue 2, "Must show: Memory").
//!
//! 1. Builds the chain with the `replica` library in this process (`Replica::create`, `write_at`, `snapshot`,
//!    `close`): `--snapshots` layers of `--writes` 4 KiB writes at random 4 KiB-aligned offsets over the volume.
//! 2. Starts the real `corral-replica serve` on it in a fresh process and measures spawn → readiness (the open
//!    scans every layer with `SEEK_DATA`/`SEEK_HOLE` to build the block map), the daemon's `VmRSS`/`VmHWM` when
//!    ready and after reads through the data protocol (which check the data), and `extent_map_runs` from its
//!    Prometheus `/metrics`.
//! 3. Opens the replica once more with the library in a fresh child process (so the build's allocations do not
//!    blur the figure) and measures the open time, the RSS the open added, `Replica::status().extent_map_runs`
//!    and the number of data extents over all layers.
//!
//! ```sh
//! bench/replica/run.sh large-chain                   # 500 snapshots × 2000 writes, ~4 GiB on disk
//! bench/replica/run.sh large-chain --drop-caches     # cold open (drops the page cache: root, shared machine!)
//! ```

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use common::{Daemon, XorShift, command_line, default_daemon_binary, mib, proc_memory};
use data_protocol::{ClientConfig, DataClient};
use replica::{Replica, ReplicaOptions, SnapshotRequest};

const BLOCK: u64 = 4096;
const PARAMS_FILE: &str = "bench-chain.params";
/// The issue's memory target for the daemon.
const RSS_TARGET: u64 = 64 << 20;

#[derive(Parser, Debug)]
#[command(about = "Open time and memory of a replica with a 1 TiB sparse volume and hundreds of snapshots")]
struct Args {
    /// Directory of the replica to build (removed at the end unless --keep).
    #[arg(long, default_value = "/var/tmp/corral-bench-large-chain")]
    dir: PathBuf,
    /// Volume size in bytes.
    #[arg(long, default_value_t = 1 << 40)]
    size: u64,
    /// Snapshots in the chain.
    #[arg(long, default_value_t = 500)]
    snapshots: u32,
    /// Scattered 4 KiB writes in each snapshot.
    #[arg(long, default_value_t = 2000)]
    writes: u32,
    /// Random 4 KiB reads through the data protocol after the daemon is ready (besides reading back every
    /// block of the newest snapshot).
    #[arg(long, default_value_t = 20_000)]
    reads: u32,
    /// Seed of the offset generator.
    #[arg(long, default_value_t = 2)]
    seed: u64,
    /// Reuse the chain a previous `--keep` run left in --dir (same parameters) instead of building it.
    #[arg(long)]
    reuse: bool,
    /// Keep the replica directory at the end.
    #[arg(long)]
    keep: bool,
    /// `sync` and drop the page, dentry and inode caches before starting the daemon, to time a cold open
    /// (needs root; slows everything else on the machine for a moment).
    #[arg(long)]
    drop_caches: bool,
    /// The `corral-replica` binary (default: next to this example in the target directory).
    #[arg(long, env = "CORRAL_REPLICA_BIN")]
    bin: Option<PathBuf>,
    /// Internal: open the replica in --dir in this process, print the figures as `key=value` lines, and exit.
    #[arg(long, hide = true)]
    open_in_process: bool,
}

impl Args {
    fn params(&self) -> String {
        format!(
            "size={} snapshots={} writes={} seed={}\n",
            self.size, self.snapshots, self.writes, self.seed
        )
    }
}

/// The writes of the chain, in order: `(snapshot, block)`. Deterministic, so the read check can replay it.
fn write_sequence(a: &Args) -> impl Iterator<Item = (u32, u64)> {
    let mut rng = XorShift::new(a.seed);
    let blocks = a.size / BLOCK;
    let writes = a.writes;
    (0..a.snapshots)
        .flat_map(move |s| (0..writes).map(move |_| s))
        .map(move |s| (s, rng.below(blocks)))
}

/// A 4 KiB block that says which block it is and which snapshot wrote it.
fn fill_block(buf: &mut [u8], block: u64, snapshot: u32) {
    buf.fill(0xA5);
    buf[..8].copy_from_slice(&block.to_le_bytes());
    buf[8..12].copy_from_slice(&snapshot.to_le_bytes());
}

fn build_chain(a: &Args) -> anyhow::Result<()> {
    let t = Instant::now();
    let r = Replica::create(&a.dir, a.size, &ReplicaOptions::default())?;
    let mut buf = vec![0u8; 4096];
    let mut current = 0;
    let snapshot = |s: u32| {
        r.snapshot(&SnapshotRequest {
            name: format!("bench-{s:04}"),
            user_created: true,
            ..Default::default()
        })
    };
    for (s, block) in write_sequence(a) {
        if s != current {
            snapshot(current)?;
            current = s;
            if s % 50 == 0 {
                eprintln!("#   {s} snapshots after {:.0} s", t.elapsed().as_secs_f64());
            }
        }
        fill_block(&mut buf, block, s);
        r.write_at(block * BLOCK, &buf)?;
    }
    snapshot(current)?;
    r.close()?;
    std::fs::write(a.dir.join(PARAMS_FILE), a.params())?;
    println!(
        "# built {} snapshots × {} writes in {:.1} s",
        a.snapshots,
        a.writes,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Child-process mode: the library's own open, measured from a clean heap.
fn open_in_process(a: &Args) -> anyhow::Result<()> {
    let before = proc_memory("self")?;
    let t = Instant::now();
    let r = Replica::open(&a.dir, &ReplicaOptions::default())?;
    let open = t.elapsed();
    let after = proc_memory("self")?;
    let st = r.status()?;
    // The same SEEK_DATA/SEEK_HOLE walk the open does, without the map: splits the open time into the
    // filesystem's part and the map's.
    let t = Instant::now();
    let mut extents = 0u64;
    for name in &st.chain {
        let f = std::fs::File::open(a.dir.join(name))?;
        let len = f.metadata()?.len();
        for e in corral_disk::sparse::data_extents(&f, 0..len) {
            e?;
            extents += 1;
        }
    }
    let scan = t.elapsed();
    r.close()?;
    println!("open_ms={:.1}", open.as_secs_f64() * 1e3);
    println!("scan_ms={:.1}", scan.as_secs_f64() * 1e3);
    println!("rss_before={}", before.rss);
    println!("rss_after={}", after.rss);
    println!("hwm_after={}", after.hwm);
    println!("runs={}", st.extent_map_runs);
    println!("layers={}", st.chain.len());
    println!("extents={extents}");
    Ok(())
}

struct InProcess {
    open: Duration,
    scan: Duration,
    rss_before: u64,
    rss_after: u64,
    hwm_after: u64,
    runs: u64,
    layers: u64,
    extents: u64,
}

fn run_in_process_child(a: &Args) -> anyhow::Result<InProcess> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("--open-in-process").arg("--dir").arg(&a.dir);
    let out = cmd.output().context("run the in-process open")?;
    if !out.status.success() {
        bail!("in-process open failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8(out.stdout)?;
    let get = |k: &str| -> anyhow::Result<f64> {
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .with_context(|| format!("{k} missing in {text:?}"))?;
        Ok(v.parse()?)
    };
    let int = |k: &str| -> anyhow::Result<u64> {
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .with_context(|| format!("{k} missing in {text:?}"))?;
        Ok(v.parse()?)
    };
    Ok(InProcess {
        open: Duration::from_secs_f64(get("open_ms")? / 1e3),
        scan: Duration::from_secs_f64(get("scan_ms")? / 1e3),
        rss_before: int("rss_before")?,
        rss_after: int("rss_after")?,
        hwm_after: int("hwm_after")?,
        runs: int("runs")?,
        layers: int("layers")?,
        extents: int("extents")?,
    })
}

/// Reads every block the newest snapshot wrote (must carry that snapshot's mark) and `random` blocks anywhere
/// (zeros, or a block that names itself), 32 in flight. Returns (blocks read, blocks holding data).
async fn read_through_daemon(a: &Args, addr: &str) -> anyhow::Result<(u64, u64)> {
    let client = DataClient::connect(addr, ClientConfig::default()).await?;
    ensure!(
        client.info().size == a.size,
        "daemon announced {} bytes",
        client.info().size
    );
    let newest = a.snapshots - 1;
    let newest_blocks: HashSet<u64> = write_sequence(a)
        .filter(|&(s, _)| s == newest)
        .map(|(_, b)| b)
        .collect();
    let mut rng = XorShift::new(a.seed ^ 0xdead_beef);
    let blocks = a.size / BLOCK;
    let random = (0..a.reads).map(|_| (rng.below(blocks), false));
    let work: Vec<(u64, bool)> = newest_blocks.iter().map(|&b| (b, true)).chain(random).collect();
    let work = Arc::new(work);
    let mut tasks = tokio::task::JoinSet::new();
    for stream in 0..32usize {
        let (client, work) = (client.clone(), work.clone());
        tasks.spawn(async move {
            let mut buf = vec![0u8; 4096];
            let (mut read, mut data) = (0u64, 0u64);
            for &(b, must_be_newest) in work.iter().skip(stream).step_by(32) {
                client.read(b * BLOCK, &mut buf).await?;
                read += 1;
                if buf.iter().all(|&x| x == 0) {
                    ensure!(!must_be_newest, "block {b} of the newest snapshot reads as zeros");
                    continue;
                }
                data += 1;
                let (mut id, mut snap) = ([0u8; 8], [0u8; 4]);
                id.copy_from_slice(&buf[..8]);
                snap.copy_from_slice(&buf[8..12]);
                ensure!(
                    u64::from_le_bytes(id) == b,
                    "block {b} holds block {}",
                    u64::from_le_bytes(id)
                );
                let snap = u32::from_le_bytes(snap);
                ensure!(
                    !must_be_newest || snap == newest,
                    "block {b} holds snapshot {snap}, not {newest}"
                );
            }
            anyhow::Ok((read, data))
        });
    }
    let (mut read, mut data) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        let (r, d) = r??;
        read += r;
        data += d;
    }
    client.close().await;
    Ok((read, data))
}

fn drop_caches() -> anyhow::Result<()> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").context("write /proc/sys/vm/drop_caches (needs root)")
}

fn per_run(bytes: u64, runs: u64) -> String {
    if runs == 0 {
        "-".to_owned()
    } else {
        format!("{:.1} B", bytes as f64 / runs as f64)
    }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.open_in_process {
        return open_in_process(&a);
    }
    println!("# {}", command_line());
    ensure!(
        a.snapshots > 0 && a.size % BLOCK == 0,
        "need at least one snapshot and a size multiple of 4096"
    );
    let bin = match a.bin.clone() {
        Some(b) => b,
        None => default_daemon_binary()?,
    };
    let params_path = a.dir.join(PARAMS_FILE);
    if a.reuse {
        let found = std::fs::read_to_string(&params_path)
            .with_context(|| format!("--reuse: read {}", params_path.display()))?;
        ensure!(
            found == a.params(),
            "--reuse: {} holds {found:?}, flags say {:?}",
            a.dir.display(),
            a.params()
        );
        println!("# reusing the chain in {}", a.dir.display());
    } else {
        if a.dir.exists() {
            std::fs::remove_dir_all(&a.dir).with_context(|| format!("remove {}", a.dir.display()))?;
        }
        let parent = a.dir.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(parent)?;
        let st = rustix::fs::statvfs(parent).context("statvfs")?;
        let free = st.f_bavail * st.f_frsize;
        let need = u64::from(a.snapshots) * u64::from(a.writes) * BLOCK;
        ensure!(
            free > need + (2 << 30),
            "{} has {} free; the chain needs {} plus 2 GiB of margin",
            parent.display(),
            mib(free),
            mib(need)
        );
        println!(
            "# building {} snapshots × {} scattered 4 KiB writes over {} in {} ({} of data; {} free)",
            a.snapshots,
            a.writes,
            mib(a.size),
            a.dir.display(),
            mib(need),
            mib(free)
        );
        build_chain(&a)?;
    }

    if a.drop_caches {
        drop_caches()?;
        println!("# page, dentry and inode caches dropped: the open below is cold");
    }
    let log = a.dir.with_extension("daemon.log");
    let mut daemon = Daemon::start(&bin, &a.dir, &[], true, &log, Duration::from_secs(600))?;
    let ready = daemon.memory()?;
    let runs = daemon.metric("corral_replica_extent_map_runs")?;
    let layers = daemon.metric("corral_replica_chain_layers")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let t = Instant::now();
    let (read, data) = rt.block_on(read_through_daemon(&a, &daemon.data_addr()))?;
    let read_time = t.elapsed();
    let after_reads = daemon.memory()?;
    let (stop_time, clean) = daemon.stop(Duration::from_secs(60))?;
    ensure!(
        clean,
        "daemon did not exit cleanly on SIGTERM; see {}",
        log.display()
    );

    let inproc = run_in_process_child(&a)?;
    // Gauges are integers in f64; the conversion is exact far beyond any plausible run count.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let (runs, layers) = (runs as u64, layers as u64);
    ensure!(
        runs == inproc.runs,
        "daemon reports {runs} runs, the library {}",
        inproc.runs
    );

    let ok = |b: bool| if b { "yes" } else { "NO" };
    println!();
    println!("| figure | value |");
    println!("|---|---|");
    println!("| volume | {} |", mib(a.size));
    println!("| layers (snapshots + head) | {layers} |");
    println!(
        "| data extents over all layers (SEEK_DATA) | {} |",
        inproc.extents
    );
    println!("| block-map runs (`corral_replica_extent_map_runs`) | {runs} |");
    println!(
        "| daemon spawn → ready (open) | {:.2} s |",
        daemon.ready_after.as_secs_f64()
    );
    println!(
        "| daemon VmRSS / VmHWM when ready | {} / {} |",
        mib(ready.rss),
        mib(ready.hwm)
    );
    println!(
        "| daemon VmRSS / VmHWM after {read} reads ({data} with data, {:.2} s) | {} / {} |",
        read_time.as_secs_f64(),
        mib(after_reads.rss),
        mib(after_reads.hwm)
    );
    println!(
        "| daemon RSS per run (whole process) | {} |",
        per_run(after_reads.rss, runs)
    );
    println!(
        "| daemon SIGTERM → clean exit | {:.2} s |",
        stop_time.as_secs_f64()
    );
    println!(
        "| library `Replica::open` (fresh process, warm) | {:.2} s |",
        inproc.open.as_secs_f64()
    );
    println!(
        "| of which the SEEK_DATA/SEEK_HOLE walk alone (same files, warm) | {:.2} s |",
        inproc.scan.as_secs_f64()
    );
    println!(
        "| RSS added by the open (fresh process) | {} ({} → {}, HWM {}) |",
        mib(inproc.rss_after.saturating_sub(inproc.rss_before)),
        mib(inproc.rss_before),
        mib(inproc.rss_after),
        mib(inproc.hwm_after)
    );
    println!(
        "| RSS added per run (map + per-layer state) | {} |",
        per_run(inproc.rss_after.saturating_sub(inproc.rss_before), inproc.runs)
    );
    println!();
    let peak = ready.hwm.max(after_reads.hwm);
    println!(
        "target RSS < 64 MiB: {} (peak {}); target open in seconds: {} ({:.2} s)",
        ok(peak < RSS_TARGET),
        mib(peak),
        ok(daemon.ready_after < Duration::from_secs(60)),
        daemon.ready_after.as_secs_f64()
    );
    ensure!(
        inproc.layers == layers,
        "daemon has {layers} layers, the library {}",
        inproc.layers
    );

    if !a.keep {
        // Freeing a million scattered extents is slow on a filesystem mounted with `discard` (one TRIM per
        // extent): worth seeing, since deleting a replica or purging snapshots does the same.
        let t = Instant::now();
        std::fs::remove_dir_all(&a.dir).with_context(|| format!("remove {}", a.dir.display()))?;
        let _ = std::fs::remove_file(&log);
        println!(
            "removed {} in {:.1} s",
            a.dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
