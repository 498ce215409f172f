//! Cluster-wide (leader): the v2 copies of `dataEngine: v2` backing images (issue 21, seed 001). A v2 image's
//! copy on a v2 disk is the snapshot lvol `bi-NAME-disk-LVSUUID` in the disk's store, made and reported by the
//! disk's `serve-lvstore` daemon (`BackingImageCreate/Get/Delete`).
//!
//! The first v2 copy: once the v1 flow ([`super::image_controller`]) has the image's file ready on some disk (a
//! qcow2 source converted to raw by the data source, so the file is byte for byte what the lvol holds), a ready v2
//! disk's daemon fills the copy from that disk's `corral-bim` download endpoint (uncompressed), checking the
//! file's SHA-512. `v2FirstCopyStatus` goes `pending` → `in-progress` → `ready` | `failed`; a failed copy is
//! deleted and the copy tried again from `pending` after a backoff (doubling from 2 s to 60 s). Once the first
//! copy is ready, the image controller removes the v1 file.
//!
//! Every pass asks each v2 disk's daemon for its copy ([`super::v2_copy::copy_status`] turns the answer into the
//! disk's entry: unreachable → `unknown`, gone → `failed`). Disks of replicas of volumes on the image get a copy
//! entry in the spec; a deleted image's copies are deleted from every daemon that answers.
//!
//! Once the first copy is ready, HA and cleanup follow the v1 rules with the same functions
//! ([`super::cleanup`]; `keep_copies`): disks are added up to `minNumberOfCopies`, unused disks are marked in
//! `diskLastRefAtMap` (this controller's for a v2 image) and leave the spec after
//! `backing-image-cleanup-wait-interval`; then `sync_copies` deletes what is no longer wanted and syncs one new
//! copy at a time, a failing sync backing off per image and disk.
//!
//! Once every copy is lost (`failed` or gone, none ready, being made or unreachable), nothing is left to sync from
//! and the v1 file went when the first copy was ready: the image's source runs again (as for a v1 image whose every
//! file failed) and the first copy goes back to `pending`, to be made from the new file; an upload, which only the
//! user can repeat, reads `failed`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral_proto::v1;
use tokio_util::sync::CancellationToken;

use super::cleanup::{DiskUse, FileClass, disks_to_add, expired, last_ref_marks};
use super::datasource_controller::job_retry_backoff;
use super::disks::{DiskRef, disks, selected};
use super::image_controller::{CLEANUP_SETTING, replica_disks, run_source_again};
use super::model::{
    BackingImage, BackingImageDataSource, BackingImageManager, DiskFileSpec, DiskFileStatus, FileState, state,
};
use super::strategy::{CopyKind, CopyStrategy as _};
use super::v2_copy::{Fetched, copy_status};
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::ProcessState;
use crate::runtime::{Requeue, WorkQueue, feed, now, run_worker};
use crate::store::absent_ok;
use crate::v2::model::{LvstoreDaemon, daemon_name};

/// Backoff of the first copy's retries: doubles from the first to the last.
const RETRY_FIRST: Duration = Duration::from_secs(2);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// The message of an uploaded v2 image whose every copy failed or is gone once its file was removed.
const UPLOAD_LOST: &str = "every v2 copy failed or is gone, and an uploaded image cannot be prepared from its source \
                           again: delete the image and upload it again";

/// The disk key of the first copy's retries.
const FIRST: &str = "";

/// The wait after the first copy's `attempts`-th failure (from 1).
fn first_copy_backoff(attempts: u32) -> Duration {
    RETRY_FIRST
        .saturating_mul(1 << attempts.saturating_sub(1).min(5))
        .min(RETRY_MAX)
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<BackingImage>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(2),
        |ev| Some(ev.name().to_owned()),
        |o| o.data.spec.data_engine.copies_are_lvols().then(|| o.name.clone()),
    );
    let retries = Arc::new(Retries::default());
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backing-image-v2", q, c, m, |name| {
            reconcile(ctx.clone(), retries.clone(), name)
        })
        .await;
    });
}

/// Failed jobs by image and disk: the first copy (under the disk `""`) and each sync to another disk. Leader-local:
/// a new leader starts the count again, which at worst retries sooner once.
#[derive(Default)]
struct Retries(Mutex<HashMap<(String, String), Failure>>);

struct Failure {
    attempts: u32,
    /// When the next attempt may start.
    next: Instant,
    /// The status message meanwhile: why the last attempt failed and when the next one comes.
    message: String,
}

impl Retries {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Failure>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a failed attempt of `image` on `disk`: the wait before the next one, by the `attempts` so far.
    fn failed(&self, image: &str, disk: &str, backoff: fn(u32) -> Duration) -> Duration {
        let mut m = self.lock();
        let e = m
            .entry((image.to_owned(), disk.to_owned()))
            .or_insert_with(|| Failure {
                attempts: 0,
                next: Instant::now(),
                message: String::new(),
            });
        e.attempts += 1;
        let wait = backoff(e.attempts);
        e.next = Instant::now() + wait;
        wait
    }

    /// Sets the message shown while the next attempt waits.
    fn explain(&self, image: &str, disk: &str, message: &str) {
        if let Some(e) = self.lock().get_mut(&(image.to_owned(), disk.to_owned())) {
            message.clone_into(&mut e.message);
        }
    }

    /// How long until the next attempt may start (zero: now).
    fn wait(&self, image: &str, disk: &str) -> Duration {
        self.lock()
            .get(&(image.to_owned(), disk.to_owned()))
            .map_or(Duration::ZERO, |e| {
                e.next.saturating_duration_since(Instant::now())
            })
    }

