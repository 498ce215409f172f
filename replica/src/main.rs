//! `corral-replica`: the replica daemon and its debugging CLI. Parses flags and wires; the work is in the library.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::human_bytes;
use corral_daemon::output::{self, emit};
use corral_proto::v1;
use replica::cli::{control, print_replica, print_status, sync_agent, wait_job};
use replica::daemon::{ServeConfig, serve};

#[derive(Parser, Debug)]
#[command(
    name = "corral-replica",
    version,
    about = "Corral replica daemon and debugging CLI"
)]
struct Cli {
    #[command(flatten)]
    output: corral_daemon::output::OutputArgs,
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    #[command(flatten)]
    tls: corral_tls::TlsDirArg,
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start: the size of `Serve` (every daemon flag) does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve a replica directory: gRPC ReplicaService on --listen, the data protocol on --data-listen,
    /// SyncAgentService on --sync-listen (port 0 picks a free port; --ready-file reports it).
    Serve(ServeArgs),
    /// Serve the v2 data engine on one disk: the disk's lvstore (crate lvstore) hosting many replicas as lvol
    /// chains, each on its own control, data and sync listeners (its replica address); gRPC LvstoreService on
    /// --listen adds, lists and removes them.
    ServeLvstore(ServeLvstoreArgs),
    /// Show a replica: offline from its directory (--dir), or live over gRPC (--url: a replica address, or its
    /// control endpoint HOST:PORT).
    Info {
        #[arg(long, conflicts_with = "url", required_unless_present = "url")]
        dir: Option<PathBuf>,
        #[arg(long)]
        url: Option<String>,
    },
    /// Inspect or convert a disk image (raw or qcow2) offline.
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
    /// Snapshot operations on a running replica.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapCmd,
    },
    /// Replicas and backing-image copies of a running v2 disk daemon (`serve-lvstore`): add, remove, list, and
    /// the store's space.
    Lvstore {
        /// The daemon's LvstoreService address HOST:PORT (its --listen).
        #[arg(long, alias = "addr")]
        url: String,
        #[command(subcommand)]
        cmd: LvstoreCmd,
    },
    /// Compute (or verify, with --rehash) a snapshot's checksum and record it.
    Hash {
        #[arg(long)]
        url: String,
        snapshot: String,
        /// Hash again even when the file's ctime did not change (detects silent corruption).
        #[arg(long)]
        rehash: bool,
    },
}

