//! Backing images in the control plane (seed 000): the resources ([`model`]), the controllers that run
//! `corral-datasource` for an image's first copy ([`datasource_controller`], node-local), one `corral-bim` per
//! disk that fetches, syncs, re-adopts and deletes files ([`bim_controller`], node-local), and the cluster-wide
//! [`image_controller`] (leader) that decides which disks hold a copy (replicas, HA, cleanup in [`cleanup`]'s
//! order), aggregates status and re-runs a download when every copy failed; [`v2_copy`] is the per-disk status of a
//! v2 image's copies (snapshot lvols in v2 disks' stores, issue 21), which [`v2_controller`] (leader) makes,
//! reports and deletes; [`v2_source`] reads a ready v2 copy through its disk daemon for a clone or a backup of a v2
//! image; a `restore` source's backup URL and credentials come from [`crate::backup_target::restore_source`].
//! [`routes`] is the REST API
//! (`/v1/backingimages`), [`service`] the checks other features call, [`cli`] the `corral backing-image`
//! commands.

pub mod bim_controller;
pub mod cleanup;
pub mod cli;
pub mod datasource_controller;
pub mod disks;
pub mod image_controller;
pub mod model;
pub mod openapi;
pub mod routes;
pub mod service;
pub mod strategy;
pub mod v2_controller;
pub mod v2_copy;
pub mod v2_source;

use corral_proto::v1::backing_image_manager_service_client::BackingImageManagerServiceClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::context::Ctx;
use crate::model::{Replica, Volume};
use model::{BackingImage, BackingImageManager, manager_name, state};

/// Node-local controllers: this node's data sources and disk managers.
pub fn start_node(ctx: &Ctx, cancel: &CancellationToken) {
    datasource_controller::start(ctx, cancel);
    bim_controller::start(ctx, cancel);
}

/// Cluster-wide controller (the leader only).
pub fn start_leader(ctx: &Ctx, cancel: &CancellationToken) {
    image_controller::start(ctx, cancel);
    v2_controller::start(ctx, cancel);
}

/// A client of a disk's `corral-bim`.
pub async fn bim_client(address: &str) -> anyhow::Result<BackingImageManagerServiceClient<Channel>> {
    let ch = corral_proto::grpc::connect(address, corral_proto::grpc::GrpcTimeouts::CONTROL).await?;
    Ok(BackingImageManagerServiceClient::new(ch))
}

/// What a replica of a volume with a backing image starts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaBacking {
    /// The file is ready on the replica's disk: `--backing-file PATH`; the image's name and SHA-512.
    Ready {
        path: String,
        image: String,
        checksum: String,
    },
    /// Not (yet) on the disk; the image controller adds the disk to the image's spec because the replica is there.
    Waiting(String),
}

impl ReplicaBacking {
    /// The replica's flags for a ready file: its path, and the image's name and SHA-512 as the control plane knows
    /// them (a backup records those, not the file's basename `backing`). Empty while waiting.
    pub fn replica_args(&self) -> Vec<String> {
        match self {
            ReplicaBacking::Ready {
                path,
                image,
                checksum,
            } => {
                let mut args = vec!["--backing-file".to_owned(), path.clone()];
                // A copy is ready only once verified, so its checksum is known; an empty one (never expected)
                // would be refused by the replica, so the path alone is passed then.
                if !checksum.is_empty() {
                    args.extend([
                        "--backing-image-name".to_owned(),
                        image.clone(),
                        "--backing-image-checksum".to_owned(),
                        checksum.clone(),
                    ]);
                }
                args
            }
            ReplicaBacking::Waiting(_) => Vec::new(),
        }
    }
}

/// The backing file of a replica, resolved again at every start (the disk may have moved). None: the volume has
/// no backing image.
pub async fn replica_backing(ctx: &Ctx, r: &Replica) -> anyhow::Result<Option<ReplicaBacking>> {
    let Some(vol) = ctx.db.get::<Volume>(&r.spec.volume).await? else {
        return Ok(None);
    };
    let Some(image) = vol.data.spec.backing_image.clone() else {
        return Ok(None);
    };
    let Some(bi) = ctx.db.get::<BackingImage>(&image).await? else {
        return Ok(Some(ReplicaBacking::Waiting(format!(
            "backing image {image} does not exist"
        ))));
    };
    let bim = ctx
        .db
        .get::<BackingImageManager>(&manager_name(&r.spec.disk_uuid))
        .await?;
    let file = bim.as_ref().and_then(|m| {
        m.data
            .status
            .files
            .get(&image)
            .filter(|f| f.uuid == bi.data.spec.uuid)
    });
    Ok(Some(match file {
        Some(f) if f.state == state::READY && !f.path.is_empty() => ReplicaBacking::Ready {
            path: f.path.clone(),
            image,
            checksum: f.current_checksum.clone(),
        },
        Some(f) => ReplicaBacking::Waiting(format!(
            "waiting for backing image {image} on disk {}: {} {}% {}",
            r.spec.disk, f.state, f.progress, f.message
        )),
        None => ReplicaBacking::Waiting(format!(
            "waiting for backing image {image} to be copied to disk {}",
            r.spec.disk
        )),
    }))
}

/// The v2 backing image a v2 replica's head is cloned from (`crate::v2::replica::reconcile`): Ok("") for a volume
/// without one, Ok(name) once the copy on the replica's disk is ready, Err(why) while it is not (the v2 image
/// controller makes it: the replica's disk is in the image's spec because the replica is there).
pub async fn v2_replica_backing(ctx: &Ctx, r: &Replica) -> anyhow::Result<Result<String, String>> {
    let Some(vol) = ctx.db.get::<Volume>(&r.spec.volume).await? else {
        return Ok(Ok(String::new()));
    };
    let Some(image) = vol.data.spec.backing_image.clone() else {
        return Ok(Ok(String::new()));
    };
    let Some(bi) = ctx.db.get::<BackingImage>(&image).await? else {
        return Ok(Err(format!("backing image {image} does not exist")));
    };
    let copy = bi
        .data
        .status
        .disk_file_status_map
        .get(&r.spec.disk_uuid)
        .filter(|f| f.is_lvol());
    Ok(match copy {
        Some(f) if f.state == state::READY => Ok(image),
        Some(f) => Err(format!(
            "waiting for v2 backing image {image} on disk {}: {} {}% {}",
            r.spec.disk, f.state, f.progress, f.message
        )),
        None => Err(format!(
            "waiting for v2 backing image {image} to be copied to disk {}",
            r.spec.disk
        )),
    })
}