    /// The message of a failure whose next attempt has not come yet.
    fn waiting(&self, image: &str, disk: &str) -> Option<String> {
        self.lock()
            .get(&(image.to_owned(), disk.to_owned()))
            .filter(|e| e.next > Instant::now())
            .map(|e| e.message.clone())
    }

    fn clear(&self, image: &str, disk: &str) {
        self.lock().remove(&(image.to_owned(), disk.to_owned()));
    }

    fn clear_image(&self, image: &str) {
        self.lock().retain(|(i, _), _| i != image);
    }
}

/// A v2 disk and its daemon's `LvstoreService` address while it runs.
#[derive(Debug, Clone)]
struct Store {
    disk: DiskRef,
    address: Option<String>,
}

async fn stores(ctx: &Ctx) -> anyhow::Result<Vec<Store>> {
    let daemons = ctx.db.list::<LvstoreDaemon>().await?;
    Ok(disks(ctx)
        .await?
        .into_iter()
        .filter(|d| d.engine.in_lvstore())
        .map(|disk| {
            let name = daemon_name(&disk.node_id, &disk.disk_name);
            let address = daemons
                .iter()
                .find(|o| o.name == name)
                .map(|o| &o.data)
                .filter(|d| d.state == ProcessState::Running && !d.address.is_empty())
                .map(|d| d.address.clone());
            Store { disk, address }
        })
        .collect())
}

/// The refusal of a v2 image where no v2 disk could hold it (checked at create, so nothing is made).
pub async fn check_v2_disk(ctx: &Ctx, bi: &BackingImage) -> Result<(), String> {
    let all = stores(ctx).await.map_err(|e| format!("{e:#}"))?;
    if all.iter().any(|s| s.disk.ready && selected(bi, &s.disk)) {
        return Ok(());
    }
    Err(if all.is_empty() {
        "a v2 backing image needs a v2 disk (an lvstore) and the cluster has none: add one with \
         `corral node disk-add NODE DISK PATH --disk-engine v2`"
            .to_owned()
    } else {
        "no ready v2 disk (within the image's disk and node selectors) can hold a v2 backing image".to_owned()
    })
}

/// What the daemon at `address` says of its copy of `name`.
async fn fetch(address: &str, name: &str) -> Fetched {
    let mut c = match crate::v2::replica::client(address).await {
        Ok(c) => c,
        Err(e) => return Fetched::Unreachable(format!("{e:#}")),
    };
    match c
        .backing_image_get(v1::BackingImageRef {
            name: name.to_owned(),
        })
        .await
    {
        Ok(r) => Fetched::Copy(r.into_inner()),
        Err(s) if s.code() == tonic::Code::NotFound => Fetched::Absent,
        Err(s) => Fetched::Unreachable(s.message().to_owned()),
    }
}

/// Deletes the copy of `name` from the daemon at `address`; absent is fine.
async fn delete_copy(address: &str, name: &str) -> anyhow::Result<()> {
    let mut c = crate::v2::replica::client(address).await?;
    match c
        .backing_image_delete(v1::BackingImageRef {
            name: name.to_owned(),
        })
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
        Err(s) => Err(anyhow::anyhow!(
            "delete v2 backing image {name} on the lvstore daemon at {address}: {}",
            s.message()
        )),
    }
}

/// The v1 file the first v2 copy is made from.
struct ReadyFile {
    url: String,
    size: u64,
    checksum: String,
    /// The disk and node of the corral-bim that holds it.
    disk_uuid: String,
    node_id: String,
}

/// The v1 file the first v2 copy is made from: the download URL of a ready file, its size and SHA-512, where it is.
async fn ready_file(ctx: &Ctx, name: &str, uuid: &str, all: &[DiskRef]) -> anyhow::Result<Option<ReadyFile>> {
    Ok(ctx
        .db
        .list::<BackingImageManager>()
        .await?
        .into_iter()
        .filter(|m| {
            all.iter()
                .any(|d| d.disk_uuid == m.data.spec.disk_uuid && d.ready)
        })
        .find_map(|m| {
            let f = m.data.status.files.get(name)?;
            (f.uuid == uuid && f.state == state::READY && !m.data.status.http_address.is_empty()).then(|| {
                ReadyFile {
                    url: format!(
                        "{}/v1/files/{name}/download",
                        sparse_sync::http_base(
                            &m.data.status.http_address,
                            corral_tls::installed().is_some()
                        )
                    ),
                    size: f.size,
                    checksum: f.current_checksum.clone(),
                    disk_uuid: m.data.spec.disk_uuid.clone(),
                    node_id: m.data.spec.node_id.clone(),
                }
            })
        }))
}

