//! `corral-bim`: the backing-image manager daemon (`serve`) and its CLI. Parses flags and wires; the work is in the
//! library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use backing_image_manager::PortRange;
use backing_image_manager::daemon::{ServeConfig, serve};
use clap::{Parser, Subcommand};
use corral_daemon::cli::{Process, RunKind};

mod cli;

#[derive(Parser, Debug)]
#[command(
    name = "corral-bim",
    version,
    about = "Corral backing-image manager: one per disk; daemon and CLI"
)]
struct Cli {
    /// gRPC address of the manager the CLI commands talk to.
    #[arg(long, global = true, env = "CORRAL_BIM_URL", default_value = "127.0.0.1:8000")]
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
    /// Run the manager of one disk.
    Serve {
        /// gRPC address (BackingImageManagerService).
        #[arg(long, env = "CORRAL_BIM_LISTEN", default_value = "127.0.0.1:8000")]
        listen: SocketAddr,
        /// HTTP address: downloads (/v1/files/NAME/download), /metrics, /healthz.
        #[arg(long, env = "CORRAL_BIM_HTTP_LISTEN", default_value = "127.0.0.1:8001")]
        http_listen: SocketAddr,
        /// The disk directory; it must hold corral-disk.cfg naming --disk-uuid.
        #[arg(long, env = "CORRAL_BIM_DISK_PATH")]
        disk_path: PathBuf,
        /// UUID of the disk; the daemon refuses to start on a directory of another disk.
        #[arg(long, env = "CORRAL_BIM_DISK_UUID")]
        disk_uuid: String,
        /// Ports sync receivers listen on (A-B, inclusive).
        #[arg(long, env = "CORRAL_BIM_PORT_RANGE", default_value = "30001-31000")]
        port_range: PortRange,
        /// Host or IP other managers reach this one at (default: the --listen IP, 127.0.0.1 when unspecified).
        #[arg(long, env = "CORRAL_BIM_ADVERTISE_HOST")]
        advertise_host: Option<String>,
        /// Seconds between checks of the disk identity and of every ready file's mtime.
        #[arg(long, env = "CORRAL_BIM_CHECK_INTERVAL", default_value_t = 5.0)]
        check_interval: f64,
        /// Seconds a sync receiver waits for the sender before it gives up.
        #[arg(long, env = "CORRAL_BIM_SYNC_IDLE_TIMEOUT", default_value_t = 30)]
        sync_idle_timeout: u64,
        /// Upper bound of data bytes per second of each send to another manager (K/M/G suffixes), e.g. to keep
        /// syncs from starving replica IO on the disk.
        #[arg(long, env = "CORRAL_BIM_SEND_MAX_RATE", value_parser = corral_daemon::parse_size)]
        send_max_rate: Option<u64>,
    },
    /// List the images of the manager.
    Ls,
    /// Show one image.
    Get {
        name: String,
        #[arg(long, default_value = "")]
        uuid: String,
    },
    /// Take over a data source's file (--data-source), or reuse the file on the disk; waits until ready or failed.
    Fetch {
        #[command(flatten)]
        spec: cli::SpecArgs,
        /// HOST:PORT of the data source; without it the file already on the disk is reused.
        #[arg(long, default_value = "")]
        data_source: String,
        /// Return at once instead of waiting.
        #[arg(long)]
        no_wait: bool,
    },
    /// Receive the image from another manager (--from); waits until ready or failed.
    Sync {
        #[command(flatten)]
        spec: cli::SpecArgs,
        /// gRPC HOST:PORT of a manager holding the image ready.
        #[arg(long)]
        from: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Delete an image and its files.
    Rm {
        name: String,
        #[arg(long)]
        uuid: String,
    },
    /// Print every change of every image until interrupted.
    Watch,
    /// Version of the manager.
    Version,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kind = RunKind::serving(matches!(cli.cmd, Cmd::Serve { .. }));
    let process = cli.common.init(kind)?;
    let result = run(cli, process).await;
    // A refused request is the server's message, not a Rust error chain.
    if let Err(e) = &result
        && let Some(s) = e.downcast_ref::<tonic::Status>()
    {
        eprintln!("corral-bim: {:?}: {}", s.code(), s.message());
        std::process::exit(1);
    }
    result
}

async fn run(cli: Cli, process: Process) -> anyhow::Result<()> {
    let json = cli.output.json;
    // The HTTP download, the data-source client, every sync receiver and sender and every gRPC channel take the
    // process's configs; the gRPC server takes them from `ServeConfig::tls`.
    let tls = cli.tls.load_and_install()?;
    match cli.cmd {
        Cmd::Serve {
            listen,
            http_listen,
            disk_path,
            disk_uuid,
            port_range,
            advertise_host,
            check_interval,
            sync_idle_timeout,
            send_max_rate,
        } => {
            anyhow::ensure!(
                check_interval.is_finite() && check_interval > 0.0,
                "--check-interval must be a positive number of seconds"
            );
            let cfg = ServeConfig {
                listen,
                http_listen,
                disk_path,
                disk_uuid,
                port_range,
                advertise_host,
                check_interval: Duration::from_secs_f64(check_interval),
                sync_idle_timeout: Duration::from_secs(sync_idle_timeout.max(1)),
                send_max_rate,
                ready_file: process.ready_file,
                tls,
            };
            let cancel = corral_daemon::shutdown_on_signal();
            serve(cfg, cancel).await.context("corral-bim serve")
        }
        Cmd::Ls => cli::ls(&cli.url, json).await,
        Cmd::Get { name, uuid } => cli::get(&cli.url, &name, &uuid, json).await,
        Cmd::Fetch {
            spec,
            data_source,
            no_wait,
        } => {
            cli::obtain(
                &cli.url,
                spec,
                cli::Origin::DataSource(&data_source),
                !no_wait,
                json,
            )
            .await
        }
        Cmd::Sync { spec, from, no_wait } => {
            cli::obtain(&cli.url, spec, cli::Origin::Manager(&from), !no_wait, json).await
        }
        Cmd::Rm { name, uuid } => cli::rm(&cli.url, &name, &uuid).await,
        Cmd::Watch => cli::watch(&cli.url, json).await,
        Cmd::Version => cli::version(&cli.url, json).await,
    }
}
