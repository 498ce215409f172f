//! `corral volume`, `corral snapshot` and `corral replica`: the volume's commands, its snapshots' and the replica
//! list, with the tables they print and the waits (attach, detach, rebuild, clone) they show progress bars for.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Subcommand};
use corral_daemon::output::{print, serialized_name, table};

use super::views::*;
use crate::client::Client;
use crate::clone::model::CloneState;
use crate::model::{Robustness, VolumeState};

// Doc comments are clap's `--help` text: `[TARGET:]NAME` is a usage pattern, not an intra-doc link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Subcommand, Debug)]
pub enum VolumeCmd {
    /// Create a volume, empty or as a clone of another (--from-volume, --from-snapshot: waits for the copy with a
    /// progress bar unless --no-wait).
    Create(CreateArgs),
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

// The arguments of `corral volume create`, whose help is `VolumeCmd::Create`'s doc comment (this struct has none,
// so that it stays the only one). Doc comments are clap's `--help` text: `[TARGET:]NAME` is a usage pattern, not
// an intra-doc link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Args, Debug)]
pub struct CreateArgs {
    pub name: String,
    /// Size with an optional K/M/G/T (or Ki/Mi/Gi/Ti) suffix; a multiple of 4096. A clone defaults to its
    /// source's size and may be larger, never smaller.
    #[arg(long, value_parser = parse_size, required_unless_present_any = ["from_volume", "from_snapshot", "from_backup", "from_backup_volume"])]
    pub size: Option<u64>,
    #[arg(long, default_value_t = 3)]
    pub replicas: u32,
    /// Data engine: v1 or v2 (replicas as lvols on v2 disks); default: the default-data-engine setting.
    #[arg(long)]
    pub data_engine: Option<crate::model::DataEngine>,
    /// Override the disable-revision-counter setting.
    #[arg(long)]
    pub disable_revision_counter: Option<bool>,
    /// A backing image under the volume's data.
    #[arg(long)]
    pub backing_image: Option<String>,
    /// Clone this volume as it is now (a snapshot is taken on it for the copy and removed afterwards).
    #[arg(long, conflicts_with = "from_snapshot")]
    pub from_volume: Option<String>,
    /// Clone this snapshot, VOLUME/SNAPSHOT.
    #[arg(long)]
    pub from_snapshot: Option<String>,
    /// Restore this backup ([TARGET:]NAME, or its URL as `corral backup ls` shows it) into the new volume (size defaults to the backup's); waits with a
    /// progress bar until restored unless --no-wait.
    #[arg(long, conflicts_with_all = ["from_volume", "from_snapshot"])]
    pub from_backup: Option<String>,
    /// A standby (DR) volume following this backup volume ([TARGET:]NAME): its newest backup is restored,
    /// then each newer one incrementally; attachable after `corral volume activate`.
    #[arg(long, requires = "standby", conflicts_with_all = ["from_volume", "from_snapshot", "from_backup"])]
    pub from_backup_volume: Option<String>,
    #[arg(long, requires = "from_backup_volume")]
    pub standby: bool,
    /// Return once the clone is created, without waiting for its copy.
    #[arg(long)]
    pub no_wait: bool,
    /// How long to wait for a clone's copy, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub timeout: u64,
}

#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
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
pub enum ReplicaCmd {
    /// List every replica: volume, node, disk, mode, state.
    Ls,
}

/// Sizes accept `Gi`-style suffixes too.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix('i').or_else(|| t.strip_suffix("iB")).unwrap_or(t);
    corral_daemon::parse_size(t)
}

