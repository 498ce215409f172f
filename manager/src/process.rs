//! Supervision of the daemons a node's manager starts (`corral-replica`, `corral-engine`, `corral-bim`,
//! `corral-datasource`): each runs in its own process group (a signal to the manager's group or a manager SIGKILL
//! does not reach it), its log appended to `<data-dir>/logs/<kind>-<name>.log`, liveness by pid plus start time (a
//! recycled pid is not mistaken for the daemon), so a restarted manager re-adopts what is still running.
//!
//! Ports: a daemon is started with port 0 for every listener (or, on a restart, the ports it reported last, so
//! clients keep its address) and `--ready-file <data-dir>/run/<kind>-<name>.ready`; the controller polls that file
//! on its next reconciles — it never blocks waiting — and records the reported listeners in the
//! [`ProcessRecord`]. A daemon that dies before it reports ready (its old port taken: address in use) has no
//! reported ports, so its next start asks for port 0 again. No port is probed or derived from another.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use crate::model::ProcessRecord;

/// How long a started daemon may take to report ready before it is killed and started again (a loaded 2-core
/// machine starts a debug binary slowly; a healthy start takes well under a second).
pub const READY_DEADLINE: Duration = Duration::from_secs(60);

/// Why a daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("cannot open log file {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    #[error("cannot prepare the ready file {path}: {source}")]
    ReadyFile { path: PathBuf, source: std::io::Error },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
}

/// The one restart policy of the manager: the delay before the `attempt`-th restart of a daemon (and before the
/// `attempt`-th retry of a failed reconcile): 0.5 s doubling up to 30 s.
pub fn restart_backoff(attempt: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << attempt.min(6)).min(30_000))
}

/// Unix milliseconds now (start times in records survive a manager restart, unlike an `Instant`).
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Field 22 of `/proc/PID/stat`: start time in clock ticks after boot; None when the process is gone or a zombie.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `rest` starts at field 3 (state); field 22 is 19 further.
    fields.nth(18)?.parse().ok()
}

/// The process of `rec` still runs (same pid, same start time) and runs `binary_name`.
pub fn is_alive(rec: &ProcessRecord, binary_name: &str) -> bool {
    if rec.pid <= 0 || start_time(rec.pid) != Some(rec.start_time) {
        return false;
    }
    // Right after spawn the child may still be inside execve, with an empty command line: the pid and start
    // time already identify it (a recycled pid has another start time).
    std::fs::read(format!("/proc/{}/cmdline", rec.pid))
        .map(|c| c.is_empty() || String::from_utf8_lossy(&c).contains(binary_name))
        .unwrap_or(false)
}

