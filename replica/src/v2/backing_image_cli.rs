//! `corral-replica lvstore --url HOST:PORT backing-image create|ls|get|rm`: drives a running v2 disk daemon's
//! backing-image copies by hand (debugging; in a cluster the manager does this). `create` waits with a progress
//! bar until the copy is ready or failed, and fails with the copy's message.

use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use corral_daemon::output::{self, emit, field_table};
use corral_daemon::{human_bytes, percent_bar};
use corral_proto::v1::{
    self, backing_image_create_request::Source, lvstore_service_client::LvstoreServiceClient,
};
use tonic::transport::Channel;

/// `lvstore backing-image ...`.
#[derive(Subcommand, Debug)]
pub enum BackingImageCmd {
    /// Make this disk's copy of an image (the snapshot lvol bi-NAME-disk-LVSUUID) from an HTTP(S) URL, a file on
    /// the daemon's host, or another disk daemon's ready copy; waits with a progress bar until it is ready.
    Create(CreateArgs),
    /// Every copy on this disk: state, progress, size, lvol.
    Ls,
    /// One copy's status, with its SHA-512 and last message.
    Get { name: String },
    /// Delete this disk's copy (cancels a create in progress; refused while a replica's chain sits on it).
    Rm { name: String },
}

#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["from_url", "from_file", "from_lvstore"]))]
pub struct CreateArgs {
    /// The backing image's name (letters, digits, `.`, `_`, `-`).
    pub name: String,
    /// An HTTP(S) URL answering GET with the raw image (e.g. a backing-image manager's
    /// /v1/files/NAME/download). A daemon with --tls-dir dials it over https with the cluster's certificates:
    /// then it must be a cluster endpoint.
    #[arg(long)]
    pub from_url: Option<String>,
    /// A raw image file on the daemon's host (absolute path).
    #[arg(long)]
    pub from_file: Option<String>,
    /// Sync from the ready copy on another v2 disk daemon: its LvstoreService address HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub from_lvstore: Option<String>,
    /// The image's UUID as the control plane knows it (default: the name).
    #[arg(long)]
    pub uuid: Option<String>,
    /// Expected SHA-512 (128 lower-case hex digits); default: a URL or file is taken as it is, a sync checks the
    /// source copy's own checksum.
    #[arg(long, default_value = "")]
    pub checksum: String,
    /// The image's size in bytes (a multiple of 4096; K, M, G suffixes); default: the source's length.
    #[arg(long, default_value = "0", value_parser = corral_daemon::parse_size)]
    pub size: u64,
    /// Answer once the daemon took the request (pending), without waiting.
    #[arg(long)]
    pub no_wait: bool,
}

fn human(i: &v1::BackingImageV2CopyInfo) -> String {
    let mut rows = vec![
        ("name", i.name.clone()),
        ("uuid", i.uuid.clone()),
        ("disk", i.disk_uuid.clone()),
        ("lvol", i.lvol.clone()),
        ("state", i.state.clone()),
        ("progress", format!("{}%", i.progress)),
        ("size", format!("{} ({} bytes)", human_bytes(i.size), i.size)),
        ("sha512", i.current_checksum.clone()),
    ];
    if !i.message.is_empty() {
        rows.push(("message", i.message.clone()));
    }
    field_table(rows).to_string()
}

async fn get(
    c: &mut LvstoreServiceClient<Channel>,
    name: &str,
) -> anyhow::Result<v1::BackingImageV2CopyInfo> {
    Ok(c.backing_image_get(v1::BackingImageRef { name: name.into() })
        .await?
        .into_inner())
}

/// Runs `cmd` against the daemon `c` talks to.
pub async fn run(
    mut c: LvstoreServiceClient<Channel>,
    cmd: BackingImageCmd,
    json: bool,
) -> anyhow::Result<()> {
    match cmd {
        BackingImageCmd::Create(a) => {
            let source = match (a.from_url, a.from_file, a.from_lvstore) {
                (Some(u), _, _) => Source::FromUrl(u),
                (_, Some(f), _) => Source::FromFile(f),
                (_, _, Some(l)) => Source::FromLvstore(l),
                _ => bail!("give --from-url, --from-file or --from-lvstore"),
            };
            let name = a.name.clone();
            let started = c
                .backing_image_create(v1::BackingImageCreateRequest {
                    backing_image_uuid: a.uuid.unwrap_or_else(|| a.name.clone()),
                    name: a.name,
                    checksum: a.checksum,
                    size: a.size,
                    source: Some(source),
                })
                .await?
                .into_inner();
            if a.no_wait {
                return Ok(output::print(json, &started, || human(&started))?);
            }
            let bar = percent_bar(&format!("copying {name}"));
            let last = loop {
                let i = get(&mut c, &name).await?;
                bar.set_position(u64::from(i.progress));
                if i.state != "pending" && i.state != "in-progress" {
                    bar.finish_and_clear();
                    break i;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            output::print(json, &last, || human(&last))?;
            if last.state != "ready" {
                bail!("backing image {name}: {}: {}", last.state, last.message);
            }
            Ok(())
        }
        BackingImageCmd::Ls => {
            let r = c.backing_image_list(v1::LvstoreEmpty {}).await?.into_inner();
            Ok(output::print(json, &r, || {
                let rows = r
                    .backing_images
                    .iter()
                    .map(|i| {
                        vec![
                            i.name.clone(),
                            i.state.clone(),
                            format!("{}%", i.progress),
                            human_bytes(i.size),
                            i.lvol.clone(),
                            i.message.clone(),
                        ]
                    })
                    .collect();
                output::table(&["NAME", "STATE", "PROGRESS", "SIZE", "LVOL", "MESSAGE"], rows).to_string()
            })?)
        }
        BackingImageCmd::Get { name } => {
            let i = get(&mut c, &name).await?;
            Ok(output::print(json, &i, || human(&i))?)
        }
        BackingImageCmd::Rm { name } => {
            c.backing_image_delete(v1::BackingImageRef { name: name.clone() })
                .await?;
            emit(&format!("backing image {name} deleted from this disk"));
            Ok(())
        }
    }
}