// `serve`: every daemon flag of a v1 replica (a plain comment: a doc comment would replace the subcommand's help).
#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Replica directory (created if missing).
    #[arg(long, env = "CORRAL_REPLICA_DIR")]
    dir: PathBuf,
    /// Control (gRPC ReplicaService) address HOST:PORT.
    #[arg(long, env = "CORRAL_REPLICA_LISTEN", default_value = "127.0.0.1:9502")]
    listen: SocketAddr,
    /// Data-protocol address HOST:PORT (default: a free port on the --listen host; the ready file and
    /// ReplicaGet report it).
    #[arg(long, env = "CORRAL_REPLICA_DATA_LISTEN")]
    data_listen: Option<SocketAddr>,
    /// Also serve the data protocol on this unix socket (a stale socket file there is replaced). An engine
    /// on this node learns it from ReplicaGet and connects there instead of TCP; the manager gives it to
    /// every replica it starts.
    #[arg(long, env = "CORRAL_REPLICA_DATA_UNIX")]
    data_unix: Option<PathBuf>,
    /// Sync-agent (gRPC SyncAgentService) address HOST:PORT (default: a free port on the --listen host; the
    /// ready file and ReplicaGet report it).
    #[arg(long, env = "CORRAL_REPLICA_SYNC_LISTEN")]
    sync_listen: Option<SocketAddr>,
    /// Create the replica with this size in bytes (a multiple of 4096) when the directory holds none;
    /// when it holds one, the size must match.
    #[arg(long, env = "CORRAL_REPLICA_SIZE", value_parser = corral_daemon::parse_size)]
    size: Option<u64>,
    /// Read-only bottom layer: a raw or qcow2 image, or a directory holding exactly one (the volume may be
    /// larger than the image; past its end the volume reads zeros). Recorded in volume.meta.
    #[arg(long, env = "CORRAL_REPLICA_BACKING_FILE")]
    backing_file: Option<PathBuf>,
    /// Name of the backing image as the control plane knows it (recorded in backups; needs
    /// --backing-image-checksum).
    #[arg(
        long,
        env = "CORRAL_REPLICA_BACKING_IMAGE_NAME",
        requires_all = ["backing_file", "backing_image_checksum"]
    )]
    backing_image_name: Option<String>,
    /// SHA-512 of the backing file as the control plane verified it, `HEX` or `sha512:HEX` (recorded in backups
    /// with the name, as bare hex).
    #[arg(
        long,
        env = "CORRAL_REPLICA_BACKING_IMAGE_CHECKSUM",
        requires = "backing_image_name"
    )]
    backing_image_checksum: Option<String>,
    /// Do not keep the revision counter (faster; the engine then salvages by head mtime and size).
    #[arg(long, env = "CORRAL_DISABLE_REVISION_COUNTER")]
    disable_revision_counter: bool,
    /// Volume name reported to clients.
    #[arg(long, env = "CORRAL_VOLUME", default_value = "")]
    volume: String,
    #[command(flatten)]
    metrics: corral_daemon::metrics::MetricsListenArg,
    /// Data-protocol requests a connection runs before writing their replies (and flushes it queues).
    #[arg(long, default_value_t = 128)]
    data_window: usize,
    /// Never copy a clone's or rebuild's source files directly, even when the source replica is on this
    /// host: always pull them over the network (sparse-sync).
    #[arg(long, env = "CORRAL_REPLICA_NO_LOCAL_COPY")]
    no_local_copy: bool,
    /// TEST BUILDS ONLY: make a data-protocol operation fail (repeatable). OP is read, write, unmap,
    /// write-zeroes, flush or block-status; ACTION is error, no-space, delay:MS, hang or drop; the first N
    /// operations pass. Change at run time with POST/DELETE /debug/faults on --metrics-listen.
    #[cfg(feature = "fault-injection")]
    #[arg(long = "fault", value_name = "OP=ACTION[,after=N]", value_parser = clap::value_parser!(replica::fault::FaultRule))]
    faults: Vec<replica::fault::FaultRule>,
}

// `serve-lvstore`: every daemon flag of a v2 disk daemon.
#[derive(clap::Args, Debug)]
struct ServeLvstoreArgs {
    /// The disk: a block device or a preallocated file holding an lvstore.
    #[arg(long, env = "CORRAL_LVSTORE_DISK")]
    disk: PathBuf,
    /// gRPC LvstoreService address HOST:PORT; hosted replicas listen on its host.
    #[arg(long, env = "CORRAL_LVSTORE_LISTEN", default_value = "127.0.0.1:9600")]
    listen: SocketAddr,
    /// Format the disk when it holds no lvstore (an existing lvstore is never formatted over).
    #[arg(long)]
    format: bool,
    /// Cluster size for --format.
    #[arg(long, default_value = "1M", value_parser = corral_daemon::parse_size)]
    cluster_size: u64,
    /// Data-protocol requests a connection runs before writing their replies.
    #[arg(long, default_value_t = 128)]
    data_window: usize,
    /// How the lvstore's data IO reaches the disk: direct (O_DIRECT), buffered (the page cache), or auto
    /// (direct on a block device, buffered on a file).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(lvstore::DataIo))]
    data_io: lvstore::DataIo,
    /// Threads of the disk's IO pool, shared by every hosted replica: requests that wait for the device run
    /// there, several per data connection at once (0: each connection runs its requests one at a time).
    #[arg(long, default_value_t = 16)]
    io_threads: usize,
    /// Requests of one data connection at the IO pool at once.
    #[arg(long, default_value_t = 64)]
    io_depth: usize,
    /// Host replica NAME from the start (repeatable; created on the engine's ReplicaCreate). The ready
    /// file reports its listeners as NAME.control, NAME.data and NAME.sync.
    #[arg(long = "replica", value_name = "NAME")]
    replicas: Vec<String>,
    /// Also serve each hosted replica's data protocol on a unix socket DIR/NAME.data.sock (created; a stale
    /// socket file there is replaced). An engine on this node learns it from ReplicaGet and connects there
    /// instead of TCP; the manager gives it to every lvstore daemon it starts.
    #[arg(long, env = "CORRAL_LVSTORE_DATA_UNIX_DIR", value_name = "DIR")]
    data_unix_dir: Option<PathBuf>,
    /// At most this many data bytes per second (K, M, G suffixes) when this disk sends a backing-image copy
    /// to another disk (BackingImageExpose); default: unbounded.
    #[arg(long, env = "CORRAL_LVSTORE_BACKING_IMAGE_SEND_RATE", value_parser = corral_daemon::parse_size)]
    backing_image_send_rate: Option<u64>,
    #[command(flatten)]
    metrics: corral_daemon::metrics::MetricsListenArg,
}

