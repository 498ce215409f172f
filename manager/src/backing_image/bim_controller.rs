//! Node-local: one supervised `corral-bim` per disk of this node that has a `BackingImageManager` document. It
//! reports the daemon's files (List, refreshed on every Watch event), and makes the files of the spec ready: the
//! first copy is taken from the image's data source with Fetch, a copy whose image has a ready copy elsewhere is
//! synced from the least busy ready copy (at most 3 sends per source), and when no ready copy exists anywhere
//! (e.g. every `corral-bim` was restarted: live upgrade) the file already on the disk is reused with an empty
//! Fetch. Files the spec no longer names are deleted — never one a replica on this disk uses. While the disk is
//! not ready or names another UUID the manager and all its files are `unknown` and nothing is touched.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corral_proto::v1;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::model::{
    BackingImage, BackingImageDataSource, BackingImageManager, ManagerFile, ManagerState, file_state,
    manager_name, state,
};
use crate::context::Ctx;
use crate::model::{Node, Replica, Volume};
use crate::process::{Observed, Supervisor};
use crate::runtime::{Requeue, WorkQueue, feed_node_local, run_worker};
use crate::store::{Object, absent_ok};

pub const BINARY: &str = "corral-bim";
/// Concurrent sends one ready copy feeds (the seed's limit; `corral-bim` enforces it too).
pub const SENDS_PER_SOURCE: u32 = 3;
const RESYNC: Duration = Duration::from_secs(2);

struct Local {
    sup: Supervisor,
    /// Manager name → (gRPC address, cancel) of its Watch task.
    watches: Mutex<HashMap<String, (String, CancellationToken)>>,
    /// Manager name → the daemon (pid) whose API version was found compatible: checked once per process.
    compatible: Mutex<HashMap<String, i32>>,
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed_node_local::<BackingImageManager>(
        ctx,
        q.clone(),
        cancel.clone(),
        RESYNC,
        |m: &BackingImageManager| m.spec.node_id.as_str(),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    let local = Arc::new(Local {
        sup: Supervisor::new(BINARY, "bim", &ctx.cfg.processes, &ctx.cfg.data_dir),
        watches: Mutex::default(),
        compatible: Mutex::default(),
    });
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        let q2 = q.clone();
        run_worker("backing-image-manager", q, c.clone(), m, |name| {
            reconcile(ctx.clone(), local.clone(), q2.clone(), c.clone(), name)
        })
        .await;
    });
}

