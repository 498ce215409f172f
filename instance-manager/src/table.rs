//! The process table: every process this instance manager owns, persisted as `<data-dir>/processes.json` (temp
//! file, fsync, rename, fsync of the directory) after every change, so a restarted instance manager re-adopts the
//! processes that still run (same pid and start time) and reports the ones that died meanwhile as failed.
//!
//! A process is started in its own process group with `--ready-file <data-dir>/run/<name>.ready` appended to its
//! arguments and its output appended to `<data-dir>/logs/<name>.log`. It is `starting` until its ready file names
//! its pid, then `running` with the listeners the file reports. Children this process started are reaped by a
//! task that records their exit status; adopted ones (started by an earlier run) are polled for liveness.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use corral_daemon::supervise;
use corral_proto::v1;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::ImError;

/// The data-plane binaries a process may run; nothing else (the instance manager runs as root on every node).
pub const ALLOWED_BINARIES: [&str; 4] = [
    "corral-engine",
    "corral-replica",
    "corral-bim",
    "corral-datasource",
];

/// How often starting processes' ready files and adopted processes' liveness are looked at.
const POLL: Duration = Duration::from_millis(250);

/// The default time between SIGTERM and SIGKILL of a deleted process.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    Starting,
    Running,
    Stopped,
    Error,
}

impl ProcessState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Error => "error",
        }
    }

    fn live(self) -> bool {
        matches!(self, Self::Starting | Self::Running)
    }

    fn wire(self) -> v1::InstanceProcessState {
        match self {
            Self::Starting => v1::InstanceProcessState::Starting,
            Self::Running => v1::InstanceProcessState::Running,
            Self::Stopped => v1::InstanceProcessState::Stopped,
            Self::Error => v1::InstanceProcessState::Error,
        }
    }
}

/// One row of the table, as persisted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    name: String,
    kind: String,
    binary: String,
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    pid: i32,
    start_time: u64,
    started_at_ms: i64,
    state: ProcessState,
    #[serde(default)]
    exit_status: i32,
    #[serde(default)]
    error: String,
    #[serde(default)]
    listen: BTreeMap<String, String>,
    #[serde(default)]
    restarts: u32,
    log_path: PathBuf,
    /// This run of the instance manager started it (it reaps it); false for an adopted process, polled instead.
    #[serde(skip)]
    child: bool,
    /// A delete is under way: its exit is a stop, not a failure.
    #[serde(skip)]
    deleting: bool,
}

