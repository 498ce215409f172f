//! Cluster-wide (leader): for every backing image, decides which disks hold a copy and tells their disk managers.
//! The disks are: those of replicas whose volume uses the image, the data source's disk until a manager took the
//! first file, disks added to reach `minNumberOfCopies` (distinct nodes first, then disks) once a copy is ready,
//! minus disks whose file nobody used for `backing-image-cleanup-wait-interval` minutes (in [`super::cleanup`]'s
//! order, never below the minimum). It marks the data source started once a manager reports the file ready, runs
//! the source again when every copy failed (not for uploads), aggregates the per-disk status, and removes a
//! deleted image once no disk manager reports its file.
//!
//! A v2 image (`dataEngine: v2`) uses this flow only for its first v1 file, the source of its first v2 copy: no
//! replica disks, no HA, and the file goes once the first v2 copy is ready; its v2 copies (the `v2` entries of the
//! spec and status maps, and its `diskLastRefAtMap`) belong to [`super::v2_controller`], and this controller keeps
//! them as they are.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::cleanup::{DiskUse, FileClass, disks_to_add, expired, last_ref_marks};
use super::disks::{DiskRef, disks, selected};
use super::model::{
    BackingImage, BackingImageDataSource, BackingImageManager, DataSourceSpec, DiskFileSpec, DiskFileStatus,
    ManagerSpec, ManagerState, SourceType, manager_name, state,
};
use super::strategy::CopyStrategy as _;
use crate::context::Ctx;
use crate::model::{ProcessState, Replica, Volume};
use crate::runtime::{Requeue, WorkQueue, feed, now, run_worker};
use crate::store::{Object, StoreError, absent_ok};

pub const CLEANUP_SETTING: &str = "backing-image-cleanup-wait-interval";
pub const MIN_COPIES_SETTING: &str = "backing-image-min-copies";

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<BackingImage>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(2),
        |ev| Some(ev.name().to_owned()),
        |o| Some(o.name.clone()),
    );
    feed::<BackingImageDataSource>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(30),
        |ev| Some(ev.name().to_owned()),
        |o| Some(o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backing-image", q, c, m, |name| reconcile(ctx.clone(), name)).await;
    });
}

/// The data source of a new image (or of one whose source runs again): a random ready disk that can hold it, and
/// the image's parameters as `corral-datasource` takes them. Errors are messages for the user.
pub async fn data_source_for(ctx: &Ctx, bi: &BackingImage) -> Result<BackingImageDataSource, String> {
    let all = disks(ctx).await.map_err(|e| format!("{e:#}"))?;
    let mut pool: Vec<&DiskRef> = all.iter().filter(|d| d.ready && selected(bi, d)).collect();
    let p = &bi.spec.parameters;
    let param = |k: &str| {
        p.get(k).filter(|v| !v.is_empty()).cloned().ok_or_else(|| {
            format!(
                "source type {} needs the parameter {k:?}",
                bi.spec.source_type.as_str()
            )
        })
    };
    let mut params = BTreeMap::new();
    let mut backup_target = String::new();
    let mut expected_checksum = bi.spec.expected_checksum.clone();
    match bi.spec.source_type {
        SourceType::Download => {
            let url = param("url")?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("url {url:?} is not an http:// or https:// URL"));
            }
            params.insert("url".to_owned(), url);
        }
        SourceType::Upload => {}
        SourceType::Restore => {
            let url = param("backupURL")?;
            backup_target = crate::backup_target::restore_source::resolve(ctx, &url).await?;
            params.insert("backup-url".to_owned(), url);
        }
        SourceType::Clone => {
            let src = param("backingImage")?;
            clone_source(ctx, src, &mut pool, &mut params, &mut expected_checksum).await?;
        }
        SourceType::ExportFromVolume => {
            export_source(ctx, param("volume")?, param("snapshot")?, p, &mut params).await?;
        }
    }
    // A v1 image's copies serve v1 replicas, which live on v1 disks only: its first copy goes to one where there is
    // one (a v2 image's first file may go anywhere: the v2 copy is made from it and it is removed).
    let engine = bi.spec.data_engine;
    if engine.first_file_is_copy() && pool.iter().any(|d| engine.copy_fits(d.engine)) {
        pool.retain(|d| engine.copy_fits(d.engine));
    }
    if pool.is_empty() {
        return Err("no ready disk can hold the backing image's first copy".to_owned());
    }
    // Random, so new images spread over the cluster.
    let idx = usize::try_from(uuid::Uuid::new_v4().as_u128() % pool.len() as u128).unwrap_or(0);
    let d = pool[idx];
    Ok(BackingImageDataSource {
        spec: DataSourceSpec {
            uuid: bi.spec.uuid.clone(),
            node_id: d.node_id.clone(),
            disk_uuid: d.disk_uuid.clone(),
            disk_path: d.path.clone(),
            source_type: bi.spec.source_type,
            parameters: params,
            expected_checksum,
            started: false,
            generation: 0,
            backup_target,
            data_engine: bi.spec.data_engine,
        },
        status: Default::default(),
    })
}

