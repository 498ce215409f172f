//! Starting a daemon for a test: port 0 and a ready file, a log file, a deadline, and a kill on drop.
//!
//! Every Corral daemon takes `--ready-file PATH`: once all its listeners are bound it writes PATH atomically with
//! `{"pid": <u32>, "listen": {"<name>": "<addr>", …}}`, `<addr>` being `host:port` (TCP) or `unix:/path`. A test
//! passes port 0 for every listener and reads the real addresses back from [`Daemon::addr`], so no two tests ever
//! race for a port. Names: replica `control`, `data`, `sync`, `metrics`; engine `control`, `nbd`, `metrics`; bim
//! `grpc`, `http`, `metrics`; datasource `http`, `metrics`; sync `http`; manager `http`.
//!
//! A third-party server that cannot write a ready file (etcd, rclone) is started with
//! [`DaemonCommand::listening_on`] instead: it is ready when every named TCP address accepts a connection.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::poll::POLL_INTERVAL;

/// How long a daemon may take from spawn to ready unless the test says otherwise: generous, because a loaded
/// 2-core CI machine starts a debug binary slowly; a healthy start takes well under a second.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How much of a daemon's log a failing test prints (its end, where the failure is).
const LOG_TAIL_BYTES: usize = 64 << 10;

/// What a daemon wrote to its ready file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ReadyReport {
    pub pid: u32,
    /// Listener name → `host:port` or `unix:/path`.
    pub listen: BTreeMap<String, String>,
}

impl ReadyReport {
    /// Reads and parses a ready file.
    ///
    /// # Errors
    /// When the file is missing, unreadable or not the documented JSON.
    pub fn read(path: &Path) -> Result<Self, DaemonError> {
        let text = std::fs::read(path).map_err(|source| DaemonError::ReadyFile {
            path: path.to_owned(),
            reason: source.to_string(),
        })?;
        serde_json::from_slice(&text).map_err(|e| DaemonError::ReadyFile {
            path: path.to_owned(),
            reason: format!("{e}: {}", String::from_utf8_lossy(&text)),
        })
    }
}

/// Why a daemon did not come up.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("could not spawn {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("{label} exited before it was ready ({status}); its log:\n{log}")]
    Exited {
        label: String,
        status: ExitStatus,
        log: String,
    },
    #[error("{label} not ready within {timeout:?}: {waiting}; its log:\n{log}")]
    NotReady {
        label: String,
        timeout: Duration,
        waiting: String,
        log: String,
    },
    #[error("ready file {path}: {reason}")]
    ReadyFile { path: PathBuf, reason: String },
}

impl DaemonError {
    /// The daemon failed because an address it was told to bind was taken: a retry on other ports may succeed.
    pub fn is_address_in_use(&self) -> bool {
        match self {
            DaemonError::Exited { log, .. } => {
                let log = log.to_ascii_lowercase();
                log.contains("address already in use")
                    || log.contains("address in use")
                    || log.contains("os error 98")
            }
            _ => false,
        }
    }
}

/// How a daemon says it is ready.
#[derive(Debug, Clone)]
enum Readiness {
    /// `--ready-file PATH` is appended to the arguments.
    ReadyFile,
    /// Ready when each named TCP address accepts a connection (servers that cannot write a ready file).
    Listening(BTreeMap<String, String>),
}

/// A daemon to start: program, arguments, environment and how it reports readiness.
#[derive(Debug, Clone)]
pub struct DaemonCommand {
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    readiness: Readiness,
    ready_timeout: Duration,
    label: String,
    log_file: Option<PathBuf>,
    own_process_group: bool,
}