/// Requeues the manager on every change the daemon streams, until cancelled or the stream ends.
fn watch(local: &Local, q: &Arc<WorkQueue>, cancel: &CancellationToken, name: &str, address: &str) {
    let Ok(mut w) = local.watches.lock() else { return };
    if w.get(name)
        .is_some_and(|(a, t)| a == address && !t.is_cancelled())
    {
        return;
    }
    if let Some((_, t)) = w.remove(name) {
        t.cancel();
    }
    let token = cancel.child_token();
    w.insert(name.to_owned(), (address.to_owned(), token.clone()));
    let (q, name, address) = (q.clone(), name.to_owned(), address.to_owned());
    tokio::spawn(async move {
        let stream = async {
            let mut c = super::bim_client(&address).await?;
            let mut s = c.watch(v1::Empty {}).await?.into_inner();
            while let Some(ev) = s.next().await {
                ev?;
                q.add(&name);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            () = token.cancelled() => {}
            r = stream => if let Err(e) = r { tracing::debug!(manager = name, error = %e, "watch ended") },
        }
        // The next reconcile starts a new watch.
        token.cancel();
    });
}

async fn stop(local: &Local, name: &str) {
    if let Some((_, t)) = local.watches.lock().ok().and_then(|mut w| w.remove(name)) {
        t.cancel();
    }
    local.sup.stop(name, None, Duration::from_secs(10)).await;
}

/// Why the disk cannot be used now, if so.
async fn disk_problem(ctx: &Ctx, m: &BackingImageManager) -> anyhow::Result<Option<String>> {
    let node = ctx.db.must_get::<Node>(&ctx.cfg.node_id).await?;
    let Some(disk) = node.data.spec.disks.get(&m.spec.disk_name) else {
        return Ok(Some(format!(
            "disk {} is not on node {}",
            m.spec.disk_name, ctx.cfg.node_id
        )));
    };
    if disk.disk_uuid != m.spec.disk_uuid {
        return Ok(Some(format!(
            "disk {} now has UUID {}, not {}",
            m.spec.disk_name, disk.disk_uuid, m.spec.disk_uuid
        )));
    }
    match node.data.status.disks.get(&m.spec.disk_name) {
        Some(st) if st.error.is_empty() => Ok(None),
        Some(st) => Ok(Some(st.error.clone())),
        None => Ok(Some(format!("disk {} has not reported yet", m.spec.disk_name))),
    }
}

async fn set_status(
    ctx: &Ctx,
    name: &str,
    f: impl Fn(&mut super::model::ManagerStatus) + Send + Sync,
) -> anyhow::Result<()> {
    absent_ok(
        ctx.db
            .modify::<BackingImageManager>(name, |m| {
                let before = m.status.clone();
                f(&mut m.status);
                m.status != before
            })
            .await,
    )?;
    Ok(())
}

async fn reconcile(
    ctx: Ctx,
    local: Arc<Local>,
    q: Arc<WorkQueue>,
    cancel: CancellationToken,
    name: String,
) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<BackingImageManager>(&name).await? else {
        stop(&local, &name).await;
        return Ok(None);
    };
    let m = &obj.data;
    if m.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    if let Some(problem) = disk_problem(&ctx, m).await? {
        // The files may be fine; nothing can be said or done about them now.
        set_status(&ctx, &name, |s| {
            s.state = Some(ManagerState::Unknown);
            s.message.clone_from(&problem);
            for f in s.files.values_mut() {
                if f.state != state::FAILED {
                    f.state = state::UNKNOWN;
                }
            }
        })
        .await?;
        return Ok(Some(RESYNC));
    }
    match local.sup.observe(&name, m.status.process.as_ref()).await {
        Observed::Running => {}
        Observed::Starting => return Ok(Some(Duration::from_millis(200))),
        Observed::Ready(listen) => {
            let (Some(grpc), Some(http)) = (listen.get("grpc"), listen.get("http")) else {
                anyhow::bail!("corral-bim of {name} reported no grpc or http listener: {listen:?}");
            };
            tracing::info!(manager = name, grpc, http, "corral-bim ready");
            set_status(&ctx, &name, |s| {
                s.address.clone_from(grpc);
                s.http_address.clone_from(http);
                if let Some(p) = &mut s.process {
                    p.listen.clone_from(&listen);
                }
            })
            .await?;
            return Ok(Some(Duration::ZERO));
        }
        Observed::Down => {
            let restarts = m.status.process.as_ref().map_or(0, |p| p.restarts + 1);
            if let Some(wait) = Supervisor::restart_wait(m.status.process.as_ref(), restarts) {
                return Ok(Some(wait));
            }
            let rec = spawn(&ctx, &local, &name, m, restarts).await?;
            // Addresses are known once it reports ready.
            set_status(&ctx, &name, |s| {
                s.state = Some(ManagerState::Starting);
                s.process = Some(rec.clone());
                s.address.clear();
                s.http_address.clear();
            })
            .await?;
            return Ok(Some(Duration::from_millis(200)));
        }
    }
    let Ok(mut client) = super::bim_client(&m.status.address).await else {
        return Ok(Some(Duration::from_millis(300)));
    };
    if let Some(wait) = check_version(&ctx, &local, &mut client, &name, m).await? {
        return Ok(Some(wait));
    }
    let list = match client.list(v1::Empty {}).await {
        Ok(l) => l.into_inner(),
        Err(_) => return Ok(Some(Duration::from_millis(300))),
    };
    watch(&local, &q, &cancel, &name, &m.status.address);
    let files: BTreeMap<String, ManagerFile> = list.images.iter().filter_map(manager_file).collect();
    report_failures(&ctx, m, &files);
    let (mstate, message) = if list.disk_message.is_empty() {
        (ManagerState::Running, String::new())
    } else {
        (ManagerState::Unknown, list.disk_message.clone())
    };
    set_status(&ctx, &name, |s| {
        s.state = Some(mstate);
        s.message.clone_from(&message);
        s.files.clone_from(&files);
    })
    .await?;
    if !list.disk_message.is_empty() {
        return Ok(Some(RESYNC));
    }
    let managers = ctx.db.list::<BackingImageManager>().await?;
    for (image, uuid) in &m.spec.backing_images {
        if let Err(e) = make_ready(&ctx, &mut client, m, &managers, &files, image, uuid).await {
            tracing::warn!(
                manager = name,
                image,
                error = format!("{e:#}"),
                "cannot prepare backing image file"
            );
        }
    }
    delete_unwanted(&ctx, &mut client, m, &files).await?;
    Ok(Some(RESYNC))
}