async fn reconcile(ctx: Ctx, retries: Arc<Retries>, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<BackingImage>(&name).await? else {
        retries.clear_image(&name);
        return Ok(None);
    };
    let bi = &obj.data;
    if !bi.spec.data_engine.copies_are_lvols() {
        return Ok(None);
    }
    let uuid = bi.spec.uuid.clone();
    let stores = stores(&ctx).await?;

    // What every v2 disk holds, and whether its daemon answered with a copy of this image.
    let (mut copies, holds) = observe(bi, &stores, &name).await;

    if bi.spec.deletion_timestamp.is_some() {
        delete_copies(&ctx, &name, &uuid, &stores, &holds, copies).await?;
        retries.clear_image(&name);
        return Ok(Some(Duration::from_secs(1)));
    }
    let p = Seen {
        ctx: &ctx,
        retries: &retries,
        bi,
        name: &name,
        uuid: &uuid,
        stores: &stores,
        holds: &holds,
    };
    let (mut wanted, used) = wanted_disks(&p).await?;

    // The first copy.
    let mut first = FirstCopy {
        state: bi.status.v2_first_copy_status,
        disk: bi.status.v2_first_copy_disk.clone(),
        message: String::new(),
        requeue: Duration::from_secs(2),
    };
    let source = ctx.db.get::<BackingImageDataSource>(&name).await?.map(|o| o.data);
    // Its source runs again (every copy was lost): the first copy waits for the file it prepares.
    let mut source_again = source
        .as_ref()
        .is_some_and(|d| !d.spec.started && d.spec.generation > 0);
    source_again |= recover_lost_copies(&p, &copies, &mut first).await?;
    advance_first_copy(
        &p,
        source.as_ref(),
        source_again,
        &mut first,
        &mut copies,
        &mut wanted,
    )
    .await?;

    // HA and cleanup, then the syncs, once a copy is ready to sync from (before, the first copy's disk is the
    // only one and nothing is marked).
    let (marks, removed) = if first.state == Some(state::READY) {
        keep_and_sync(&p, &used, &mut wanted, &mut copies).await
    } else {
        (BTreeMap::new(), Vec::new())
    };
    let requeue = first.requeue;
    let first_state = Some((first.state, first.disk, first.message));
    // Only what this pass adds goes into the spec (a disk the user removed meanwhile stays removed). A disk whose
    // entry is the v1 file's (the first copy made on the disk that held the file) is added: the v1 entry goes with
    // the file, and the copy must not go with it.
    let added: BTreeMap<String, DiskFileSpec> = wanted
        .into_iter()
        .filter(|(d, _)| {
            !bi.spec
                .disk_file_spec_map
                .get(d)
                .is_some_and(DiskFileSpec::is_lvol)
        })
        .collect();
    write(
        &ctx,
        &name,
        &uuid,
        &Pass {
            added: &added,
            removed: &removed,
            copies: &copies,
            marks: &marks,
            first: first_state,
        },
    )
    .await?;
    Ok(Some(requeue))
}

/// What a pass over a live image works from: the image, its v2 disks, and which of their daemons hold a copy.
struct Seen<'a> {
    ctx: &'a Ctx,
    retries: &'a Retries,
    bi: &'a BackingImage,
    name: &'a str,
    uuid: &'a str,
    stores: &'a [Store],
    holds: &'a BTreeMap<String, bool>,
}

/// The first copy as a pass leaves it: its state, disk and message, and when the image is looked at again.
struct FirstCopy {
    /// None: not started.
    state: Option<FileState>,
    disk: String,
    message: String,
    requeue: Duration,
}

/// The disks that must hold a copy: those already in the spec, the replicas' (a v2 image is only on v2 volumes,
/// so on v2 disks); and disk UUID → node of the replicas on v2 disks (their copies are never cleaned up).
async fn wanted_disks(
    p: &Seen<'_>,
) -> anyhow::Result<(BTreeMap<String, DiskFileSpec>, BTreeMap<String, String>)> {
    let mut wanted: BTreeMap<String, DiskFileSpec> =
        p.bi.spec
            .disk_file_spec_map
            .iter()
            .filter(|(_, s)| s.is_lvol())
            .map(|(d, s)| (d.clone(), s.clone()))
            .collect();
    let used: BTreeMap<String, String> = replica_disks(p.ctx, p.name)
        .await?
        .into_iter()
        .filter(|(disk, _)| p.stores.iter().any(|s| &s.disk.disk_uuid == disk))
        .collect();
    for (disk, node) in &used {
        wanted
            .entry(disk.clone())
            .or_insert_with(|| DiskFileSpec::lvol_copy(node.clone()));
    }
    Ok((wanted, used))
}

/// Every v2 copy failed or is gone (no copy ready, being made, or on a daemon that does not answer), and the v1
/// file went when the first copy was ready: nothing is left to sync from. The image is prepared from its source
/// again, as a v1 image whose every file failed is, and the first copy made again (true: the source runs again);
/// an uploaded image's first copy reads failed.
async fn recover_lost_copies(
    p: &Seen<'_>,
    copies: &BTreeMap<String, DiskFileStatus>,
    first: &mut FirstCopy,
) -> anyhow::Result<bool> {
    if first.state != Some(state::READY) || !copies.values().all(|c| c.state == state::FAILED) {
        return Ok(false);
    }
    let (bi, name) = (p.bi, p.name);
    if bi.spec.source_type.refetchable() {
        tracing::warn!(
            image = name,
            source = bi.spec.source_type.as_str(),
            "every v2 copy failed or is gone: preparing the image from its source again"
        );
        run_source_again(p.ctx, bi, name).await?;
        p.retries.clear_image(name);
        first.state = Some(state::PENDING);
        first.disk.clear();
        first.requeue = Duration::from_secs(1);
        Ok(true)
    } else {
        tracing::warn!(
            image = name,
            "every v2 copy failed or is gone and the image was uploaded: it cannot be prepared again"
        );
        first.state = Some(state::FAILED);
        Ok(false)
    }
}

