//! Supervision of the daemons a node's manager runs (`corral-replica`, `corral-engine`, `corral-bim`,
//! `corral-datasource`), behind one interface with two process hosts ([`ProcessHost`]):
//! - **local** (the default): the manager starts them itself, each in its own process group (a signal to the
//!   manager's group or a manager SIGKILL does not reach it), its log appended to `<data-dir>/logs/<kind>-<name>.log`,
//!   liveness by pid plus start time (`corral_daemon::supervise`), so a restarted manager re-adopts what still runs;
//! - **instance manager** (`--instance-manager URL`): the node's `corral-im` owns them (process `<kind>-<name>`), so
//!   they also outlive the manager's container; the manager only asks it to create, report and delete them.
//!
//! Ports: a daemon is started with port 0 for every listener (or, on a restart, the ports it reported last, so
//! clients keep its address) and a ready file; the controller observes it on its next reconciles — it never blocks
//! waiting — and records the reported listeners in the [`ProcessRecord`]. A daemon that dies before it reports
//! ready (its old port taken: address in use) has no reported ports, so its next start asks for port 0 again. No
//! port is probed or derived from another.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use corral_daemon::supervise;
use corral_proto::v1;

use crate::instance_manager::InstanceManager;
use crate::model::ProcessRecord;

pub use corral_daemon::supervise::now_ms;

/// How long a started daemon may take to report ready before it is killed and started again (a loaded 2-core
/// machine starts a debug binary slowly; a healthy start takes well under a second).
pub const READY_DEADLINE: Duration = Duration::from_secs(60);

/// Why a daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Spawn(#[from] supervise::SpawnError),
    #[error("cannot prepare the ready file {path}: {source}")]
    ReadyFile { path: PathBuf, source: std::io::Error },
    #[error("instance manager {url}: cannot start {name}: {status}")]
    InstanceManager {
        url: String,
        name: String,
        status: tonic::Status,
    },
}

/// The one restart policy of the manager: the delay before the `attempt`-th restart of a daemon (and before the
/// `attempt`-th retry of a failed reconcile): 0.5 s doubling up to 30 s.
pub fn restart_backoff(attempt: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << attempt.min(6)).min(30_000))
}

/// The process of `rec` still runs (same pid, same start time) and runs `binary_name`.
pub fn is_alive(rec: &ProcessRecord, binary_name: &str) -> bool {
    supervise::is_alive(rec.pid, rec.start_time, binary_name)
}

/// Where the node's daemons run.
#[derive(Debug, Clone)]
pub enum ProcessHost {
    /// Children of this manager, started from `bin_dir`, given `tls_dir` (the manager's `--tls-dir`) as
    /// `CORRAL_TLS_DIR`.
    Local {
        bin_dir: PathBuf,
        tls_dir: Option<PathBuf>,
    },
    /// Processes of the node's instance manager.
    InstanceManager(InstanceManager),
}

impl ProcessHost {
    /// The instance manager, when daemons run there.
    pub fn instance_manager(&self) -> Option<&InstanceManager> {
        match self {
            Self::Local { .. } => None,
            Self::InstanceManager(im) => Some(im),
        }
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
    /// Prefix of log and ready file names (`engine` → `logs/engine-NAME.log`, `run/engine-NAME.ready`), and of
    /// the process name in an instance manager (`engine-NAME`).
    kind: &'static str,
    host: ProcessHost,
    data_dir: PathBuf,
    /// What this manager process started locally, so a daemon is stopped even after its document is gone.
    started: Mutex<HashMap<String, ProcessRecord>>,
}

impl Supervisor {
    /// Daemons of `kind` on the node's process host (`NodeConfig::processes`), files under `data_dir`.
    pub fn new(binary: &'static str, kind: &'static str, host: &ProcessHost, data_dir: &Path) -> Self {
        Self::on(binary, kind, host.clone(), data_dir)
    }