/// A file as the daemon reports it (List, or the reply to Fetch/Sync), by image name.
fn manager_file(i: &v1::BimImage) -> Option<(String, ManagerFile)> {
    let spec = i.spec.as_ref()?;
    let st = i.status.clone().unwrap_or_default();
    Some((
        spec.name.clone(),
        ManagerFile {
            uuid: spec.uuid.clone(),
            state: file_state(&st.state),
            progress: st.progress,
            message: st.message,
            size: st.size,
            virtual_size: st.virtual_size,
            current_checksum: st.current_checksum,
            path: i.path.clone(),
            sending_reference: st.sending_reference,
            sender_address: st.sender_address,
        },
    ))
}

/// Reports each copy that has just failed (a checksum that no longer matches, a file gone, a fetch or sync that
/// broke off): a warning naming the image, disk and reason, and the manager's copy-failure counter. The daemon
/// removed the failed file already (a replica that has it open keeps reading it until it restarts); the copy is
/// synced again from a ready one, which lands by rename.
fn report_failures(ctx: &Ctx, m: &BackingImageManager, now: &BTreeMap<String, ManagerFile>) {
    for (image, f) in now {
        let was = m.status.files.get(image).filter(|o| o.uuid == f.uuid);
        if f.state == state::FAILED && was.is_none_or(|o| o.state != state::FAILED) {
            tracing::warn!(
                image,
                disk = m.spec.disk_path,
                disk_uuid = m.spec.disk_uuid,
                reason = f.message,
                "backing image copy failed: it is synced again from a ready copy (or the source, if none is left)"
            );
            ctx.metrics.backing_image_copy_failed();
        }
    }
}

/// Once per daemon process: whether it speaks this manager's API. One that does not (an older or newer
/// `corral-bim` still running from before an upgrade) is never asked to fetch, sync or delete anything: it is
/// stopped (stopping leaves every file) and this build's `corral-bim` is started, which adopts the files without
/// copying them. Some(wait): do nothing else now.
async fn check_version(
    ctx: &Ctx,
    local: &Local,
    client: &mut v1::backing_image_manager_service_client::BackingImageManagerServiceClient<
        tonic::transport::Channel,
    >,
    name: &str,
    m: &BackingImageManager,
) -> anyhow::Result<Option<Duration>> {
    let pid = m.status.process.as_ref().map_or(0, |p| p.pid);
    if local.compatible.lock().is_ok_and(|c| c.get(name) == Some(&pid)) {
        return Ok(None);
    }
    let reported = match client.version_get(v1::Empty {}).await {
        Ok(v) => {
            let v = v.into_inner();
            if corral_proto::backing_image::bim_api_compatible(v.api_version, v.api_min_version) {
                if let Ok(mut c) = local.compatible.lock() {
                    c.insert(name.to_owned(), pid);
                }
                return Ok(None);
            }
            format!(
                "corral-bim {} (pid {pid}) serves API versions {}..={}, this manager speaks {}",
                v.version,
                v.api_min_version,
                v.api_version,
                corral_proto::backing_image::BIM_API_VERSION
            )
        }
        // A daemon too old to know the call.
        Err(e) if e.code() == tonic::Code::Unimplemented => {
            format!("corral-bim (pid {pid}) has no VersionGet: {}", e.message())
        }
        Err(_) => return Ok(Some(Duration::from_millis(300))),
    };
    let message = format!("{reported}: replacing it (its files stay and are adopted)");
    tracing::warn!(manager = name, "incompatible corral-bim: {message}");
    set_status(ctx, name, |s| {
        s.state = Some(ManagerState::Unknown);
        s.message.clone_from(&message);
    })
    .await?;
    if let Some((_, t)) = local.watches.lock().ok().and_then(|mut w| w.remove(name)) {
        t.cancel();
    }
    local
        .sup
        .stop(name, m.status.process.as_ref(), Duration::from_secs(10))
        .await;
    Ok(Some(Duration::ZERO))
}