/// One step of the first copy: `pending` starts it (once its backoff is over and the file is ready),
/// `in-progress` follows it to `ready` or `failed`, `failed` goes back to `pending` after the backoff — unless the
/// image was uploaded and nothing of it is left.
async fn advance_first_copy(
    p: &Seen<'_>,
    source: Option<&BackingImageDataSource>,
    source_again: bool,
    first: &mut FirstCopy,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    wanted: &mut BTreeMap<String, DiskFileSpec>,
) -> anyhow::Result<()> {
    // An uploaded image with no copy and no file left: only the user can upload it again.
    let upload_lost = first.state == Some(state::FAILED)
        && !p.bi.spec.source_type.refetchable()
        && source.is_some_and(|d| d.spec.started)
        && !copies.values().any(|c| c.state == state::READY)
        && ready_file(p.ctx, p.name, p.uuid, &disks(p.ctx).await?)
            .await?
            .is_none();
    match first.state {
        None => first.state = Some(state::PENDING),
        Some(state::PENDING) => start_first_copy(p, source_again, first, copies, wanted).await?,
        Some(state::IN_PROGRESS) => follow_first_copy(p, first, copies).await,
        Some(state::FAILED) if upload_lost => {
            first.message = UPLOAD_LOST.to_owned();
            first.requeue = Duration::from_secs(10);
        }
        Some(state::FAILED | state::UNKNOWN) => {
            let wait = p.retries.wait(p.name, FIRST);
            if wait.is_zero() {
                first.state = Some(state::PENDING);
                first.requeue = Duration::ZERO;
            } else {
                first.message = p.bi.status.v2_first_copy_message.clone();
                first.requeue = wait;
            }
        }
        _ => {}
    }
    Ok(())
}

/// A pending first copy: once its backoff is over and the v1 file is ready, made on a ready store.
async fn start_first_copy(
    p: &Seen<'_>,
    source_again: bool,
    first: &mut FirstCopy,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    wanted: &mut BTreeMap<String, DiskFileSpec>,
) -> anyhow::Result<()> {
    let (bi, name) = (p.bi, p.name);
    let wait = p.retries.wait(name, FIRST);
    if !wait.is_zero() {
        first.requeue = wait;
    } else if let Some(file) = ready_file(p.ctx, name, p.uuid, &disks(p.ctx).await?).await? {
        // A ready store, preferring one a replica needs, then the file's own disk (a v2 disk's directory
        // holds the data source's file when the node has no v1 disk), then one on the file's node.
        let mut pool: Vec<&Store> = p
            .stores
            .iter()
            .filter(|s| s.disk.ready && s.address.is_some() && selected(bi, &s.disk))
            .collect();
        pool.sort_by_key(|s| {
            (
                !wanted.contains_key(&s.disk.disk_uuid),
                s.disk.disk_uuid != file.disk_uuid,
                s.disk.node_id != file.node_id,
                s.disk.disk_uuid.clone(),
            )
        });
        match pool.first() {
            None => {
                first.message = "waiting for a ready v2 disk whose lvstore daemon runs to make the first v2 \
                                 copy on"
                    .to_owned();
                first.requeue = Duration::from_secs(5);
            }
            Some(s) => {
                first.disk.clone_from(&s.disk.disk_uuid);
                let made = create_first_copy(name, p.uuid, s, &file, p.holds, copies, wanted, p.retries);
                match made.await? {
                    Ok(()) => first.state = Some(state::IN_PROGRESS),
                    Err(why) => {
                        first.state = Some(state::FAILED);
                        first.message = why;
                    }
                }
            }
        }
    } else if source_again {
        first.message = format!(
            "every v2 copy failed or is gone: preparing the image from its source ({}) again; the first \
             v2 copy is made from the file it prepares",
            bi.spec.source_type.as_str()
        );
    } else {
        first.message =
            "waiting for the image's file to be ready (the first v2 copy is made from it)".to_owned();
    }
    Ok(())
}

/// A first copy being made: ready, or failed (deleted, its retry backing off), or still going.
async fn follow_first_copy(
    p: &Seen<'_>,
    first: &mut FirstCopy,
    copies: &mut BTreeMap<String, DiskFileStatus>,
) {
    let name = p.name;
    match copies.get(&first.disk).map(|c| c.state) {
        Some(state::READY) => {
            tracing::info!(image = name, disk = first.disk, "the first v2 copy is ready");
            first.state = Some(state::READY);
            p.retries.clear(name, FIRST);
        }
        Some(state::FAILED) | None => {
            let why = copies
                .get(&first.disk)
                .map_or_else(|| "the copy is gone".to_owned(), |c| c.message.clone());
            let wait = p.retries.failed(name, FIRST, first_copy_backoff);
            tracing::warn!(
                image = name,
                disk = first.disk,
                error = why,
                "the first v2 copy failed"
            );
            if let Some(s) = p.stores.iter().find(|s| s.disk.disk_uuid == first.disk)
                && let Some(a) = &s.address
                && let Err(e) = delete_copy(a, name).await
            {
                tracing::warn!(
                    image = name,
                    error = format!("{e:#}"),
                    "failed first v2 copy not deleted"
                );
            }
            first.state = Some(state::FAILED);
            first.message = format!("first v2 copy failed: {why}; retrying in {}s", wait.as_secs());
            if let Some(c) = copies.get_mut(&first.disk) {
                c.state = state::FAILED;
                c.message.clone_from(&first.message);
            }
        }
        // In progress, or its daemon unreachable (a restarted daemon removes the unfinished copy: it then
        // reads as failed).
        Some(_) => first.requeue = Duration::from_secs(1),
    }
}

