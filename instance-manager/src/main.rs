//! `corral-im`: the instance manager of one node, and a debug CLI for it. Parses flags and wires.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::output::{self, OutputArgs};
use corral_proto::v1::{
    self, instance_service_client::InstanceServiceClient, instance_service_server::InstanceServiceServer,
};
use instance_manager::service::InstanceGrpc;
use instance_manager::table::ProcessTable;

#[derive(Parser, Debug)]
#[command(
    name = "corral-im",
    version = instance_manager::build_info::VERSION,
    about = "Corral instance manager: owns a node's data-plane processes so they outlive the manager"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    #[command(flatten)]
    out: OutputArgs,
    #[command(flatten)]
    tls: corral_tls::TlsDirArg,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve the process API.
    Serve {
        /// gRPC address (port 0: any; --ready-file reports it as `grpc`).
        #[arg(long, env = "CORRAL_IM_LISTEN", default_value = "127.0.0.1:9600")]
        listen: SocketAddr,
        /// Where the process table (`processes.json`), the processes' logs (`logs/NAME.log`) and ready files
        /// (`run/NAME.ready`) live.
        #[arg(long, env = "CORRAL_DATA_DIR", default_value = "/var/lib/corral")]
        data_dir: PathBuf,
        /// Directory holding the data-plane binaries (corral-engine, corral-replica, corral-bim,
        /// corral-datasource); default: beside this binary.
        #[arg(long, env = "CORRAL_BIN_DIR")]
        bin_dir: Option<PathBuf>,
        #[command(flatten)]
        metrics: corral_daemon::metrics::MetricsListenArg,
    },
    /// List the processes of an instance manager.
    Ps {
        #[arg(long, env = "CORRAL_IM_URL", default_value = "http://127.0.0.1:9600")]
        url: String,
    },
    /// Print the tail of a process's log.
    Log {
        name: String,
        #[arg(long, env = "CORRAL_IM_URL", default_value = "http://127.0.0.1:9600")]
        url: String,
        /// Lines from the end.
        #[arg(long, default_value_t = 100)]
        lines: u32,
    },
    /// Print an instance manager's version and API version.
    Version {
        #[arg(long, env = "CORRAL_IM_URL", default_value = "http://127.0.0.1:9600")]
        url: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let process = cli
        .common
        .init(RunKind::serving(matches!(cli.cmd, Cmd::Serve { .. })))?;
    let tls = cli.tls.load_and_install()?;
    match cli.cmd {
        Cmd::Serve {
            listen,
            data_dir,
            bin_dir,
            metrics,
        } => {
            serve(
                listen,
                data_dir,
                bin_dir,
                metrics.metrics_listen,
                process.ready_file,
                tls,
            )
            .await
        }
        Cmd::Ps { url } => {
            let list = client(&url)
                .await?
                .process_list(v1::ProcessListRequest {})
                .await?
                .into_inner();
            output::print(cli.out.json, &list.processes, || {
                let rows = list
                    .processes
                    .iter()
                    .map(|p| {
                        let state =
                            v1::InstanceProcessState::try_from(p.state).map_or("unknown", |s| state_name(s));
                        let listen = p
                            .listen
                            .iter()
                            .map(|(k, v)| format!("{k}={v}"))
                            .collect::<Vec<_>>();
                        vec![
                            p.name.clone(),
                            p.kind.clone(),
                            p.pid.to_string(),
                            state.to_owned(),
                            listen.join(" "),
                            p.restarts.to_string(),
                            p.error.clone(),
                        ]
                    })
                    .collect();
                output::table(
                    &["NAME", "KIND", "PID", "STATE", "LISTEN", "RESTARTS", "ERROR"],
                    rows,
                )
                .to_string()
            })?;
            Ok(())
        }
        Cmd::Log { name, url, lines } => {
            let r = client(&url)
                .await?
                .process_log(v1::ProcessLogRequest { name, lines })
                .await?
                .into_inner();
            output::print(cli.out.json, &r.lines, || r.lines.join("\n"))?;
            Ok(())
        }
        Cmd::Version { url } => {
            let v = client(&url)
                .await?
                .version_get(v1::VersionGetRequest {})
                .await?
                .into_inner();
            output::print(cli.out.json, &v, || {
                format!(
                    "corral-im {} (instance API v{}, clients from v{}; features {})",
                    v.version,
                    v.api_version,
                    v.api_min_version,
                    corral_proto::data_plane::effective(&v.features).join(",")
                )
            })?;
            Ok(())
        }
    }
}

fn state_name(s: v1::InstanceProcessState) -> &'static str {
    match s {
        v1::InstanceProcessState::Starting => "starting",
        v1::InstanceProcessState::Running => "running",
        v1::InstanceProcessState::Stopped => "stopped",
        v1::InstanceProcessState::Error => "error",
        v1::InstanceProcessState::Unspecified => "unknown",
    }
}

async fn client(url: &str) -> anyhow::Result<InstanceServiceClient<tonic::transport::Channel>> {
    let ch = corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::OPERATOR).await?;
    Ok(InstanceServiceClient::new(ch))
}

async fn serve(
    listen: SocketAddr,
    data_dir: PathBuf,
    bin_dir: Option<PathBuf>,
    metrics_listen: Option<SocketAddr>,
    ready_file: Option<PathBuf>,
    tls: Option<corral_tls::TlsConfigs>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    let data_dir = data_dir.canonicalize()?;
    let bin_dir = match bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .map(std::path::Path::to_path_buf)
            .context("no directory beside the executable")?,
    };
    let features = instance_manager::build_info::features().map_err(anyhow::Error::msg)?;
    tracing::info!(%listen, data_dir = %data_dir.display(), bin_dir = %bin_dir.display(), ?metrics_listen,
        version = instance_manager::build_info::VERSION, ?features, "corral-im starting");
    let cancel = corral_daemon::shutdown_on_signal();
    let tls_dir = match &tls {
        Some(t) => Some(t.dir.canonicalize()?),
        None => None,
    };
    let table = ProcessTable::open(&data_dir, &bin_dir, tls_dir.as_deref()).await?;
    let monitor = tokio::spawn(table.clone().monitor(cancel.clone()));
    let grpc = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen}"))?;
    let mut ready = corral_daemon::ready::ReadyReport::new().tcp("grpc", grpc.local_addr()?);
    let mut metrics_task = None;
    if let Some(addr) = metrics_listen {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        ready = ready.tcp("metrics", l.local_addr()?);
        let routes = instance_manager::metrics::metrics(table.clone()).routes();
        metrics_task = Some(tokio::spawn(corral_daemon::metrics::serve(
            l,
            routes,
            cancel.clone(),
        )));
    }
    ready.announce(ready_file.as_deref())?;
    tonic::transport::Server::builder()
        .add_service(InstanceServiceServer::new(InstanceGrpc::new(
            table,
            cancel.clone(),
            features,
        )))
        .serve_with_incoming_shutdown(
            corral_proto::grpc::incoming(grpc, tls.map(|t| t.server))?,
            cancel.cancelled(),
        )
        .await?;
    cancel.cancel();
    let _ = monitor.await;
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    tracing::info!(
        "instance manager stopped; its processes keep running and are re-adopted at the next start"
    );
    Ok(())
}