/// Starts the disk's `corral-bim`: gRPC and HTTP on their previous ports (other disks' managers sync from that
/// address) or port 0; its sync receivers take ports of the node's range (it skips ports found busy).
async fn spawn(
    ctx: &Ctx,
    local: &Local,
    name: &str,
    m: &BackingImageManager,
    restarts: u32,
) -> anyhow::Result<crate::model::ProcessRecord> {
    let host = &ctx.cfg.host;
    let prev = m.status.process.as_ref();
    let (from, to) = ctx.cfg.port_range;
    let args = vec![
        "serve".to_owned(),
        "--listen".to_owned(),
        format!("{host}:{}", Supervisor::previous_port(prev, "grpc")),
        "--http-listen".to_owned(),
        format!("{host}:{}", Supervisor::previous_port(prev, "http")),
        "--disk-path".to_owned(),
        m.spec.disk_path.clone(),
        "--disk-uuid".to_owned(),
        m.spec.disk_uuid.clone(),
        "--port-range".to_owned(),
        // The node's range is half-open, the daemon's inclusive.
        format!("{from}-{}", to.saturating_sub(1).max(from)),
        "--advertise-host".to_owned(),
        host.clone(),
    ];
    let rec = local.sup.start(name, args, restarts).await?;
    ctx.metrics.daemon_started();
    tracing::info!(
        manager = name,
        pid = rec.pid,
        disk = m.spec.disk_path,
        "started corral-bim"
    );
    Ok(rec)
}

fn spec(name: &str, uuid: &str, size: u64, checksum: &str) -> v1::BimImageSpec {
    v1::BimImageSpec {
        name: name.to_owned(),
        uuid: uuid.to_owned(),
        size,
        checksum: checksum.to_owned(),
    }
}

/// Sends one ready copy is feeding now: what it reports, or the receivers naming it if more (a sync just asked).
fn sends_from(managers: &[Object<BackingImageManager>], source: &BackingImageManager, image: &str) -> u32 {
    let reported = source.status.files.get(image).map_or(0, |f| f.sending_reference);
    let receiving = managers
        .iter()
        .filter_map(|m| m.data.status.files.get(image))
        .filter(|f| {
            matches!(f.state, state::STARTING | state::IN_PROGRESS | state::PENDING)
                && f.sender_address == source.status.address
        })
        .count();
    reported.max(u32::try_from(receiving).unwrap_or(u32::MAX))
}

