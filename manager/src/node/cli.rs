//! `corral node cordon | uncordon | drain NODE`.

use std::time::{Duration, Instant};

use clap::Subcommand;

use super::drain::DrainState;
use super::views::NodeView;
use crate::client::Client;

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

pub async fn run(c: &Client, json: bool, cmd: NodeLifecycleCmd) -> anyhow::Result<()> {
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
