//! `corral-engine`: the volume controller daemon and its operator CLI. Parses flags and wires.

mod backup;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::output::{self, emit, table};
use corral_proto::v1::{self, controller_service_client::ControllerServiceClient};
use engine::daemon::{ServeConfig, serve};
use engine::frontend::NbdListen;
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(
    name = "corral-engine",
    version,
    about = "Corral engine: one volume over N replicas, served through NBD"
)]
struct Cli {
    /// Engine gRPC address for the operator commands.
    #[arg(
        long,
        global = true,
        env = "CORRAL_ENGINE_URL",
        default_value = "127.0.0.1:9501"
    )]
    url: String,
    #[command(flatten)]
    output: corral_daemon::output::OutputArgs,
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    #[command(flatten)]
    tls: corral_tls::TlsDirArg,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the engine of one volume.
    Serve(ServeArgs),
    /// Volume state.
    Info,
    /// Replicas.
    Replica {
        #[command(subcommand)]
        cmd: ReplicaCmd,
    },
    /// Snapshots.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapCmd,
    },
    /// Grow the volume.
    Expand {
        #[arg(long, value_parser = corral_daemon::parse_size)]
        size: u64,
    },
    /// Rebuild progress of replicas being added.
    RebuildStatus,
    /// IO counters.
    Metrics,
    /// Backups to a file or S3 target, and restores.
    Backup {
        #[command(subcommand)]
        cmd: backup::BackupCmd,
    },
}

/// Rebuild rate settings of `serve`, the defaults of every rebuild whose request names none.
#[derive(clap::Args, Debug)]
struct RebuildRateArgs {
    /// Upper bound of data bytes per second one rebuild moves, over its local copy or the network (bytes, or
    /// with K/M/G; 0: unlimited).
    #[arg(long, env = "CORRAL_REBUILD_MAX_RATE", value_parser = corral_daemon::parse_size, default_value = "0")]
    rebuild_max_rate: u64,
    /// While the new replica serves foreground IO, its local copy slows to this many data bytes per second, and
    /// speeds up again when IO stops (0: never back off).
    #[arg(long, env = "CORRAL_REBUILD_BUSY_RATE", value_parser = corral_daemon::parse_size, default_value = "64M")]
    rebuild_busy_rate: u64,
}

#[derive(Subcommand, Debug)]
enum ReplicaCmd {
    /// List replicas with mode and error.
    Ls,
    /// Add a replica and rebuild it (progress bar until RW).
    Add {
        /// tcp://HOST:PORT?data=PORT&sync=PORT[&replica=NAME]
        address: corral_proto::ReplicaAddress,
        /// Do not wait for the rebuild to finish.
        #[arg(long)]
        no_wait: bool,
        /// Upper bound of data bytes per second this rebuild moves (bytes, or with K/M/G; default: the engine's
        /// --rebuild-max-rate).
        #[arg(long, value_parser = corral_daemon::parse_size, default_value = "0")]
        max_rate: u64,
        /// Data bytes per second the local copy slows to while the new replica serves foreground IO (default:
        /// the engine's --rebuild-busy-rate).
        #[arg(long, value_parser = corral_daemon::parse_size, default_value = "0")]
        busy_rate: u64,
    },
    /// Remove a replica from the volume.
    Rm {
        /// The replica's address as `replica ls` shows it.
        address: corral_proto::ReplicaAddress,
    },
}

#[derive(Subcommand, Debug)]
enum SnapCmd {
    /// Take a snapshot (a UUID name when omitted).
    Create {
        name: Option<String>,
        #[arg(long = "label")]
        labels: Vec<String>,
    },
    /// The snapshot tree.
    Ls,
    /// Mark a snapshot removed (space is reclaimed by purge).
    Rm { name: String },
    /// Revert the volume to a snapshot (NBD clients are disconnected while it happens).
    Revert { name: String },
    /// Reclaim the space of removed snapshots, with progress.
    Purge,
    /// Clone, clone status, export to a file (engine/src/clone.rs).
    #[command(flatten)]
    Clone(engine::cli::clone::CloneCmd),
}

