//! The operator commands (`snapshot clone`, `clone-status`, `export`), with progress bars.

use std::path::Path;
use std::time::Duration;

use anyhow::bail;
use corral_proto::v1;
use corral_proto::v1::controller_service_client::ControllerServiceClient;
use tonic::transport::Channel;

use crate::export::{ExportFormat, export_to_file};
use crate::remote_engine::engine_client;

/// How often `snapshot clone` asks for the clone's state while it waits.
const STATUS_POLL: Duration = Duration::from_millis(50);

/// The `snapshot` subcommands of this module.
#[derive(clap::Subcommand, Debug)]
pub enum CloneCmd {
    /// Clone a snapshot of another volume into this (same-sized) volume, with progress.
    Clone {
        /// gRPC address of the source volume's engine.
        #[arg(long)]
        from_engine: String,
        /// Snapshot of the source volume.
        #[arg(long)]
        snapshot: String,
        /// Include the source's backing image data (for a target without that backing image).
        #[arg(long)]
        export_backing_image: bool,
        /// Upper bound of data sent per second by the source (bytes, or with K/M/G); unlimited when omitted.
        #[arg(long, value_parser = corral_daemon::parse_size)]
        max_rate: Option<u64>,
        /// Do not wait for the clone to finish.
        #[arg(long)]
        no_wait: bool,
        /// Shut the target's attached frontend down for the clone (started again after a waited-for clone;
        /// left down with --no-wait). Without it a target whose frontend is attached is refused.
        #[arg(long)]
        detach_frontend: bool,
    },
    /// State of the clone into this volume, per replica.
    CloneStatus,
    /// Write a snapshot to a new image file (holes stay holes).
    Export {
        /// Snapshot name.
        name: String,
        /// File to create.
        #[arg(long)]
        to: std::path::PathBuf,
        #[arg(long, value_enum, default_value = "raw")]
        format: ExportFormat,
        /// Leave out the backing image's data (blocks only it holds read as zeros).
        #[arg(long)]
        no_backing_image: bool,
    },
}

/// Runs one of the commands against the engine at `url`.
pub async fn run(url: &str, json: bool, cmd: CloneCmd) -> anyhow::Result<()> {
    match cmd {
        CloneCmd::Clone {
            from_engine,
            snapshot,
            export_backing_image,
            max_rate,
            no_wait,
            detach_frontend,
        } => {
            let req = v1::VolumeCloneRequest {
                from_engine_address: from_engine,
                snapshot_name: snapshot,
                export_backing_image_if_exist: export_backing_image,
                max_bytes_per_second: max_rate.unwrap_or(0),
            };
            clone(url, json, req, no_wait, detach_frontend).await
        }
        CloneCmd::CloneStatus => status(url, json).await,
        CloneCmd::Export {
            name,
            to,
            format,
            no_backing_image,
        } => export(url, json, &name, &to, format, !no_backing_image).await,
    }
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else {
        println!("{}", human());
    }
    Ok(())
}

/// `snapshot clone`: starts the clone on the target engine at `url` and waits for it (unless `no_wait`).
/// With `detach_frontend` an attached frontend is shut down first and, for a waited-for clone, started again.
pub async fn clone(
    url: &str,
    json: bool,
    req: v1::VolumeCloneRequest,
    no_wait: bool,
    detach_frontend: bool,
) -> anyhow::Result<()> {
    let mut c = engine_client(url).await?;
    let was_up =
        detach_frontend && c.volume_get(v1::Empty {}).await?.into_inner().frontend_state == "attached";
    if was_up {
        c.frontend_shutdown(v1::Empty {}).await?;
    }
    let r = wait_clone(&mut c, json, req, no_wait).await;
    if was_up && !(no_wait && r.is_ok()) {
        c.frontend_start(v1::Empty {}).await?;
    }
    r
}

async fn wait_clone(
    c: &mut ControllerServiceClient<Channel>,
    json: bool,
    req: v1::VolumeCloneRequest,
    no_wait: bool,
) -> anyhow::Result<()> {
    let snapshot = req.snapshot_name.clone();
    let from_engine = req.from_engine_address.clone();
    c.snapshot_clone(req).await?;
    if no_wait {
        println!(
            "clone of {snapshot} from {from_engine} started (the frontend stays down until you start it)"
        );
        return Ok(());
    }
    let b = corral_daemon::percent_bar(&format!("cloning {snapshot}"));
    loop {
        let s = c.snapshot_clone_status(v1::Empty {}).await?.into_inner();
        b.set_position(u64::from(s.progress));
        match s.state.as_str() {
            "complete" => {
                b.finish_and_clear();
                return print(json, &s, || {
                    let sent: u64 = s.replicas.values().map(|r| r.bytes_transferred).sum();
                    format!(
                        "cloned {} from {} into {} replica(s) ({} sent)",
                        s.snapshot_name,
                        s.from_replica_address,
                        s.replicas.len(),
                        corral_daemon::human_bytes(sent)
                    )
                });
            }
            "error" => {
                b.finish_and_clear();
                bail!("clone of {snapshot} failed: {}", s.error);
            }
            // A status query is a few small RPCs; polling often keeps the wait after the replicas' commit short
            // next to the transfer (a 1 GiB clone takes about a second).
            _ => tokio::time::sleep(STATUS_POLL).await,
        }
    }
}

/// `snapshot clone-status`.
pub async fn status(url: &str, json: bool) -> anyhow::Result<()> {
    let s = engine_client(url)
        .await?
        .snapshot_clone_status(v1::Empty {})
        .await?
        .into_inner();
    print(json, &s, || {
        let mut t = comfy_table::Table::new();
        t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
        t.set_header(vec![
            "replica", "state", "progress", "snapshot", "from", "sent", "error",
        ]);
        for (addr, r) in &s.replicas {
            t.add_row(vec![
                addr.clone(),
                r.state.clone(),
                format!("{}%", r.progress),
                r.snapshot_name.clone(),
                r.from_addresses.join(" "),
                r.bytes_transferred.to_string(),
                r.error.clone(),
            ]);
        }
        format!("clone: {} ({}%)\n{t}", s.state, s.progress)
    })
}

/// `snapshot export`.
pub async fn export(
    url: &str,
    json: bool,
    snapshot: &str,
    to: &Path,
    format: ExportFormat,
    with_backing: bool,
) -> anyhow::Result<()> {
    let b = corral_daemon::percent_bar(&format!("exporting {snapshot}"));
    let r = export_to_file(url, snapshot, to, format, with_backing, |have, total| {
        if let Some(pct) = (have.min(total) * 100).checked_div(total) {
            b.set_position(pct.min(99));
        }
    })
    .await;
    b.finish_and_clear();
    let r = r?;
    print(json, &r, || {
        format!(
            "snapshot {} exported to {} ({:?}, {} data sent by {})",
            r.snapshot,
            r.path,
            r.format,
            corral_daemon::human_bytes(r.bytes_sent),
            r.replica
        )
    })
}