impl DaemonCommand {
    /// A Corral daemon at `program` that takes `--ready-file`.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        let program = program.into();
        let label = program.file_name().map_or_else(
            || program.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        Self {
            program,
            args: Vec::new(),
            envs: Vec::new(),
            readiness: Readiness::ReadyFile,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            label,
            log_file: None,
            own_process_group: false,
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Replaces the value after `flag` (its first occurrence), or appends `flag value` when absent: e.g. to restart
    /// a daemon on the port it reported, `--listen 127.0.0.1:0` becomes `--listen 127.0.0.1:40123`.
    pub fn set_flag(mut self, flag: &str, value: impl AsRef<OsStr>) -> Self {
        match self.args.iter().position(|a| a == flag) {
            Some(i) if i + 1 < self.args.len() => self.args[i + 1] = value.as_ref().to_owned(),
            _ => {
                self.args.push(flag.into());
                self.args.push(value.as_ref().to_owned());
            }
        }
        self
    }

    /// The name in messages and log file names (default: the program's file name).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Where the log goes (appended), instead of a file in the daemon's own temporary directory: for a benchmark
    /// whose report names it.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_file = Some(path.into());
        self
    }

    /// Runs the daemon in a process group of its own (its pid is the group id), so a test can signal its whole
    /// group, as an init system or a container runtime would, without signalling itself.
    pub fn own_process_group(mut self) -> Self {
        self.own_process_group = true;
        self
    }

    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// For a server that cannot write a ready file: it is ready when TCP address `addr` (named `name` in
    /// [`Daemon::addr`]) accepts a connection. No `--ready-file` is passed once any address is named.
    pub fn listening_on(mut self, name: &str, addr: impl fmt::Display) -> Self {
        let addr = addr.to_string();
        match &mut self.readiness {
            Readiness::Listening(m) => {
                m.insert(name.to_owned(), addr);
            }
            r @ Readiness::ReadyFile => *r = Readiness::Listening(BTreeMap::from([(name.to_owned(), addr)])),
        }
        self
    }

    /// Starts the daemon and waits until it is ready.
    ///
    /// # Panics
    /// When it cannot be spawned, exits early or is not ready in time; the message carries its log.
    pub fn spawn(self) -> Daemon {
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`spawn`](Self::spawn) returning the failure instead (e.g. to retry on [`DaemonError::is_address_in_use`]).
    ///
    /// # Errors
    /// When the daemon cannot be spawned, exits before it is ready or is not ready in time.
    pub fn try_spawn(self) -> Result<Daemon, DaemonError> {
        let run_dir = tempfile::Builder::new()
            .prefix(&format!("{}-", self.label))
            .tempdir()
            .map_err(|source| DaemonError::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        let log = self
            .log_file
            .clone()
            .unwrap_or_else(|| run_dir.path().join(format!("{}.log", self.label)));
        let mut d = Daemon {
            command: self,
            child: None,
            report: ReadyReport {
                pid: 0,
                listen: BTreeMap::new(),
            },
            log,
            run_dir,
        };
        d.start()?;
        Ok(d)
    }
}

/// A running daemon: killed (SIGKILL) on drop; its log is printed when the test is failing.
#[derive(Debug)]
pub struct Daemon {
    command: DaemonCommand,
    child: Option<Child>,
    report: ReadyReport,
    log: PathBuf,
    run_dir: tempfile::TempDir,
}

impl Daemon {
    fn ready_path(&self) -> PathBuf {
        self.run_dir.path().join("ready.json")
    }

    fn start(&mut self) -> Result<(), DaemonError> {
        let c = &self.command;
        let ready_path = self.ready_path();
        let _ = std::fs::remove_file(&ready_path);
        let spawn_err = |source| DaemonError::Spawn {
            program: c.program.display().to_string(),
            source,
        };
        // One file for stdout and stderr, appended over restarts: nobody has to drain a pipe, and the whole story
        // is there when a test fails.
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(spawn_err)?;
        let mut cmd = Command::new(&c.program);
        cmd.args(&c.args)
            .envs(c.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(spawn_err)?)
            .stderr(log);
        if matches!(c.readiness, Readiness::ReadyFile) {
            cmd.arg("--ready-file").arg(&ready_path);
        }
        if c.own_process_group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        let mut child = cmd.spawn().map_err(spawn_err)?;
        let deadline = Instant::now() + c.ready_timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(DaemonError::Exited {
                    label: c.label.clone(),
                    status,
                    log: log_tail(&self.log),
                });
            }
            let waiting = match &c.readiness {
                Readiness::ReadyFile => match ReadyReport::read(&ready_path) {
                    Ok(r) if r.pid == child.id() => {
                        self.report = r;
                        break;
                    }
                    Ok(r) => format!("{} names pid {}, not {}", ready_path.display(), r.pid, child.id()),
                    Err(e) => e.to_string(),
                },
                Readiness::Listening(addrs) => match addrs
                    .iter()
                    .find(|(_, a)| TcpStream::connect(a.as_str()).is_err())
                {
                    None => {
                        self.report = ReadyReport {
                            pid: child.id(),
                            listen: addrs.clone(),
                        };
                        break;
                    }
                    Some((name, a)) => format!("{name} on {a} does not accept connections"),
                },
            };
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(DaemonError::NotReady {
                    label: c.label.clone(),
                    timeout: c.ready_timeout,
                    waiting,
                    log: log_tail(&self.log),
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        self.child = Some(child);
        Ok(())
    }

    /// The address listener `name` bound: `host:port` or `unix:/path`.
    ///
    /// # Panics
    /// When the daemon reported no such listener.
    pub fn addr(&self, name: &str) -> &str {
        self.report.listen.get(name).map_or_else(
            || {
                panic!(
                    "{} reported no listener {name:?} (it reported {:?})",
                    self.command.label, self.report.listen
                )
            },
            String::as_str,
        )
    }

    /// The TCP address of listener `name`.
    ///
    /// # Panics
    /// When there is no such listener or it is a unix socket.
    pub fn socket_addr(&self, name: &str) -> SocketAddr {
        let a = self.addr(name);
        a.parse().unwrap_or_else(|e| {
            panic!(
                "{} listener {name} is {a:?}, not host:port: {e}",
                self.command.label
            )
        })
    }

    /// The TCP port of listener `name`.
    ///
    /// # Panics
    /// As [`socket_addr`](Self::socket_addr).
    pub fn port(&self, name: &str) -> u16 {
        self.socket_addr(name).port()
    }

    /// `http://host:port` of listener `name`.
    pub fn http_url(&self, name: &str) -> String {
        format!("http://{}", self.socket_addr(name))
    }

    /// Every listener the daemon reported.
    pub fn listeners(&self) -> &BTreeMap<String, String> {
        &self.report.listen
    }

    /// The process id (as the daemon reported it in its ready file).
    pub fn pid(&self) -> u32 {
        self.report.pid
    }

    pub fn command(&self) -> &DaemonCommand {
        &self.command
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The daemon's log so far (stdout and stderr, every start).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running (false once it exited or was killed).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL and reap; nothing when it is not running.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait up to `grace` for the exit; SIGKILL after that. Returns the exit status, `None` when it had
    /// to be killed or was not running.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Some(pid) = i32::try_from(child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Kills the daemon and starts the same command again (with port 0, it may bind other ports).
    ///
    /// # Panics
    /// As [`DaemonCommand::spawn`].
    pub fn restart(&mut self) {
        self.kill();
        self.start().unwrap_or_else(|e| panic!("restart: {e}"));
    }

    /// Kills the daemon and starts `command` in its place, keeping the log file (e.g. the same command with the
    /// ports it reported, see [`DaemonCommand::set_flag`]).
    ///
    /// # Panics
    /// As [`DaemonCommand::spawn`].
    pub fn restart_with(&mut self, command: DaemonCommand) {
        self.kill();
        self.command = command;
        self.start().unwrap_or_else(|e| panic!("restart: {e}"));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- log of {} ({}) ----\n{}\n---- end of log of {} ----",
                self.command.label,
                self.log.display(),
                log_tail(&self.log),
                self.command.label
            );
        }
    }
}

/// SIGKILLs every process (but this one) whose command line mentions `dir`: the daemons a manager started for a
/// test under its data directory, which outlive the manager when it is killed.
pub fn kill_under(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|&p| u32::try_from(p).ok() != Some(std::process::id()))
            .and_then(rustix::process::Pid::from_raw)
        else {
            continue;
        };
        if std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// The last [`LOG_TAIL_BYTES`] of a log file.
fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let skip = len.saturating_sub(LOG_TAIL_BYTES as u64);
    let _ = f.seek(SeekFrom::Start(skip));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    if skip > 0 {
        format!("[… {skip} bytes before]\n{text}")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in daemon in sh: binds nothing, but honours the ready-file contract.
    fn sh_daemon(script: &str) -> DaemonCommand {
        DaemonCommand::new("/bin/sh")
            .label("sh-daemon")
            .args(["-c", script, "sh"])
    }

    #[test]
    fn reads_the_listeners_from_the_ready_file() {
        // `$1` and `$2` are `--ready-file PATH`; write to a temp name and rename, as the contract says.
        let d = sh_daemon(
            r#"echo starting; printf '{"pid": %s, "listen": {"http": "127.0.0.1:4000", "sock": "unix:/x"}}' $$ > "$2.tmp"; mv "$2.tmp" "$2"; exec sleep 60"#,
        )
        .spawn();
        assert_eq!(d.port("http"), 4000);
        assert_eq!(d.addr("sock"), "unix:/x");
        assert!(d.log_text().contains("starting"));
    }

    #[test]
    fn a_daemon_that_exits_early_fails_with_its_log() {
        let e = sh_daemon("echo 'bind 127.0.0.1:5: Address already in use (os error 98)' >&2; exit 3")
            .try_spawn()
            .unwrap_err();
        assert!(e.is_address_in_use(), "{e}");
        assert!(e.to_string().contains("exited before it was ready"), "{e}");
    }

    #[test]
    fn a_ready_file_of_another_pid_is_not_ready() {
        let e = sh_daemon(r#"echo '{"pid": 1, "listen": {}}' > "$2"; exec sleep 60"#)
            .ready_timeout(Duration::from_millis(300))
            .try_spawn()
            .unwrap_err();
        assert!(e.to_string().contains("names pid 1"), "{e}");
    }

    #[test]
    fn set_flag_replaces_or_appends() {
        let c = DaemonCommand::new("x")
            .args(["serve", "--listen", "127.0.0.1:0"])
            .set_flag("--listen", "127.0.0.1:9")
            .set_flag("--size", "1M");
        let args: Vec<_> = c.args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args, ["serve", "--listen", "127.0.0.1:9", "--size", "1M"]);
    }
}
