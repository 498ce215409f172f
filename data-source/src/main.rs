//! `corral-datasource`: parses flags and wires; the work is in the library.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use data_source::spec::parse_param;
use data_source::{DataEngine, DataSource, DataSourceConfig, SourceType};

#[derive(Parser, Debug)]
#[command(
    name = "corral-datasource",
    version,
    about = "Corral data source: prepares the first copy of a backing image on a disk"
)]
struct Cli {
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Prepare one image file and serve its state on GET /v1/file until SIGTERM.
    Serve {
        /// HTTP address (GET /v1/file, POST /v1/file?action=upload|transfer, /metrics).
        #[arg(long, env = "CORRAL_DATASOURCE_LISTEN", default_value = "127.0.0.1:8000")]
        listen: SocketAddr,
        /// Disk directory; its corral-disk.cfg must name --disk-uuid. The file is prepared in DIR/tmp.
        #[arg(long, env = "CORRAL_DISK_PATH")]
        disk_path: PathBuf,
        /// Expected disk uuid.
        #[arg(long, env = "CORRAL_DISK_UUID")]
        disk_uuid: String,
        /// Backing image name.
        #[arg(long, env = "CORRAL_BACKING_IMAGE_NAME")]
        name: String,
        /// Backing image uuid.
        #[arg(long, env = "CORRAL_BACKING_IMAGE_UUID")]
        uuid: String,
        /// download | upload | export-from-volume | restore | clone.
        #[arg(long, env = "CORRAL_SOURCE_TYPE")]
        source_type: String,
        /// Source parameter KEY=VALUE (repeatable): download url; export-from-volume snapshot-name,
        /// sender-address, volume-size, file-type (raw|qcow2); restore backup-url; clone backing-image,
        /// backing-image-uuid, and for a v2 image lvstore-address (HOST:PORT of the disk daemon that holds a ready
        /// copy) and backing-image-size.
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_param)]
        params: Vec<(String, String)>,
        /// SHA-512 (hex) the file must have: of the image as given, or of the final file.
        #[arg(long, env = "CORRAL_EXPECTED_CHECKSUM")]
        expected_checksum: Option<String>,
        /// v1 | v2 (v2: qcow2 images are converted to raw before checksumming).
        #[arg(long, default_value = "v1", env = "CORRAL_DATA_ENGINE")]
        data_engine: DataEngine,
        /// Seconds without any data before a download or export fails (a restore: without progress, plus as
        /// long again for a conflicting backup-store lock).
        #[arg(long, default_value_t = 30, env = "CORRAL_NO_DATA_TIMEOUT")]
        no_data_timeout: u64,
        /// Retries of a broken download (renewed whenever data flowed; each resumes with a Range request).
        #[arg(long, default_value_t = 8)]
        download_retries: usize,
        /// IP an export's receiver binds and tells the replica (default: the --listen IP).
        #[arg(long, env = "CORRAL_RECEIVER_IP")]
        receiver_ip: Option<IpAddr>,
        /// File of a restore's S3 credentials (KEY=VALUE lines: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
        /// AWS_SESSION_TOKEN); without it they come from the environment.
        #[arg(long, env = "CORRAL_BACKUP_CREDENTIALS_FILE")]
        backup_credentials_file: Option<PathBuf>,
        #[command(flatten)]
        tls: corral_tls::TlsDirArg,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let process = cli.common.init(RunKind::Daemon)?;
    let Cmd::Serve {
        listen,
        disk_path,
        disk_uuid,
        name,
        uuid,
        source_type,
        params,
        expected_checksum,
        data_engine,
        no_data_timeout,
        download_retries,
        receiver_ip,
        backup_credentials_file,
        tls,
    } = cli.cmd;
    // The HTTP API and an export's sync receiver take the process's configs.
    let tls = tls.load_and_install()?;
    let ready_file = process.ready_file;
    let source_type: SourceType = source_type.parse().map_err(anyhow::Error::msg)?;
    let parameters: BTreeMap<String, String> = params.into_iter().collect();
    let config = DataSourceConfig {
        disk_path,
        disk_uuid,
        name,
        uuid,
        source_type,
        parameters,
        expected_checksum: expected_checksum.map(|c| c.to_ascii_lowercase()),
        data_engine,
        no_data_timeout: Duration::from_secs(no_data_timeout.max(1)),
        download_retries,
        receiver_ip: receiver_ip.unwrap_or(listen.ip()),
        backup_credentials_file,
    };
    tracing::info!(?config, %listen, tls = ?tls, "corral-datasource starting");
    let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
    rt.block_on(async move {
        let cancel = corral_daemon::shutdown_on_signal();
        let ds = DataSource::new(config, cancel.child_token())?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        let addr = listener.local_addr()?;
        // /metrics is served on the HTTP listener.
        corral_daemon::ready::ReadyReport::new()
            .tcp("http", addr)
            .tcp("metrics", addr)
            .announce(ready_file.as_deref())?;
        data_source::serve(listener, ds, cancel)
            .await
            .context("serving HTTP")
    })
}