/// A clone's source: a v2 image's ready copy (the data source receives it from the disk daemon holding it,
/// preferably on a disk of that node), or a v1 image's file on the same disk (`pool` narrowed to the disks holding a
/// ready copy). The clone is checked against the source's SHA-512 unless the user named a checksum.
async fn clone_source(
    ctx: &Ctx,
    src: String,
    pool: &mut Vec<&DiskRef>,
    params: &mut BTreeMap<String, String>,
    expected_checksum: &mut String,
) -> Result<(), String> {
    let s = ctx
        .db
        .get::<BackingImage>(&src)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("backing image {src:?} to clone does not exist"))?;
    if s.data.spec.deletion_timestamp.is_some() {
        return Err(format!("backing image {src:?} to clone is being deleted"));
    }
    if s.data.spec.data_engine.copies_are_lvols() {
        // A v2 image has no file once its first v2 copy is ready: the data source receives a ready copy
        // from the disk daemon that holds it (`BackingImageExpose`), from any disk, preferably on the
        // copy's node.
        let copies = super::v2_source::ready_v2_copies(ctx, &s.data)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let Some(copy) = copies
            .iter()
            .find(|c| pool.iter().any(|d| d.node_id == c.node_id))
            .or_else(|| copies.first())
        else {
            return Err(format!(
                "v2 backing image {src:?} has no ready copy on a ready v2 disk whose daemon runs to clone"
            ));
        };
        if pool.iter().any(|d| d.node_id == copy.node_id) {
            pool.retain(|d| d.node_id == copy.node_id);
        }
        params.insert("lvstore-address".to_owned(), copy.address.clone());
        params.insert("backing-image-size".to_owned(), copy.size.to_string());
    } else {
        // The clone reads the source's file on the same disk.
        let holders: BTreeSet<String> = ctx
            .db
            .list::<BackingImageManager>()
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|m| {
                m.data
                    .status
                    .files
                    .get(&src)
                    .is_some_and(|f| f.uuid == s.data.spec.uuid && f.state == state::READY)
            })
            .map(|m| m.data.spec.disk_uuid)
            .collect();
        pool.retain(|d| holders.contains(&d.disk_uuid));
        if pool.is_empty() {
            return Err(format!(
                "backing image {src:?} has no ready copy on a ready disk to clone"
            ));
        }
    }
    // A clone is its source byte for byte: checked against the source's SHA-512 unless the user named one.
    if expected_checksum.is_empty() && is_sha512(&s.data.status.current_checksum) {
        expected_checksum.clone_from(&s.data.status.current_checksum);
    }
    params.insert("backing-image".to_owned(), src);
    params.insert("backing-image-uuid".to_owned(), s.data.spec.uuid);
    Ok(())
}

