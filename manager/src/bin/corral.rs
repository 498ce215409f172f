//! `corral`: the user CLI. Talks to a manager's REST API (`--url`, `$CORRAL_URL`); `corral up` runs a single-node
//! manager on the embedded store. Tables by default, `--json` for scripts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::output::{emit, table};
use manager::client::Client;
use manager::clone::model::CloneState;
use manager::model::{Robustness, VolumeState};
use manager::node::views::{DiskCreate, NodeView};
use manager::setting::views::{SettingValue, SettingView};
use manager::volume::views::*;

#[derive(Parser, Debug)]
#[command(
    name = "corral",
    version,
    about = "Corral: replicated block volumes served over NBD"
)]
struct Cli {
    /// Manager REST address.
    #[arg(
        long,
        global = true,
        env = "CORRAL_URL",
        default_value = "http://127.0.0.1:9500"
    )]
    url: String,
    /// A file holding the API token to present (else $CORRAL_TOKEN, else DATA_DIR/admin.token, which the manager
    /// writes on first start).
    #[arg(long, global = true, env = "CORRAL_TOKEN_FILE", value_name = "PATH")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    output: corral_daemon::output::OutputArgs,
    #[command(flatten)]
    log: corral_daemon::cli::LogArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a single-node manager on the embedded store (foreground, or --detach). Its pid and address go to
    /// DATA_DIR/manager.ready (atomically) once it serves; `corral down` finds it there.
    Up {
        #[arg(long, env = "CORRAL_DATA_DIR", default_value = "./corral-data")]
        data_dir: PathBuf,
        /// REST address; port 0 picks a free port (printed, and in DATA_DIR/manager.ready).
        #[arg(long, default_value = "127.0.0.1:9500")]
        listen: SocketAddr,
        /// `embedded` or `etcd://HOST:PORT`.
        #[arg(long, default_value = "embedded")]
        store: String,
        #[arg(long, default_value = "node-1")]
        node_id: String,
        /// Start in the background and return once the API answers.
        #[arg(long)]
        detach: bool,
    },
    /// Stop the manager `corral up` runs on DATA_DIR: detach its node's attached volumes through the API, then
    /// SIGTERM it (SIGKILL after --timeout) and the daemons it leaves under DATA_DIR.
    Down {
        #[arg(long, env = "CORRAL_DATA_DIR", default_value = "./corral-data")]
        data_dir: PathBuf,
        /// Seconds to wait for each volume to detach, and for the processes to exit after SIGTERM.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Nodes and disks.
    Node {
        #[command(subcommand)]
        cmd: NodeCmd,
    },
    /// Volumes.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// Snapshots of a volume.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
    /// Replicas of every volume.
    Replica {
        #[command(subcommand)]
        cmd: ReplicaCmd,
    },
    /// Cluster settings.
    Setting {
        #[command(subcommand)]
        cmd: SettingCmd,
    },
    /// Backing images (read-only base images of volumes).
    BackingImage {
        #[command(subcommand)]
        cmd: manager::backing_image::cli::BackingImageCmd,
    },
    /// Recurring jobs: snapshots (or backups) on a cron schedule, with retention.
    Job {
        #[command(subcommand)]
        cmd: manager::job::cli::JobCmd,
    },
    /// Backups: targets, backups of volumes, restores.
    Backup {
        #[command(subcommand)]
        cmd: manager::backup::cli::BackupCmd,
    },
    /// The v2 data engine's per-disk lvstore daemons.
    Lvstore {
        #[command(subcommand)]
        cmd: manager::v2::cli::LvstoreCmd,
    },
    /// API tokens with roles (admin only): create (the secret is shown once), list, revoke.
    Token {
        #[command(subcommand)]
        cmd: manager::token::cli::TokenCmd,
    },
}