async fn make_ready(
    ctx: &Ctx,
    client: &mut v1::backing_image_manager_service_client::BackingImageManagerServiceClient<
        tonic::transport::Channel,
    >,
    me: &BackingImageManager,
    managers: &[Object<BackingImageManager>],
    files: &BTreeMap<String, ManagerFile>,
    image: &str,
    uuid: &str,
) -> anyhow::Result<()> {
    if let Some(f) = files.get(image)
        && f.uuid == uuid
        && f.state != state::FAILED
    {
        return Ok(());
    }
    if let Some(f) = files.get(image)
        && f.uuid != uuid
    {
        // An older image of the same name: its files go before the new one is prepared.
        client
            .delete(v1::BimImageRef {
                name: image.to_owned(),
                uuid: f.uuid.clone(),
            })
            .await?;
    }
    let Some(bi) = ctx.db.get::<BackingImage>(image).await? else {
        return Ok(());
    };
    if bi.data.spec.uuid != uuid || bi.data.spec.deletion_timestamp.is_some() {
        return Ok(());
    }
    let ds = ctx.db.get::<BackingImageDataSource>(image).await?;
    let started = ds.as_ref().is_none_or(|d| d.data.spec.started);
    if !started {
        let Some(ds) = ds else { return Ok(()) };
        let d = &ds.data;
        if d.spec.disk_uuid == me.spec.disk_uuid && d.status.state == Some(state::READY_FOR_TRANSFER) {
            tracing::info!(image, disk = me.spec.disk_path, "taking the data source's file");
            client
                .fetch(v1::BimFetchRequest {
                    spec: Some(spec(image, uuid, d.status.size, &d.status.current_checksum)),
                    data_source_address: d.status.address.clone(),
                })
                .await?;
        }
        return Ok(());
    }
    let checksum = if bi.data.status.current_checksum.is_empty() {
        bi.data.spec.expected_checksum.clone()
    } else {
        bi.data.status.current_checksum.clone()
    };
    // A dead node's manager still reads running and ready in the store: only nodes that are up can send.
    let mut up_nodes = std::collections::BTreeSet::new();
    for n in ctx.db.list::<Node>().await? {
        if crate::scheduler::node_is_up(ctx, &n.data).await {
            up_nodes.insert(n.name);
        }
    }
    let ready: Vec<&BackingImageManager> = managers
        .iter()
        .map(|m| &m.data)
        .filter(|m| m.spec.disk_uuid != me.spec.disk_uuid && m.status.state == Some(ManagerState::Running))
        .filter(|m| up_nodes.contains(&m.spec.node_id))
        .filter(|m| {
            m.status
                .files
                .get(image)
                .is_some_and(|f| f.uuid == uuid && f.state == state::READY)
        })
        .collect();
    if ready.is_empty() {
        let anywhere_ready = managers.iter().any(|m| {
            m.data
                .status
                .files
                .get(image)
                .is_some_and(|f| f.uuid == uuid && f.state == state::READY)
        });
        if !anywhere_ready && files.get(image).is_none_or(|f| f.state != state::FAILED) {
            // No ready copy in the cluster (daemons restarted): adopt what is on this disk, if it matches.
            let r = client
                .fetch(v1::BimFetchRequest {
                    spec: Some(spec(image, uuid, bi.data.status.size, &checksum)),
                    data_source_address: String::new(),
                })
                .await;
            if let Err(e) = r {
                tracing::debug!(image, error = %e, "no file to reuse on this disk");
            }
        }
        return Ok(());
    }
    let Some(source) = ready
        .iter()
        .map(|m| (sends_from(managers, m, image), *m))
        .filter(|(n, _)| *n < SENDS_PER_SOURCE)
        .min_by_key(|(n, m)| (*n, m.spec.disk_uuid.clone()))
        .map(|(_, m)| m)
    else {
        tracing::debug!(
            image,
            "every ready copy is sending {SENDS_PER_SOURCE} copies: waiting"
        );
        return Ok(());
    };
    tracing::info!(
        image,
        from = source.status.address,
        to = me.spec.disk_path,
        "syncing backing image"
    );
    let reply = client
        .sync(v1::BimSyncRequest {
            spec: Some(spec(image, uuid, bi.data.status.size, &checksum)),
            from_address: source.status.address.clone(),
        })
        .await?
        .into_inner();
    // Recorded at once, naming its sender, so the next disk's reconcile counts this sync against the source's
    // limit (the daemons' own reports arrive later; without this a fourth receiver could ask a busy source, which
    // refuses, and its copy would fail).
    if let Some((name, mut file)) = manager_file(&reply) {
        if file.sender_address.is_empty() {
            file.sender_address.clone_from(&source.status.address);
        }
        set_status(ctx, &manager_name(&me.spec.disk_uuid), |s| {
            s.files.insert(name.clone(), file.clone());
        })
        .await?;
    }
    Ok(())
}

/// Deletes files the spec does not name (or of another UUID), except what a replica on this disk uses.
async fn delete_unwanted(
    ctx: &Ctx,
    client: &mut v1::backing_image_manager_service_client::BackingImageManagerServiceClient<
        tonic::transport::Channel,
    >,
    me: &BackingImageManager,
    files: &BTreeMap<String, ManagerFile>,
) -> anyhow::Result<()> {
    let unwanted: Vec<(&String, &ManagerFile)> = files
        .iter()
        .filter(|(n, f)| me.spec.backing_images.get(*n) != Some(&f.uuid))
        .collect();
    if unwanted.is_empty() {
        return Ok(());
    }
    let in_use = images_in_use_on(ctx, &me.spec.disk_uuid).await?;
    for (image, f) in unwanted {
        if in_use.contains_key(image.as_str()) {
            tracing::warn!(
                image,
                disk = me.spec.disk_path,
                "not deleting a backing file a replica uses"
            );
            continue;
        }
        tracing::info!(
            image,
            uuid = f.uuid,
            disk = me.spec.disk_path,
            "deleting backing image file"
        );
        client
            .delete(v1::BimImageRef {
                name: image.clone(),
                uuid: f.uuid.clone(),
            })
            .await?;
    }
    Ok(())
}

/// Image name → replicas on the disk whose volume uses it.
pub async fn images_in_use_on(ctx: &Ctx, disk_uuid: &str) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let volumes = ctx.db.list::<Volume>().await?;
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in ctx.db.list::<Replica>().await? {
        if r.data.spec.disk_uuid != disk_uuid {
            continue;
        }
        if let Some(img) = volumes
            .iter()
            .find(|v| v.name == r.data.spec.volume)
            .and_then(|v| v.data.spec.backing_image.clone())
        {
            out.entry(img).or_default().push(r.name.clone());
        }
    }
    Ok(out)
}