/// An export of `snapshot` of `volume` (`exportType` raw or qcow2): sent by the sync agent of one of the volume's
/// running RW replicas.
async fn export_source(
    ctx: &Ctx,
    volume: String,
    snapshot: String,
    p: &BTreeMap<String, String>,
    params: &mut BTreeMap<String, String>,
) -> Result<(), String> {
    let export_type = p.get("exportType").cloned().unwrap_or_else(|| "raw".to_owned());
    if export_type != "raw" && export_type != "qcow2" {
        return Err(format!("exportType {export_type:?} is not raw or qcow2"));
    }
    let v = ctx
        .db
        .get::<Volume>(&volume)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("volume {volume:?} does not exist"))?;
    let replica = ctx
        .db
        .list::<Replica>()
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|r| {
            r.data.spec.volume == volume
                && r.data.status.state == ProcessState::Running
                && r.data.status.mode == "RW"
        })
        .ok_or_else(|| {
            format!("volume {volume} has no running healthy replica to export from (attach it)")
        })?;
    // The replica's sync agent: the sync endpoint of its address (a v2 replica's is on its disk daemon),
    // else the one its process reported when it became ready.
    let sync = replica
        .data
        .status
        .address
        .parse::<corral_proto::ReplicaAddress>()
        .ok()
        .map(|a| a.sync.to_socket_string())
        .or_else(|| {
            replica
                .data
                .status
                .process
                .as_ref()
                .and_then(|p| p.listen.get("sync"))
                .cloned()
        })
        .ok_or_else(|| {
            format!(
                "replica {} of volume {volume} has not reported its sync endpoint (restart it)",
                replica.name
            )
        })?;
    params.insert("snapshot-name".to_owned(), snapshot);
    params.insert("sender-address".to_owned(), sync);
    params.insert("volume-size".to_owned(), v.data.spec.size.to_string());
    params.insert("file-type".to_owned(), export_type);
    Ok(())
}

/// Runs image `name`'s source again (every copy failed or is gone; not for an upload, which only the user can
/// repeat): its data source moves to a fresh disk when one can be chosen (the old one may be gone), with fresh
/// parameters (a clone's source copy may be elsewhere now), and its generation is bumped, so its node starts a
/// new daemon with a fresh count of attempts. The new file must have the checksum recorded from the first one: a
/// source that now serves other data fails the copy (the data source keeps no such file) rather than changing the
/// base under the image's volumes.
pub async fn run_source_again(ctx: &Ctx, bi: &BackingImage, name: &str) -> anyhow::Result<()> {
    let fresh = data_source_for(ctx, bi).await.ok();
    let recorded = &bi.status.current_checksum;
    ctx.db
        .modify::<BackingImageDataSource>(name, |d| {
            if let Some(f) = &fresh {
                d.spec.node_id.clone_from(&f.spec.node_id);
                d.spec.disk_uuid.clone_from(&f.spec.disk_uuid);
                d.spec.disk_path.clone_from(&f.spec.disk_path);
                d.spec.parameters.clone_from(&f.spec.parameters);
            }
            if is_sha512(recorded) {
                d.spec.expected_checksum.clone_from(recorded);
            }
            d.spec.started = false;
            d.spec.generation += 1;
            true
        })
        .await?;
    Ok(())
}

/// A SHA-512 in hex (what a verified copy's checksum is).
fn is_sha512(c: &str) -> bool {
    c.len() == 128 && c.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Disk UUID → node of the replicas whose volume uses `image`.
pub async fn replica_disks(ctx: &Ctx, image: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let vols: BTreeSet<String> = ctx
        .db
        .list::<Volume>()
        .await?
        .into_iter()
        .filter(|v| v.data.spec.backing_image.as_deref() == Some(image))
        .map(|v| v.name)
        .collect();
    Ok(ctx
        .db
        .list::<Replica>()
        .await?
        .into_iter()
        .filter(|r| vols.contains(&r.data.spec.volume))
        .map(|r| (r.data.spec.disk_uuid, r.data.spec.node_id))
        .collect())
}

fn file_of<'a>(m: &'a BackingImageManager, image: &str, uuid: &str) -> Option<&'a super::model::ManagerFile> {
    m.status.files.get(image).filter(|f| f.uuid == uuid)
}