#[derive(Subcommand, Debug)]
enum NodeCmd {
    /// List the nodes: ready, schedulable, drain state, manager and data-plane versions.
    Ls,
    /// Show a node with its disks (space, engine, state) and conditions.
    Get { name: String },
    /// Add a disk (a directory) to a node. A v2 disk (--disk-engine v2) keeps its lvstore in PATH/lvstore.img:
    /// a file the manager creates preallocated (--lvstore-size, default 10G) and formats on first use, or a block
    /// device linked there (formatted only when it reads zeros); foreign data there is never formatted over.
    DiskAdd {
        node: String,
        disk: String,
        path: String,
        #[arg(long, default_value_t = 0, value_parser = corral_daemon::parse_size)]
        reserved: u64,
        /// The data engine whose replicas the disk takes: v1 or v2.
        #[arg(long, default_value = "v1")]
        disk_engine: manager::model::DataEngine,
        /// v2: size of the store file created on first use (a whole number of MiB, at least 64M).
        #[arg(long, value_parser = corral_daemon::parse_size)]
        lvstore_size: Option<u64>,
        /// Return once the disk is recorded, without waiting for the node to report it usable (its space
        /// measured; for v2, its store formatted and served) or failed.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for that, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Remove a disk from a node; refused while replicas are on it (move them first, e.g. `node drain`).
    DiskRm { node: String, disk: String },
    #[command(flatten)]
    Lifecycle(manager::node::cli::NodeLifecycleCmd),
}

// Doc comments are clap's `--help` text: `[TARGET:]NAME` is a usage pattern, not an intra-doc link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Subcommand, Debug)]
enum VolumeCmd {
    /// Create a volume, empty or as a clone of another (--from-volume, --from-snapshot: waits for the copy with a
    /// progress bar unless --no-wait).
    Create {
        name: String,
        /// Size with an optional K/M/G/T (or Ki/Mi/Gi/Ti) suffix; a multiple of 4096. A clone defaults to its
        /// source's size and may be larger, never smaller.
        #[arg(long, value_parser = parse_size, required_unless_present_any = ["from_volume", "from_snapshot", "from_backup", "from_backup_volume"])]
        size: Option<u64>,
        #[arg(long, default_value_t = 3)]
        replicas: u32,
        /// Data engine: v1 or v2 (replicas as lvols on v2 disks); default: the default-data-engine setting.
        #[arg(long)]
        data_engine: Option<manager::model::DataEngine>,
        /// Override the disable-revision-counter setting.
        #[arg(long)]
        disable_revision_counter: Option<bool>,
        /// A backing image under the volume's data.
        #[arg(long)]
        backing_image: Option<String>,
        /// Clone this volume as it is now (a snapshot is taken on it for the copy and removed afterwards).
        #[arg(long, conflicts_with = "from_snapshot")]
        from_volume: Option<String>,
        /// Clone this snapshot, VOLUME/SNAPSHOT.
        #[arg(long)]
        from_snapshot: Option<String>,
        /// Restore this backup ([TARGET:]NAME, or its URL as `corral backup ls` shows it) into the new volume (size defaults to the backup's); waits with a
        /// progress bar until restored unless --no-wait.
        #[arg(long, conflicts_with_all = ["from_volume", "from_snapshot"])]
        from_backup: Option<String>,
        /// A standby (DR) volume following this backup volume ([TARGET:]NAME): its newest backup is restored,
        /// then each newer one incrementally; attachable after `corral volume activate`.
        #[arg(long, requires = "standby", conflicts_with_all = ["from_volume", "from_snapshot", "from_backup"])]
        from_backup_volume: Option<String>,
        #[arg(long, requires = "from_backup_volume")]
        standby: bool,
        /// Return once the clone is created, without waiting for its copy.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for a clone's copy, in seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// List volumes: size, replicas, state, robustness, node, endpoint.
    Ls,
    /// One volume: replicas with their modes and rebuild progress, snapshots, endpoints.
    Get { name: String },
    /// Attach and print the NBD URI once served.
    Attach {
        name: String,
        #[arg(long)]
        node: Option<String>,
        /// Maintenance mode: run the engine without its NBD frontend (snapshots, revert; no IO from anyone).
        #[arg(long)]
        maintenance: bool,
        #[arg(long)]
        no_wait: bool,
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Stop serving the volume (its engine stops; replicas and data stay); waits until detached unless --no-wait.
    Detach {
        name: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Delete a detached volume with its replicas and their data.
    Rm { name: String },
    /// Grow the volume to --size (never shrink).
    Expand {
        name: String,
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    /// Activate a standby (DR) volume: a last incremental restore of the newest backup, then attachable.
    Activate {
        name: String,
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// Restart a faulted volume's engine from the best replica.
    Salvage { name: String },
    /// Wait (progress bar over attach and rebuilds) until the volume is attached and healthy.
    WaitHealthy {
        name: String,
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
}

#[derive(Subcommand, Debug)]
enum SnapshotCmd {
    /// Take a snapshot of a volume (named, or a generated name, printed).
    Create { volume: String, name: Option<String> },
    /// List a volume's snapshots.
    Ls { volume: String },
    /// Remove a snapshot: marked removed, then purged (its data merged into its child; the newest snapshot stays
    /// marked removed until a snapshot is taken above it).
    Rm { volume: String, name: String },
    /// Revert to a snapshot. Attached: the frontend goes down for it (clients are disconnected). Detached: the
    /// volume is attached without a frontend on this node, reverted and detached again.
    Revert { volume: String, name: String },
}

#[derive(Subcommand, Debug)]
enum ReplicaCmd {
    /// List every replica: volume, node, disk, mode, state.
    Ls,
}

#[derive(Subcommand, Debug)]
enum SettingCmd {
    /// List the settings with their values, defaults and descriptions.
    Ls,
    /// Show one setting.
    Get { name: String },
    /// Change a setting (the value is checked against the setting's type).
    Set { name: String, value: String },
}

/// Sizes accept `Gi`-style suffixes too.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix('i').or_else(|| t.strip_suffix("iB")).unwrap_or(t);
    corral_daemon::parse_size(t)
}

fn lower<T: serde::Serialize>(v: &T) -> String {
    corral_daemon::output::serialized_name(v)
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    Ok(corral_daemon::output::print(json, v, human)?)
}

fn volume_table(vs: &[VolumeView]) -> String {
    table(
        &[
            "NAME",
            "SIZE",
            "REPLICAS",
            "STATE",
            "ROBUSTNESS",
            "NODE",
            "ENDPOINT",
        ],
        vs.iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    corral_daemon::human_bytes(v.size),
                    v.number_of_replicas.to_string(),
                    if v.frontend_disabled {
                        format!("{} (maintenance)", lower(&v.state))
                    } else {
                        lower(&v.state)
                    },
                    lower(&v.robustness),
                    v.current_node_id.clone().unwrap_or_default(),
                    v.endpoints.last().cloned().unwrap_or_default(),
                ]
            })
            .collect(),
    )
    .to_string()
}

fn volume_detail(v: &VolumeView) -> String {
    let mut s = volume_table(std::slice::from_ref(v));
    s.push('\n');
    for e in &v.endpoints {
        s.push_str(&format!("endpoint: {e}\n"));
    }
    if !v.message.is_empty() {
        s.push_str(&format!("message: {}\n", v.message));
    }
    if let (Some(ds), Some(c)) = (&v.data_source, &v.clone_status) {
        s.push_str(&format!(
            "clone of {ds} (snapshot {}): {} {}%{}\n",
            c.snapshot,
            lower(&c.state),
            c.progress,
            if c.message.is_empty() {
                String::new()
            } else {
                format!(" ({})", c.message)
            }
        ));
    }
    s.push_str(&replica_table(&v.replicas));
    s
}

fn replica_table(rs: &[ReplicaView]) -> String {
    table(
        &["REPLICA", "VOLUME", "NODE", "DISK", "STATE", "MODE", "ADDRESS"],
        rs.iter()
            .map(|r| {
                vec![
                    r.name.clone(),
                    r.volume.clone(),
                    r.node_id.clone(),
                    r.disk.clone(),
                    if r.failed {
                        "failed".into()
                    } else {
                        lower(&r.state)
                    },
                    match r.rebuild_progress {
                        Some(p) => format!("{} (rebuild {p}%)", r.mode),
                        None => r.mode.clone(),
                    },
                    r.address.clone(),
                ]
            })
            .collect(),
    )
    .to_string()
}

/// The source volume's name in `vol://NAME` or `snap://NAME/SNAPSHOT`.
fn from_volume_name(data_source: &str) -> &str {
    let rest = data_source
        .strip_prefix("vol://")
        .or_else(|| data_source.strip_prefix("snap://"))
        .unwrap_or(data_source);
    rest.split('/').next().unwrap_or(rest)
}

/// Waits until the clone into `name` completed (progress bar of the copy); a failed clone is an error with its
/// reason.
async fn wait_clone(c: &Client, name: &str, timeout: Duration) -> anyhow::Result<VolumeView> {
    let bar = corral_daemon::percent_bar("cloning");
    let end = Instant::now() + timeout;
    loop {
        let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
        let Some(st) = &v.clone_status else {
            bar.finish_and_clear();
            return Ok(v);
        };
        bar.set_position(u64::from(st.progress));
        match st.state {
            CloneState::Completed => {
                bar.finish_and_clear();
                return Ok(v);
            }
            CloneState::Failed => {
                bar.abandon();
                bail!(
                    "the clone into {name} failed: {}; delete it (corral volume rm {name}) and create it again",
                    st.message
                );
            }
            CloneState::Initiated | CloneState::Copying => {}
        }
        if Instant::now() > end {
            bar.abandon();
            bail!(
                "the clone into {name} is still running ({}%) after {timeout:?}: see corral volume get {name}",
                st.progress
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Waits until `node` reports `disk` usable (its space measured, which for a v2 disk means its store is served)
/// or failed (the error, as the node reports it). A volume created before that finds no schedulable disk there.
async fn wait_disk(c: &Client, node: &str, disk: &str, timeout: Duration) -> anyhow::Result<NodeView> {
    let end = Instant::now() + timeout;
    loop {
        let n: NodeView = c.get(&format!("/v1/nodes/{node}")).await?;
        let Some(d) = n.disks.iter().find(|d| d.name == disk) else {
            bail!("disk {disk} is no longer on node {node}");
        };
        if !d.error.is_empty() {
            bail!(
                "disk {disk} on node {node} was added but cannot be used: {}",
                d.error
            );
        }
        if d.storage_maximum > 0 {
            return Ok(n);
        }
        if Instant::now() > end {
            bail!(
                "node {node} has not reported disk {disk} usable after {timeout:?} (is its manager up? see corral node \
                 get {node}); the disk stays added"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_volume(
    c: &Client,
    name: &str,
    timeout: Duration,
    what: &str,
    done: impl Fn(&VolumeView) -> bool,
) -> anyhow::Result<VolumeView> {
    let bar = corral_daemon::percent_bar(what);
    let end = Instant::now() + timeout;
    loop {
        let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
        let total = v.replicas.len().max(1) + 1;
        // Each replica counts 100 when RW, its rebuild progress while WO; the engine counts 100 once attached.
        let ready: usize = v
            .replicas
            .iter()
            .map(|r| match (r.mode.as_str(), r.rebuild_progress) {
                ("RW", _) => 100,
                (_, Some(p)) => usize::try_from(p).unwrap_or(0),
                _ => 0,
            })
            .sum::<usize>()
            + 100 * usize::from(v.state == VolumeState::Attached);
        bar.set_position(u64::try_from(ready / total).unwrap_or(0));
        if done(&v) {
            bar.finish_and_clear();
            return Ok(v);
        }
        if Instant::now() > end {
            bar.abandon();
            bail!(
                "volume {name} is {} after {timeout:?}: {}",
                lower(&v.state),
                v.message
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Where `corral up` reports the manager it runs (`{pid, listen: {http}}`, written atomically once it serves).
const MANAGER_READY_FILE: &str = "manager.ready";

async fn up(
    data_dir: PathBuf,
    listen: SocketAddr,
    store: String,
    node_id: String,
    detach: bool,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    let data_dir = data_dir.canonicalize()?;
    let ready = data_dir.join(MANAGER_READY_FILE);
    if let Some(running) = running_manager(&ready) {
        bail!(
            "a corral manager already runs on {} (pid {}, http://{}): `corral down --data-dir {}` first",
            data_dir.display(),
            running.pid,
            running.listen.get("http").map_or("?", String::as_str),
            data_dir.display()
        );
    }
    if detach {
        std::fs::create_dir_all(data_dir.join("logs"))?;
        let log = data_dir.join("logs").join("manager.log");
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let exe = std::env::current_exe()?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--listen")
            .arg(listen.to_string())
            .args(["--store", &store, "--node-id", &node_id])
            .stdin(std::process::Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let _ = std::fs::remove_file(&ready);
        let mut child = cmd.spawn().context("start the manager")?;
        let end = Instant::now() + Duration::from_secs(30);
        let report = loop {
            match corral_daemon::ready::ReadyReport::read(&ready) {
                Ok(r) if r.pid == child.id() => break r,
                _ => {}
            }
            if let Some(st) = child.try_wait()? {
                bail!(
                    "the manager exited ({st}) before it served; log: {}",
                    log.display()
                );
            }
            if Instant::now() > end {
                bail!("the manager did not serve within 30 s (log: {})", log.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        emit(&format!(
            "corral manager running (pid {}) at http://{}; log {}; stop it with: corral down --data-dir {}",
            report.pid,
            report.listen.get("http").map_or("?", String::as_str),
            log.display(),
            data_dir.display()
        ));
        return Ok(());
    }
    let cfg = manager::server::ServerConfig {
        data_dir,
        listen,
        store,
        node_id,
        host: listen.ip().to_string(),
        bin_dir: manager::server::default_bin_dir(),
        port_range: (20000, 30000),
        ready_file: Some(ready.clone()),
        instance_manager: None,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        admin_token_file: None,
    };
    let result = manager::server::run(cfg, corral_daemon::shutdown_on_signal()).await;
    // A clean stop leaves no report behind: `corral down` then says nothing runs.
    if corral_daemon::ready::ReadyReport::read(&ready).is_ok_and(|r| r.pid == std::process::id()) {
        let _ = std::fs::remove_file(&ready);
    }
    result
}

/// `/proc/PID`'s state letter, `None` when there is no such process.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `PID (COMM) STATE ...`: COMM may hold spaces and parentheses, the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Alive: exists and is not a zombie waiting for its parent.
fn alive(pid: u32) -> bool {
    process_state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// The executable's file name of a live process.
fn exe_name(pid: u32) -> Option<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    Some(
        exe.file_name()?
            .to_string_lossy()
            .trim_end_matches(" (deleted)")
            .to_owned(),
    )
}

/// The manager a ready file names, when that process still runs a Corral binary (not a stale report of a crashed
/// manager whose pid now belongs to something else).
fn running_manager(ready: &std::path::Path) -> Option<corral_daemon::ready::ReadyReport> {
    let r = corral_daemon::ready::ReadyReport::read(ready).ok()?;
    (alive(r.pid) && exe_name(r.pid).is_some_and(|n| n.starts_with("corral"))).then_some(r)
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if let Ok(p) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), sig);
    }
}

/// SIGTERM, wait up to `timeout` for every pid to exit, SIGKILL the rest. Returns the pids that had to be killed.
async fn terminate(pids: &[u32], timeout: Duration) -> Vec<u32> {
    for &p in pids {
        signal(p, nix::sys::signal::Signal::SIGTERM);
    }
    let end = Instant::now() + timeout;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let killed: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &killed {
        signal(p, nix::sys::signal::Signal::SIGKILL);
    }
    let end = Instant::now() + Duration::from_secs(5);
    while killed.iter().any(|&p| alive(p)) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    killed
}

/// Corral daemons (`corral-*`) whose command line names `dir`: what a manager on `dir` started.
fn daemons_under(dir: &std::path::Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id() && alive(p))
        .filter_map(|p| {
            let name = exe_name(p).filter(|n| n.starts_with("corral-"))?;
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(&needle)
                .then_some((p, name))
        })
        .collect()
}

/// Detaches the volumes attached to the node of the manager at `c`, waiting for each.
async fn detach_node_volumes(c: &Client, timeout: Duration) -> anyhow::Result<()> {
    let nodes: Vec<NodeView> = c.get("/v1/nodes").await?;
    let node = nodes
        .iter()
        .find(|n| n.address.trim_end_matches('/') == c.base())
        .map(|n| n.name.clone());
    let vols: Vec<VolumeView> = c.get("/v1/volumes").await?;
    let mine: Vec<&VolumeView> = vols
        .iter()
        .filter(|v| {
            let on = v.node_id.as_ref().or(v.current_node_id.as_ref());
            on.is_some() && (node.is_none() || on == node.as_ref())
        })
        .collect();
    if mine.is_empty() {
        emit("no attached volumes");
    }
    for v in mine {
        emit(&format!("detaching volume {}", v.name));
        c.post::<VolumeView>(&format!("/v1/volumes/{}/detach", v.name), &())
            .await?;
        wait_volume(c, &v.name, timeout, &format!("detaching {}", v.name), |v| {
            v.state == VolumeState::Detached && v.node_id.is_none()
        })
        .await?;
        emit(&format!("volume {} detached", v.name));
    }
    Ok(())
}

async fn down(data_dir: PathBuf, token: Option<String>, timeout: Duration) -> anyhow::Result<()> {
    let data_dir = data_dir.canonicalize().unwrap_or(data_dir);
    let ready = data_dir.join(MANAGER_READY_FILE);
    let report = match corral_daemon::ready::ReadyReport::read(&ready) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            emit(&format!(
                "no corral manager runs on {} (no {}): nothing to stop",
                data_dir.display(),
                ready.display()
            ));
            return Ok(());
        }
        Err(e) => bail!("cannot read {}: {e}", ready.display()),
    };
    let manager_runs = running_manager(&ready).is_some();
    if manager_runs {
        let addr = report.listen.get("http").cloned().unwrap_or_default();
        // The data directory's admin.token may be new since main looked (the manager made it after this started).
        let token = token.or_else(|| {
            manager::token::cli::find_token(None, None, &data_dir)
                .ok()
                .flatten()
        });
        let c = Client::new(&addr).with_token(token);
        emit(&format!(
            "stopping the corral manager on {} (pid {}, http://{addr})",
            data_dir.display(),
            report.pid
        ));
        // Volumes go first, through the API: their engines stop cleanly and the store says detached.
        if let Err(e) = detach_node_volumes(&c, timeout).await {
            eprintln!("corral: warning: volumes not detached cleanly ({e:#}); stopping anyway");
        }
        if terminate(&[report.pid], timeout).await.is_empty() {
            emit(&format!("manager (pid {}) stopped", report.pid));
        } else {
            emit(&format!(
                "manager (pid {}) did not stop within {timeout:?} of SIGTERM: killed",
                report.pid
            ));
        }
    } else {
        emit(&format!(
            "the manager {} names (pid {}) is not running: it crashed or was killed; removing the stale file",
            ready.display(),
            report.pid
        ));
    }
    let _ = std::fs::remove_file(&ready);
    let left = daemons_under(&data_dir);
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|(p, n)| format!("{n} (pid {p})")).collect();
        emit(&format!("stopping the daemons it left: {}", names.join(", ")));
        let pids: Vec<u32> = left.iter().map(|(p, _)| *p).collect();
        let killed = terminate(&pids, timeout).await;
        if !killed.is_empty() {
            emit(&format!("killed after {timeout:?}: {killed:?}"));
        }
    }
    emit("stopped");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kind = RunKind::serving(matches!(cli.cmd, Cmd::Up { .. }));
    cli.log.init(kind)?;
    let json = cli.output.json;
    // The data directory whose admin.token is the last place to look for a token (`corral up`'s default).
    let data_dir = match &cli.cmd {
        Cmd::Up { data_dir, .. } | Cmd::Down { data_dir, .. } => data_dir.clone(),
        _ => {
            std::env::var_os("CORRAL_DATA_DIR").map_or_else(|| PathBuf::from("./corral-data"), PathBuf::from)
        }
    };
    let token = manager::token::cli::find_token(
        cli.token_file.as_deref(),
        std::env::var("CORRAL_TOKEN").ok(),
        &data_dir,
    )?;
    let c = Client::new(&cli.url).with_token(token.clone());
    match cli.cmd {
        Cmd::Up {
            data_dir,
            listen,
            store,
            node_id,
            detach,
        } => up(data_dir, listen, store, node_id, detach).await?,
        Cmd::Down { data_dir, timeout } => down(data_dir, token, Duration::from_secs(timeout)).await?,
        Cmd::Token { cmd } => manager::token::cli::run(&c, json, cmd).await?,
        Cmd::Node { cmd } => match cmd {
            NodeCmd::Ls => {
                let ns: Vec<NodeView> = c.get("/v1/nodes").await?;
                print(json, &ns, || {
                    table(
                        &[
                            "NODE",
                            "READY",
                            "SCHEDULING",
                            "REPLICAS",
                            "ADDRESS",
                            "VERSION",
                            "INSTANCE MANAGER",
                            "DATA PLANE",
                            "DISKS",
                        ],
                        ns.iter()
                            .map(|n| {
                                vec![
                                    n.name.clone(),
                                    n.ready.to_string(),
                                    match (n.drain_state, n.allow_scheduling) {
                                        (manager::node::drain::DrainState::None, true) => {
                                            "allowed".to_owned()
                                        }
                                        (manager::node::drain::DrainState::None, false) => {
                                            "cordoned".to_owned()
                                        }
                                        (d, _) => d.as_str().to_owned(),
                                    },
                                    n.replicas.to_string(),
                                    n.address.clone(),
                                    n.manager_version.clone(),
                                    if n.instance_manager.is_empty() {
                                        "- (manager runs the daemons)".to_owned()
                                    } else {
                                        format!("{} {}", n.instance_manager, n.instance_manager_version)
                                    },
                                    format!(
                                        "{} ({})",
                                        n.data_plane_version,
                                        corral_proto::data_plane::effective(&n.data_plane_features).join(",")
                                    ),
                                    n.disks
                                        .iter()
                                        .map(|d| {
                                            format!(
                                                "{} {} ({} free{})",
                                                d.name,
                                                d.path,
                                                corral_daemon::human_bytes(d.storage_available),
                                                if d.error.is_empty() {
                                                    String::new()
                                                } else {
                                                    format!(", {}", d.error)
                                                }
                                            )
                                        })
                                        .collect::<Vec<_>>()
                                        .join("\n"),
                                ]
                            })
                            .collect(),
                    )
                    .to_string()
                })?;
            }
            NodeCmd::Get { name } => {
                let n: NodeView = c.get(&format!("/v1/nodes/{name}")).await?;
                print(true, &n, String::new)?;
            }
            NodeCmd::DiskAdd {
                node,
                disk,
                path,
                reserved,
                disk_engine,
                lvstore_size,
                no_wait,
                timeout,
            } => {
                let body = DiskCreate {
                    name: disk.clone(),
                    path,
                    allow_scheduling: true,
                    storage_reserved: reserved,
                    disk_engine,
                    lvstore_size,
                };
                let mut n: NodeView = c.post(&format!("/v1/nodes/{node}/disks"), &body).await?;
                if !no_wait {
                    n = wait_disk(&c, &node, &disk, Duration::from_secs(timeout)).await?;
                }
                print(true, &n, String::new)?;
            }
            NodeCmd::DiskRm { node, disk } => {
                c.delete(&format!("/v1/nodes/{node}/disks/{disk}")).await?;
            }
            NodeCmd::Lifecycle(cmd) => manager::node::cli::run(&c, json, cmd).await?,
        },
        Cmd::Volume { cmd } => match cmd {
            VolumeCmd::Create {
                name,
                size,
                replicas,
                data_engine,
                disable_revision_counter,
                backing_image,
                from_volume,
                from_snapshot,
                from_backup,
                from_backup_volume,
                standby,
                no_wait,
                timeout,
            } => {
                let from_backup = match (&from_backup_volume, &from_backup) {
                    (Some(bv), _) => Some(manager::backup::cli::newest_backup_of(&c, bv).await?),
                    (None, Some(b)) => Some(manager::backup::cli::backup_id(&c, b).await?),
                    (None, None) => None,
                };
                let data_source = from_volume
                    .map(|v| format!("vol://{v}"))
                    .or(from_snapshot.map(|s| format!("snap://{s}")));
                let size = match (size, &data_source) {
                    (Some(s), _) => s,
                    (None, None) if from_backup.is_some() => {
                        manager::backup::cli::backup_size(&c, from_backup.as_deref().unwrap_or_default())
                            .await?
                    }
                    (None, Some(_)) => {
                        let source = from_volume_name(data_source.as_deref().unwrap_or_default());
                        let v: VolumeView = c.get(&format!("/v1/volumes/{source}")).await?;
                        v.size
                    }
                    (None, None) => bail!("--size is required"),
                };
                let body = VolumeCreate {
                    name: name.clone(),
                    size,
                    number_of_replicas: replicas,
                    disable_revision_counter,
                    frontend: None,
                    backing_image,
                    data_source,
                    from_backup: from_backup.clone(),
                    standby,
                    data_engine,
                };
                let mut v: VolumeView = c.post("/v1/volumes", &body).await?;
                if v.clone_status.is_some() && !no_wait {
                    v = wait_clone(&c, &name, Duration::from_secs(timeout)).await?;
                }
                if standby && !no_wait {
                    manager::backup::cli::wait_standby(&c, &name, Duration::from_secs(timeout)).await?;
                    v = c.get(&format!("/v1/volumes/{name}")).await?;
                } else if from_backup.is_some() && !no_wait {
                    manager::backup::cli::wait_restore(&c, &name, Duration::from_secs(timeout)).await?;
                    v = c.get(&format!("/v1/volumes/{name}")).await?;
                }
                print(json, &v, || volume_table(std::slice::from_ref(&v)))?;
            }
            VolumeCmd::Ls => {
                let vs: Vec<VolumeView> = c.get("/v1/volumes").await?;
                print(json, &vs, || volume_table(&vs))?;
            }
            VolumeCmd::Get { name } => {
                let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
                let restore = manager::backup::cli::restore_line(&c, &name).await;
                print(json, &v, || volume_detail(&v) + &restore)?;
            }
            VolumeCmd::Attach {
                name,
                node,
                maintenance,
                no_wait,
                timeout,
            } => {
                let mut v: VolumeView = c
                    .post(
                        &format!("/v1/volumes/{name}/attach"),
                        &AttachRequest {
                            node_id: node,
                            disable_frontend: maintenance,
                        },
                    )
                    .await?;
                if !no_wait {
                    v = wait_volume(&c, &name, Duration::from_secs(timeout), "attaching", |v| {
                        v.state == VolumeState::Attached && (v.frontend_disabled || !v.endpoints.is_empty())
                    })
                    .await?;
                }
                print(json, &v, || {
                    if v.frontend_disabled {
                        format!("volume {name} is attached without a frontend (maintenance)")
                    } else if v.endpoints.is_empty() {
                        format!("volume {name} is {}", lower(&v.state))
                    } else {
                        v.endpoints.join("\n")
                    }
                })?;
            }
            VolumeCmd::Detach { name, no_wait } => {
                let mut v: VolumeView = c.post(&format!("/v1/volumes/{name}/detach"), &()).await?;
                if !no_wait {
                    v = wait_volume(&c, &name, Duration::from_secs(60), "detaching", |v| {
                        v.state == VolumeState::Detached
                    })
                    .await?;
                }
                print(json, &v, || format!("volume {name} is {}", lower(&v.state)))?;
            }
            VolumeCmd::Rm { name } => {
                c.delete(&format!("/v1/volumes/{name}")).await?;
            }
            VolumeCmd::Expand { name, size } => {
                let v: VolumeView = c
                    .post(&format!("/v1/volumes/{name}/expand"), &SizeRequest { size })
                    .await?;
                print(json, &v, || volume_table(std::slice::from_ref(&v)))?;
            }
            VolumeCmd::WaitHealthy { name, timeout } => {
                let v = wait_volume(&c, &name, Duration::from_secs(timeout), "rebuilding", |v| {
                    v.state == VolumeState::Attached && v.robustness == Robustness::Healthy
                })
                .await?;
                print(json, &v, || volume_detail(&v))?;
            }
            VolumeCmd::Activate { name, timeout } => {
                c.post::<serde_json::Value>(&format!("/v1/volumes/{name}/activate"), &())
                    .await?;
                manager::backup::cli::wait_restore(&c, &name, Duration::from_secs(timeout)).await?;
                let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
                print(json, &v, || format!("volume {name} is active"))?;
            }
            VolumeCmd::Salvage { name } => {
                c.post::<VolumeView>(&format!("/v1/volumes/{name}/salvage"), &())
                    .await?;
                let v = wait_volume(&c, &name, Duration::from_secs(120), "salvaging", |v| {
                    v.robustness != Robustness::Faulted && v.state == VolumeState::Attached
                })
                .await?;
                print(json, &v, || volume_detail(&v))?;
            }
        },
        Cmd::Snapshot { cmd } => match cmd {
            SnapshotCmd::Create { volume, name } => {
                let r: serde_json::Value = c
                    .post(
                        &format!("/v1/volumes/{volume}/snapshots"),
                        &SnapshotCreate {
                            name,
                            labels: Default::default(),
                        },
                    )
                    .await?;
                print(json, &r, || r["name"].as_str().unwrap_or_default().to_owned())?;
            }
            SnapshotCmd::Ls { volume } => {
                let ss: Vec<SnapshotView> = c.get(&format!("/v1/volumes/{volume}/snapshots")).await?;
                print(json, &ss, || {
                    table(
                        &["SNAPSHOT", "PARENT", "CREATED", "SIZE", "REMOVED"],
                        ss.iter()
                            .map(|s| {
                                vec![
                                    s.name.clone(),
                                    s.parent.clone(),
                                    s.created.clone(),
                                    corral_daemon::human_bytes(s.size),
                                    s.removed.to_string(),
                                ]
                            })
                            .collect(),
                    )
                    .to_string()
                })?;
            }
            SnapshotCmd::Rm { volume, name } => {
                c.delete(&format!("/v1/volumes/{volume}/snapshots/{name}"))
                    .await?;
            }
            SnapshotCmd::Revert { volume, name } => {
                let v: VolumeView = c
                    .post(&format!("/v1/volumes/{volume}/snapshots/{name}/revert"), &())
                    .await?;
                print(json, &v, || format!("volume {volume} reverted to {name}"))?;
            }
        },
        Cmd::Replica { cmd: ReplicaCmd::Ls } => {
            let rs: Vec<ReplicaView> = c.get("/v1/replicas").await?;
            print(json, &rs, || replica_table(&rs))?;
        }
        Cmd::BackingImage { cmd } => manager::backing_image::cli::run(&c, json, cmd).await?,
        Cmd::Job { cmd } => manager::job::cli::run(&c, json, cmd).await?,
        Cmd::Backup { cmd } => manager::backup::cli::run(&c, json, cmd).await?,
        Cmd::Lvstore { cmd } => manager::v2::cli::run(&c, json, cmd).await?,
        Cmd::Setting { cmd } => match cmd {
            SettingCmd::Ls => {
                let ss: Vec<SettingView> = c.get("/v1/settings").await?;
                print(json, &ss, || {
                    table(
                        &["SETTING", "VALUE", "DEFAULT", "DESCRIPTION"],
                        ss.iter()
                            .map(|s| {
                                vec![
                                    s.name.clone(),
                                    s.value.clone(),
                                    s.default.clone(),
                                    s.description.clone(),
                                ]
                            })
                            .collect(),
                    )
                    .to_string()
                })?;
            }
            SettingCmd::Get { name } => {
                let s: SettingView = c.get(&format!("/v1/settings/{name}")).await?;
                print(json, &s, || s.value.clone())?;
            }
            SettingCmd::Set { name, value } => {
                let s: SettingView = c
                    .put(&format!("/v1/settings/{name}"), &SettingValue { value })
                    .await?;
                print(json, &s, || format!("{} = {}", s.name, s.value))?;
            }
        },
    }
    Ok(())
}