impl Entry {
    fn info(&self) -> v1::ProcessInfo {
        v1::ProcessInfo {
            name: self.name.clone(),
            kind: self.kind.clone(),
            binary: self.binary.clone(),
            args: self.args.clone(),
            pid: self.pid,
            start_time: self.start_time,
            started_at_ms: self.started_at_ms,
            state: self.state.wire().into(),
            exit_status: self.exit_status,
            error: self.error.clone(),
            listen: self.listen.clone().into_iter().collect(),
            restarts: self.restarts,
            log_path: self.log_path.display().to_string(),
            deleted: false,
        }
    }
}

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct ProcessSpec {
    pub name: String,
    pub kind: String,
    pub binary: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// Figures for `/metrics`.
#[derive(Debug, Default)]
pub struct TableFigures {
    pub by_state: BTreeMap<&'static str, i64>,
    pub restarts: u64,
}

/// The process table of one instance manager.
pub struct ProcessTable {
    data_dir: PathBuf,
    bin_dir: PathBuf,
    /// This instance manager's `--tls-dir`, given to every process it starts as `CORRAL_TLS_DIR` (the node's
    /// certificates: a client cannot choose another).
    tls_dir: Option<PathBuf>,
    entries: Mutex<BTreeMap<String, Entry>>,
    /// Orders writes of the table file (each writes the newest snapshot).
    persist_lock: tokio::sync::Mutex<()>,
    changes: broadcast::Sender<v1::ProcessInfo>,
    /// Creates that replaced a stopped or failed process of the same name since this run started.
    restarts_total: std::sync::atomic::AtomicU64,
}

impl ProcessTable {
    fn file(data_dir: &Path) -> PathBuf {
        data_dir.join("processes.json")
    }

    /// Opens the table of `data_dir`: processes recorded live that still run are adopted, those that died while no
    /// instance manager watched are recorded as failed.
    pub async fn open(data_dir: &Path, bin_dir: &Path, tls_dir: Option<&Path>) -> Result<Arc<Self>, ImError> {
        let path = Self::file(data_dir);
        let loaded: Vec<Entry> = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| ImError::Load {
                path: path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(ImError::Load {
                    path,
                    reason: e.to_string(),
                });
            }
        };
        let mut entries = BTreeMap::new();
        for mut e in loaded {
            if e.state.live() {
                if supervise::is_alive(e.pid, e.start_time, &e.binary) {
                    tracing::info!(name = e.name, pid = e.pid, state = e.state.as_str(), "re-adopted");
                } else {
                    tracing::warn!(
                        name = e.name,
                        pid = e.pid,
                        "gone while the instance manager was down"
                    );
                    e.state = ProcessState::Error;
                    e.exit_status = -1;
                    e.error = "exited while the instance manager was down (status unknown)".to_owned();
                }
            }
            entries.insert(e.name.clone(), e);
        }
        let table = Arc::new(Self {
            data_dir: data_dir.to_owned(),
            bin_dir: bin_dir.to_owned(),
            tls_dir: tls_dir.map(Path::to_owned),
            entries: Mutex::new(entries),
            persist_lock: tokio::sync::Mutex::new(()),
            changes: broadcast::channel(256).0,
            restarts_total: std::sync::atomic::AtomicU64::new(0),
        });
        table.persist().await?;
        Ok(table)
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        // A panic while holding the lock leaves the map consistent (every change is one insert or field write).
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn ready_path(&self, name: &str) -> PathBuf {
        self.data_dir.join("run").join(format!("{name}.ready"))
    }

    pub fn subscribe(&self) -> broadcast::Receiver<v1::ProcessInfo> {
        self.changes.subscribe()
    }

    fn announce(&self, info: v1::ProcessInfo) {
        // No watcher is not an error.
        let _ = self.changes.send(info);
    }

    /// Writes the table as it is now: temp file, fsync, rename, fsync of the directory.
    async fn persist(&self) -> Result<(), ImError> {
        let _order = self.persist_lock.lock().await;
        let snapshot: Vec<Entry> = self.lock().values().cloned().collect();
        let path = Self::file(&self.data_dir);
        let p = path.clone();
        let written = tokio::task::spawn_blocking(move || write_atomically(&p, &snapshot))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        written.map_err(|source| ImError::Persist { path, source })
    }

    pub fn get(&self, name: &str) -> Result<v1::ProcessInfo, ImError> {
        self.lock()
            .get(name)
            .map(Entry::info)
            .ok_or_else(|| ImError::NotFound(name.to_owned()))
    }

    pub fn list(&self) -> Vec<v1::ProcessInfo> {
        self.lock().values().map(Entry::info).collect()
    }

    pub fn figures(&self) -> TableFigures {
        let mut f = TableFigures {
            restarts: self.restarts_total.load(std::sync::atomic::Ordering::Relaxed),
            ..TableFigures::default()
        };
        for s in [
            ProcessState::Starting,
            ProcessState::Running,
            ProcessState::Stopped,
            ProcessState::Error,
        ] {
            f.by_state.insert(s.as_str(), 0);
        }
        for e in self.lock().values() {
            *f.by_state.entry(e.state.as_str()).or_default() += 1;
        }
        f
    }

    pub fn log_path(&self, name: &str) -> Result<PathBuf, ImError> {
        self.lock()
            .get(name)
            .map(|e| e.log_path.clone())
            .ok_or_else(|| ImError::NotFound(name.to_owned()))
    }

    /// Starts a process. Refuses a name that is starting or running; replaces a stopped or failed one.
    pub async fn create(self: &Arc<Self>, spec: ProcessSpec) -> Result<v1::ProcessInfo, ImError> {
        check_spec(&spec)?;
        let ready = self.ready_path(&spec.name);
        let log = self.data_dir.join("logs").join(format!("{}.log", spec.name));
        let info = {
            let mut entries = self.lock();
            let restarts = match entries.get(&spec.name) {
                Some(e) if e.state.live() || e.deleting => {
                    return Err(ImError::AlreadyExists {
                        name: spec.name,
                        state: e.state.as_str(),
                        pid: e.pid,
                    });
                }
                Some(e) => {
                    self.restarts_total
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    e.restarts + 1
                }
                None => 0,
            };
            // A file left by an earlier run must not pass for this one's report.
            if let Err(e) = std::fs::remove_file(&ready)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(ImError::Persist {
                    path: ready,
                    source: e,
                });
            }
            if let Some(dir) = ready.parent() {
                std::fs::create_dir_all(dir).map_err(|source| ImError::Persist {
                    path: dir.to_owned(),
                    source,
                })?;
            }
            let mut args = spec.args.clone();
            args.push("--ready-file".to_owned());
            args.push(ready.display().to_string());
            let mut env: Vec<(String, String)> = spec.env.clone().into_iter().collect();
            if let Some(dir) = &self.tls_dir {
                // Last: it wins over a client's value.
                env.push((corral_tls::TLS_DIR_ENV.to_owned(), dir.display().to_string()));
            }
            let (spawned, child) = supervise::spawn(&self.bin_dir.join(&spec.binary), &args, &env, &log)
                .map_err(|source| ImError::Spawn {
                    name: spec.name.clone(),
                    source,
                })?;
            let entry = Entry {
                name: spec.name.clone(),
                kind: spec.kind,
                binary: spec.binary,
                args,
                env: spec.env,
                pid: spawned.pid,
                start_time: spawned.start_time,
                started_at_ms: spawned.started_at_ms,
                state: ProcessState::Starting,
                exit_status: 0,
                error: String::new(),
                listen: BTreeMap::new(),
                restarts,
                log_path: log,
                child: true,
                deleting: false,
            };
            let info = entry.info();
            entries.insert(spec.name.clone(), entry);
            self.reap(spec.name, spawned.pid, child);
            info
        };
        tracing::info!(name = info.name, pid = info.pid, binary = info.binary, "started");
        self.announce(info.clone());
        self.persist().await?;
        Ok(info)
    }

    /// Records the exit of a child this run started.
    fn reap(self: &Arc<Self>, name: String, pid: i32, mut child: tokio::process::Child) {
        let table = Arc::clone(self);
        tokio::spawn(async move {
            let status = child.wait().await;
            let info = {
                let mut entries = table.lock();
                let Some(e) = entries.get_mut(&name).filter(|e| e.pid == pid) else {
                    return;
                };
                match status {
                    Ok(s) if s.success() || e.deleting => {
                        e.state = ProcessState::Stopped;
                        e.exit_status = s.code().unwrap_or(-1);
                    }
                    Ok(s) => {
                        e.state = ProcessState::Error;
                        e.exit_status = s.code().unwrap_or(-1);
                        e.error = format!("exited: {s}");
                    }
                    Err(err) => {
                        e.state = ProcessState::Error;
                        e.exit_status = -1;
                        e.error = format!("cannot wait for it: {err}");
                    }
                }
                e.listen.clear();
                tracing::info!(
                    name,
                    pid,
                    state = e.state.as_str(),
                    status = e.exit_status,
                    "exited"
                );
                e.info()
            };
            table.announce(info);
            if let Err(e) = table.persist().await {
                tracing::error!(error = %e, "cannot record an exit");
            }
        });
    }

    /// SIGTERM, SIGKILL after `grace`, then forgets the process.
    pub async fn delete(&self, name: &str, grace: Duration) -> Result<v1::ProcessInfo, ImError> {
        let (pid, start, binary) = {
            let mut entries = self.lock();
            let e = entries
                .get_mut(name)
                .ok_or_else(|| ImError::NotFound(name.to_owned()))?;
            e.deleting = true;
            (e.pid, e.start_time, e.binary.clone())
        };
        tracing::info!(name, pid, "stopping");
        supervise::terminate(pid, start, &binary, grace).await;
        let removed = self.lock().remove(name);
        let _ = std::fs::remove_file(self.ready_path(name));
        let mut info = removed.map_or_else(
            || v1::ProcessInfo {
                name: name.to_owned(),
                ..Default::default()
            },
            |mut e| {
                if e.state.live() {
                    e.state = ProcessState::Stopped;
                    e.exit_status = -1;
                    e.listen.clear();
                }
                e.info()
            },
        );
        self.persist().await?;
        info.deleted = true;
        self.announce(info.clone());
        Ok(info)
    }

    /// Until `cancel`: moves starting processes to running once their ready file names their pid, and records
    /// adopted processes that died.
    pub async fn monitor(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(POLL) => {}
            }
            let mut changed = Vec::new();
            {
                let mut entries = self.lock();
                for e in entries.values_mut().filter(|e| e.state.live() && !e.deleting) {
                    if !e.child && !supervise::is_alive(e.pid, e.start_time, &e.binary) {
                        e.state = ProcessState::Error;
                        e.exit_status = -1;
                        e.error =
                            "exited (status unknown: adopted from an earlier instance manager)".to_owned();
                        e.listen.clear();
                        tracing::warn!(name = e.name, pid = e.pid, "adopted process is gone");
                        changed.push(e.info());
                        continue;
                    }
                    if e.state == ProcessState::Starting
                        && let Ok(report) = corral_daemon::ready::ReadyReport::read(
                            &self.data_dir.join("run").join(format!("{}.ready", e.name)),
                        )
                        && i64::from(report.pid) == i64::from(e.pid)
                    {
                        e.state = ProcessState::Running;
                        e.listen = report.listen;
                        tracing::info!(name = e.name, pid = e.pid, listen = ?e.listen, "ready");
                        changed.push(e.info());
                    }
                }
            }
            if changed.is_empty() {
                continue;
            }
            for info in changed {
                self.announce(info);
            }
            if let Err(e) = self.persist().await {
                tracing::error!(error = %e, "cannot record a state change");
            }
        }
    }
}

