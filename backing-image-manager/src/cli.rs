//! The operator commands of `corral-bim`: tables by default, JSON with `--json`, a progress bar while waiting.

use anyhow::{Context, bail};
use backing_image_manager::client::connect_with;
use backing_image_manager::manager::check_ref;
use clap::Args;
use comfy_table::Table;
use corral_daemon::output::{emit, print, print_json_line};
use corral_proto::grpc::GrpcTimeouts;
use corral_proto::v1;

/// The image spec flags of fetch and sync.
#[derive(Args, Debug)]
pub struct SpecArgs {
    #[arg(long)]
    name: String,
    #[arg(long)]
    uuid: String,
    /// Size in bytes (K/M/G suffixes accepted); 0 = not checked.
    #[arg(long, value_parser = corral_daemon::parse_size, default_value = "0")]
    size: u64,
    /// Expected SHA-512 (hex); empty = not checked.
    #[arg(long, default_value = "")]
    checksum: String,
}

impl SpecArgs {
    fn to_proto(&self) -> anyhow::Result<v1::BimImageSpec> {
        check_ref(&self.name, &self.uuid)?;
        Ok(v1::BimImageSpec {
            name: self.name.clone(),
            uuid: self.uuid.clone(),
            size: self.size,
            checksum: self.checksum.clone(),
        })
    }
}

fn status(img: &v1::BimImage) -> v1::BimImageStatus {
    img.status.clone().unwrap_or_default()
}

fn short(sum: &str) -> String {
    if sum.len() > 16 {
        format!("{}…", &sum[..16])
    } else {
        sum.to_owned()
    }
}

fn table(images: &[v1::BimImage]) -> Table {
    corral_daemon::output::table(
        &[
            "NAME",
            "UUID",
            "STATE",
            "PROGRESS",
            "SIZE",
            "ALLOCATED",
            "SHA-512",
            "SENDING",
            "MESSAGE",
        ],
        images
            .iter()
            .map(|img| {
                let spec = img.spec.clone().unwrap_or_default();
                let s = status(img);
                vec![
                    spec.name,
                    spec.uuid,
                    s.state,
                    format!("{}%", s.progress),
                    corral_daemon::human_bytes(s.size),
                    corral_daemon::human_bytes(s.real_size),
                    short(&s.current_checksum),
                    s.sending_reference.to_string(),
                    s.message,
                ]
            })
            .collect(),
    )
}

pub async fn ls(url: &str, json: bool) -> anyhow::Result<()> {
    let list = connect(url).await?.list(v1::Empty {}).await?.into_inner();
    if !json && !list.disk_message.is_empty() {
        eprintln!("disk {} unavailable: {}", list.disk_uuid, list.disk_message);
    }
    Ok(print(json, &list, || table(&list.images).to_string())?)
}

pub async fn get(url: &str, name: &str, uuid: &str, json: bool) -> anyhow::Result<()> {
    let img = connect(url)
        .await?
        .get(v1::BimImageRef {
            name: name.to_owned(),
            uuid: uuid.to_owned(),
        })
        .await?
        .into_inner();
    print_image(&img, json)
}

fn print_image(img: &v1::BimImage, json: bool) -> anyhow::Result<()> {
    Ok(print(json, img, || {
        let mut out = format!("{}\npath: {}", table(std::slice::from_ref(img)), img.path);
        let s = status(img);
        if !s.current_checksum.is_empty() {
            out.push_str(&format!("\nsha512: {}", s.current_checksum));
        }
        out
    })?)
}

