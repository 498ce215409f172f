//! Supervision of the daemons a node's manager starts: `corral-replica` and `corral-engine` processes in their own
//! process groups (a signal to the manager's group or a manager SIGKILL does not reach them), logs appended to files
//! under the data directory, liveness by pid plus start time (a recycled pid is not mistaken for the daemon), so a
//! restarted manager re-adopts what is still running.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::model::ProcessRecord;

/// Why a daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("cannot open log file {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
    #[error("no free port in {from}..{to} on {host}")]
    NoPort { host: String, from: u16, to: u16 },
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
    std::fs::read(format!("/proc/{}/cmdline", rec.pid))
        .map(|c| String::from_utf8_lossy(&c).contains(binary_name))
        .unwrap_or(false)
}

/// Starts `binary args...` in its own process group with stdout and stderr appended to `log`. The child is reaped
/// by a background task so it never lingers as a zombie.
pub fn spawn(binary: &Path, args: &[String], log: &Path, port: u16) -> Result<ProcessRecord, ProcessError> {
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
        port,
        restarts: 0,
    })
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

/// Hands out ports on one host: `width` consecutive ports, all bindable now and not reserved by a daemon this
/// manager knows about (stopped daemons keep their ports reserved until their records go).
pub fn allocate_ports(
    host: &str,
    range: (u16, u16),
    width: u16,
    reserved: &BTreeSet<u16>,
) -> Result<u16, ProcessError> {
    let (from, to) = range;
    let mut p = from;
    while p.saturating_add(width) <= to {
        let all_free = (p..p + width).all(|q| !reserved.contains(&q) && TcpListener::bind((host, q)).is_ok());
        if all_free {
            return Ok(p);
        }
        p += width;
    }
    Err(ProcessError::NoPort {
        host: host.to_owned(),
        from,
        to,
    })
}

/// Something accepts TCP connections on `addr`.
pub fn accepts(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .ok()
        .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_millis(300)).is_ok())
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
            port: 0,
            restarts: 0,
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
    fn ports_skip_reserved_and_bound_ones() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let bound = l.local_addr().unwrap().port();
        let reserved: BTreeSet<u16> = [bound + 3].into_iter().collect();
        let p = allocate_ports("127.0.0.1", (bound, bound.saturating_add(30)), 3, &reserved).unwrap();
        assert!(
            p >= bound + 6,
            "{p} overlaps {bound} or the reserved {}",
            bound + 3
        );
    }
}
