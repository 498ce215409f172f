//! Node-local: removes what this node still runs or keeps for volumes that moved on while its manager was away
//! (down, partitioned, SIGKILLed): a replica replaced elsewhere, a volume deleted, an engine re-attached on another
//! node. The controllers only act on documents, and those documents are gone (or name another node) by the time the
//! manager is back, so nothing else would stop those daemons or free that space.
//!
//! What the manager knows today, and nothing more: the daemons it started carry `--ready-file
//! <data-dir>/run/<kind>-<name>.ready` on their command line (so a process is this node's and names its resource,
//! even when no document records its pid any more), and a v1 replica's data is `<disk>/replicas/<name>`. Under an
//! instance manager (`--instance-manager`) the daemons are not in this manager's container, so `/proc` shows none
//! of them: the instance manager's process list (`ProcessList`, names `<kind>-<name>`) is asked instead, and an
//! orphan is stopped with `ProcessDelete`. When the instance manager does not answer, the sweep fails and is tried
//! again (nothing is taken for gone). Each sweep
//! asks the store about every one of them; one is an orphan when its document is gone or belongs to another node.
//! Only what stays an orphan for `GRACE` is removed (a normal deletion, which the replica and engine controllers
//! carry out themselves, is over by then), after asking the store once more right before. A document that still
//! names this node keeps its daemon and data, whatever state it is in. Each removal is logged at warn and recorded
//! in the node's `status.orphansRemoved` (`corral node get`).
//!
//! Left alone: `corral-bim`, `corral-datasource` and lvstore daemons (their controllers compare the disk's files
//! with the documents themselves), and v2 replicas (the lvstore controller removes unclaimed lvols).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use corral_proto::v1;

use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::instance_manager::InstanceManager;
use crate::model::{Engine, Node, ORPHANS_KEPT, OrphanRemoved, Replica};
use crate::runtime::now;

/// How long a stale daemon gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// How often the node looks for orphans.
const SWEEP: Duration = Duration::from_secs(5);
/// How long something must stay an orphan before it is removed.
const GRACE: Duration = Duration::from_secs(15);

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let ctx = ctx.clone();
    let cancel = cancel.clone();
    tokio::spawn(async move {
        let mut seen = Seen::default();
        loop {
            if let Err(e) = sweep(&ctx, &mut seen).await {
                tracing::warn!(error = format!("{e:#}"), "orphan sweep failed");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(SWEEP) => {}
            }
        }
    });
}

/// A daemon of this node found by its ready file on its command line.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeDaemon {
    pub kind: DaemonKind,
    /// The replica's name, or the engine's (its volume's).
    pub name: String,
    pub pid: i32,
    pub start_time: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DaemonKind {
    Replica,
    Engine,
}

impl DaemonKind {
    fn binary(self) -> &'static str {
        match self {
            Self::Replica => super::replica::BINARY,
            Self::Engine => super::engine::BINARY,
        }
    }

    /// The supervisor's kind: the prefix of ready files and of process names in an instance manager.
    fn prefix(self) -> &'static str {
        match self {
            Self::Replica => "replica",
            Self::Engine => "engine",
        }
    }
}

/// A replica or engine process of an instance manager's list, as this node's daemon (`None`: another kind, or
/// no longer running).
pub fn im_daemon(p: &v1::ProcessInfo) -> Option<NodeDaemon> {
    let kind = match p.kind.as_str() {
        "replica" => DaemonKind::Replica,
        "engine" => DaemonKind::Engine,
        _ => return None,
    };
    let running = matches!(
        v1::InstanceProcessState::try_from(p.state),
        Ok(v1::InstanceProcessState::Starting | v1::InstanceProcessState::Running)
    );
    let name = p.name.strip_prefix(kind.prefix())?.strip_prefix('-')?;
    (running && p.binary == kind.binary() && !name.is_empty()).then(|| NodeDaemon {
        kind,
        name: name.to_owned(),
        pid: p.pid,
        start_time: p.start_time,
    })
}