/// Sets or removes `image` in the spec of every disk manager; creates the managers of new disks and deletes
/// managers left with nothing to hold.
async fn push_to_managers(
    ctx: &Ctx,
    image: &str,
    uuid: Option<&str>,
    wanted: &BTreeMap<String, DiskFileSpec>,
    managers: &[Object<BackingImageManager>],
    all_disks: &[DiskRef],
) -> anyhow::Result<()> {
    for m in managers {
        let want = uuid.filter(|_| wanted.contains_key(&m.data.spec.disk_uuid));
        if m.data.spec.backing_images.get(image).map(String::as_str) != want {
            absent_ok(
                ctx.db
                    .modify::<BackingImageManager>(&m.name, |x| {
                        match want {
                            Some(u) => x.spec.backing_images.insert(image.to_owned(), u.to_owned()),
                            None => x.spec.backing_images.remove(image),
                        };
                        true
                    })
                    .await,
            )?;
        } else if want.is_none() && m.data.spec.backing_images.is_empty() && m.data.status.files.is_empty() {
            // Nothing left on the disk: its daemon goes (a later image brings it back).
            match ctx.db.delete::<BackingImageManager>(&m.name, m.version).await {
                Ok(()) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let Some(uuid) = uuid else { return Ok(()) };
    for disk_uuid in wanted.keys() {
        let name = manager_name(disk_uuid);
        if managers.iter().any(|m| m.name == name) {
            continue;
        }
        let Some(d) = all_disks.iter().find(|d| &d.disk_uuid == disk_uuid) else {
            continue;
        };
        let m = BackingImageManager {
            spec: ManagerSpec {
                node_id: d.node_id.clone(),
                disk_name: d.disk_name.clone(),
                disk_uuid: d.disk_uuid.clone(),
                disk_path: d.path.clone(),
                backing_images: [(image.to_owned(), uuid.to_owned())].into_iter().collect(),
            },
            status: Default::default(),
        };
        match ctx.db.create(&name, m).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

async fn reconcile(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let managers = ctx.db.list::<BackingImageManager>().await?;
    let all_disks = disks(&ctx).await?;
    let Some(obj) = ctx.db.get::<BackingImage>(&name).await? else {
        ctx.db.delete_any::<BackingImageDataSource>(&name).await?;
        push_to_managers(&ctx, &name, None, &BTreeMap::new(), &managers, &all_disks).await?;
        return Ok(None);
    };
    let bi = &obj.data;
    let uuid = bi.spec.uuid.clone();
    if bi.spec.deletion_timestamp.is_some() {
        return finish_deletion(&ctx, &obj, &managers, &all_disks).await;
    }
    let mut ds = match data_source(&ctx, bi, &name).await? {
        Ok(d) => d,
        Err(requeue) => return Ok(requeue),
    };
    let any_ready = managers
        .iter()
        .any(|m| file_of(&m.data, &name, &uuid).is_some_and(|f| f.state == state::READY));
    if !ds.data.spec.started && any_ready {
        ds = stop_source(&ctx, &name).await?;
    }
    let started = ds.data.spec.started;
    let ds_disk = ds.data.spec.disk_uuid.clone();

    // What every disk holds.
    let mut files = files_of(&name, &uuid, &managers, &all_disks);
    if !started {
        add_source_file(&mut files, &ds);
    }

    // Every copy failed: the source runs again where it can. Copies fail one by one (each disk manager checks on
    // its own), and a failed copy's file is removed and waits (pending) for a ready copy to sync from: so "all
    // failed" is no copy ready, none being made, none unreachable, and at least one failed.
    let all_failed = !files.is_empty() && files.values().all(|f| f.state == state::FAILED);
    let none_left = started
        && !any_ready
        && files.values().any(|f| f.state == state::FAILED)
        && files
            .values()
            .all(|f| f.state == state::FAILED || f.state == state::PENDING);
    if none_left && bi.spec.source_type.refetchable() {
        tracing::warn!(
            image = name,
            "every copy of the backing image failed: preparing it from its source again"
        );
        run_source_again(&ctx, bi, &name).await?;
        return Ok(Some(Duration::from_secs(1)));
    }

    // The disks that must hold a copy.
    let v2 = bi.spec.data_engine.copies_are_lvols();
    // A v2 image's v1 file is kept until its first v2 copy is ready, then removed.
    let v2_first_ready = v2 && bi.status.v2_first_copy_status == Some(state::READY);
    let used = if v2 {
        BTreeMap::new()
    } else {
        replica_disks(&ctx, &name).await?
    };
    let mut wanted = wanted_v1_files(bi, &ds, &used, v2_first_ready);
    let min = usize::try_from(bi.spec.min_number_of_copies).unwrap_or(1);
    // What a disk holds, as cleanup and HA count it: a copy that cannot be reached now is retained last, like a
    // failed one, and does not count towards the minimum.
    let class = |disk: &str| match files.get(disk).map(|f| f.state) {
        Some(state::READY) => FileClass::Ready,
        Some(state::FAILED | state::UNKNOWN) => FileClass::Failed,
        _ => FileClass::InProgress,
    };
    let held = |w: &BTreeMap<String, DiskFileSpec>| -> Vec<DiskUse> {
        w.iter()
            .map(|(disk, s)| DiskUse {
                disk_uuid: disk.clone(),
                node_id: s.node_id.clone(),
                file: class(disk),
                in_use: used.contains_key(disk) || (!started && *disk == ds_disk) || (v2 && !v2_first_ready),
            })
            .collect()
    };
    if any_ready && !v2 {
        // HA: more ready v1 disks (a v2 disk's directory serves no v1 replica), on nodes without a copy first.
        let candidates: Vec<DiskUse> = all_disks
            .iter()
            .filter(|d| {
                d.ready
                    && bi.spec.data_engine.copy_fits(d.engine)
                    && selected(bi, d)
                    && !wanted.contains_key(&d.disk_uuid)
            })
            .map(|d| DiskUse {
                disk_uuid: d.disk_uuid.clone(),
                node_id: d.node_id.clone(),
                file: class(&d.disk_uuid),
                in_use: false,
            })
            .collect();
        for disk in disks_to_add(&held(&wanted), &candidates, min) {
            let node_id = all_disks
                .iter()
                .find(|d| d.disk_uuid == disk)
                .map(|d| d.node_id.clone())
                .unwrap_or_default();
            wanted.insert(
                disk,
                DiskFileSpec {
                    node_id,
                    ..Default::default()
                },
            );
        }
    }

    // Cleanup of files nobody uses.
    let uses = held(&wanted);
    let t = now();
    let mut marks = last_ref_marks(&uses, &bi.status.disk_last_ref_at_map, min, t);
    let wait = i64::try_from(ctx.setting_u64(CLEANUP_SETTING).await.saturating_mul(60)).unwrap_or(i64::MAX);
    for disk in expired(&marks, wait, t) {
        tracing::info!(image = name, disk, "removing an unused backing image file");
        wanted.remove(&disk);
        marks.remove(&disk);
        files.remove(&disk);
    }
    if v2_first_ready && !wanted.is_empty() {
        tracing::info!(
            image = name,
            "the first v2 copy is ready: removing the v1 file it was made from"
        );
        wanted.clear();
        marks.clear();
    }

    write_status(&ctx, &obj, &ds, &managers, &files, &wanted, &marks, all_failed).await?;
    push_to_managers(&ctx, &name, Some(&uuid), &wanted, &managers, &all_disks).await?;
    Ok(Some(Duration::from_secs(2)))
}

/// The image's data source: the stored one, or a new one on a disk that can hold the image. `Err(requeue)` when
/// none can be made yet (the reason goes to the image's message) or another pass created it meanwhile.
async fn data_source(
    ctx: &Ctx,
    bi: &BackingImage,
    name: &str,
) -> anyhow::Result<Result<Object<BackingImageDataSource>, Requeue>> {
    Ok(match ctx.db.get::<BackingImageDataSource>(name).await? {
        Some(d) => Ok(d),
        None => match data_source_for(ctx, bi).await {
            Ok(d) => match ctx.db.create(name, d).await {
                Ok(o) => Ok(o),
                Err(StoreError::AlreadyExists { .. }) => Err(Some(Duration::ZERO)),
                Err(e) => return Err(e.into()),
            },
            Err(msg) => {
                ctx.db
                    .modify::<BackingImage>(name, |b| {
                        let changed = b.status.message != msg;
                        b.status.message.clone_from(&msg);
                        changed
                    })
                    .await?;
                Err(Some(Duration::from_secs(5)))
            }
        },
    })
}

/// A disk manager took the first file: the data source stops.
async fn stop_source(ctx: &Ctx, name: &str) -> anyhow::Result<Object<BackingImageDataSource>> {
    tracing::info!(
        image = name,
        "a disk manager took the first file: stopping the data source"
    );
    Ok(ctx
        .db
        .modify::<BackingImageDataSource>(name, |d| {
            d.spec.started = true;
            true
        })
        .await?)
}

/// The data source's progress as the entry of its disk while it runs, unless a disk manager reports the file there
/// as ready or being committed.
fn add_source_file(files: &mut BTreeMap<String, DiskFileStatus>, ds: &Object<BackingImageDataSource>) {
    let d = &ds.data.status;
    let st = files.entry(ds.data.spec.disk_uuid.clone()).or_default();
    if st.state != state::READY && st.state != state::IN_PROGRESS {
        *st = DiskFileStatus {
            state: match d.state {
                None => state::PENDING,
                // Transferred: the disk manager is committing the file, and only its report says the copy
                // is ready (the data source's "ready" came before the file was in place).
                Some(state::READY) => state::IN_PROGRESS,
                Some(other) => other,
            },
            progress: d.progress,
            message: d.message.clone(),
            node_id: ds.data.spec.node_id.clone(),
            ..Default::default()
        };
    }
}

/// The disks that must hold a v1 file of the image before HA and cleanup: the spec's (a v1 image), the disks of the
/// replicas using it (`used`), and the data source's disk until the first file is taken over (a v2 image: its one
/// v1 file, until its first v2 copy is ready).
fn wanted_v1_files(
    bi: &BackingImage,
    ds: &Object<BackingImageDataSource>,
    used: &BTreeMap<String, String>,
    v2_first_ready: bool,
) -> BTreeMap<String, DiskFileSpec> {
    let v2 = bi.spec.data_engine.copies_are_lvols();
    // A v2 image's one v1 file is on the data source's disk (the disk may be a v2 disk's directory, whose entry
    // in the maps is then the v2 copy's).
    let mut wanted = if v2 {
        BTreeMap::new()
    } else {
        bi.spec.disk_file_spec_map.clone()
    };
    if v2 && !v2_first_ready {
        wanted.insert(
            ds.data.spec.disk_uuid.clone(),
            DiskFileSpec {
                node_id: ds.data.spec.node_id.clone(),
                ..Default::default()
            },
        );
    }
    for (disk, node) in used {
        wanted.insert(
            disk.clone(),
            DiskFileSpec {
                node_id: node.clone(),
                ..Default::default()
            },
        );
    }
    if !ds.data.spec.started {
        wanted.insert(
            ds.data.spec.disk_uuid.clone(),
            DiskFileSpec {
                node_id: ds.data.spec.node_id.clone(),
                ..Default::default()
            },
        );
    }
    wanted
}

/// A deleted image: its data source and files go; the document goes once no reachable disk manager reports the
/// file (a down node's leftovers are removed by its manager when it comes back: its spec no longer names the image)
/// and the v2 controller removed its v2 copies.
async fn finish_deletion(
    ctx: &Ctx,
    obj: &Object<BackingImage>,
    managers: &[Object<BackingImageManager>],
    all_disks: &[DiskRef],
) -> anyhow::Result<Requeue> {
    let (name, bi) = (obj.name.as_str(), &obj.data);
    let uuid = bi.spec.uuid.clone();
    ctx.db.delete_any::<BackingImageDataSource>(name).await?;
    push_to_managers(ctx, name, None, &BTreeMap::new(), managers, all_disks).await?;
    // Gone once no reachable disk manager reports the file (a down node's leftovers are removed by its
    // manager when it comes back: its spec no longer names the image).
    let remaining = managers.iter().any(|m| {
        file_of(&m.data, name, &uuid).is_some()
            && all_disks
                .iter()
                .any(|d| d.disk_uuid == m.data.spec.disk_uuid && d.ready)
    });
    // v2 copies: their controller removes them and their entries.
    let v2_left = bi
        .status
        .disk_file_status_map
        .values()
        .any(DiskFileStatus::is_lvol);
    if !remaining && !v2_left {
        tracing::info!(image = name, "backing image deleted");
        match ctx.db.delete::<BackingImage>(name, obj.version).await {
            Ok(()) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(None);
    }
    Ok(Some(Duration::from_secs(1)))
}

/// What every disk manager holds of the image (the copies of its spec, pending when not reported yet), `unknown`
/// where the manager or the disk cannot be reached.
fn files_of(
    name: &str,
    uuid: &str,
    managers: &[Object<BackingImageManager>],
    all_disks: &[DiskRef],
) -> BTreeMap<String, DiskFileStatus> {
    let mut files: BTreeMap<String, DiskFileStatus> = BTreeMap::new();
    for m in managers {
        let in_spec = m.data.spec.backing_images.get(name).map(String::as_str) == Some(uuid);
        let f = file_of(&m.data, name, uuid);
        if !in_spec && f.is_none() {
            continue;
        }
        let mut st = match f {
            Some(f) => DiskFileStatus {
                state: f.state,
                progress: f.progress,
                message: f.message.clone(),
                node_id: m.data.spec.node_id.clone(),
                ..Default::default()
            },
            None => DiskFileStatus {
                state: state::PENDING,
                node_id: m.data.spec.node_id.clone(),
                ..Default::default()
            },
        };
        if m.data.status.state == Some(ManagerState::Unknown) && st.state != state::FAILED {
            st.state = state::UNKNOWN;
            st.message.clone_from(&m.data.status.message);
        }
        // A disk whose node is down (or that is not ready) cannot serve its copy, whatever was reported last.
        if !all_disks
            .iter()
            .any(|d| d.disk_uuid == m.data.spec.disk_uuid && d.ready)
            && st.state != state::FAILED
        {
            st.state = state::UNKNOWN;
            st.message = format!(
                "disk {} of node {} is not ready",
                m.data.spec.disk_name, m.data.spec.node_id
            );
        }
        files.insert(m.data.spec.disk_uuid.clone(), st);
    }
    files
}

/// Writes the image's v1 entries of the spec and status maps, its last-reference marks (v1 images), its message and
/// its size and checksum (from the first ready copy, else the data source's).
#[allow(clippy::too_many_arguments)] // the pass's results, each written to its own field
async fn write_status(
    ctx: &Ctx,
    obj: &Object<BackingImage>,
    ds: &Object<BackingImageDataSource>,
    managers: &[Object<BackingImageManager>],
    files: &BTreeMap<String, DiskFileStatus>,
    wanted: &BTreeMap<String, DiskFileSpec>,
    marks: &BTreeMap<String, i64>,
    all_failed: bool,
) -> anyhow::Result<()> {
    let (name, bi) = (obj.name.as_str(), &obj.data);
    let (uuid, v2) = (&bi.spec.uuid, bi.spec.data_engine.copies_are_lvols());
    let first_ready = managers
        .iter()
        .filter_map(|m| file_of(&m.data, name, uuid))
        .find(|f| f.state == state::READY);
    let (size, virtual_size, checksum) = match first_ready {
        Some(f) => (f.size, f.virtual_size, f.current_checksum.clone()),
        None if !ds.data.status.current_checksum.is_empty() => (
            ds.data.status.size,
            ds.data.status.virtual_size,
            ds.data.status.current_checksum.clone(),
        ),
        None => (
            bi.status.size,
            bi.status.virtual_size,
            bi.status.current_checksum.clone(),
        ),
    };
    let message = if all_failed {
        let why: Vec<String> = files
            .values()
            .map(|f| f.message.clone())
            .filter(|m| !m.is_empty())
            .collect();
        format!("every copy failed: {}", why.join("; "))
    } else {
        String::new()
    };
    let updated = ctx
        .db
        .modify::<BackingImage>(name, |b| {
            if b.spec.uuid != *uuid {
                return false;
            }
            let before = b.clone();
            // v2 entries are the v2 controller's.
            b.spec.disk_file_spec_map.retain(|_, s| s.is_lvol());
            for (d, s) in wanted {
                b.spec
                    .disk_file_spec_map
                    .entry(d.clone())
                    .or_insert_with(|| s.clone());
            }
            b.status.disk_file_status_map.retain(|_, f| f.is_lvol());
            for (d, f) in files {
                b.status
                    .disk_file_status_map
                    .entry(d.clone())
                    .or_insert_with(|| f.clone());
            }
            // A v2 image's marks are its v2 copies' ([`super::v2_controller`]): its one v1 file is never marked
            // (in use until the first v2 copy is ready, then removed).
            if !v2 {
                b.status.disk_last_ref_at_map.clone_from(marks);
            }
            b.status.message.clone_from(&message);
            if b.status.size == 0 || first_ready.is_some() {
                b.status.size = size;
                b.status.virtual_size = virtual_size;
                b.status.current_checksum.clone_from(&checksum);
            }
            *b != before
        })
        .await;
    absent_ok(updated)?;
    Ok(())
}