    /// Daemons of `kind` started by this manager from `bin_dir`.
    pub fn local(binary: &'static str, kind: &'static str, bin_dir: &Path, data_dir: &Path) -> Self {
        Self::on(
            binary,
            kind,
            ProcessHost::Local {
                bin_dir: bin_dir.to_owned(),
                tls_dir: None,
            },
            data_dir,
        )
    }

    fn on(binary: &'static str, kind: &'static str, host: ProcessHost, data_dir: &Path) -> Self {
        Self {
            binary,
            kind,
            host,
            data_dir: data_dir.to_owned(),
            started: Mutex::default(),
        }
    }

    pub fn binary(&self) -> &'static str {
        self.binary
    }

    /// The name of `name`'s process in an instance manager (one namespace for every kind).
    pub fn process_name(&self, name: &str) -> String {
        format!("{}-{name}", self.kind)
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.data_dir
            .join("logs")
            .join(format!("{}-{name}.log", self.kind))
    }

    /// The ready file of a local daemon; also the base name of files the manager writes beside it for the
    /// daemon (a data source's credentials), which the instance manager reads at the same path.
    pub fn ready_path(&self, name: &str) -> PathBuf {
        self.data_dir
            .join("run")
            .join(format!("{}-{name}.ready", self.kind))
    }

    /// What the daemon recorded in `rec` does now. A daemon that has not reported ready within
    /// [`READY_DEADLINE`] of its start is killed and reported down (its next start asks for port 0).
    pub async fn observe(&self, name: &str, rec: Option<&ProcessRecord>) -> Observed {
        let Some(rec) = rec else { return Observed::Down };
        match &self.host {
            ProcessHost::Local { .. } => self.observe_local(name, rec),
            ProcessHost::InstanceManager(im) => self.observe_im(im, name, rec).await,
        }
    }

    fn observe_local(&self, name: &str, rec: &ProcessRecord) -> Observed {
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
        if self.past_ready_deadline(name, rec) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(rec.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            return Observed::Down;
        }
        Observed::Starting
    }

    async fn observe_im(&self, im: &InstanceManager, name: &str, rec: &ProcessRecord) -> Observed {
        let pname = self.process_name(name);
        let info = match im.get(&pname).await {
            Ok(Some(info)) => info,
            Ok(None) => return Observed::Down,
            Err(status) => {
                // The instance manager is restarting or unreachable: its processes are not known to be gone,
                // so nothing is restarted; the next reconcile looks again.
                tracing::warn!(daemon = self.binary, name, url = im.url, %status, "cannot ask the instance manager");
                return if rec.listen.is_empty() {
                    Observed::Starting
                } else {
                    Observed::Running
                };
            }
        };
        if info.pid != rec.pid || info.start_time != rec.start_time {
            // Another run than the recorded one (started by a manager that died before recording it): not ours.
            return Observed::Down;
        }
        match v1::InstanceProcessState::try_from(info.state) {
            Ok(v1::InstanceProcessState::Running) if rec.listen.is_empty() => {
                Observed::Ready(info.listen.into_iter().collect())
            }
            Ok(v1::InstanceProcessState::Running) => Observed::Running,
            Ok(v1::InstanceProcessState::Starting) => {
                if self.past_ready_deadline(name, rec) {
                    if let Err(status) = im.delete(&pname, Duration::ZERO).await {
                        tracing::warn!(daemon = self.binary, name, %status, "cannot delete a daemon that never got ready");
                    }
                    return Observed::Down;
                }
                Observed::Starting
            }
            _ => {
                if !info.error.is_empty() {
                    tracing::info!(daemon = self.binary, name, error = info.error, "daemon exited");
                }
                Observed::Down
            }
        }
    }