/// SIGTERM, then SIGKILL after `grace`; returns once the process is gone.
pub async fn stop(rec: &ProcessRecord, binary_name: &str, grace: Duration) {
    if !is_alive(rec, binary_name) {
        return;
    }
    let pid = nix::unistd::Pid::from_raw(rec.pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    while is_alive(rec, binary_name) {
        if tokio::time::Instant::now() > deadline {
            tracing::warn!(pid = rec.pid, "daemon ignored SIGTERM: SIGKILL");
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a recorded daemon is doing now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Never started, gone, or killed for not reporting ready in time.
    Down,
    /// Running; its ready file is not written yet.
    Starting,
    /// Reported ready since the last look: record these listeners (name → address).
    Ready(BTreeMap<String, String>),
    /// Running, and its listeners are recorded.
    Running,
}

/// The daemons of one kind that one controller supervises: how they are started, observed, restarted (one
/// backoff policy) and stopped. Keyed by resource name.
pub struct Supervisor {
    /// The binary's file name (`corral-engine`); also how a live pid is recognised.
    binary: &'static str,
    /// Prefix of log and ready file names (`engine` → `logs/engine-NAME.log`, `run/engine-NAME.ready`).
    kind: &'static str,
    bin_dir: PathBuf,
    data_dir: PathBuf,
    /// What this manager process started, so a daemon is stopped even after its document is gone.
    started: Mutex<HashMap<String, ProcessRecord>>,
}

impl Supervisor {
    pub fn new(binary: &'static str, kind: &'static str, bin_dir: &Path, data_dir: &Path) -> Self {
        Self {
            binary,
            kind,
            bin_dir: bin_dir.to_owned(),
            data_dir: data_dir.to_owned(),
            started: Mutex::default(),
        }
    }

    pub fn binary(&self) -> &'static str {
        self.binary
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.data_dir
            .join("logs")
            .join(format!("{}-{name}.log", self.kind))
    }

    pub fn ready_path(&self, name: &str) -> PathBuf {
        self.data_dir
            .join("run")
            .join(format!("{}-{name}.ready", self.kind))
    }

    /// What the daemon recorded in `rec` does now. A daemon that has not reported ready within
    /// [`READY_DEADLINE`] of its start is killed and reported down (its next start asks for port 0).
    pub fn observe(&self, name: &str, rec: Option<&ProcessRecord>) -> Observed {
        let Some(rec) = rec else { return Observed::Down };
        if !is_alive(rec, self.binary) {
            return Observed::Down;
        }
        // A record written before ready files existed has no start stamp: its daemon was serving already.
        if !rec.listen.is_empty() || rec.started_at_ms == 0 {
            return Observed::Running;
        }
        let path = self.ready_path(name);
        match corral_daemon::ready::ReadyReport::read(&path) {
            Ok(report) if i64::from(report.pid) == i64::from(rec.pid) => {
                return Observed::Ready(report.listen);
            }
            Ok(report) => {
                tracing::debug!(daemon = self.binary, name, pid = report.pid, "stale ready file");
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::debug!(daemon = self.binary, name, error = %e, "ready file not readable yet"),
        }
        let waited = u64::try_from(now_ms().saturating_sub(rec.started_at_ms)).unwrap_or(0);
        if Duration::from_millis(waited) > READY_DEADLINE {
            tracing::warn!(
                daemon = self.binary,
                name,
                pid = rec.pid,
                "not ready within {READY_DEADLINE:?}: killing it"
            );
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(rec.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            return Observed::Down;
        }
        Observed::Starting
    }

    /// How long to wait before starting again a daemon whose last run is `rec`, as its `attempt`-th restart
    /// ([`restart_backoff`] counted from the last start); None: start now.
    pub fn restart_wait(rec: Option<&ProcessRecord>, attempt: u32) -> Option<Duration> {
        let rec = rec.filter(|_| attempt > 0)?;
        let since =
            Duration::from_millis(u64::try_from(now_ms().saturating_sub(rec.started_at_ms)).unwrap_or(0));
        restart_backoff(attempt)
            .checked_sub(since)
            .filter(|d| !d.is_zero())
    }

    /// The port listener `name` should ask for on a start: the one the last run reported (clients keep its
    /// address), or 0 (the daemon picks one and reports it).
    pub fn previous_port(rec: Option<&ProcessRecord>, listener: &str) -> u16 {
        rec.and_then(|r| r.listen.get(listener))
            .and_then(|a| a.parse::<SocketAddr>().ok())
            .map_or(0, |a| a.port())
    }

    /// Starts the daemon for `name` with `args` and its ready file; the record has no listeners until
    /// [`Supervisor::observe`] reports them.
    pub fn start(
        &self,
        name: &str,
        mut args: Vec<String>,
        restarts: u32,
    ) -> Result<ProcessRecord, ProcessError> {
        let ready = self.ready_path(name);
        if let Some(dir) = ready.parent() {
            std::fs::create_dir_all(dir).map_err(|source| ProcessError::ReadyFile {
                path: ready.clone(),
                source,
            })?;
        }
        // A file left by an earlier run must not pass for this one's report.
        match std::fs::remove_file(&ready) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(ProcessError::ReadyFile {
                    path: ready,
                    source: e,
                });
            }
            _ => {}
        }
        args.push("--ready-file".to_owned());
        args.push(ready.display().to_string());
        let mut rec = spawn(&self.bin_dir.join(self.binary), &args, &self.log_path(name))?;
        rec.restarts = restarts;
        if let Ok(mut m) = self.started.lock() {
            m.insert(name.to_owned(), rec.clone());
        }
        Ok(rec)
    }

    /// Stops the daemon in `rec` and any this manager process started for `name`.
    pub async fn stop(&self, name: &str, rec: Option<&ProcessRecord>, grace: Duration) {
        let started = self.started.lock().ok().and_then(|mut m| m.remove(name));
        for p in rec.into_iter().chain(started.as_ref()) {
            stop(p, self.binary, grace).await;
        }
        // Its report is stale now (and a deleted resource's would stay behind).
        let _ = std::fs::remove_file(self.ready_path(name));
    }
}

/// Starts `binary args...` in its own process group with stdout and stderr appended to `log`. The child is reaped
/// by a background task so it never lingers as a zombie.
fn spawn(binary: &Path, args: &[String], log: &Path) -> Result<ProcessRecord, ProcessError> {
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ProcessError::Log {
            path: log.to_owned(),
            source,
        })?;
    }
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| ProcessError::Log {
                path: log.to_owned(),
                source,
            })
    };
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(open()?)
        .stderr(open()?)
        .process_group(0)
        .kill_on_drop(false);
    let started_at_ms = now_ms();
    let mut child = cmd.spawn().map_err(|source| ProcessError::Spawn {
        binary: binary.to_owned(),
        source,
    })?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let start = start_time(pid).unwrap_or(0);
    let name = binary.display().to_string();
    tokio::spawn(async move {
        match child.wait().await {
            Ok(status) => tracing::info!(pid, binary = %name, %status, "daemon exited"),
            Err(e) => tracing::warn!(pid, binary = %name, error = %e, "cannot wait for daemon"),
        }
    });
    Ok(ProcessRecord {
        pid,
        start_time: start,
        listen: BTreeMap::new(),
        started_at_ms,
        restarts: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let pid = i32::try_from(std::process::id()).unwrap();
        let st = start_time(pid).unwrap();
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_string_lossy().into_owned();
        let rec = ProcessRecord {
            pid,
            start_time: st,
            ..Default::default()
        };
        assert!(is_alive(&rec, &name));
        assert!(!is_alive(
            &ProcessRecord {
                start_time: st + 1,
                ..rec.clone()
            },
            &name
        ));
        assert!(!is_alive(&rec, "corral-engine-not-this"));
    }

    #[test]
    fn backoff_doubles_from_half_a_second_to_thirty() {
        let waits: Vec<u64> = (0..9)
            .map(|n| u64::try_from(restart_backoff(n).as_millis()).unwrap())
            .collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
        let fresh = ProcessRecord {
            started_at_ms: now_ms(),
            ..Default::default()
        };
        assert_eq!(Supervisor::restart_wait(Some(&fresh), 0), None);
        assert_eq!(Supervisor::restart_wait(None, 3), None);
        let w = Supervisor::restart_wait(Some(&fresh), 2).unwrap();
        assert!(
            w > Duration::from_millis(1500) && w <= Duration::from_secs(2),
            "{w:?}"
        );
        let old = ProcessRecord {
            started_at_ms: now_ms() - 60_000,
            ..Default::default()
        };
        assert_eq!(Supervisor::restart_wait(Some(&old), 6), None);
    }

    #[test]
    fn a_restart_asks_for_the_reported_port_or_zero() {
        let rec = ProcessRecord {
            listen: [("nbd".to_owned(), "127.0.0.1:40123".to_owned())].into(),
            ..Default::default()
        };
        assert_eq!(Supervisor::previous_port(Some(&rec), "nbd"), 40123);
        assert_eq!(Supervisor::previous_port(Some(&rec), "control"), 0);
        assert_eq!(Supervisor::previous_port(None, "nbd"), 0);
    }

    #[tokio::test]
    async fn a_daemon_is_starting_until_its_ready_file_names_its_pid() {
        let dir = tempfile::tempdir().unwrap();
        // A shell script stands in for a daemon that never reports ready by itself; the supervisor recognises
        // it by its name on the command line.
        let script = dir.path().join("fake-daemon");
        std::fs::write(&script, "#!/bin/sh\nsleep 30\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let sup = Supervisor::new("fake-daemon", "test", dir.path(), dir.path());
        let rec = sup.start("a", Vec::new(), 0).unwrap();
        assert!(rec.listen.is_empty());
        assert_eq!(sup.observe("a", Some(&rec)), Observed::Starting);
        // Another pid's report is stale.
        corral_daemon::ready::ReadyReport {
            pid: u32::try_from(rec.pid).unwrap() + 1,
            listen: BTreeMap::new(),
        }
        .announce(Some(&sup.ready_path("a")))
        .unwrap();
        assert_eq!(sup.observe("a", Some(&rec)), Observed::Starting);
        let listen: BTreeMap<String, String> = [("http".to_owned(), "127.0.0.1:1".to_owned())].into();
        corral_daemon::ready::ReadyReport {
            pid: u32::try_from(rec.pid).unwrap(),
            listen: listen.clone(),
        }
        .announce(Some(&sup.ready_path("a")))
        .unwrap();
        assert_eq!(sup.observe("a", Some(&rec)), Observed::Ready(listen.clone()));
        let ready = ProcessRecord {
            listen,
            ..rec.clone()
        };
        assert_eq!(sup.observe("a", Some(&ready)), Observed::Running);
        // Past the deadline without a report: killed.
        let late = ProcessRecord {
            started_at_ms: rec.started_at_ms - i64::try_from(READY_DEADLINE.as_millis()).unwrap() - 1,
            ..rec.clone()
        };
        std::fs::remove_file(sup.ready_path("a")).unwrap();
        assert_eq!(sup.observe("a", Some(&late)), Observed::Down);
        testkit::wait_for("the killed daemon to go", Duration::from_secs(10), || {
            (!is_alive(&rec, "fake-daemon")).then_some(())
        });
        assert_eq!(sup.observe("a", Some(&rec)), Observed::Down);
        // Stopping removes its report.
        corral_daemon::ready::ReadyReport::new()
            .announce(Some(&sup.ready_path("a")))
            .unwrap();
        sup.stop("a", Some(&rec), Duration::from_secs(1)).await;
        assert!(!sup.ready_path("a").exists());
    }
}