/// HA and cleanup ([`keep_copies`]), then the syncs ([`sync_copies`]): the new `diskLastRefAtMap` and the disks
/// removed from the spec.
async fn keep_and_sync(
    p: &Seen<'_>,
    used: &BTreeMap<String, String>,
    wanted: &mut BTreeMap<String, DiskFileSpec>,
    copies: &mut BTreeMap<String, DiskFileStatus>,
) -> (BTreeMap<String, i64>, Vec<String>) {
    let name = p.name;
    let wait = i64::try_from(p.ctx.setting_u64(CLEANUP_SETTING).await.saturating_mul(60)).unwrap_or(i64::MAX);
    let kept = keep_copies(
        p.bi,
        p.stores,
        copies,
        used,
        wanted,
        &|d| !p.retries.wait(name, d).is_zero(),
        (now(), wait),
    );
    for d in &kept.added {
        tracing::info!(image = name, disk = d, "a v2 copy added for minNumberOfCopies");
    }
    for d in &kept.removed {
        tracing::info!(image = name, disk = d, "removing an unused v2 copy");
    }
    sync_copies(name, p.uuid, p.stores, p.holds, wanted, copies, p.retries).await;
    (kept.marks, kept.removed)
}

/// What every v2 disk's daemon holds of the image (disk UUID → copy status), and whether it answered with a copy
/// of this image (disk UUID → held).
async fn observe(
    bi: &BackingImage,
    stores: &[Store],
    name: &str,
) -> (BTreeMap<String, DiskFileStatus>, BTreeMap<String, bool>) {
    let uuid = &bi.spec.uuid;
    let mut copies: BTreeMap<String, DiskFileStatus> = BTreeMap::new();
    // Disk UUID → its daemon answered with a copy of this image.
    let mut holds: BTreeMap<String, bool> = BTreeMap::new();
    for s in stores {
        let before = bi
            .status
            .disk_file_status_map
            .get(&s.disk.disk_uuid)
            .filter(|f| f.is_lvol());
        let fetched = match &s.address {
            Some(a) => fetch(a, name).await,
            None => Fetched::Unreachable(format!(
                "the lvstore daemon of disk {} on node {} is not running",
                s.disk.disk_name, s.disk.node_id
            )),
        };
        holds.insert(
            s.disk.disk_uuid.clone(),
            matches!(&fetched, Fetched::Copy(c) if c.uuid == *uuid),
        );
        if let Some(st) = copy_status(uuid, &s.disk.node_id, before, fetched) {
            copies.insert(s.disk.disk_uuid.clone(), st);
        }
    }
    (copies, holds)
}

/// A deleted image: every copy a daemon holds goes; its entry stays while the daemon refuses (a replica's chain sits
/// on it). An unreachable store's entry is dropped, so the image does not wait for a dead node; its lvol stays in
/// that store (nothing collects such a leftover yet).
async fn delete_copies(
    ctx: &Ctx,
    name: &str,
    uuid: &str,
    stores: &[Store],
    holds: &BTreeMap<String, bool>,
    mut copies: BTreeMap<String, DiskFileStatus>,
) -> anyhow::Result<()> {
    let mut left = BTreeMap::new();
    for s in stores {
        if !holds.get(&s.disk.disk_uuid).copied().unwrap_or(false) {
            continue;
        }
        let Some(a) = &s.address else { continue };
        if let Err(e) = delete_copy(a, name).await {
            tracing::warn!(
                image = name,
                disk = s.disk.disk_name,
                error = format!("{e:#}"),
                "v2 copy not deleted"
            );
            if let Some(mut st) = copies.remove(&s.disk.disk_uuid) {
                st.message = format!("{e:#}");
                left.insert(s.disk.disk_uuid.clone(), st);
            }
        } else {
            tracing::info!(image = name, disk = s.disk.disk_name, "v2 copy deleted");
        }
    }
    write(
        ctx,
        name,
        uuid,
        &Pass {
            added: &BTreeMap::new(),
            removed: &[],
            copies: &left,
            marks: &BTreeMap::new(),
            first: None,
        },
    )
    .await?;
    Ok(())
}

/// Starts the first v2 copy on store `s` from the ready file; a leftover copy there goes first. `Ok(Err(why))`
/// when its daemon refused (the first copy backs off); taken, the copy enters `copies` and `wanted`.
#[allow(clippy::too_many_arguments)] // the pass's state the first copy joins
async fn create_first_copy(
    name: &str,
    uuid: &str,
    s: &Store,
    file: &ReadyFile,
    holds: &BTreeMap<String, bool>,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    wanted: &mut BTreeMap<String, DiskFileSpec>,
    retries: &Retries,
) -> anyhow::Result<Result<(), String>> {
    let address = s.address.clone().unwrap_or_default();
    // A leftover (a failed copy, or one of an earlier image of the name) goes first.
    if copies.contains_key(&s.disk.disk_uuid) || holds.get(&s.disk.disk_uuid).copied().unwrap_or(false) {
        delete_copy(&address, name).await?;
    }
    let req = v1::BackingImageCreateRequest {
        name: name.to_owned(),
        backing_image_uuid: uuid.to_owned(),
        checksum: file.checksum.clone(),
        size: file.size,
        source: Some(v1::backing_image_create_request::Source::FromUrl(
            file.url.clone(),
        )),
    };
    let res = crate::v2::replica::client(&address)
        .await?
        .backing_image_create(req)
        .await;
    match res {
        Ok(r) => {
            tracing::info!(
                image = name,
                disk = s.disk.disk_name,
                url = file.url,
                "making the first v2 copy"
            );
            copies.insert(
                s.disk.disk_uuid.clone(),
                copy_status(uuid, &s.disk.node_id, None, Fetched::Copy(r.into_inner())).unwrap_or_default(),
            );
            wanted.insert(
                s.disk.disk_uuid.clone(),
                DiskFileSpec::lvol_copy(s.disk.node_id.clone()),
            );
            Ok(Ok(()))
        }
        Err(e) => {
            let wait = retries.failed(name, FIRST, first_copy_backoff);
            Ok(Err(format!(
                "first v2 copy on disk {} refused: {}; retrying in {}s",
                s.disk.disk_name,
                e.message(),
                wait.as_secs()
            )))
        }
    }
}

