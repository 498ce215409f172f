//! Support shared by the replica benchmarks: start the real `corral-replica serve` daemon on free loopback
//! ports, wait for it with a deadline, read its memory from `/proc`, and stop it when the benchmark ends.

#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The command line this benchmark was started with, for the report.
pub fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// `corral-replica` next to this example in the same target directory (`target/release/examples/x` →
/// `target/release/corral-replica`).
pub fn default_daemon_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("current_exe")?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("example is not in a target directory")?;
    let bin = profile_dir.join("corral-replica");
    if !bin.exists() {
        bail!(
            "{} not found: build it with `cargo build --release -p replica --bins` or pass --bin",
            bin.display()
        );
    }
    Ok(bin)
}

/// Three consecutive free ports P, P+1, P+2 (best effort: the ports are released before the daemon binds).
pub fn free_port_triple() -> anyhow::Result<u16> {
    for _ in 0..200 {
        let p = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if p > 65000 {
            continue;
        }
        if (0..3).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return Ok(p);
        }
    }
    bail!("no three consecutive free ports on 127.0.0.1")
}

/// One free port.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
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
    child: Child,
    /// Control port P; data protocol on P+1, sync agent on P+2.
    pub port: u16,
    /// Prometheus address, when started with one.
    pub metrics: Option<u16>,
    /// Time from spawn to all three ports accepting connections.
    pub ready_after: Duration,
    /// Where the daemon's log goes.
    pub log: PathBuf,
}

impl Daemon {
    /// Spawns `bin serve --dir DIR --listen 127.0.0.1:P [extra…]`, logging to `log`, and waits until its control,
    /// data and sync-agent ports accept connections (`ready_timeout` deadline; fails early if it exits).
    pub fn start(
        bin: &Path,
        dir: &Path,
        extra: &[String],
        with_metrics: bool,
        log: &Path,
        ready_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let port = free_port_triple()?;
        let metrics = if with_metrics { Some(free_port()?) } else { None };
        let mut cmd = Command::new(bin);
        cmd.args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", &format!("127.0.0.1:{port}")]);
        if let Some(m) = metrics {
            cmd.args(["--metrics-listen", &format!("127.0.0.1:{m}")]);
        }
        cmd.args(extra);
        // A file, not a pipe: nobody reads the daemon's log while the benchmark runs, and a full pipe would
        // block the daemon.
        let log_file = File::create(log).with_context(|| format!("create {}", log.display()))?;
        cmd.stdout(Stdio::null()).stderr(log_file);
        let started = Instant::now();
        let child = cmd.spawn().with_context(|| format!("spawn {}", bin.display()))?;
        let mut d = Self {
            child,
            port,
            metrics,
            ready_after: Duration::ZERO,
            log: log.to_owned(),
        };
        let deadline = started + ready_timeout;
        loop {
            if let Some(status) = d.child.try_wait()? {
                bail!(
                    "corral-replica exited during start ({status}); see {}",
                    log.display()
                );
            }
            let up = |p: u16| TcpStream::connect(("127.0.0.1", p)).is_ok();
            if up(port + 2) && up(port + 1) && up(port) && metrics.is_none_or(up) {
                d.ready_after = started.elapsed();
                return Ok(d);
            }
            if Instant::now() >= deadline {
                bail!(
                    "corral-replica not ready within {ready_timeout:?}; see {}",
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Process id, as a string for `/proc`.
    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Data-protocol address.
    pub fn data_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port + 1)
    }

    /// The daemon's current and peak RSS.
    pub fn memory(&self) -> anyhow::Result<ProcMemory> {
        proc_memory(&self.pid())
    }

    /// Fetches `/metrics` and returns the value of the sample named `name`.
    pub fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let port = self.metrics.context("daemon started without --metrics-listen")?;
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
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
        let started = Instant::now();
        if self.child.try_wait()?.is_some() {
            return Ok((Duration::ZERO, false));
        }
        let raw = i32::try_from(self.child.id()).context("pid out of range")?;
        let pid = rustix::process::Pid::from_raw(raw).context("pid 0")?;
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
        while started.elapsed() < grace {
            if let Some(status) = self.child.try_wait()? {
                return Ok((started.elapsed(), status.success()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok((started.elapsed(), false))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.stop(Duration::from_secs(20));
        }
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