/// What a sweep found stale: the key and when it was first seen so.
#[derive(Default)]
struct Seen(HashMap<String, Instant>);

impl Seen {
    /// Marks `key` stale now; true once it has been for [`GRACE`].
    fn due(&mut self, key: &str) -> bool {
        self.0
            .entry(key.to_owned())
            .or_insert_with(Instant::now)
            .elapsed()
            >= GRACE
    }
}

/// Reads a replica or engine process of this node from its command line (`argv`, NUL-split): `None` for any other
/// process, or one another manager (another data directory) started.
pub fn parse_daemon(run_dir: &Path, argv: &[String]) -> Option<(DaemonKind, String)> {
    let i = argv.iter().position(|a| a == "--ready-file")?;
    let ready = Path::new(argv.get(i + 1)?);
    if ready.parent()? != run_dir {
        return None;
    }
    let file = ready.file_name()?.to_str()?.strip_suffix(".ready")?;
    let exe = Path::new(argv.first()?).file_name()?.to_str()?;
    let (kind, name) = if let Some(n) = file.strip_prefix("replica-") {
        (DaemonKind::Replica, n)
    } else if let Some(n) = file.strip_prefix("engine-") {
        (DaemonKind::Engine, n)
    } else {
        return None;
    };
    (exe == kind.binary() && !name.is_empty()).then(|| (kind, name.to_owned()))
}

/// The replica and engine processes of this node: the instance manager's, or those this node's manager started
/// (scanning `/proc`).
async fn node_daemons(ctx: &Ctx) -> anyhow::Result<Vec<NodeDaemon>> {
    if let Some(im) = ctx.cfg.processes.instance_manager() {
        let listed = im
            .list()
            .await
            .map_err(|s| anyhow::anyhow!("instance manager {}: cannot list its processes: {s}", im.url))?;
        return Ok(listed.iter().filter_map(im_daemon).collect());
    }
    let data_dir = ctx.cfg.data_dir.clone();
    Ok(tokio::task::spawn_blocking(move || local_daemons(&data_dir)).await?)
}

/// Stops a stale daemon: through the instance manager that owns it, or by its pid and start time.
async fn stop_daemon(im: Option<&InstanceManager>, d: &NodeDaemon) -> anyhow::Result<()> {
    match im {
        Some(im) => {
            let pname = format!("{}-{}", d.kind.prefix(), d.name);
            im.delete(&pname, STOP_GRACE)
                .await
                .map_err(|s| anyhow::anyhow!("instance manager {}: cannot stop {pname}: {s}", im.url))
        }
        None => {
            corral_daemon::supervise::terminate(d.pid, d.start_time, d.kind.binary(), STOP_GRACE).await;
            Ok(())
        }
    }
}

/// The replica and engine processes this node's manager started itself (scans `/proc`).
fn local_daemons(data_dir: &Path) -> Vec<NodeDaemon> {
    let run_dir = data_dir.join("run");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let Some((kind, name)) = parse_daemon(&run_dir, &argv) else {
            continue;
        };
        let Some(start_time) = corral_daemon::supervise::start_time(pid) else {
            continue;
        };
        out.push(NodeDaemon {
            kind,
            name,
            pid,
            start_time,
        });
    }
    out
}

/// Why the store no longer needs `name` on this node (`None`: it does, or might).
async fn replica_stale(ctx: &Ctx, name: &str) -> anyhow::Result<Option<String>> {
    Ok(match ctx.db.get::<Replica>(name).await? {
        None => Some("its replica document is gone (replaced or its volume deleted)".into()),
        Some(r) if r.data.spec.node_id != ctx.cfg.node_id => {
            Some(format!("the replica belongs to node {}", r.data.spec.node_id))
        }
        Some(_) => None,
    })
}

