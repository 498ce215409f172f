//! Supervised daemons: what both the manager's local supervision and the instance manager (`corral-im`) need to
//! run a data-plane daemon that outlives its supervisor. A daemon runs in its own process group (a signal to the
//! supervisor's group, or the supervisor's SIGKILL, does not reach it), its stdout and stderr appended to a log
//! file, and it is recognised later by pid plus start time (a recycled pid is not mistaken for it) plus its binary
//! name on the command line — so a restarted supervisor re-adopts what still runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot open log file {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
}

/// Unix milliseconds now (start stamps survive a supervisor restart, unlike an `Instant`).
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The kernel's `PF_EXITING` task flag (`include/linux/sched.h`): set when the process starts to exit, before it
/// releases its memory and becomes a zombie.
const PF_EXITING: u64 = 0x4;

/// Field 22 of `/proc/PID/stat`: start time in clock ticks after boot; None when the process is gone, a zombie or
/// exiting. An exiting process must not count: once it has released its memory its command line reads empty, which
/// [`is_alive`] takes for a child still inside execve, so a killed daemon would look alive again for a moment.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `rest` starts at field 3 (state): field 9 (flags) is 6 further, field 22 then 13 further.
    let flags: u64 = fields.nth(5)?.parse().ok()?;
    if flags & PF_EXITING != 0 {
        return None;
    }
    fields.nth(12)?.parse().ok()
}

/// The process `pid` still runs, started at `start` (clock ticks, [`start_time`]), and runs `binary_name`.
pub fn is_alive(pid: i32, start: u64, binary_name: &str) -> bool {
    if pid <= 0 {
        return false;
    }
    // The command line is read before the state: a process that exits between the two reads has released its
    // memory (an empty command line) but is then seen exiting, so an empty line read first belongs to a process
    // that was not exiting yet.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"));
    if start_time(pid) != Some(start) {
        return false;
    }
    // Right after spawn the child may still be inside execve, with an empty command line: the pid and start
    // time already identify it (a recycled pid has another start time).
    cmdline
        .map(|c| c.is_empty() || String::from_utf8_lossy(&c).contains(binary_name))
        .unwrap_or(false)
}

/// SIGTERM, then SIGKILL after `grace`; returns once the process is gone.
pub async fn terminate(pid: i32, start: u64, binary_name: &str, grace: Duration) {
    if !is_alive(pid, start, binary_name) {
        return;
    }
    let target = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    let mut killed = false;
    while is_alive(pid, start, binary_name) {
        if !killed && tokio::time::Instant::now() > deadline {
            tracing::warn!(pid, binary = binary_name, "daemon ignored SIGTERM: SIGKILL");
            let _ = nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGKILL);
            killed = true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A started daemon: how to recognise it later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spawned {
    pub pid: i32,
    /// Clock ticks after boot ([`start_time`]).
    pub start_time: u64,
    /// Unix milliseconds of the start.
    pub started_at_ms: i64,
}

/// Starts `binary args...` (with `env` added) in its own process group, stdout and stderr appended to `log`.
/// The caller owns the returned child and must reap it (`wait`), so it never lingers as a zombie.
pub fn spawn(
    binary: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
) -> Result<(Spawned, tokio::process::Child), SpawnError> {
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(|source| SpawnError::Log {
            path: log.to_owned(),
            source,
        })?;
    }
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| SpawnError::Log {
                path: log.to_owned(),
                source,
            })
    };
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(open()?)
        .stderr(open()?)
        .process_group(0)
        .kill_on_drop(false);
    let started_at_ms = now_ms();
    let child = cmd.spawn().map_err(|source| SpawnError::Spawn {
        binary: binary.to_owned(),
        source,
    })?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let start = start_time(pid).unwrap_or(0);
    Ok((
        Spawned {
            pid,
            start_time: start,
            started_at_ms,
        },
        child,
    ))
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
        assert!(is_alive(pid, st, &name));
        assert!(!is_alive(pid, st + 1, &name));
        // The field read is the start time: non-zero, and no later than that of a child started after this process.
        assert!(st > 0);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let child_st = start_time(i32::try_from(child.id()).unwrap()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(child_st >= st, "child {child_st} before parent {st}");
        assert!(!is_alive(pid, st, "corral-engine-not-this"));
    }

    #[tokio::test]
    async fn a_spawned_daemon_runs_in_its_own_group_logs_and_terminates() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("logs/x.log");
        let (s, mut child) = spawn(
            Path::new("/bin/sh"),
            &["-c".into(), "echo hello $GREETING; exec sleep 30".into()],
            &[("GREETING".into(), "there".into())],
            &log,
        )
        .unwrap();
        let reap = tokio::spawn(async move { child.wait().await });
        assert_eq!(
            nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(s.pid)))
                .unwrap()
                .as_raw(),
            s.pid
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("hello there")
        {
            assert!(std::time::Instant::now() < deadline, "no log line");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        terminate(s.pid, s.start_time, "sleep", Duration::from_secs(5)).await;
        assert!(!reap.await.unwrap().unwrap().success());
    }
}