#[derive(Subcommand, Debug)]
enum ImageCmd {
    /// Format, virtual size, allocated size, backing file and SHA-512 of an image (or of the one image in a
    /// directory).
    Info { path: PathBuf },
    /// Convert an image (over its backing chain) to a sparse raw file or to qcow2, with a progress bar.
    Convert {
        /// Output format: raw or qcow2.
        #[arg(long)]
        to: disk_image::ImageFormat,
        src: PathBuf,
        dst: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum LvstoreCmd {
    /// Host replica NAME (creating its head lvol now with --size; without it the engine's ReplicaCreate does).
    Add {
        name: String,
        #[arg(long, value_parser = corral_daemon::parse_size, default_value = "0")]
        size: u64,
        #[arg(long)]
        disable_revision_counter: bool,
    },
    /// Stop serving replica NAME; with --delete-data its lvols are deleted too.
    Rm {
        name: String,
        #[arg(long)]
        delete_data: bool,
    },
    /// Hosted replicas with their addresses.
    Ls,
    /// The store: device, clusters used and free.
    Info,
    /// This disk's copies of v2 backing images: create (from a URL, a file or another disk daemon, with a
    /// progress bar), ls, get, rm.
    BackingImage {
        #[command(subcommand)]
        cmd: replica::v2::backing_image_cli::BackingImageCmd,
    },
}

#[derive(Subcommand, Debug)]
enum SnapCmd {
    /// List the snapshot tree.
    Ls {
        #[arg(long)]
        url: String,
    },
    /// Take a snapshot (the engine normally does this on all replicas at once).
    Create {
        #[arg(long)]
        url: String,
        /// The volume's current engine generation: a replica that accepted one refuses this change without it.
        #[arg(long, default_value_t = 0)]
        generation: u64,
        name: String,
        /// Label k=v (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
    },
    /// Mark a snapshot removed (space is reclaimed by purge).
    Rm {
        #[arg(long)]
        url: String,
        /// The volume's current engine generation: a replica that accepted one refuses this change without it.
        #[arg(long, default_value_t = 0)]
        generation: u64,
        name: String,
    },
    /// Revert the replica to a snapshot (new empty head over it).
    Revert {
        #[arg(long)]
        url: String,
        /// The volume's current engine generation: a replica that accepted one refuses this change without it.
        #[arg(long, default_value_t = 0)]
        generation: u64,
        name: String,
    },
    /// Fold or prune every removed snapshot, with progress.
    Purge {
        #[arg(long)]
        url: String,
        /// The volume's current engine generation: a replica that accepted one refuses this change without it.
        #[arg(long, default_value_t = 0)]
        generation: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kind = RunKind::serving(matches!(cli.cmd, Cmd::Serve(_) | Cmd::ServeLvstore(_)));
    let process = cli.common.init(kind)?;
    let json = cli.output.json;
    let tls = cli.tls.load_and_install()?;
    match cli.cmd {
        Cmd::Serve(args) => serve_replica(args, process.ready_file, tls).await,
        Cmd::ServeLvstore(args) => serve_lvstore(args, process.ready_file, tls).await,
        Cmd::Info { dir: Some(dir), .. } => {
            let s = replica::inspect(&dir).with_context(|| format!("inspect {}", dir.display()))?;
            print_status(&s, json)
        }
        Cmd::Info { url: Some(url), .. } => {
            let r = control(&url, 0)
                .await?
                .replica_get(v1::Empty {})
                .await?
                .into_inner();
            print_replica(&r.replica.unwrap_or_default(), json)
        }
        Cmd::Info { .. } => bail!("give --dir or --url"),
        Cmd::Image {
            cmd: ImageCmd::Info { path },
        } => replica::image_cli::image_info(&path, json).await,
        Cmd::Image {
            cmd: ImageCmd::Convert { to, src, dst },
        } => replica::image_cli::image_convert(src, dst, to).await,
        Cmd::Snapshot { cmd } => snapshot(cmd, json).await,
        Cmd::Lvstore { url, cmd } => lvstore(&url, cmd, json).await,
        Cmd::Hash {
            url,
            snapshot,
            rehash,
        } => {
            let mut sa = sync_agent(&url, 0).await?;
            sa.snapshot_hash(v1::SnapshotHashRequest {
                snapshot_name: snapshot.clone(),
                rehash,
            })
            .await?;
            let (state, error) = wait_job(&format!("hashing {snapshot}"), || {
                let mut sa = sa.clone();
                let snapshot = snapshot.clone();
                async move {
                    let s = sa
                        .snapshot_hash_status(v1::SnapshotHashStatusRequest {
                            snapshot_name: snapshot,
                        })
                        .await?
                        .into_inner();
                    Ok((s.state, s.progress, s.error))
                }
            })
            .await?;
            let last = sa
                .snapshot_hash_status(v1::SnapshotHashStatusRequest {
                    snapshot_name: snapshot.clone(),
                })
                .await?
                .into_inner();
            if json {
                output::print(true, &last, String::new)?;
            } else if state == "complete" {
                let note = if last.skipped {
                    " (recorded, file unchanged)"
                } else {
                    ""
                };
                emit(&format!("{snapshot}: sha512-sparse {}{note}", last.checksum));
                if last.silently_corrupted {
                    emit("WARNING: silent corruption: content changed without its ctime changing");
                }
            }
            if state != "complete" {
                bail!("hash {state}: {error}");
            }
            if last.silently_corrupted {
                std::process::exit(3);
            }
            Ok(())
        }
    }
}

/// `serve`: a v1 replica until SIGTERM.
async fn serve_replica(
    args: ServeArgs,
    ready_file: Option<PathBuf>,
    tls: Option<corral_tls::TlsConfigs>,
) -> anyhow::Result<()> {
    let ServeArgs {
        dir,
        listen,
        data_listen,
        data_unix,
        sync_listen,
        size,
        backing_file,
        backing_image_name,
        backing_image_checksum,
        disable_revision_counter,
        volume,
        metrics,
        data_window,
        no_local_copy,
        #[cfg(feature = "fault-injection")]
        faults,
    } = args;
    let cancel = corral_daemon::shutdown_on_signal();
    let data = data_protocol::ServerConfig {
        window: data_window,
        tls: tls.as_ref().map(|t| t.server.clone()),
        ..Default::default()
    };
    // Never derived from the --listen port: each listener is named, or a free port.
    let any_port = SocketAddr::new(listen.ip(), 0);
    let cfg = ServeConfig {
        dir,
        listen,
        data_listen: data_listen.unwrap_or(any_port),
        data_unix,
        sync_listen: sync_listen.unwrap_or(any_port),
        ready_file,
        size,
        backing_file,
        backing_image: match (backing_image_name, backing_image_checksum) {
            (Some(n), Some(c)) => Some(replica::backing::BackingImageId::new(&n, &c)?),
            _ => None,
        },
        disable_revision_counter,
        volume,
        metrics_listen: metrics.metrics_listen,
        data,
        local_copy: !no_local_copy,
        #[cfg(feature = "fault-injection")]
        faults,
    };
    serve(cfg, cancel).await
}

/// `serve-lvstore`: a v2 disk daemon until SIGTERM.
async fn serve_lvstore(
    args: ServeLvstoreArgs,
    ready_file: Option<PathBuf>,
    tls: Option<corral_tls::TlsConfigs>,
) -> anyhow::Result<()> {
    let ServeLvstoreArgs {
        disk,
        listen,
        format,
        cluster_size,
        data_window,
        data_io,
        io_threads,
        io_depth,
        replicas,
        data_unix_dir,
        backing_image_send_rate,
        metrics,
    } = args;
    let cfg = replica::v2::daemon::LvstoreServeConfig {
        disk,
        listen,
        format,
        cluster_size,
        ready_file,
        data: data_protocol::ServerConfig {
            window: data_window,
            io_depth,
            tls: tls.as_ref().map(|t| t.server.clone()),
            ..Default::default()
        },
        data_io,
        io_threads,
        replicas,
        metrics_listen: metrics.metrics_listen,
        data_unix_dir,
        backing_image_send_rate,
    };
    replica::v2::daemon::serve_lvstore(cfg, corral_daemon::shutdown_on_signal()).await
}

async fn lvstore(url: &str, cmd: LvstoreCmd, json: bool) -> anyhow::Result<()> {
    let ch = corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::OPERATOR)
        .await
        .context("v2 disk daemon")?;
    let mut c = v1::lvstore_service_client::LvstoreServiceClient::new(ch);
    match cmd {
        LvstoreCmd::BackingImage { cmd } => replica::v2::backing_image_cli::run(c, cmd, json).await,
        LvstoreCmd::Add {
            name,
            size,
            disable_revision_counter,
        } => {
            let r = c
                .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
                    name,
                    size,
                    disable_revision_counter,
                    ..Default::default()
                })
                .await?
                .into_inner();
            Ok(output::print(json, &r, || {
                format!("{} {} {}", r.name, r.state, r.address)
            })?)
        }
        LvstoreCmd::Rm { name, delete_data } => {
            c.lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
                name: name.clone(),
                delete_data,
            })
            .await?;
            emit(&format!("replica {name} removed"));
            Ok(())
        }
        LvstoreCmd::Ls => {
            let r = c.lvstore_replica_list(v1::LvstoreEmpty {}).await?.into_inner();
            Ok(output::print(json, &r, || {
                r.replicas
                    .iter()
                    .map(|x| format!("{}\t{}\t{}\t{}", x.name, x.state, x.size, x.address))
                    .collect::<Vec<_>>()
                    .join("\n")
            })?)
        }
        LvstoreCmd::Info => {
            let r = c.lvstore_info(v1::LvstoreEmpty {}).await?.into_inner();
            Ok(output::print(json, &r, || {
                format!(
                    "{}: {} clusters of {} used, {} free, {} total",
                    r.path,
                    r.used_clusters,
                    human_bytes(r.cluster_size),
                    r.free_clusters,
                    r.total_clusters
                )
            })?)
        }
    }
}