async fn engine_stale(ctx: &Ctx, name: &str) -> anyhow::Result<Option<String>> {
    Ok(match ctx.db.get::<Engine>(name).await? {
        None => Some("the volume has no engine document (detached or deleted)".into()),
        Some(e) if e.data.spec.node_id != ctx.cfg.node_id => Some(format!(
            "the volume's engine runs on node {} now",
            e.data.spec.node_id
        )),
        Some(_) => None,
    })
}

async fn sweep(ctx: &Ctx, seen: &mut Seen) -> anyhow::Result<()> {
    let daemons = node_daemons(ctx).await?;
    let mut still = Seen::default();
    let mut removed = Vec::new();
    for d in daemons {
        let key = format!("{:?}/{}/{}", d.kind, d.name, d.pid);
        let stale = match d.kind {
            DaemonKind::Replica => replica_stale(ctx, &d.name).await?,
            DaemonKind::Engine => engine_stale(ctx, &d.name).await?,
        };
        let Some(why) = stale else { continue };
        still
            .0
            .insert(key.clone(), *seen.0.get(&key).unwrap_or(&Instant::now()));
        if !still.due(&key) {
            continue;
        }
        // Once more, right before: a document written meanwhile wins.
        let again = match d.kind {
            DaemonKind::Replica => replica_stale(ctx, &d.name).await?,
            DaemonKind::Engine => engine_stale(ctx, &d.name).await?,
        };
        if again.is_none() {
            continue;
        }
        stop_daemon(ctx.cfg.processes.instance_manager(), &d).await?;
        let prefix = d.kind.prefix();
        let kind = match d.kind {
            DaemonKind::Replica => "replica-process",
            DaemonKind::Engine => "engine-process",
        };
        let _ = std::fs::remove_file(
            ctx.cfg
                .data_dir
                .join("run")
                .join(format!("{prefix}-{}.ready", d.name)),
        );
        let sock = match d.kind {
            DaemonKind::Replica => format!("replica-{}.data.sock", d.name),
            DaemonKind::Engine => format!("{}.sock", d.name),
        };
        let _ = std::fs::remove_file(ctx.cfg.data_dir.join("sockets").join(sock));
        removed.push(OrphanRemoved {
            kind: kind.into(),
            name: d.name.clone(),
            detail: format!("stopped pid {}: {why}", d.pid),
            at: now(),
        });
        still.0.remove(&key);
    }
    // A replica process that is stale but not yet due keeps its data until it is stopped.
    let running: Vec<String> = still
        .0
        .keys()
        .filter_map(|k| k.strip_prefix("Replica/"))
        .filter_map(|k| k.rsplit_once('/').map(|(n, _)| n.to_owned()))
        .collect();
    let node = ctx.db.must_get::<Node>(&ctx.cfg.node_id).await?;
    let replica_dirs: Vec<PathBuf> = node
        .data
        .spec
        .disks
        .values()
        .filter_map(|d| d.engine.replicas_dir(Path::new(&d.path)))
        .collect();
    let dirs = tokio::task::spawn_blocking(move || {
        replica_dirs
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flat_map(Iterator::flatten)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect::<Vec<_>>()
    })
    .await?;
    for path in dirs {
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
            continue;
        };
        let key = format!("data/{}", path.display());
        if running.contains(&name) {
            continue;
        }
        let Some(why) = replica_stale(ctx, &name).await? else {
            continue;
        };
        still
            .0
            .insert(key.clone(), *seen.0.get(&key).unwrap_or(&Instant::now()));
        if !still.due(&key) {
            continue;
        }
        // No process of this node may still use it (one found stale above is stopped by now).
        if replica_stale(ctx, &name).await?.is_none() {
            continue;
        }
        let p = path.clone();
        let size = tokio::task::spawn_blocking(move || {
            let size = dir_bytes(&p);
            std::fs::remove_dir_all(&p).map(|()| size)
        })
        .await?;
        match size {
            Ok(bytes) => removed.push(OrphanRemoved {
                kind: "replica-data".into(),
                name,
                detail: format!(
                    "removed {} ({}): {why}",
                    path.display(),
                    corral_daemon::human_bytes(bytes)
                ),
                at: now(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove orphaned replica data");
            }
        }
        still.0.remove(&key);
    }
    *seen = still;
    if removed.is_empty() {
        return Ok(());
    }
    for r in &removed {
        tracing::warn!(kind = r.kind, name = r.name, detail = r.detail, "removed orphan");
    }
    ctx.db
        .modify::<Node>(&ctx.cfg.node_id, |n| {
            n.status.orphans_removed.extend(removed.iter().cloned());
            let extra = n.status.orphans_removed.len().saturating_sub(ORPHANS_KEPT);
            n.status.orphans_removed.drain(..extra);
            true
        })
        .await?;
    Ok(())
}

/// Bytes the files under `dir` occupy (allocated blocks), for the report.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.blocks().saturating_mul(512),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn a_daemon_is_this_nodes_only_when_its_ready_file_is_in_this_data_dir() {
        let run = Path::new("/d/n1/run");
        assert_eq!(
            parse_daemon(
                run,
                &argv("/bin/corral-replica serve --dir /x --ready-file /d/n1/run/replica-v-r-1234abcd.ready")
            ),
            Some((DaemonKind::Replica, "v-r-1234abcd".into()))
        );
        assert_eq!(
            parse_daemon(
                run,
                &argv("/bin/corral-engine serve --ready-file /d/n1/run/engine-vol.ready")
            ),
            Some((DaemonKind::Engine, "vol".into()))
        );
        // Another node's manager, another kind, another binary, no ready file.
        assert_eq!(
            parse_daemon(
                run,
                &argv("/bin/corral-engine serve --ready-file /d/n2/run/engine-vol.ready")
            ),
            None
        );
        assert_eq!(
            parse_daemon(
                run,
                &argv("/bin/corral-bim serve --ready-file /d/n1/run/bim-disk.ready")
            ),
            None
        );
        assert_eq!(
            parse_daemon(run, &argv("/bin/sleep 9 --ready-file /d/n1/run/engine-vol.ready")),
            None
        );
        assert_eq!(parse_daemon(run, &argv("/bin/corral-engine serve")), None);
    }

    #[test]
    fn an_instance_managers_running_replica_or_engine_is_a_node_daemon_named_by_its_resource() {
        let p = |name: &str, kind: &str, binary: &str, state: v1::InstanceProcessState| v1::ProcessInfo {
            name: name.into(),
            kind: kind.into(),
            binary: binary.into(),
            pid: 42,
            start_time: 7,
            state: state.into(),
            ..Default::default()
        };
        let running = v1::InstanceProcessState::Running;
        assert_eq!(
            im_daemon(&p("replica-v-r-1", "replica", "corral-replica", running)),
            Some(NodeDaemon {
                kind: DaemonKind::Replica,
                name: "v-r-1".into(),
                pid: 42,
                start_time: 7
            })
        );
        assert_eq!(
            im_daemon(&p(
                "engine-vol",
                "engine",
                "corral-engine",
                v1::InstanceProcessState::Starting
            ))
            .map(|d| (d.kind, d.name)),
            Some((DaemonKind::Engine, "vol".into()))
        );
        // Exited, another kind, a binary that is not the kind's, a name without the kind's prefix.
        assert_eq!(
            im_daemon(&p(
                "engine-vol",
                "engine",
                "corral-engine",
                v1::InstanceProcessState::Stopped
            )),
            None
        );
        assert_eq!(
            im_daemon(&p(
                "engine-vol",
                "engine",
                "corral-engine",
                v1::InstanceProcessState::Error
            )),
            None
        );
        assert_eq!(im_daemon(&p("bim-default", "bim", "corral-bim", running)), None);
        assert_eq!(
            im_daemon(&p("engine-vol", "engine", "corral-replica", running)),
            None
        );
        assert_eq!(im_daemon(&p("vol", "engine", "corral-engine", running)), None);
        assert_eq!(im_daemon(&p("engine-", "engine", "corral-engine", running)), None);
    }
}