/// Item 8 of issue 21, as for v1 files and with the same rules ([`super::cleanup`]): once a copy is ready, ready
/// v2 disks are added to `wanted` until `minNumberOfCopies` copies can serve (distinct nodes first, then distinct
/// disks; not a disk whose sync backs off, `backing_off`); then every disk of `wanted` no replica uses (`used`) is
/// marked, the marks keeping the minimum retained, and the disks whose mark is older than the wait are removed
/// from `wanted` ([`sync_copies`] then deletes their copies). The last argument is (now, wait) in seconds.
fn keep_copies(
    bi: &BackingImage,
    stores: &[Store],
    copies: &BTreeMap<String, DiskFileStatus>,
    used: &BTreeMap<String, String>,
    wanted: &mut BTreeMap<String, DiskFileSpec>,
    backing_off: &dyn Fn(&str) -> bool,
    (now, wait): (i64, i64),
) -> Kept {
    let serving = |disk: &str| {
        stores
            .iter()
            .any(|s| s.disk.disk_uuid == disk && s.disk.ready && s.address.is_some())
    };
    // A disk without a copy yet counts as one being made while its daemon runs. A copy whose daemon does not answer
    // on a disk that is ready (its node up) counts as one being made too: its daemon restarts under the node's
    // manager and lists the copy again from its xattrs — a replacement on another disk would only be cleaned up
    // again after the wait interval. On a disk that is not ready it is lost for now, like a failed one.
    let disk_ready = |disk: &str| stores.iter().any(|s| s.disk.disk_uuid == disk && s.disk.ready);
    let class = |disk: &str| match copies.get(disk).map(|c| c.state) {
        Some(state::READY) => FileClass::Ready,
        Some(state::UNKNOWN) if disk_ready(disk) => FileClass::InProgress,
        Some(state::FAILED | state::UNKNOWN) => FileClass::Failed,
        Some(_) => FileClass::InProgress,
        None if serving(disk) && !backing_off(disk) => FileClass::InProgress,
        None => FileClass::Failed,
    };
    let held = |w: &BTreeMap<String, DiskFileSpec>| -> Vec<DiskUse> {
        w.iter()
            .map(|(disk, s)| DiskUse {
                disk_uuid: disk.clone(),
                node_id: s.node_id.clone(),
                file: class(disk),
                in_use: used.contains_key(disk),
            })
            .collect()
    };
    let min = usize::try_from(bi.spec.min_number_of_copies).unwrap_or(1);
    let candidates: Vec<DiskUse> = stores
        .iter()
        .filter(|s| {
            s.disk.ready
                && s.address.is_some()
                && selected(bi, &s.disk)
                && !wanted.contains_key(&s.disk.disk_uuid)
                && !backing_off(&s.disk.disk_uuid)
        })
        .map(|s| DiskUse {
            disk_uuid: s.disk.disk_uuid.clone(),
            node_id: s.disk.node_id.clone(),
            file: class(&s.disk.disk_uuid),
            in_use: false,
        })
        .collect();
    let added = disks_to_add(&held(wanted), &candidates, min);
    for disk in &added {
        let node_id = stores
            .iter()
            .find(|s| &s.disk.disk_uuid == disk)
            .map(|s| s.disk.node_id.clone())
            .unwrap_or_default();
        wanted.insert(disk.clone(), DiskFileSpec::lvol_copy(node_id));
    }
    let mut marks = last_ref_marks(&held(wanted), &bi.status.disk_last_ref_at_map, min, now);
    let removed = expired(&marks, wait, now);
    for d in &removed {
        wanted.remove(d);
        marks.remove(d);
    }
    Kept {
        added,
        removed,
        marks,
    }
}

/// What [`keep_copies`] did to the disks that must hold a copy.
struct Kept {
    /// Added for `minNumberOfCopies`.
    added: Vec<String>,
    /// Removed: unused for the wait interval.
    removed: Vec<String>,
    /// The new `diskLastRefAtMap`.
    marks: BTreeMap<String, i64>,
}

/// Seed 001's `deleteInvalidV2Copy` and `prepareV2Copy`, once the image has a ready copy: copies on disks no
/// longer `wanted` are deleted (never the last ready one); failed copies are deleted, and their disk is synced
/// again — at once when its daemon no longer had the copy (its lvol went, or a restart dropped an unfinished one),
/// else after a backoff per image and disk (30 s doubling to 10 min, [`job_retry_backoff`]), its entry reading
/// `failed` with the reason meanwhile; `unknown` ones (daemon unreachable) are kept — their lvol may well be
/// there. Then, when no copy is being made, one wanted disk without a copy gets one, synced from a ready copy on
/// another disk (`BackingImageCreate` with `from_lvstore`: the target's daemon has the source's expose its
/// snapshot lvol); a refused create backs off the same way.
async fn sync_copies(
    name: &str,
    uuid: &str,
    stores: &[Store],
    holds: &BTreeMap<String, bool>,
    wanted: &BTreeMap<String, DiskFileSpec>,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    retries: &Retries,
) {
    for (disk, c) in &*copies {
        if c.state == state::READY {
            retries.clear(name, disk);
        }
    }
    drop_copies(name, stores, holds, wanted, copies, retries).await;
    if copies
        .values()
        .any(|c| c.state == state::PENDING || c.state == state::IN_PROGRESS)
    {
        return;
    }
    start_copy(name, uuid, stores, holds, wanted, copies, retries).await;
}