/// Follows the image through Watch until it is ready or failed, with a progress bar.
async fn wait(
    url: &str,
    mut events: tonic::Streaming<v1::BimImageEvent>,
    first: v1::BimImage,
    json: bool,
) -> anyhow::Result<()> {
    let spec = first.spec.clone().unwrap_or_default();
    let bar = corral_daemon::percent_bar(&spec.name);
    let mut last = first;
    loop {
        let s = status(&last);
        bar.set_position(u64::from(s.progress));
        match s.state.as_str() {
            "ready" | "failed" => break,
            _ => {}
        }
        let Some(ev) = events.message().await.context("watch stream")? else {
            bail!("the manager at {url} closed the watch stream");
        };
        if ev.resync {
            let mut c = connect(url).await?;
            last = c
                .get(v1::BimImageRef {
                    name: spec.name.clone(),
                    uuid: spec.uuid.clone(),
                })
                .await?
                .into_inner();
            continue;
        }
        match ev.image {
            Some(img) if img.spec.as_ref().is_some_and(|s| s.name == spec.name) => {
                if ev.deleted {
                    bail!("image {} was deleted", spec.name);
                }
                last = img;
            }
            _ => {}
        }
    }
    bar.finish_and_clear();
    print_image(&last, json)?;
    if status(&last).state == "failed" {
        bail!("image {} failed: {}", spec.name, status(&last).message);
    }
    Ok(())
}

/// Where `fetch` or `sync` gets the image from.
pub enum Origin<'a> {
    /// `fetch`: a data source's file (HOST:PORT), or the file already on the disk (empty).
    DataSource(&'a str),
    /// `sync`: another manager holding the image ready (gRPC HOST:PORT).
    Manager(&'a str),
}

/// `fetch` and `sync`: asks the manager for the image and, with `wait_done`, follows it until ready or failed.
pub async fn obtain(
    url: &str,
    spec: SpecArgs,
    origin: Origin<'_>,
    wait_done: bool,
    json: bool,
) -> anyhow::Result<()> {
    let mut c = connect(url).await?;
    // Watch before asking, so no change between the answer and the first event is missed.
    let events = c.watch(v1::Empty {}).await?.into_inner();
    let spec = Some(spec.to_proto()?);
    let img = match origin {
        Origin::DataSource(address) => {
            c.fetch(v1::BimFetchRequest {
                spec,
                data_source_address: address.to_owned(),
            })
            .await?
        }
        Origin::Manager(address) => {
            c.sync(v1::BimSyncRequest {
                spec,
                from_address: address.to_owned(),
            })
            .await?
        }
    }
    .into_inner();
    if wait_done {
        wait(url, events, img, json).await
    } else {
        print_image(&img, json)
    }
}

pub async fn rm(url: &str, name: &str, uuid: &str) -> anyhow::Result<()> {
    connect(url)
        .await?
        .delete(v1::BimImageRef {
            name: name.to_owned(),
            uuid: uuid.to_owned(),
        })
        .await?;
    Ok(())
}

pub async fn watch(url: &str, json: bool) -> anyhow::Result<()> {
    let mut events = connect(url).await?.watch(v1::Empty {}).await?.into_inner();
    while let Some(ev) = events.message().await? {
        if json {
            print_json_line(&ev)?;
            continue;
        }
        if ev.resync {
            emit("(events lost: run ls)");
            continue;
        }
        let img = ev.image.unwrap_or_default();
        let spec = img.spec.clone().unwrap_or_default();
        let s = status(&img);
        if ev.deleted {
            emit(&format!("{} {} deleted", spec.name, spec.uuid));
        } else {
            emit(&format!(
                "{} {} {} {}%{}",
                spec.name,
                spec.uuid,
                s.state,
                s.progress,
                if s.message.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", s.message)
                }
            ));
        }
    }
    Ok(())
}

pub async fn version(url: &str, json: bool) -> anyhow::Result<()> {
    let v = connect(url).await?.version_get(v1::Empty {}).await?.into_inner();
    Ok(print(json, &v, || {
        format!(
            "corral-bim {} (API {}, min {}){}",
            v.version,
            v.api_version,
            v.api_min_version,
            if v.git_commit.is_empty() {
                String::new()
            } else {
                format!(" {}", v.git_commit)
            }
        )
    })?)
}

/// The CLI's connection: a person decides when to give up, not a request timer.
async fn connect(
    url: &str,
) -> Result<backing_image_manager::client::BimClient, backing_image_manager::BimError> {
    connect_with(url, GrpcTimeouts::OPERATOR).await
}
