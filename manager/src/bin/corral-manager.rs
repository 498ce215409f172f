//! `corral-manager`: one node's control plane. Parses flags and wires.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use corral_daemon::cli::RunKind;

/// This build's version, as `--version` prints it and the node reports it (`corral node ls`): the crate's, or
/// `CORRAL_BUILD_VERSION` given to the compiler (a distribution's own version string; the rolling-upgrade test's
/// second manager build, `0.1.0-upgrade`). Read by this binary only, so setting it rebuilds nothing else.
const VERSION: &str = match option_env!("CORRAL_BUILD_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

#[derive(Parser, Debug)]
#[command(
    name = "corral-manager",
    version = VERSION,
    about = "Corral manager: the control plane of one node"
)]
struct Cli {
    /// Directory for the embedded store, the default disk, daemon logs and NBD sockets.
    #[arg(long, env = "CORRAL_DATA_DIR", default_value = "/var/lib/corral")]
    data_dir: PathBuf,
    /// REST API address.
    #[arg(long, env = "CORRAL_LISTEN", default_value = "127.0.0.1:9500")]
    listen: SocketAddr,
    /// State store: `embedded` (a redb file in the data directory) or `etcd://HOST:PORT[,HOST:PORT]`.
    #[arg(long, env = "CORRAL_STORE", default_value = "embedded")]
    store: String,
    /// This node's name (default: the host name).
    #[arg(long, env = "CORRAL_NODE_ID")]
    node_id: Option<String>,
    /// Address the node's daemons listen on and other nodes reach them at.
    #[arg(long, env = "CORRAL_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Address on a separate storage network (as Longhorn's storage-network setting): the data path listens and
    /// is reached there (replicas' control, data and sync, v2 lvstore daemons, engines' NBD TCP frontends), the
    /// management traffic (REST, store, the manager's calls to engines) stays on --host. Default: --host.
    #[arg(long, env = "CORRAL_STORAGE_HOST")]
    storage_host: Option<String>,
    /// Directory holding corral-replica, corral-engine, corral-bim and corral-datasource (default: beside this
    /// binary).
    #[arg(long, env = "CORRAL_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Ports the sync receivers of this node's corral-bim may listen on, FROM-TO (every other daemon listener
    /// binds port 0 and reports it).
    #[arg(long, env = "CORRAL_PORT_RANGE", default_value = "20000-30000", value_parser = manager_bin::parse_range)]
    port_range: (u16, u16),
    /// Run the node's daemons through this instance manager (`http://HOST:PORT` of `corral-im serve`) instead of
    /// as children of this manager: they then outlive the manager's container, and a manager restart or upgrade
    /// never interrupts IO. Default: the manager runs them itself.
    #[arg(long, env = "CORRAL_INSTANCE_MANAGER", value_name = "URL")]
    instance_manager: Option<String>,
    /// Where the first admin token is written when the store holds no token (mode 0600; default
    /// DATA_DIR/admin.token). A token already in the file (e.g. a mounted Kubernetes Secret) is adopted instead.
    #[arg(long, env = "CORRAL_ADMIN_TOKEN_FILE", value_name = "PATH")]
    admin_token_file: Option<PathBuf>,
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    /// Mutual TLS between the cluster's daemons: `auto` (the default, unless --tls-dir is given) keeps a cluster
    /// CA in the store (made by the first manager) and issues this node's certificate into DATA_DIR/tls (re-issued
    /// at start when missing, of another CA, or in the last third of its validity); the node's daemons, its
    /// `corral-im` and the CLIs use that directory. With --tls-dir: the operator's files instead. `off` without
    /// --tls-dir: the node's daemons listen in plaintext (anyone who reaches a port can read and write volumes;
    /// logged as a warning).
    #[arg(long = "tls", env = "CORRAL_TLS", value_enum)]
    tls_mode: Option<manager_bin::TlsMode>,
    #[command(flatten)]
    tls: corral_tls::TlsDirArg,
    /// Issue (or keep, when still good) this node's DATA_DIR/tls from the store's cluster CA, print its path and
    /// exit without serving: run it before the node's `corral-im` starts with that directory as its --tls-dir
    /// (an init container, a compose one-shot). Needs --tls auto.
    #[arg(long)]
    tls_issue_only: bool,
}

mod manager_bin {
    /// `--tls`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
    pub enum TlsMode {
        /// Certificates issued by the manager from the store's cluster CA.
        Auto,
        /// No certificates of the manager's (plaintext without --tls-dir).
        Off,
    }

    pub fn parse_range(s: &str) -> Result<(u16, u16), String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected FROM-TO"))?;
        let a: u16 = a.trim().parse().map_err(|_| format!("{s:?}: bad port {a:?}"))?;
        let b: u16 = b.trim().parse().map_err(|_| format!("{s:?}: bad port {b:?}"))?;
        if a >= b {
            return Err(format!("{s:?}: FROM must be below TO"));
        }
        Ok((a, b))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let process = cli.common.init(RunKind::Daemon)?;
    let tls_auto = match cli.tls_mode {
        Some(mode) => mode == manager_bin::TlsMode::Auto,
        None => cli.tls.tls_dir.is_none(),
    };
    anyhow::ensure!(
        !(tls_auto && cli.tls.tls_dir.is_some()),
        "--tls auto issues the node's certificates itself: drop --tls-dir (CORRAL_TLS_DIR), or drop --tls auto (CORRAL_TLS) to use the files there"
    );
    if !tls_auto && cli.tls.tls_dir.is_none() {
        tracing::warn!(
            "--tls off without --tls-dir: this node's daemons accept any peer on TCP in plaintext \
             (anyone who reaches their ports can read and write volumes)"
        );
    }
    cli.tls.load_and_install()?;
    let node_id = match cli.node_id {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?
            .trim()
            .to_owned(),
    };
    let cfg = manager::server::ServerConfig {
        data_dir: cli.data_dir,
        listen: cli.listen,
        store: cli.store,
        node_id,
        host: cli.host,
        storage_host: cli.storage_host,
        bin_dir: cli.bin_dir.unwrap_or_else(manager::server::default_bin_dir),
        port_range: cli.port_range,
        ready_file: process.ready_file,
        instance_manager: cli.instance_manager,
        version: VERSION.to_owned(),
        admin_token_file: cli.admin_token_file,
        tls_dir: cli.tls.tls_dir.map(|d| d.canonicalize()).transpose()?,
        tls_auto,
    };
    if cli.tls_issue_only {
        anyhow::ensure!(
            tls_auto,
            "--tls-issue-only issues from the cluster CA: it needs --tls auto"
        );
        let dir = manager::server::issue_node_tls(&cfg).await?;
        println!("{}", dir.display());
        return Ok(());
    }
    let cancel = corral_daemon::shutdown_on_signal();
    manager::server::run(cfg, cancel).await
}
