//! `corral`: the user CLI. Talks to a manager's REST API (`--url`, `$CORRAL_URL`); `corral up` runs a single-node
//! manager on the embedded store ([`up`]). Tables by default, `--json` for scripts. This file parses and
//! dispatches: each noun's commands are its feature's `cli` module (`manager::volume::cli`, `manager::node::cli`,
//! …).

mod up;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use manager::client::Client;
use manager::node::cli::NodeCmd;
use manager::setting::cli::SettingCmd;
use manager::volume::cli::{ReplicaCmd, SnapshotCmd, VolumeCmd};

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
        } => up::up(data_dir, listen, store, node_id, detach).await?,
        Cmd::Down { data_dir, timeout } => up::down(data_dir, token, Duration::from_secs(timeout)).await?,
        Cmd::Token { cmd } => manager::token::cli::run(&c, json, cmd).await?,
        Cmd::Node { cmd } => manager::node::cli::run(&c, json, cmd).await?,
        Cmd::Volume { cmd } => manager::volume::cli::run(&c, json, cmd).await?,
        Cmd::Snapshot { cmd } => manager::volume::cli::run_snapshot(&c, json, cmd).await?,
        Cmd::Replica { cmd } => manager::volume::cli::run_replica(&c, json, cmd).await?,
        Cmd::BackingImage { cmd } => manager::backing_image::cli::run(&c, json, cmd).await?,
        Cmd::Job { cmd } => manager::job::cli::run(&c, json, cmd).await?,
        Cmd::Backup { cmd } => manager::backup::cli::run(&c, json, cmd).await?,
        Cmd::Lvstore { cmd } => manager::v2::cli::run(&c, json, cmd).await?,
        Cmd::Setting { cmd } => manager::setting::cli::run(&c, json, cmd).await?,
    }
    Ok(())
}
