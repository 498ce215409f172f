//! `corral lvstore ls`: the v2 disks' per-disk daemons (the disk and volume flags for v2 are `corral node
//! disk-add --disk-engine v2` and `corral volume create --data-engine v2`).

use clap::Subcommand;

use super::routes::LvstoreView;
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum LvstoreCmd {
    /// List the lvstore daemons (one per v2 disk): state, pid, restarts, address, why one does not run.
    Ls,
}

pub async fn run(c: &Client, json: bool, cmd: LvstoreCmd) -> anyhow::Result<()> {
    match cmd {
        LvstoreCmd::Ls => {
            let ds: Vec<LvstoreView> = c.get("/v1/lvstores").await?;
            corral_daemon::output::print(json, &ds, || {
                corral_daemon::output::table(
                    &[
                        "LVSTORE", "NODE", "DISK", "STATE", "PID", "RESTARTS", "ADDRESS", "MESSAGE",
                    ],
                    ds.iter()
                        .map(|d| {
                            vec![
                                d.name.clone(),
                                d.node_id.clone(),
                                d.disk.clone(),
                                serde_json::to_value(d.state)
                                    .ok()
                                    .and_then(|v| v.as_str().map(str::to_owned))
                                    .unwrap_or_default(),
                                d.pid.map(|p| p.to_string()).unwrap_or_default(),
                                d.restarts.to_string(),
                                d.address.clone(),
                                d.message.clone(),
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })?;
        }
    }
    Ok(())
}
