//! `corral node`: list, get, disk add and remove, and the lifecycle commands cordon, uncordon and drain.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Subcommand;
use corral_daemon::output::{print, table};

use super::drain::DrainState;
use super::views::{DiskCreate, NodeView};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
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
        disk_engine: crate::model::DataEngine,
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
    Lifecycle(NodeLifecycleCmd),
}

#[derive(Subcommand, Debug)]
pub enum NodeLifecycleCmd {
    /// Stop placing new replicas on NODE (its replicas and engines stay).
    Cordon { node: String },
    /// Let NODE take replicas again. Ends a drain: replicas not moved yet stay on NODE.
    Uncordon { node: String },
    /// Move every replica off NODE: each gets a replacement on another node, rebuilt before the one on NODE is
    /// removed, so no volume drops below its replica count. Refused (nothing changes) when a volume could not keep
    /// its count, is detached with a replica there, or is attached on NODE (drain moves replicas, not engines:
    /// detach it or attach it elsewhere first). Waits with a progress bar until NODE holds no replica.
    Drain {
        node: String,
        /// Seconds to wait for the drain to finish (it goes on in the cluster after a timeout).
        #[arg(long, default_value_t = 1800)]
        timeout: u64,
        /// Return once the drain is accepted.
        #[arg(long)]
        no_wait: bool,
    },
}

pub async fn run(c: &Client, json: bool, cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
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
                                    (DrainState::None, true) => "allowed".to_owned(),
                                    (DrainState::None, false) => "cordoned".to_owned(),
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
                n = wait_disk(c, &node, &disk, Duration::from_secs(timeout)).await?;
            }
            print(true, &n, String::new)?;
        }
        NodeCmd::DiskRm { node, disk } => {
            c.delete(&format!("/v1/nodes/{node}/disks/{disk}")).await?;
        }
        NodeCmd::Lifecycle(cmd) => run_lifecycle(c, json, cmd).await?,
    }
    Ok(())
}

async fn run_lifecycle(c: &Client, json: bool, cmd: NodeLifecycleCmd) -> anyhow::Result<()> {
    let (node, verb) = match &cmd {
        NodeLifecycleCmd::Cordon { node } => (node.clone(), "cordon"),
        NodeLifecycleCmd::Uncordon { node } => (node.clone(), "uncordon"),
        NodeLifecycleCmd::Drain { node, .. } => (node.clone(), "drain"),
    };
    let mut n: NodeView = c
        .post(&format!("/v1/nodes/{node}/{verb}"), &serde_json::json!({}))
        .await?;
    if let NodeLifecycleCmd::Drain { timeout, no_wait, .. } = cmd
        && !no_wait
    {
        n = wait_drained(c, &node, n, Duration::from_secs(timeout)).await?;
    }
    corral_daemon::output::print(json, &n, || summary(&n))?;
    Ok(())
}

fn summary(n: &NodeView) -> String {
    let mut s = format!(
        "node {}: scheduling {}, drain {}, {} replica(s) on it",
        n.name,
        if n.allow_scheduling { "allowed" } else { "disabled" },
        n.drain_state.as_str(),
        n.replicas
    );
    for b in &n.drain_blocked {
        s = format!("{s}\n  waiting: {b}");
    }
    s
}

/// Polls the node until no replica is left on it, showing how many moved.
async fn wait_drained(
    c: &Client,
    node: &str,
    first: NodeView,
    timeout: Duration,
) -> anyhow::Result<NodeView> {
    let total = first.replicas.max(1);
    let bar = corral_daemon::percent_bar(&format!("draining {node}"));
    let deadline = Instant::now() + timeout;
    let mut n = first;
    let mut last = None;
    loop {
        let moved = total.saturating_sub(n.replicas);
        bar.set_position(u64::from(moved * 100 / total));
        let now = (n.replicas, n.drain_blocked.clone());
        if last.as_ref() != Some(&now) {
            let mut line = format!("draining {node}: {} replica(s) left", n.replicas);
            if !n.drain_blocked.is_empty() {
                line = format!("{line}; waiting: {}", n.drain_blocked.join("; "));
            }
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.set_message(line);
            }
        }
        last = Some(now);
        match n.drain_state {
            DrainState::Drained => {
                bar.finish_and_clear();
                return Ok(n);
            }
            DrainState::None => {
                bar.abandon();
                anyhow::bail!(
                    "node {node} was uncordoned: the drain ended with {} replica(s) on it",
                    n.replicas
                );
            }
            DrainState::Draining => {}
        }
        if Instant::now() > deadline {
            bar.abandon();
            anyhow::bail!(
                "node {node} still holds {} replica(s) after {timeout:?}; the drain goes on (see `corral node get {node}`)",
                n.replicas
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        n = c.get(&format!("/v1/nodes/{node}")).await?;
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