/// The v2 daemon's address of the lvstore on `disk`, when it runs.
fn store_address(stores: &[Store], disk: &str) -> Option<String> {
    stores
        .iter()
        .find(|s| s.disk.disk_uuid == disk)
        .and_then(|s| s.address.clone())
}

/// A ready copy on a disk other than `but` whose daemon runs: its disk, daemon address and copy info.
fn ready_copy(
    stores: &[Store],
    copies: &BTreeMap<String, DiskFileStatus>,
    but: &str,
) -> Option<(String, String, super::model::V2CopyInfo)> {
    copies
        .iter()
        .filter(|(d, c)| d.as_str() != but && c.state == state::READY)
        .find_map(|(d, c)| Some((d.clone(), store_address(stores, d)?, c.v2_copy.clone()?)))
}

/// Deletes the copies on disks no longer wanted (never the last ready one) and the failed ones, backing a failed
/// disk off before its next sync.
async fn drop_copies(
    name: &str,
    stores: &[Store],
    holds: &BTreeMap<String, bool>,
    wanted: &BTreeMap<String, DiskFileSpec>,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    retries: &Retries,
) {
    let disks: Vec<String> = copies.keys().cloned().collect();
    for disk in disks {
        let Some(c) = copies.get(&disk) else { continue };
        let unwanted = !wanted.contains_key(&disk);
        let held = holds.get(&disk).copied().unwrap_or(false);
        let delete = match c.state {
            state::FAILED => true,
            state::READY => unwanted && ready_copy(stores, copies, &disk).is_some(),
            state::UNKNOWN => false,
            _ => unwanted,
        };
        if !delete {
            continue;
        }
        // The daemon reports the copy failed: a sync that did not complete, which the disk's backoff counts.
        let failure = (c.state == state::FAILED && held).then(|| c.message.clone());
        if held {
            let Some(a) = store_address(stores, &disk) else {
                continue;
            };
            if let Err(e) = delete_copy(&a, name).await {
                tracing::warn!(
                    image = name,
                    disk,
                    error = format!("{e:#}"),
                    "v2 copy not deleted"
                );
                continue;
            }
        }
        if let Some(why) = failure {
            let wait = retries.failed(name, &disk, job_retry_backoff);
            let message = format!("sync failed: {why}; next attempt in {}s", wait.as_secs());
            tracing::warn!(
                image = name,
                disk,
                error = why,
                wait = wait.as_secs(),
                "v2 copy sync failed"
            );
            retries.explain(name, &disk, &message);
        }
        if !unwanted && let Some(message) = retries.waiting(name, &disk) {
            if let Some(c) = copies.get_mut(&disk) {
                c.state = state::FAILED;
                c.progress = 0;
                c.message = message;
            }
            continue;
        }
        tracing::info!(
            image = name,
            disk,
            state = c.state.as_str(),
            unwanted,
            held,
            "v2 copy deleted"
        );
        if unwanted {
            // Out of the spec: a later copy to the disk starts afresh.
            retries.clear(name, &disk);
        }
        copies.remove(&disk);
    }
}

/// Starts one copy onto a wanted disk without one (not backing off, its daemon running), synced from a ready copy
/// on another disk; a refused create backs the disk off.
async fn start_copy(
    name: &str,
    uuid: &str,
    stores: &[Store],
    holds: &BTreeMap<String, bool>,
    wanted: &BTreeMap<String, DiskFileSpec>,
    copies: &mut BTreeMap<String, DiskFileStatus>,
    retries: &Retries,
) {
    let Some(target) = wanted.keys().find(|d| {
        !copies.contains_key(*d)
            && retries.wait(name, d).is_zero()
            && stores
                .iter()
                .any(|s| &s.disk.disk_uuid == *d && s.disk.ready && s.address.is_some())
    }) else {
        return;
    };
    let Some((from_disk, from, info)) = ready_copy(stores, copies, target) else {
        return;
    };
    let Some(to) = store_address(stores, target) else {
        return;
    };
    let node = stores
        .iter()
        .find(|s| &s.disk.disk_uuid == target)
        .map(|s| s.disk.node_id.clone())
        .unwrap_or_default();
    if holds.get(target).copied().unwrap_or(false)
        && let Err(e) = delete_copy(&to, name).await
    {
        tracing::warn!(
            image = name,
            disk = target,
            error = format!("{e:#}"),
            "leftover v2 copy not deleted"
        );
        return;
    }
    let req = v1::BackingImageCreateRequest {
        name: name.to_owned(),
        backing_image_uuid: uuid.to_owned(),
        checksum: info.current_checksum.clone(),
        size: info.size,
        source: Some(v1::backing_image_create_request::Source::FromLvstore(
            from.clone(),
        )),
    };
    let res = match crate::v2::replica::client(&to).await {
        Ok(mut c) => c
            .backing_image_create(req)
            .await
            .map_err(|s| s.message().to_owned()),
        Err(e) => Err(format!("{e:#}")),
    };
    match res {
        Ok(r) => {
            tracing::info!(
                image = name,
                disk = target,
                from_disk,
                "syncing a v2 copy from another disk"
            );
            if let Some(st) = copy_status(uuid, &node, None, Fetched::Copy(r.into_inner())) {
                copies.insert(target.clone(), st);
            }
        }
        Err(e) => {
            let wait = retries.failed(name, target, job_retry_backoff);
            let message = format!(
                "sync from disk {from_disk} refused: {e}; next attempt in {}s",
                wait.as_secs()
            );
            tracing::warn!(
                image = name,
                disk = target,
                error = e,
                wait = wait.as_secs(),
                "v2 copy sync refused"
            );
            retries.explain(name, target, &message);
            copies.insert(
                target.clone(),
                DiskFileStatus {
                    state: state::FAILED,
                    message,
                    node_id: node,
                    data_engine: CopyKind::Lvol.engine(),
                    ..Default::default()
                },
            );
        }
    }
}