    fn past_ready_deadline(&self, name: &str, rec: &ProcessRecord) -> bool {
        let waited = u64::try_from(now_ms().saturating_sub(rec.started_at_ms)).unwrap_or(0);
        let late = Duration::from_millis(waited) > READY_DEADLINE;
        if late {
            tracing::warn!(
                daemon = self.binary,
                name,
                pid = rec.pid,
                "not ready within {READY_DEADLINE:?}: killing it"
            );
        }
        late
    }

    /// How long to wait before starting again a daemon whose last run is `rec`, as its `attempt`-th restart
    /// ([`restart_backoff`] counted from the last start); None: start now.
    pub fn restart_wait(rec: Option<&ProcessRecord>, attempt: u32) -> Option<Duration> {
        Self::wait_since_start(rec.filter(|_| attempt > 0)?, restart_backoff(attempt))
    }

    /// What is left of `backoff` counted from `rec`'s start; None: nothing.
    pub fn wait_since_start(rec: &ProcessRecord, backoff: Duration) -> Option<Duration> {
        let since =
            Duration::from_millis(u64::try_from(now_ms().saturating_sub(rec.started_at_ms)).unwrap_or(0));
        backoff.checked_sub(since).filter(|d| !d.is_zero())
    }

    /// The port listener `name` should ask for on a start: the one the last run reported (clients keep its
    /// address), or 0 (the daemon picks one and reports it).
    pub fn previous_port(rec: Option<&ProcessRecord>, listener: &str) -> u16 {
        rec.and_then(|r| r.listen.get(listener))
            .and_then(|a| a.parse::<SocketAddr>().ok())
            .map_or(0, |a| a.port())
    }

    /// Starts the daemon for `name` with `args` (and a ready file); the record has no listeners until
    /// [`Supervisor::observe`] reports them.
    pub async fn start(
        &self,
        name: &str,
        args: Vec<String>,
        restarts: u32,
    ) -> Result<ProcessRecord, ProcessError> {
        let mut rec = match &self.host {
            ProcessHost::Local { bin_dir, tls_dir } => {
                self.start_local(bin_dir, tls_dir.as_deref(), name, args)?
            }
            ProcessHost::InstanceManager(im) => self.start_im(im, name, args).await?,
        };
        rec.restarts = restarts;
        Ok(rec)
    }

    fn start_local(
        &self,
        bin_dir: &Path,
        tls_dir: Option<&Path>,
        name: &str,
        mut args: Vec<String>,
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
        let binary = bin_dir.join(self.binary);
        let env: Vec<_> = tls_dir
            .map(|d| (corral_tls::TLS_DIR_ENV.to_owned(), d.display().to_string()))
            .into_iter()
            .collect();
        let (spawned, mut child) = supervise::spawn(&binary, &args, &env, &self.log_path(name))?;
        let pid = spawned.pid;
        let shown = binary.display().to_string();
        // Reaped here so it never lingers as a zombie; a restarted manager finds it by pid and start time.
        tokio::spawn(async move {
            match child.wait().await {
                Ok(status) => tracing::info!(pid, binary = %shown, %status, "daemon exited"),
                Err(e) => tracing::warn!(pid, binary = %shown, error = %e, "cannot wait for daemon"),
            }
        });
        let rec = ProcessRecord {
            pid,
            start_time: spawned.start_time,
            listen: BTreeMap::new(),
            started_at_ms: spawned.started_at_ms,
            restarts: 0,
        };
        if let Ok(mut m) = self.started.lock() {
            m.insert(name.to_owned(), rec.clone());
        }
        Ok(rec)
    }

