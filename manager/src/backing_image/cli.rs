//! `corral backing-image create|ls|get|rm|cleanup`: tables or `--json`, progress bars while an image is prepared
//! or uploaded. An upload streams the file through the manager in 1 MiB pieces (bounded memory) as the multipart
//! form the data source takes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Subcommand;
use tokio::io::AsyncReadExt;

use super::model::state;
use super::routes::{BackingImageCreate, BackingImageView, CleanupRequest};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum BackingImageCmd {
    /// Create an image from a URL (--source download --download-url), a local file (--from-file), a volume snapshot
    /// (--source export-from-volume --volume V --snapshot S), a backup (--source restore --backup-url U) or another
    /// image (--source clone --backing-image B); waits with a progress bar until a copy is ready.
    Create(Box<CreateArgs>),
    /// List the backing images: source, size, state, copies.
    Ls,
    /// Show a backing image and its copy on every disk.
    Get { name: String },
    /// Delete (refused while a volume uses it).
    Rm { name: String },
    /// Remove the copies on some disks now (refused for disks whose replicas use it).
    Cleanup {
        name: String,
        /// Disk UUIDs.
        #[arg(long = "disk", required = true)]
        disks: Vec<String>,
    },
}

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    name: String,
    /// download | upload | export-from-volume | restore | clone (default: download, or upload with --from-file).
    #[arg(long)]
    source: Option<String>,
    /// The image's URL (download). Not `--url`: that global flag is the manager's address.
    #[arg(long)]
    download_url: Option<String>,
    /// Upload this file through the manager.
    #[arg(long)]
    from_file: Option<PathBuf>,
    #[arg(long)]
    volume: Option<String>,
    #[arg(long)]
    snapshot: Option<String>,
    /// raw | qcow2 (export-from-volume).
    #[arg(long)]
    export_type: Option<String>,
    /// The backup to restore: `TARGET?backup=NAME&volume=VOLUME` (e.g. `s3://B/P?endpoint=E&backup=N&volume=V`);
    /// the credentials of the configured backup target it points into are used.
    #[arg(long)]
    backup_url: Option<String>,
    /// The image to clone.
    #[arg(long)]
    backing_image: Option<String>,
    /// SHA-512 the image must have.
    #[arg(long, default_value = "")]
    expected_checksum: String,
    /// Ready copies kept on distinct nodes (default: the backing-image-min-copies setting).
    #[arg(long)]
    min_copies: Option<u32>,
    /// v1 (default): files on disks; v2: snapshot lvols in v2 disks' stores (for v2 volumes).
    #[arg(long, value_parser = ["v1", "v2"])]
    data_engine: Option<String>,
    /// Return once created instead of waiting until ready.
    #[arg(long)]
    no_wait: bool,
    #[arg(long, default_value_t = 1800)]
    timeout: u64,
}

fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    corral_daemon::output::table(header, rows).to_string()
}

fn list_table(bs: &[BackingImageView]) -> String {
    table(
        &[
            "NAME",
            "SOURCE",
            "SIZE",
            "VIRTUAL SIZE",
            "STATE",
            "COPIES",
            "MESSAGE",
        ],
        bs.iter()
            .map(|b| {
                let ready = b.disks.iter().filter(|d| d.state == state::READY).count();
                vec![
                    b.name.clone(),
                    b.source_type.as_str().to_owned(),
                    corral_daemon::human_bytes(b.size),
                    corral_daemon::human_bytes(b.virtual_size),
                    if b.state == state::READY.as_str() || b.state == state::FAILED.as_str() {
                        b.state.clone()
                    } else {
                        format!("{} {}%", b.state, b.progress)
                    },
                    format!("{ready}/{} (min {})", b.disks.len(), b.min_number_of_copies),
                    b.message.clone(),
                ]
            })
            .collect(),
    )
}

fn detail(b: &BackingImageView) -> String {
    let mut s = list_table(std::slice::from_ref(b));
    s.push_str(&format!("\nuuid: {}\n", b.uuid));
    for (k, v) in &b.parameters {
        s.push_str(&format!("{k}: {v}\n"));
    }
    if !b.expected_checksum.is_empty() {
        s.push_str(&format!("expected SHA-512: {}\n", b.expected_checksum));
    }
    s.push_str(&format!("current SHA-512: {}\n", b.current_checksum));
    s.push_str(&table(
        &[
            "DISK UUID",
            "NODE",
            "STATE",
            "PROGRESS",
            "UNUSED SINCE",
            "MESSAGE",
        ],
        b.disks
            .iter()
            .map(|d| {
                vec![
                    d.disk_uuid.clone(),
                    d.node_id.clone(),
                    d.state.to_string(),
                    format!("{}%", d.progress),
                    d.last_ref_at
                        .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
                        .map(|t| t.to_rfc3339())
                        .unwrap_or_default(),
                    d.message.clone(),
                ]
            })
            .collect(),
    ));
    s
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    Ok(corral_daemon::output::print(json, v, human)?)
}