/// What a pass writes to the image: disks it adds to the spec and removes from it (v2 entries only), its v2
/// entries of the status map, its `diskLastRefAtMap`, and the first copy's state when given.
struct Pass<'a> {
    added: &'a BTreeMap<String, DiskFileSpec>,
    removed: &'a [String],
    copies: &'a BTreeMap<String, DiskFileStatus>,
    marks: &'a BTreeMap<String, i64>,
    first: Option<(Option<FileState>, String, String)>,
}

/// Writes a pass to the image (see [`Pass`]).
async fn write(ctx: &Ctx, name: &str, uuid: &str, pass: &Pass<'_>) -> anyhow::Result<()> {
    let updated = ctx
        .db
        .modify::<BackingImage>(name, |b| {
            if b.spec.uuid != uuid {
                return false;
            }
            let before = b.clone();
            // Added to and removed from, not replaced: the spec is the user's too (`copy`, `cleanup`), read before
            // this pass's daemon calls, so replacing the map would undo a change made meanwhile. A deleted image's
            // entries go.
            if b.spec.deletion_timestamp.is_some() {
                b.spec.disk_file_spec_map.retain(|_, s| !s.is_lvol());
            }
            for (d, s) in pass.added {
                // A v1 entry of the same disk (the file the first copy was made from, on this v2 disk's
                // directory) gives way: the image controller drops v1 entries once the first copy is ready, and
                // the copy's entry must outlive it.
                let e = b
                    .spec
                    .disk_file_spec_map
                    .entry(d.clone())
                    .or_insert_with(|| s.clone());
                if !e.is_lvol() {
                    *e = s.clone();
                }
            }
            for d in pass.removed {
                if b.spec
                    .disk_file_spec_map
                    .get(d)
                    .is_some_and(DiskFileSpec::is_lvol)
                {
                    b.spec.disk_file_spec_map.remove(d);
                }
            }
            b.status.disk_file_status_map.retain(|_, f| !f.is_lvol());
            b.status
                .disk_file_status_map
                .extend(pass.copies.iter().map(|(d, f)| (d.clone(), f.clone())));
            b.status.disk_last_ref_at_map.clone_from(pass.marks);
            if let Some((st, disk, message)) = &pass.first {
                b.status.v2_first_copy_status = *st;
                b.status.v2_first_copy_disk.clone_from(disk);
                b.status.v2_first_copy_message.clone_from(message);
            }
            *b != before
        })
        .await;
    absent_ok(updated)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn short(attempts: u32) -> Duration {
        Duration::from_millis(200 * u64::from(attempts))
    }

    #[test]
    fn a_failure_waits_longer_each_time_per_image_and_disk_and_its_message_shows_while_it_waits() {
        let r = Retries::default();
        assert!(r.wait("img", "d1").is_zero());
        assert_eq!(r.failed("img", "d1", short), Duration::from_millis(200));
        r.explain("img", "d1", "sync failed: no space; next attempt in 0s");
        assert!(!r.wait("img", "d1").is_zero());
        assert_eq!(
            r.waiting("img", "d1").as_deref(),
            Some("sync failed: no space; next attempt in 0s")
        );
        // Another disk, another image: their own counts.
        assert!(r.wait("img", "d2").is_zero() && r.waiting("img", "d2").is_none());
        assert!(r.wait("other", "d1").is_zero());
        assert_eq!(r.failed("img", "d1", short), Duration::from_millis(400));
        std::thread::sleep(Duration::from_millis(450));
        assert!(r.wait("img", "d1").is_zero());
        assert!(r.waiting("img", "d1").is_none(), "the next attempt may start");
        assert_eq!(r.failed("img", "d1", short), Duration::from_millis(600));
        r.clear("img", "d1");
        assert_eq!(
            r.failed("img", "d1", short),
            Duration::from_millis(200),
            "counted afresh"
        );
        r.failed("img", FIRST, short);
        r.clear_image("img");
        assert!(r.wait("img", FIRST).is_zero() && r.wait("img", "d1").is_zero());
    }

    #[test]
    fn the_first_copy_retries_from_two_seconds_to_a_minute_and_a_sync_from_thirty_seconds_to_ten_minutes() {
        let first: Vec<u64> = (1..9).map(|a| first_copy_backoff(a).as_secs()).collect();
        assert_eq!(first, [2, 4, 8, 16, 32, 60, 60, 60]);
        let sync: Vec<u64> = (1..9).map(|a| job_retry_backoff(a).as_secs()).collect();
        assert_eq!(sync, [30, 60, 120, 240, 480, 600, 600, 600]);
    }
}