async fn snapshot(cmd: SnapCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        SnapCmd::Ls { url } => {
            let r = control(&url, 0)
                .await?
                .replica_get(v1::Empty {})
                .await?
                .into_inner();
            print_replica(&r.replica.unwrap_or_default(), json)
        }
        SnapCmd::Create {
            url,
            generation,
            name,
            labels,
        } => {
            let labels = corral_daemon::parse_labels(&labels).map_err(anyhow::Error::msg)?;
            control(&url, generation)
                .await?
                .replica_snapshot(v1::ReplicaSnapshotRequest {
                    name: name.clone(),
                    user_created: true,
                    created: String::new(),
                    labels,
                })
                .await?;
            emit(&format!("snapshot {name} created"));
            Ok(())
        }
        SnapCmd::Rm {
            url,
            generation,
            name,
        } => {
            control(&url, generation)
                .await?
                .disk_mark_as_removed(v1::DiskRequest { name: name.clone() })
                .await?;
            emit(&format!(
                "snapshot {name} marked removed; run `snapshot purge` to reclaim its space"
            ));
            Ok(())
        }
        SnapCmd::Revert {
            url,
            generation,
            name,
        } => {
            control(&url, generation)
                .await?
                .replica_revert(v1::ReplicaRevertRequest {
                    name: name.clone(),
                    created: String::new(),
                })
                .await?;
            emit(&format!("reverted to {name}"));
            Ok(())
        }
        SnapCmd::Purge { url, generation } => {
            let mut sa = sync_agent(&url, generation).await?;
            sa.snapshot_purge(v1::Empty {}).await?;
            let (state, error) = wait_job("purging", || {
                let mut sa = sa.clone();
                async move {
                    let s = sa.snapshot_purge_status(v1::Empty {}).await?.into_inner();
                    Ok((s.state, s.progress, s.error))
                }
            })
            .await?;
            if state != "complete" {
                bail!("purge {state}: {error}");
            }
            emit("purge complete");
            Ok(())
        }
    }
}