/// The checks of a create request: names that become file names, a binary from the allowlist, no ready file of
/// the caller's own (the instance manager reads the one it passes).
pub fn check_spec(spec: &ProcessSpec) -> Result<(), ImError> {
    corral_disk::identity::check_path_component("process name", &spec.name)
        .map_err(ImError::InvalidArgument)?;
    corral_disk::identity::check_path_component("process kind", &spec.kind)
        .map_err(ImError::InvalidArgument)?;
    if !ALLOWED_BINARIES.contains(&spec.binary.as_str()) {
        return Err(ImError::InvalidArgument(format!(
            "binary {:?} is not a data-plane binary: one of {}",
            spec.binary,
            ALLOWED_BINARIES.join(", ")
        )));
    }
    if spec
        .args
        .iter()
        .any(|a| a == "--ready-file" || a.starts_with("--ready-file="))
    {
        return Err(ImError::InvalidArgument(
            "--ready-file is the instance manager's: leave it out of the arguments".to_owned(),
        ));
    }
    if let Some(k) = spec.env.keys().find(|k| k.is_empty() || k.contains(['=', '\0'])) {
        return Err(ImError::InvalidArgument(format!(
            "bad environment variable name {k:?}"
        )));
    }
    Ok(())
}

fn write_atomically(path: &Path, entries: &[Entry]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(entries).map_err(std::io::Error::other)?;
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// The last `lines` lines of `path`.
pub fn tail(path: &Path, lines: usize) -> Result<Vec<String>, ImError> {
    use std::io::{Read, Seek, SeekFrom};
    // Read at most the last 1 MiB: enough for any reasonable tail, bounded for a huge log.
    const WINDOW: u64 = 1 << 20;
    let mut f = std::fs::File::open(path).map_err(|source| ImError::Log {
        path: path.to_owned(),
        source,
    })?;
    let mut read = || -> std::io::Result<Vec<u8>> {
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        Ok(buf)
    };
    let buf = read().map_err(|source| ImError::Log {
        path: path.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    Ok(all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|s| (*s).to_owned())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, binary: &str) -> ProcessSpec {
        ProcessSpec {
            name: name.into(),
            kind: "engine".into(),
            binary: binary.into(),
            ..ProcessSpec::default()
        }
    }

    #[test]
    fn requests_outside_the_rules_are_refused_with_the_reason() {
        let e = check_spec(&spec("a", "bash")).unwrap_err().to_string();
        assert!(
            e.contains("not a data-plane binary") && e.contains("corral-engine"),
            "{e}"
        );
        let e = check_spec(&spec("a", "../corral-engine"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a data-plane binary"), "{e}");
        for bad in ["../x", "a/b", "..", ".hidden", ""] {
            assert!(
                check_spec(&spec(bad, "corral-engine")).is_err(),
                "{bad:?} accepted"
            );
        }
        let mut s = spec("a", "corral-engine");
        s.args = vec!["--ready-file=/tmp/x".into()];
        assert!(check_spec(&s).unwrap_err().to_string().contains("--ready-file"));
        check_spec(&spec("engine-vol1", "corral-replica")).unwrap();
    }

    #[test]
    fn the_tail_is_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.log");
        std::fs::write(&p, "a\nb\nc\n").unwrap();
        assert_eq!(tail(&p, 2).unwrap(), ["b", "c"]);
        assert_eq!(tail(&p, 10).unwrap(), ["a", "b", "c"]);
        assert!(tail(&dir.path().join("none"), 1).is_err());
    }
}