pub async fn run(c: &Client, json: bool, cmd: BackingImageCmd) -> anyhow::Result<()> {
    match cmd {
        BackingImageCmd::Create(args) => {
            let CreateArgs {
                name,
                source,
                download_url,
                from_file,
                volume,
                snapshot,
                export_type,
                backup_url,
                backing_image,
                expected_checksum,
                min_copies,
                data_engine,
                no_wait,
                timeout,
            } = *args;
            let source_type =
                source.unwrap_or_else(|| if from_file.is_some() { "upload" } else { "download" }.to_owned());
            if from_file.is_some() && source_type != "upload" {
                bail!("--from-file uploads: it goes with --source upload (or no --source)");
            }
            let mut parameters = BTreeMap::new();
            for (k, v) in [
                ("url", download_url),
                ("volume", volume),
                ("snapshot", snapshot),
                ("exportType", export_type),
                ("backupURL", backup_url),
                ("backingImage", backing_image),
            ] {
                if let Some(v) = v {
                    parameters.insert(k.to_owned(), v);
                }
            }
            let size = match &from_file {
                Some(f) => Some(
                    std::fs::metadata(f)
                        .with_context(|| format!("cannot read {}", f.display()))?
                        .len(),
                ),
                None => None,
            };
            let body = BackingImageCreate {
                name: name.clone(),
                source_type,
                parameters,
                expected_checksum,
                min_number_of_copies: min_copies,
                data_engine,
                ..Default::default()
            };
            let mut b: BackingImageView = c.post("/v1/backingimages", &body).await?;
            if let (Some(f), Some(size)) = (&from_file, size) {
                upload(c, &name, f, size).await?;
            }
            if !no_wait {
                b = wait_ready(c, &name, Duration::from_secs(timeout)).await?;
            }
            print(json, &b, || detail(&b))
        }
        BackingImageCmd::Ls => {
            let bs: Vec<BackingImageView> = c.get("/v1/backingimages").await?;
            print(json, &bs, || list_table(&bs))
        }
        BackingImageCmd::Get { name } => {
            let b: BackingImageView = c.get(&format!("/v1/backingimages/{name}")).await?;
            print(json, &b, || detail(&b))
        }
        BackingImageCmd::Rm { name } => Ok(c.delete(&format!("/v1/backingimages/{name}")).await?),
        BackingImageCmd::Cleanup { name, disks } => {
            let b: BackingImageView = c
                .post(
                    &format!("/v1/backingimages/{name}/cleanup"),
                    &CleanupRequest { disks },
                )
                .await?;
            print(json, &b, || detail(&b))
        }
    }
}

async fn wait_ready(c: &Client, name: &str, timeout: Duration) -> anyhow::Result<BackingImageView> {
    let bar = corral_daemon::percent_bar(&format!("preparing {name}"));
    let end = Instant::now() + timeout;
    loop {
        let b: BackingImageView = c.get(&format!("/v1/backingimages/{name}")).await?;
        bar.set_position(u64::from(b.progress.min(100)));
        if b.state == state::READY.as_str() {
            bar.finish_and_clear();
            return Ok(b);
        }
        // A download is retried by the manager; a failed state with a message is still worth reporting.
        if b.state == state::FAILED.as_str()
            || (b.state != state::READY.as_str() && b.disks.iter().any(|d| d.state == state::FAILED))
        {
            bar.abandon();
            bail!("backing image {name} failed: {}", b.message);
        }
        if Instant::now() > end {
            bar.abandon();
            bail!(
                "backing image {name} is {} after {timeout:?}: {}",
                b.state,
                b.message
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Streams `file` as a one-part multipart form to the manager's upload route, with a progress bar.
async fn upload(c: &Client, name: &str, file: &std::path::Path, size: u64) -> anyhow::Result<()> {
    let boundary = format!("corral-{}", uuid::Uuid::new_v4().simple());
    let filename = file
        .file_name()
        .map(|f| f.to_string_lossy().replace('"', "_"))
        .unwrap_or_else(|| "image".into());
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let f = tokio::fs::File::open(file)
        .await
        .with_context(|| format!("cannot open {}", file.display()))?;
    let bar = corral_daemon::percent_bar(&format!("uploading {name}"));
    let bar2 = bar.clone();
    let chunks = futures::stream::unfold((f, 0u64), move |(mut f, sent)| {
        let bar = bar2.clone();
        async move {
            let mut buf = vec![0u8; 1 << 20];
            match f.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    let sent = sent + n as u64;
                    bar.set_position(sent.saturating_mul(100) / size.max(1));
                    Some((Ok::<_, std::io::Error>(bytes::Bytes::from(buf)), (f, sent)))
                }
                Err(e) => Some((Err(e), (f, sent))),
            }
        }
    });
    use futures::StreamExt;
    let stream = futures::stream::once(async move { Ok(bytes::Bytes::from(head)) })
        .chain(chunks)
        .chain(futures::stream::once(async move { Ok(bytes::Bytes::from(tail)) }));
    let url = format!("{}/v1/backingimages/{name}/upload?size={size}", c.base());
    let resp = c
        .authorize(reqwest::Client::new().post(&url))
        .header(
            reqwest::header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .with_context(|| format!("upload to {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        bar.abandon();
        let body: crate::error::ErrorBody = resp.json().await.unwrap_or(crate::error::ErrorBody {
            code: "unknown".into(),
            message: status.to_string(),
        });
        bail!("{} ({} {})", body.message, status.as_u16(), body.code);
    }
    bar.finish_and_clear();
    Ok(())
}