pub async fn run(c: &Client, json: bool, cmd: VolumeCmd) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Create(args) => create(c, json, args).await?,
        VolumeCmd::Ls => {
            let vs: Vec<VolumeView> = c.get("/v1/volumes").await?;
            print(json, &vs, || volume_table(&vs))?;
        }
        VolumeCmd::Get { name } => {
            let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
            let restore = crate::backup::cli::restore_line(c, &name).await;
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
                v = wait_volume(c, &name, Duration::from_secs(timeout), "attaching", |v| {
                    v.state == VolumeState::Attached && (v.frontend_disabled || !v.endpoints.is_empty())
                })
                .await?;
            }
            print(json, &v, || {
                if v.frontend_disabled {
                    format!("volume {name} is attached without a frontend (maintenance)")
                } else if v.endpoints.is_empty() {
                    format!("volume {name} is {}", serialized_name(&v.state))
                } else {
                    v.endpoints.join("\n")
                }
            })?;
        }
        VolumeCmd::Detach { name, no_wait } => {
            let mut v: VolumeView = c.post(&format!("/v1/volumes/{name}/detach"), &()).await?;
            if !no_wait {
                v = wait_volume(c, &name, Duration::from_secs(60), "detaching", |v| {
                    v.state == VolumeState::Detached
                })
                .await?;
            }
            print(json, &v, || {
                format!("volume {name} is {}", serialized_name(&v.state))
            })?;
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
            let v = wait_volume(c, &name, Duration::from_secs(timeout), "rebuilding", |v| {
                v.state == VolumeState::Attached && v.robustness == Robustness::Healthy
            })
            .await?;
            print(json, &v, || volume_detail(&v))?;
        }
        VolumeCmd::Activate { name, timeout } => {
            c.post::<serde_json::Value>(&format!("/v1/volumes/{name}/activate"), &())
                .await?;
            crate::backup::cli::wait_restore(c, &name, Duration::from_secs(timeout)).await?;
            let v: VolumeView = c.get(&format!("/v1/volumes/{name}")).await?;
            print(json, &v, || format!("volume {name} is active"))?;
        }
        VolumeCmd::Salvage { name } => {
            c.post::<VolumeView>(&format!("/v1/volumes/{name}/salvage"), &())
                .await?;
            let v = wait_volume(c, &name, Duration::from_secs(120), "salvaging", |v| {
                v.robustness != Robustness::Faulted && v.state == VolumeState::Attached
            })
            .await?;
            print(json, &v, || volume_detail(&v))?;
        }
    }
    Ok(())
}

/// `corral volume create`: empty, a clone (waits for the copy unless --no-wait), restored from a backup or a
/// standby following a backup volume (waits for the restore unless --no-wait).
async fn create(c: &Client, json: bool, args: CreateArgs) -> anyhow::Result<()> {
    let CreateArgs {
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
    } = args;
    let from_backup = match (&from_backup_volume, &from_backup) {
        (Some(bv), _) => Some(crate::backup::cli::newest_backup_of(c, bv).await?),
        (None, Some(b)) => Some(crate::backup::cli::backup_id(c, b).await?),
        (None, None) => None,
    };
    let data_source = from_volume
        .map(|v| format!("vol://{v}"))
        .or(from_snapshot.map(|s| format!("snap://{s}")));
    let size = match (size, &data_source) {
        (Some(s), _) => s,
        (None, None) if from_backup.is_some() => {
            crate::backup::cli::backup_size(c, from_backup.as_deref().unwrap_or_default()).await?
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
        v = wait_clone(c, &name, Duration::from_secs(timeout)).await?;
    }
    if standby && !no_wait {
        crate::backup::cli::wait_standby(c, &name, Duration::from_secs(timeout)).await?;
        v = c.get(&format!("/v1/volumes/{name}")).await?;
    } else if from_backup.is_some() && !no_wait {
        crate::backup::cli::wait_restore(c, &name, Duration::from_secs(timeout)).await?;
        v = c.get(&format!("/v1/volumes/{name}")).await?;
    }
    print(json, &v, || volume_table(std::slice::from_ref(&v)))?;
    Ok(())
}

pub async fn run_snapshot(c: &Client, json: bool, cmd: SnapshotCmd) -> anyhow::Result<()> {
    match cmd {
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
    }
    Ok(())
}

pub async fn run_replica(c: &Client, json: bool, cmd: ReplicaCmd) -> anyhow::Result<()> {
    match cmd {
        ReplicaCmd::Ls => {
            let rs: Vec<ReplicaView> = c.get("/v1/replicas").await?;
            print(json, &rs, || replica_table(&rs))?;
        }
    }
    Ok(())
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
                        format!("{} (maintenance)", serialized_name(&v.state))
                    } else {
                        serialized_name(&v.state)
                    },
                    serialized_name(&v.robustness),
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
            serialized_name(&c.state),
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
                        serialized_name(&r.state)
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

pub async fn wait_volume(
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
                serialized_name(&v.state),
                v.message
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
