//! Support shared by the replica benchmarks: start the real `corral-replica serve` daemon through the test kit
//! (port 0, its ready file, a deadline), read its memory from `/proc`, and stop it when the benchmark ends.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use testkit::DaemonCommand;

/// The command line this benchmark was started with, for the report.
pub fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// `corral-replica` next to this example in the same target directory (`target/release/examples/x` →
/// `target/release/corral-replica`).
pub fn default_daemon_binary() -> anyhow::Result<PathBuf> {
    testkit::binary::find_workspace_bin("corral-replica").map_err(|p| {
        anyhow!(
            "{} not found: build it with `cargo build --release -p replica --bins` or pass --bin",
            p.display()
        )
    })
}

/// Memory of a process as the kernel reports it, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct ProcMemory {
    /// Resident set size now (`VmRSS`).
    pub rss: u64,
    /// Peak resident set size (`VmHWM`).
    pub hwm: u64,
}

/// Reads `VmRSS` and `VmHWM` of `pid` (`self` for this process) from `/proc/PID/status`.
pub fn proc_memory(pid: &str) -> anyhow::Result<ProcMemory> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{name} in {path}"))?;
        let kib: u64 = line
            .trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("parse {line:?}"))?;
        Ok(kib * 1024)
    };
    Ok(ProcMemory {
        rss: field("VmRSS:")?,
        hwm: field("VmHWM:")?,
    })
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    let m = bytes as f64 / f64::from(1u32 << 20);
    format!("{m:.1} MiB")
}

/// A running `corral-replica serve`; stopped (SIGTERM, then SIGKILL after a deadline) on drop.
pub struct Daemon {
    proc: testkit::Daemon,
    /// Time from spawn to the ready file (every listener bound).
    pub ready_after: Duration,
    /// Where the daemon's log goes.
    pub log: PathBuf,
}

impl Daemon {
    /// Spawns `bin serve --dir DIR --listen 127.0.0.1:0 [extra…]` (and `--metrics-listen 127.0.0.1:0`), logging to
    /// `log`, and waits for its ready file (`ready_timeout` deadline; fails early if it exits).
    pub fn start(
        bin: &Path,
        dir: &Path,
        extra: &[String],
        with_metrics: bool,
        log: &Path,
        ready_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let mut cmd = DaemonCommand::new(bin)
            .label("corral-replica")
            .args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", "127.0.0.1:0"]);
        if with_metrics {
            cmd = cmd.args(["--metrics-listen", "127.0.0.1:0"]);
        }
        let _ = std::fs::remove_file(log);
        let started = Instant::now();
        let proc = cmd
            .args(extra)
            .log_to(log)
            .ready_timeout(ready_timeout)
            .try_spawn()?;
        Ok(Self {
            proc,
            ready_after: started.elapsed(),
            log: log.to_owned(),
        })
    }

    /// Process id, as a string for `/proc`.
    pub fn pid(&self) -> String {
        self.proc.pid().to_string()
    }

    /// Data-protocol address.
    pub fn data_addr(&self) -> String {
        self.proc.addr("data").to_owned()
    }

    /// The daemon's current and peak RSS.
    pub fn memory(&self) -> anyhow::Result<ProcMemory> {
        proc_memory(&self.pid())
    }

    /// Fetches `/metrics` and returns the value of the sample named `name`.
    pub fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let addr = self
            .proc
            .listeners()
            .get("metrics")
            .context("daemon started without --metrics-listen")?;
        let mut s = TcpStream::connect(addr.as_str())?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        let line = body
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .with_context(|| format!("{name} not in /metrics"))?;
        let value = line.split_whitespace().nth(1).context("sample without a value")?;
        value.parse().with_context(|| format!("parse {line:?}"))
    }

    /// SIGTERM, then wait (up to `grace`) for a clean exit; SIGKILL after that. Returns the time to exit and
    /// whether the exit was clean.
    pub fn stop(&mut self, grace: Duration) -> anyhow::Result<(Duration, bool)> {
        if !self.proc.is_running() {
            return Ok((Duration::ZERO, false));
        }
        let started = Instant::now();
        let status = self.proc.terminate(grace);
        Ok((started.elapsed(), status.is_some_and(|s| s.success())))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(20));
    }
}

/// xorshift64*: a tiny deterministic generator for offsets (no dependency, reproducible between runs).
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for stream `seed` (any value; 0 is remapped).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next pseudo-random value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-enough value in `0..n` (n > 0; the modulo bias is negligible for n far below 2^64).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Fills `buf` with pseudo-random bytes (so no layer of the stack can shortcut zeros).
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