async fn client(url: &str) -> anyhow::Result<ControllerServiceClient<Channel>> {
    let ch = corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::OPERATOR)
        .await
        .context("engine")?;
    Ok(ControllerServiceClient::new(ch))
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    Ok(output::print(json, v, human)?)
}

// `serve`: every daemon flag (a plain comment: a doc comment would replace the subcommand's help).
#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Volume name.
    #[arg(long, env = "CORRAL_VOLUME")]
    volume: String,
    /// Volume size (bytes, or with K/M/G/T), a multiple of 4096.
    #[arg(long, env = "CORRAL_VOLUME_SIZE", value_parser = corral_daemon::parse_size)]
    size: u64,
    /// gRPC ControllerService address.
    #[arg(long, env = "CORRAL_ENGINE_LISTEN", default_value = "127.0.0.1:9501")]
    listen: SocketAddr,
    /// Replica address tcp://HOST:PORT?data=PORT&sync=PORT[&replica=NAME]: its control, data and sync
    /// endpoints (docs/formats.md); repeat for each replica.
    #[arg(long = "replica", required = true)]
    replicas: Vec<corral_proto::ReplicaAddress>,
    /// Frontend kind.
    #[arg(long, default_value = "nbd")]
    frontend: String,
    /// NBD listener: unix:PATH or tcp:HOST:PORT (repeatable).
    #[arg(long = "nbd-listen")]
    nbd_listen: Vec<NbdListen>,
    /// The volume keeps no revision counter (replicas must agree).
    #[arg(long, env = "CORRAL_DISABLE_REVISION_COUNTER")]
    disable_revision_counter: bool,
    /// With the counter disabled: keep only the replica with the newest, largest head.
    #[arg(long)]
    salvage_requested: bool,
    /// Seconds before an unanswered replica request puts the replica ERR.
    #[arg(long, default_value_t = 8)]
    replica_timeout: u64,
    /// Data connections to each replica. Each is served by one thread of the replica, which runs the
    /// requests one `recv` brings in order; fewer connections batch more requests per wake-up.
    #[arg(long, env = "CORRAL_REPLICA_CONNECTIONS", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    replica_connections: u16,
    /// This engine start's generation, presented to every replica (data-protocol Hello): a replica that
    /// accepted it refuses every engine of a lower one, and closes their connections, so an engine left on
    /// the wrong side of a partition cannot write. 0: none (refused by a replica that has seen one).
    #[arg(long, env = "CORRAL_ENGINE_GENERATION", default_value_t = 0)]
    generation: u64,
    #[command(flatten)]
    rebuild_rate: RebuildRateArgs,
    #[command(flatten)]
    metrics: corral_daemon::metrics::MetricsListenArg,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kind = RunKind::serving(matches!(cli.cmd, Cmd::Serve(_)));
    let process = cli.common.init(kind)?;
    let json = cli.output.json;
    let tls = cli.tls.load_and_install()?;
    match cli.cmd {
        Cmd::Serve(args) => serve_engine(args, process.ready_file, tls).await,
        Cmd::Info => {
            let v = client(&cli.url)
                .await?
                .volume_get(v1::Empty {})
                .await?
                .into_inner();
            print(json, &v, || {
                table(
                    &[
                        "volume",
                        "size",
                        "frontend",
                        "endpoints",
                        "replicas",
                        "robustness",
                        "revision counter",
                    ],
                    vec![vec![
                        v.name.clone(),
                        v.size.to_string(),
                        v.frontend_state.clone(),
                        v.endpoints.join(" "),
                        v.replica_count.to_string(),
                        v.robustness.clone(),
                        if v.revision_counter_disabled {
                            "disabled".into()
                        } else {
                            "enabled".into()
                        },
                    ]],
                )
                .to_string()
            })
        }
        Cmd::Replica { cmd: ReplicaCmd::Ls } => {
            let r = client(&cli.url)
                .await?
                .replica_list(v1::Empty {})
                .await?
                .into_inner();
            print(json, &r, || {
                table(
                    &["address", "mode", "revision counter", "error"],
                    r.replicas
                        .iter()
                        .map(|x| {
                            vec![
                                x.address.clone(),
                                x.mode.clone(),
                                x.revision_counter.to_string(),
                                x.error.clone(),
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })
        }
        Cmd::Replica {
            cmd:
                ReplicaCmd::Add {
                    address,
                    no_wait,
                    max_rate,
                    busy_rate,
                },
        } => replica_add(&cli.url, json, &address, no_wait, max_rate, busy_rate).await,
        Cmd::Replica {
            cmd: ReplicaCmd::Rm { address },
        } => {
            client(&cli.url)
                .await?
                .replica_remove(v1::ReplicaAddress {
                    address: address.to_string(),
                })
                .await?;
            emit(&format!("replica {address} removed"));
            Ok(())
        }
        Cmd::Snapshot { cmd } => snapshot(&cli.url, json, cmd).await,
        Cmd::Backup { cmd } => backup::run(&cli.url, json, cmd).await,
        Cmd::Expand { size } => {
            let v = client(&cli.url)
                .await?
                .volume_expand(v1::ExpandRequest { size })
                .await?
                .into_inner();
            print(json, &v, || format!("volume {} is now {} bytes", v.name, v.size))
        }
        Cmd::RebuildStatus => {
            let s = client(&cli.url)
                .await?
                .rebuild_status(v1::Empty {})
                .await?
                .into_inner();
            print(json, &s, || {
                table(
                    &["replica", "state", "progress", "transferred", "skipped", "error"],
                    s.replicas
                        .iter()
                        .map(|j| {
                            vec![
                                j.address.clone(),
                                j.state.clone(),
                                format!("{}%", j.progress),
                                j.bytes_transferred.to_string(),
                                j.bytes_skipped.to_string(),
                                j.error.clone(),
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })
        }
        Cmd::Metrics => {
            let m = client(&cli.url)
                .await?
                .metrics_get(v1::Empty {})
                .await?
                .into_inner();
            print(json, &m, || format!("{m:#?}"))
        }
    }
}

/// `replica add`: adds a replica and, unless `no_wait`, follows its rebuild with a progress bar.
async fn replica_add(
    url: &str,
    json: bool,
    address: &corral_proto::ReplicaAddress,
    no_wait: bool,
    max_rate: u64,
    busy_rate: u64,
) -> anyhow::Result<()> {
    let mut c = client(url).await?;
    let r = c
        .replica_add(v1::ReplicaAddRequest {
            address: address.to_string(),
            rebuild: true,
            timeout_seconds: 0,
            max_bytes_per_second: max_rate,
            busy_bytes_per_second: busy_rate,
        })
        .await?
        .into_inner();
    if no_wait {
        return print(json, &r, || {
            format!("{} added ({}), rebuilding", r.address, r.mode)
        });
    }
    let b = corral_daemon::percent_bar(&format!("rebuilding {}", r.address));
    loop {
        let s = c.rebuild_status(v1::Empty {}).await?.into_inner();
        let Some(j) = s.replicas.into_iter().find(|j| j.address == r.address) else {
            bail!("rebuild of {} vanished", r.address)
        };
        b.set_position(u64::from(j.progress));
        match j.state.as_str() {
            "complete" => {
                b.finish_and_clear();
                return print(json, &j, || {
                    format!(
                        "{} rebuilt: RW ({} bytes transferred, {} skipped)",
                        j.address, j.bytes_transferred, j.bytes_skipped
                    )
                });
            }
            "error" => {
                b.finish_and_clear();
                bail!("rebuild of {} failed: {}", j.address, j.error);
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// `serve`: the engine of one volume until SIGTERM.
async fn serve_engine(
    args: ServeArgs,
    ready_file: Option<std::path::PathBuf>,
    tls: Option<corral_tls::TlsConfigs>,
) -> anyhow::Result<()> {
    let ServeArgs {
        volume,
        size,
        listen,
        replicas,
        frontend,
        nbd_listen,
        disable_revision_counter,
        salvage_requested,
        replica_timeout,
        replica_connections,
        generation,
        rebuild_rate,
        metrics,
    } = args;
    if frontend != "nbd" {
        bail!("frontend {frontend:?} is not supported (only nbd)");
    }
    let cancel = corral_daemon::shutdown_on_signal();
    let cfg = ServeConfig {
        volume,
        size,
        listen,
        replicas,
        nbd: nbd_listen,
        disable_revision_counter,
        salvage_requested,
        replica_timeout: Duration::from_secs(replica_timeout),
        replica_connections: usize::from(replica_connections),
        generation,
        metrics_listen: metrics.metrics_listen,
        ready_file,
        rebuild_rate: engine::rebuild::RebuildRate {
            max_bytes_per_second: rebuild_rate.rebuild_max_rate,
            busy_bytes_per_second: rebuild_rate.rebuild_busy_rate,
        },
        tls,
    };
    serve(cfg, cancel).await
}

async fn snapshot(url: &str, json: bool, cmd: SnapCmd) -> anyhow::Result<()> {
    let mut c = client(url).await?;
    match cmd {
        SnapCmd::Create { name, labels } => {
            let labels = corral_daemon::parse_labels(&labels).map_err(anyhow::Error::msg)?;
            let r = c
                .snapshot_create(v1::SnapshotCreateRequest {
                    name: name.unwrap_or_default(),
                    labels,
                })
                .await?
                .into_inner();
            print(json, &r, || format!("snapshot {} created", r.name))
        }
        SnapCmd::Ls => {
            let r = c.snapshot_list(v1::Empty {}).await?.into_inner();
            print(json, &r, || {
                let mut rows: Vec<&v1::DiskInfo> = r.disks.values().collect();
                rows.sort_by_key(|d| {
                    (
                        r.chain.iter().position(|c| *c == d.name).unwrap_or(usize::MAX),
                        d.name.clone(),
                    )
                });
                table(
                    &["disk", "parent", "allocated", "removed", "user", "created"],
                    rows.into_iter()
                        .map(|d| {
                            vec![
                                d.name.clone(),
                                d.parent.clone(),
                                d.size.to_string(),
                                d.removed.to_string(),
                                d.user_created.to_string(),
                                d.created.clone(),
                            ]
                        })
                        .collect(),
                )
                .to_string()
            })
        }
        SnapCmd::Rm { name } => {
            c.snapshot_remove(v1::SnapshotName { name: name.clone() }).await?;
            emit(&format!(
                "snapshot {name} marked removed; run `snapshot purge` to reclaim its space"
            ));
            Ok(())
        }
        SnapCmd::Revert { name } => {
            let was_up = c.volume_get(v1::Empty {}).await?.into_inner().frontend_state == "attached";
            c.frontend_shutdown(v1::Empty {}).await?;
            let r = c.snapshot_revert(v1::SnapshotName { name: name.clone() }).await;
            if was_up {
                c.frontend_start(v1::Empty {}).await?;
            }
            r?;
            emit(&format!("reverted to {name}"));
            Ok(())
        }
        SnapCmd::Purge => {
            c.snapshot_purge(v1::Empty {}).await?;
            let b = corral_daemon::percent_bar("purging");
            loop {
                let s = c.snapshot_purge_status(v1::Empty {}).await?.into_inner();
                b.set_position(u64::from(s.progress));
                if !s.is_purging {
                    b.finish_and_clear();
                    if s.state == "error" {
                        bail!("purge failed: {}", s.error);
                    }
                    return print(json, &s, || "purge complete".to_owned());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        SnapCmd::Clone(cmd) => engine::cli::clone::run(url, json, cmd).await,
    }
}