    async fn start_im(
        &self,
        im: &InstanceManager,
        name: &str,
        args: Vec<String>,
    ) -> Result<ProcessRecord, ProcessError> {
        let pname = self.process_name(name);
        let req = v1::ProcessCreateRequest {
            name: pname.clone(),
            kind: self.kind.to_owned(),
            binary: self.binary.to_owned(),
            args,
            env: Default::default(),
        };
        let err = |status| ProcessError::InstanceManager {
            url: im.url.clone(),
            name: pname.clone(),
            status,
        };
        let info = match im.create(req.clone()).await {
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                // Started by a manager that died before recording it: nothing uses it; start it afresh.
                tracing::info!(
                    daemon = self.binary,
                    name,
                    "replacing an unrecorded process of the instance manager"
                );
                im.delete(&pname, Duration::from_secs(10)).await.map_err(err)?;
                im.create(req).await.map_err(err)?
            }
            r => r.map_err(err)?,
        };
        Ok(ProcessRecord {
            pid: info.pid,
            start_time: info.start_time,
            listen: BTreeMap::new(),
            started_at_ms: info.started_at_ms,
            restarts: 0,
        })
    }

    /// Stops the daemon in `rec` and any this manager process started for `name`: SIGTERM, then SIGKILL after
    /// `grace`; returns once it is gone.
    pub async fn stop(&self, name: &str, rec: Option<&ProcessRecord>, grace: Duration) {
        match &self.host {
            ProcessHost::Local { .. } => {
                let started = self.started.lock().ok().and_then(|mut m| m.remove(name));
                for p in rec.into_iter().chain(started.as_ref()) {
                    supervise::terminate(p.pid, p.start_time, self.binary, grace).await;
                }
            }
            ProcessHost::InstanceManager(im) => {
                if let Err(status) = im.delete(&self.process_name(name), grace).await {
                    tracing::warn!(daemon = self.binary, name, url = im.url, %status, "cannot stop through the instance manager");
                }
            }
        }
        // Its report is stale now (and a deleted resource's would stay behind).
        let _ = std::fs::remove_file(self.ready_path(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let sup = Supervisor::local("fake-daemon", "test", dir.path(), dir.path());
        let rec = sup.start("a", Vec::new(), 0).await.unwrap();
        assert!(rec.listen.is_empty());
        assert_eq!(sup.observe("a", Some(&rec)).await, Observed::Starting);
        // Another pid's report is stale.
        corral_daemon::ready::ReadyReport {
            pid: u32::try_from(rec.pid).unwrap() + 1,
            listen: BTreeMap::new(),
        }
        .announce(Some(&sup.ready_path("a")))
        .unwrap();
        assert_eq!(sup.observe("a", Some(&rec)).await, Observed::Starting);
        let listen: BTreeMap<String, String> = [("http".to_owned(), "127.0.0.1:1".to_owned())].into();
        corral_daemon::ready::ReadyReport {
            pid: u32::try_from(rec.pid).unwrap(),
            listen: listen.clone(),
        }
        .announce(Some(&sup.ready_path("a")))
        .unwrap();
        assert_eq!(
            sup.observe("a", Some(&rec)).await,
            Observed::Ready(listen.clone())
        );
        let ready = ProcessRecord {
            listen,
            ..rec.clone()
        };
        assert_eq!(sup.observe("a", Some(&ready)).await, Observed::Running);
        // Past the deadline without a report: killed.
        let late = ProcessRecord {
            started_at_ms: rec.started_at_ms - i64::try_from(READY_DEADLINE.as_millis()).unwrap() - 1,
            ..rec.clone()
        };
        std::fs::remove_file(sup.ready_path("a")).unwrap();
        assert_eq!(sup.observe("a", Some(&late)).await, Observed::Down);
        testkit::wait_for("the killed daemon to go", Duration::from_secs(10), || {
            (!is_alive(&rec, "fake-daemon")).then_some(())
        });
        assert_eq!(sup.observe("a", Some(&rec)).await, Observed::Down);
        // Stopping removes its report.
        corral_daemon::ready::ReadyReport::new()
            .announce(Some(&sup.ready_path("a")))
            .unwrap();
        sup.stop("a", Some(&rec), Duration::from_secs(1)).await;
        assert!(!sup.ready_path("a").exists());
    }
}
