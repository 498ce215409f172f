//! Fetch (take over a data source's file), Sync (receive a copy from another manager) and Send (feed another
//! manager's receiver). Every request checks what it can before it registers anything, so a bad request leaves
//! no image and no file behind; once registered, failures end in `failed` with the image's files removed.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use corral_daemon::disk::sync_parent_dir;
use corral_proto::v1;
use corral_proto::v1::backing_image_manager_service_client::BackingImageManagerServiceClient;
use sparse_sync::receiver::{ReceiveError, ReceiveOutcome, Receiver, ReceiverConfig};
use sparse_sync::{FileContent, LayoutMode, Progress, SendOptions};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tracing::{Instrument, info};

use crate::checksum::sha512_file;
use crate::datasource::{DataSourceClient, DataSourceFile, READY_FOR_TRANSFER};
use crate::error::BimError;
use crate::files::{self, BackingConfig, ImagePaths};
use crate::manager::{Image, ImageSpec, Manager, check_ref};
use crate::ports::PortLease;
use crate::state::FileState;

/// Sends of one image running at once (each ready copy feeds at most this many syncs).
pub const SEND_LIMIT: u32 = 3;

/// A sync's progress: receiving counts up to this percentage, verifying the copy the rest.
const SYNC_VERIFY_PROGRESS: u8 = 80;

/// A gRPC client of another manager.
pub type BimClient = BackingImageManagerServiceClient<Channel>;

/// Connects to a manager at `HOST:PORT` (or an `http://` URL).
pub async fn connect(address: &str) -> Result<BimClient, BimError> {
    let url = if address.starts_with("http://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let ep = Endpoint::from_shared(url)
        .map_err(|e| BimError::InvalidArgument(format!("address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(3));
    let ch = ep
        .connect()
        .await
        .map_err(|e| BimError::Peer(format!("cannot reach a backing-image manager at {address}: {e}")))?;
    Ok(BimClient::new(ch))
}

enum Registered {
    New {
        generation: u64,
        cancel: CancellationToken,
    },
    /// Registered meanwhile by another request: report it.
    Existing,
}

/// What an existing `backing` is worth for a spec.
enum Reuse {
    Reused(BackingConfig),
    Absent,
    Mismatch(String),
    /// The file may match but only hashing it would tell.
    NeedsHash,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BimError> + Send + 'static,
) -> Result<T, BimError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BimError::Internal(e.to_string()))?
}

/// Maps a percentage onto `from..=to`.
fn scale(pct: u8, from: u8, to: u8) -> u8 {
    let share = u16::from(pct.min(100)) * u16::from(to.saturating_sub(from)) / 100;
    u8::try_from(u16::from(from) + share).unwrap_or(to)
}

fn percent(done: u64, total: u64) -> u8 {
    u8::try_from((done.saturating_mul(100) / total.max(1)).min(100)).unwrap_or(100)
}

/// Looks at `backing` for `spec`: its checksum comes from `backing.cfg` when the mtime is the recorded one, else
/// from hashing it (only when `hash` is given). A reused file gets its `backing.cfg` rewritten if anything changed.
fn try_reuse(
    paths: &ImagePaths,
    spec: &ImageSpec,
    hash: Option<&CancellationToken>,
) -> Result<Reuse, BimError> {
    let io = |op, e| BimError::io(op, &paths.backing, e);
    let Some(f) = files::facts(&paths.backing).map_err(|e| io("stat", e))? else {
        return Ok(Reuse::Absent);
    };
    if spec.size != 0 && f.size != spec.size {
        return Ok(Reuse::Mismatch(format!(
            "{} is {} bytes, the spec says {}",
            paths.backing.display(),
            f.size,
            spec.size
        )));
    }
    let recorded = files::read_config(&paths.config).ok().flatten().filter(|c| {
        c.name == spec.name
            && c.uuid == spec.uuid
            && c.size == f.size
            && c.modification_time == f.modification_time
    });
    let (sum, f) = match (&recorded, hash) {
        (Some(c), _) => (c.current_checksum.clone(), f),
        (None, None) => return Ok(Reuse::NeedsHash),
        (None, Some(cancel)) => sha512_file(&paths.backing, cancel, |_, _| {}).map_err(|e| io("hash", e))?,
    };
    if !spec.checksum.is_empty() && sum != spec.checksum {
        return Ok(Reuse::Mismatch(format!(
            "{} has SHA-512 {sum}, the spec expects {}",
            paths.backing.display(),
            spec.checksum
        )));
    }
    let cfg = BackingConfig::verified(&spec.name, &spec.uuid, &spec.checksum, sum, f, &paths.backing);
    if recorded.as_ref() != Some(&cfg) {
        files::write_config(&paths.config, &cfg).map_err(|e| BimError::io("write", &paths.config, e))?;
    }
    Ok(Reuse::Reused(cfg))
}

/// Hashes `backing.tmp`, checks it against the spec and the source's checksum, records `backing.cfg`, then
/// renames it onto `backing` (the rename keeps the mtime the config records).
fn verify_and_commit(
    paths: &ImagePaths,
    spec: &ImageSpec,
    source_checksum: &str,
    cancel: &CancellationToken,
    progress: impl Fn(u64, u64),
) -> Result<BackingConfig, String> {
    let (sum, f) = sha512_file(&paths.temp, cancel, progress)
        .map_err(|e| format!("hashing {}: {e}", paths.temp.display()))?;
    if spec.size != 0 && f.size != spec.size {
        return Err(format!("received {} bytes, the spec says {}", f.size, spec.size));
    }
    if !spec.checksum.is_empty() && sum != spec.checksum {
        return Err(format!(
            "checksum mismatch: expected SHA-512 {}, the file has {sum}",
            spec.checksum
        ));
    }
    if !source_checksum.is_empty() && sum != source_checksum {
        return Err(format!(
            "checksum mismatch: the source's file has SHA-512 {source_checksum}, the copy has {sum}"
        ));
    }
    let cfg = BackingConfig::verified(&spec.name, &spec.uuid, &spec.checksum, sum, f, &paths.temp);
    files::write_config(&paths.config, &cfg)
        .map_err(|e| format!("writing {}: {e}", paths.config.display()))?;
    std::fs::rename(&paths.temp, &paths.backing)
        .and_then(|()| sync_parent_dir(&paths.backing))
        .map_err(|e| {
            format!(
                "renaming {} onto {}: {e}",
                paths.temp.display(),
                paths.backing.display()
            )
        })?;
    Ok(cfg)
}

/// Checks a data source's file before anything is taken: same image, this disk, finished, at the one path a data
/// source of this disk may use (no symlink out of it), with the size the spec and the data source agree on.
fn check_data_source_file(
    disk: &Path,
    disk_uuid: &str,
    spec: &ImageSpec,
    f: &DataSourceFile,
) -> Result<(), BimError> {
    if f.name != spec.name || f.uuid != spec.uuid {
        return Err(BimError::InvalidArgument(format!(
            "the data source prepares {}/{}, not {}/{}",
            f.name, f.uuid, spec.name, spec.uuid
        )));
    }
    if f.disk_uuid != disk_uuid {
        return Err(BimError::InvalidArgument(format!(
            "the data source's file is on disk {}, this manager owns disk {disk_uuid}",
            f.disk_uuid
        )));
    }
    if f.state != READY_FOR_TRANSFER {
        return Err(BimError::FailedPrecondition(format!(
            "the data source's file is {}, not {READY_FOR_TRANSFER}{}",
            f.state,
            if f.message.is_empty() {
                String::new()
            } else {
                format!(": {}", f.message)
            }
        )));
    }
    if spec.size != 0 && f.size != spec.size {
        return Err(BimError::InvalidArgument(format!(
            "the spec says {} bytes, the data source's file has {}",
            spec.size, f.size
        )));
    }
    if !spec.checksum.is_empty() && !f.current_checksum.is_empty() && f.current_checksum != spec.checksum {
        return Err(BimError::InvalidArgument(format!(
            "the spec expects SHA-512 {}, the data source's file has {}",
            spec.checksum, f.current_checksum
        )));
    }
    let expected = files::data_source_file(disk, &spec.name, &spec.uuid);
    let canon = |p: &Path| std::fs::canonicalize(p).map_err(|e| BimError::io("resolve", p, e));
    let expected_dir = canon(expected.parent().unwrap_or(disk))?;
    let got = canon(Path::new(&f.file_path))?;
    if got != expected_dir.join(files::dir_name(&spec.name, &spec.uuid)) {
        return Err(BimError::InvalidArgument(format!(
            "the data source's file {} is not {}: refusing a file from outside this disk's data-source directory",
            f.file_path,
            expected.display()
        )));
    }
    let md = std::fs::symlink_metadata(&got).map_err(|e| BimError::io("stat", &got, e))?;
    if !md.is_file() || md.len() != f.size {
        return Err(BimError::InvalidArgument(format!(
            "{} is not a regular file of {} bytes as the data source reports",
            got.display(),
            f.size
        )));
    }
    check_own_file(&got, &md)
}

/// A file taken over must be a regular file of its own: a symlink or a hard link would make whatever file it
/// shares its content with the image (hashed, served over HTTP, removed with it).
fn check_own_file(path: &Path, md: &std::fs::Metadata) -> Result<(), BimError> {
    if !md.file_type().is_file() || md.nlink() != 1 {
        return Err(BimError::InvalidArgument(format!(
            "{} is not a regular file of its own ({} hard links, {:?}): refusing to take it",
            path.display(),
            md.nlink(),
            md.file_type()
        )));
    }
    Ok(())
}

/// Ends one send of an image, whatever happened to it.
struct SendingGuard {
    manager: Arc<Manager>,
    name: String,
    generation: u64,
}

impl Drop for SendingGuard {
    fn drop(&mut self) {
        self.manager.update(&self.name, self.generation, |i| {
            i.sending = i.sending.saturating_sub(1);
        });
    }
}

impl Manager {
    /// The registered image when it is not failed (such a request just reports it); an error when the name is
    /// taken by another uuid or the spec disagrees with what is registered.
    fn existing(&self, spec: &ImageSpec) -> Result<Option<v1::BimImage>, BimError> {
        let reg = self.lock();
        let Some(img) = reg.images.get(&spec.name) else {
            return Ok(None);
        };
        if img.spec.uuid != spec.uuid {
            return Err(BimError::AlreadyExists(format!(
                "image {} with uuid {} is on this disk; delete it before adding uuid {}",
                spec.name, img.spec.uuid, spec.uuid
            )));
        }
        if img.state == FileState::Failed {
            return Ok(None);
        }
        let size = if img.size != 0 { img.size } else { img.spec.size };
        if spec.size != 0 && size != 0 && size != spec.size {
            return Err(BimError::InvalidArgument(format!(
                "image {} is {size} bytes, the spec says {}",
                spec.name, spec.size
            )));
        }
        let sum = if img.current_checksum.is_empty() {
            &img.spec.checksum
        } else {
            &img.current_checksum
        };
        if !spec.checksum.is_empty() && !sum.is_empty() && *sum != spec.checksum {
            return Err(BimError::InvalidArgument(format!(
                "image {} has SHA-512 {sum}, the spec expects {}",
                spec.name, spec.checksum
            )));
        }
        Ok(Some(self.image_proto(img, reg.disk_problem.as_deref())))
    }

    fn register(&self, spec: &ImageSpec, state: FileState, sender: &str) -> Result<Registered, BimError> {
        let mut reg = self.lock();
        if let Some(p) = &reg.disk_problem {
            return Err(BimError::DiskUnavailable(p.clone()));
        }
        if let Some(img) = reg.images.get(&spec.name) {
            if img.spec.uuid != spec.uuid {
                return Err(BimError::AlreadyExists(format!(
                    "image {} with uuid {} is on this disk",
                    spec.name, img.spec.uuid
                )));
            }
            if img.state != FileState::Failed {
                return Ok(Registered::Existing);
            }
        }
        if let Some(owner) = reg.dir_owner(&spec.name, &spec.uuid) {
            return Err(BimError::AlreadyExists(format!(
                "image {} with uuid {} uses the directory {} that image {}/{} needs: choose another name or uuid",
                owner.spec.name,
                owner.spec.uuid,
                files::dir_name(&spec.name, &spec.uuid),
                spec.name,
                spec.uuid
            )));
        }
        let generation = reg.next_generation();
        let mut img = Image::new(spec.clone(), generation, state, &self.cancel);
        img.sender_address = sender.to_owned();
        img.busy = true;
        let cancel = img.cancel.clone();
        reg.images.insert(spec.name.clone(), img);
        self.emit(&reg, &spec.name);
        Ok(Registered::New { generation, cancel })
    }

    fn register_ready(&self, spec: &ImageSpec, cfg: &BackingConfig) -> Result<v1::BimImage, BimError> {
        if let Registered::New { generation, .. } = self.register(spec, FileState::Pending, "")? {
            self.update(&spec.name, generation, |i| i.set_ready(cfg));
            info!(image = %spec.name, uuid = %spec.uuid, "reused the backing file already on the disk");
        }
        self.get(&spec.name, &spec.uuid)
    }

    /// Fetch: with a data-source address, take its finished file over (transfer, then rename: no copy); without,
    /// reuse the file already on the disk if its size and checksum match the spec.
    pub async fn fetch(self: &Arc<Self>, spec: ImageSpec, address: &str) -> Result<v1::BimImage, BimError> {
        self.check_disk()?;
        if let Some(img) = self.existing(&spec)? {
            return Ok(img);
        }
        let paths = self.paths(&spec.name, &spec.uuid);
        if address.is_empty() {
            return self.fetch_existing(spec, paths).await;
        }
        let ds = DataSourceClient::new(address)?;
        let file = ds.file().await?;
        let (disk, uuid, s, f) = (
            self.cfg.disk_path.clone(),
            self.cfg.disk_uuid.clone(),
            spec.clone(),
            file.clone(),
        );
        blocking(move || check_data_source_file(&disk, &uuid, &s, &f)).await?;
        let (p, s) = (paths.clone(), spec.clone());
        if let Reuse::Reused(cfg) = blocking(move || try_reuse(&p, &s, None)).await? {
            return self.register_ready(&spec, &cfg);
        }
        let Registered::New { generation, cancel } = self.register(&spec, FileState::Starting, address)?
        else {
            return self.get(&spec.name, &spec.uuid);
        };
        let take = async {
            let p = paths.clone();
            blocking(move || {
                p.remove_all()
                    .and_then(|()| p.create_dir())
                    .map_err(|e| BimError::io("prepare", &p.dir, e))
            })
            .await?;
            ds.transfer().await?;
            let (p, src) = (paths.clone(), std::path::PathBuf::from(&file.file_path));
            blocking(move || {
                std::fs::rename(&src, &p.temp)
                    .and_then(|()| sync_parent_dir(&p.temp))
                    .and_then(|()| sync_parent_dir(&src))
                    .map_err(|e| BimError::io("rename into place", &src, e))?;
                // What was renamed may not be what was checked (the data source's directory is not ours).
                let md = std::fs::symlink_metadata(&p.temp).map_err(|e| BimError::io("stat", &p.temp, e))?;
                check_own_file(&p.temp, &md)
            })
            .await
        };
        if let Err(e) = take.await {
            self.fail(&spec.name, generation, e.to_string()).await;
            return Err(e);
        }
        info!(image = %spec.name, uuid = %spec.uuid, from = %file.file_path, "took over the data source's file");
        self.metrics.fetches.inc();
        self.update(&spec.name, generation, |i| i.state = FileState::InProgress);
        self.spawn_commit(spec.clone(), generation, file.current_checksum, cancel, 0);
        self.get(&spec.name, &spec.uuid)
    }

    async fn fetch_existing(
        self: &Arc<Self>,
        spec: ImageSpec,
        paths: ImagePaths,
    ) -> Result<v1::BimImage, BimError> {
        let p = paths.clone();
        let facts =
            blocking(move || files::facts(&p.backing).map_err(|e| BimError::io("stat", &p.backing, e)))
                .await?;
        let Some(f) = facts else {
            return Err(BimError::NotFound(format!(
                "no file to reuse at {}: give a data source address",
                paths.backing.display()
            )));
        };
        if spec.size != 0 && f.size != spec.size {
            return Err(BimError::InvalidArgument(format!(
                "{} is {} bytes, the spec says {}",
                paths.backing.display(),
                f.size,
                spec.size
            )));
        }
        let Registered::New { generation, cancel } = self.register(&spec, FileState::Pending, "")? else {
            return self.get(&spec.name, &spec.uuid);
        };
        let m = self.clone();
        let (name, uuid) = (spec.name.clone(), spec.uuid.clone());
        let job_name = name.clone();
        self.tasks.spawn(
            async move {
                let name = job_name;
                let r = blocking(move || try_reuse(&paths, &spec, Some(&cancel))).await;
                match r {
                    Ok(Reuse::Reused(cfg)) => {
                        m.metrics.fetches.inc();
                        info!(image = %name, "reused the backing file already on the disk");
                        m.update(&name, generation, |i| i.set_ready(&cfg));
                    }
                    Ok(Reuse::Mismatch(why)) => m.fail(&name, generation, why).await,
                    Ok(Reuse::Absent | Reuse::NeedsHash) => {
                        m.fail(&name, generation, "the backing file disappeared".into())
                            .await;
                    }
                    Err(e) => m.fail(&name, generation, e.to_string()).await,
                }
            }
            .instrument(tracing::Span::current()),
        );
        self.get(&name, &uuid)
    }

    /// Verifies `backing.tmp` and makes it the image (in the background); progress runs from `progress_from`
    /// to 99 while it is hashed.
    fn spawn_commit(
        self: &Arc<Self>,
        spec: ImageSpec,
        generation: u64,
        source_checksum: String,
        cancel: CancellationToken,
        progress_from: u8,
    ) {
        let m = self.clone();
        self.tasks.spawn(async move {
            let paths = m.paths(&spec.name, &spec.uuid);
            let name = spec.name.clone();
            let mp = m.clone();
            let s = spec.clone();
            let r = tokio::task::spawn_blocking(move || {
                verify_and_commit(&paths, &s, &source_checksum, &cancel, |done, total| {
                    mp.set_progress(&s.name, generation, scale(percent(done, total), progress_from, 99));
                })
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            match r {
                Ok(cfg) => {
                    info!(image = %name, checksum = %cfg.current_checksum, size = cfg.size, "backing image ready");
                    m.update(&name, generation, |i| i.set_ready(&cfg));
                }
                Err(e) => m.fail(&name, generation, e).await,
            }
        }
        .instrument(tracing::Span::current()));
    }

    /// Sync: receive the image from the manager at `from` (which must hold it ready), or reuse a matching file.
    pub async fn sync(self: &Arc<Self>, spec: ImageSpec, from: &str) -> Result<v1::BimImage, BimError> {
        if from.is_empty() {
            return Err(BimError::InvalidArgument("from_address is empty".into()));
        }
        self.check_disk()?;
        if let Some(img) = self.existing(&spec)? {
            return Ok(img);
        }
        let paths = self.paths(&spec.name, &spec.uuid);
        let (p, s) = (paths.clone(), spec.clone());
        if let Reuse::Reused(cfg) = blocking(move || try_reuse(&p, &s, None)).await? {
            return self.register_ready(&spec, &cfg);
        }
        let mut peer = connect(from).await?;
        let req = v1::BimImageRef {
            name: spec.name.clone(),
            uuid: spec.uuid.clone(),
        };
        let remote = tokio::time::timeout(Duration::from_secs(5), peer.get(req))
            .await
            .map_err(|_| {
                BimError::Peer(format!(
                    "{from} did not answer within 5 s: is it a backing-image manager?"
                ))
            })?
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => BimError::FailedPrecondition(format!(
                    "{from} does not hold {}: {}",
                    spec.name,
                    s.message()
                )),
                _ => BimError::Peer(format!(
                    "{from} is not a backing-image manager that can send {} ({:?}: {})",
                    spec.name,
                    s.code(),
                    s.message()
                )),
            })?
            .into_inner();
        let st = remote.status.unwrap_or_default();
        if st.state != FileState::Ready.as_str() {
            return Err(BimError::FailedPrecondition(format!(
                "{from} holds {} in state {}, not ready",
                spec.name, st.state
            )));
        }
        if spec.size != 0 && st.size != spec.size {
            return Err(BimError::InvalidArgument(format!(
                "the spec says {} bytes, the copy at {from} has {}",
                spec.size, st.size
            )));
        }
        if !spec.checksum.is_empty() && st.current_checksum != spec.checksum {
            return Err(BimError::InvalidArgument(format!(
                "the spec expects SHA-512 {}, the copy at {from} has {}",
                spec.checksum, st.current_checksum
            )));
        }
        let (lease, receiver) = self.bind_receiver(&paths.temp).await?;
        let Registered::New { generation, cancel } = self.register(&spec, FileState::Starting, from)? else {
            return self.get(&spec.name, &spec.uuid);
        };
        let p = paths.clone();
        let prepared = blocking(move || {
            p.remove_all()
                .and_then(|()| p.create_dir())
                .map_err(|e| BimError::io("prepare", &p.dir, e))
        })
        .await;
        if let Err(e) = prepared {
            self.fail(&spec.name, generation, e.to_string()).await;
            return Err(e);
        }
        self.metrics.syncs.inc();
        info!(image = %spec.name, uuid = %spec.uuid, from, port = lease.port(), "sync started");
        let job = SyncJob {
            spec: spec.clone(),
            generation,
            from: from.to_owned(),
            peer,
            source: st,
            lease,
            receiver,
            cancel,
        };
        let m = self.clone();
        self.tasks
            .spawn(async move { m.run_sync(job).await }.instrument(tracing::Span::current()));
        self.get(&spec.name, &spec.uuid)
    }

    /// Leases a port of the range and binds a receiver on it; ports other processes hold are skipped.
    async fn bind_receiver(&self, target: &Path) -> Result<(PortLease, Receiver), BimError> {
        let mut busy = BTreeSet::new();
        loop {
            let Some(lease) = self.ports.lease(&busy) else {
                return Err(BimError::ResourceExhausted(format!(
                    "no free port in the receiver range {}: {} held by syncs of this manager, {} by other processes",
                    self.ports.range(),
                    self.ports.in_use(),
                    busy.len()
                )));
            };
            let mut rc = ReceiverConfig::new(target);
            rc.idle_timeout = self.cfg.sync_idle_timeout;
            match Receiver::bind(SocketAddr::new(self.cfg.receiver_ip, lease.port()), rc).await {
                Ok(r) => return Ok((lease, r)),
                Err(ReceiveError::Bind { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
                    busy.insert(lease.port());
                }
                Err(e) => return Err(BimError::Internal(format!("sync receiver: {e}"))),
            }
        }
    }

    async fn run_sync(self: Arc<Self>, job: SyncJob) {
        let SyncJob {
            spec,
            generation,
            from,
            mut peer,
            source,
            lease,
            receiver,
            cancel,
        } = job;
        let name = spec.name.clone();
        let to = format!("{}:{}", self.cfg.advertise_host, lease.port());
        let rcancel = cancel.child_token();
        let mut recv = tokio::spawn(receiver.run(rcancel.clone()));
        self.update(&name, generation, |i| i.state = FileState::InProgress);

        // Progress: allocated bytes of the partial file against the source's allocated bytes.
        let ticker_stop = CancellationToken::new();
        let ticker = {
            let (m, stop, partial) = (
                self.clone(),
                ticker_stop.clone(),
                self.paths(&spec.name, &spec.uuid).partial,
            );
            let (total, name) = (source.real_size.max(1), name.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(300)) => {}
                    }
                    let p = partial.clone();
                    if let Ok(Ok(Some(f))) = tokio::task::spawn_blocking(move || files::facts(&p)).await {
                        m.set_progress(
                            &name,
                            generation,
                            scale(percent(f.real_size, total), 0, SYNC_VERIFY_PROGRESS),
                        );
                    }
                }
            })
        };

        let req = v1::BimSendRequest {
            name: spec.name.clone(),
            uuid: spec.uuid.clone(),
            to_address: to,
        };
        let send = peer.send(req);
        tokio::pin!(send);
        let received =
            |r: Result<Result<sparse_sync::ReceiveSummary, ReceiveError>, tokio::task::JoinError>| match r {
                Ok(Ok(s)) if s.outcome == ReceiveOutcome::Completed => Ok(s),
                Ok(Ok(s)) => Err(format!(
                    "the receiver ended without a complete transfer ({:?})",
                    s.outcome
                )),
                Ok(Err(e)) => Err(format!("receiver: {e}")),
                Err(e) => Err(format!("receiver task: {e}")),
            };
        let outcome: Result<sparse_sync::ReceiveSummary, String> = tokio::select! {
            r = &mut send => match r {
                Ok(_) => received((&mut recv).await),
                Err(s) => {
                    rcancel.cancel();
                    let _ = (&mut recv).await;
                    Err(format!("the sender {from} failed: {}", s.message()))
                }
            },
            r = &mut recv => match received(r) {
                // The data is in; the sender's answer should follow at once. A peer that never answers must not
                // keep the image in-progress (and its port leased) for ever, nor outlive a Delete or shutdown.
                Ok(summary) => tokio::select! {
                    r = &mut send => match r {
                        Ok(_) => Ok(summary),
                        Err(s) => Err(format!("the sender {from} failed: {}", s.message())),
                    },
                    () = tokio::time::sleep(self.cfg.sync_idle_timeout) => Err(format!(
                        "the sender {from} did not confirm the transfer within {:?}",
                        self.cfg.sync_idle_timeout
                    )),
                    () = cancel.cancelled() => Err("cancelled".to_owned()),
                },
                // Name the peer: a receiver that ends early usually means the sender went away.
                Err(e) => Err(format!("the transfer from the sender {from} broke off: {e}")),
            },
            () = cancel.cancelled() => {
                rcancel.cancel();
                let _ = (&mut recv).await;
                Err("cancelled".to_owned())
            }
        };
        ticker_stop.cancel();
        let _ = ticker.await;
        // The receiver's server is gone in every branch: its port can go back to the range.
        drop(lease);
        match outcome {
            Ok(summary) => {
                self.metrics.received_bytes.inc_by(summary.bytes_written);
                info!(image = %name, written = summary.bytes_written, holes = summary.hole_bytes_punched, "received; verifying");
                self.spawn_commit(
                    spec,
                    generation,
                    source.current_checksum,
                    cancel,
                    SYNC_VERIFY_PROGRESS,
                );
            }
            Err(e) => self.fail(&name, generation, e).await,
        }
    }

    /// Send: feeds a ready image to a sparse-sync receiver; at most [`SEND_LIMIT`] at once per image.
    pub async fn send(
        self: &Arc<Self>,
        name: &str,
        uuid: &str,
        to: &str,
    ) -> Result<v1::BimSendResponse, BimError> {
        check_ref(name, uuid)?;
        if to.is_empty() {
            return Err(BimError::InvalidArgument("to_address is empty".into()));
        }
        let (generation, paths, mtime, cancel) = {
            let mut reg = self.lock();
            if let Some(p) = &reg.disk_problem {
                return Err(BimError::DiskUnavailable(p.clone()));
            }
            let img = reg
                .images
                .get_mut(name)
                .filter(|i| i.spec.uuid == uuid)
                .ok_or_else(|| {
                    BimError::NotFound(format!("image {name} with uuid {uuid} is not on this disk"))
                })?;
            if img.state != FileState::Ready {
                return Err(BimError::FailedPrecondition(format!(
                    "image {name} is {}, not ready",
                    img.state
                )));
            }
            if img.sending >= SEND_LIMIT {
                return Err(BimError::ResourceExhausted(format!(
                    "image {name} already feeds {SEND_LIMIT} syncs; retry when one ends"
                )));
            }
            img.sending += 1;
            let r = (
                img.generation,
                ImagePaths::new(&self.cfg.disk_path, name, uuid),
                img.modification_time.clone(),
                img.cancel.child_token(),
            );
            self.emit(&reg, name);
            r
        };
        let _guard = SendingGuard {
            manager: self.clone(),
            name: name.to_owned(),
            generation,
        };
        let p = paths.clone();
        let content = blocking(move || {
            let content = FileContent::open(&p.backing, LayoutMode::SeekData)
                .map_err(|e| BimError::io("open", &p.backing, e))?;
            let now = files::facts(&p.backing).map_err(|e| BimError::io("stat", &p.backing, e))?;
            if now.map(|f| f.modification_time) != Some(mtime) {
                return Err(BimError::FailedPrecondition(format!(
                    "{} changed on disk since it was verified",
                    p.backing.display()
                )));
            }
            Ok(content)
        })
        .await?;
        let opts = SendOptions {
            max_rate: self.cfg.send_max_rate,
            ..SendOptions::default()
        };
        let s = sparse_sync::send(Arc::new(content), to, &opts, &Progress::new(), &cancel)
            .await
            .map_err(|e| BimError::Peer(format!("sending {name} to {to}: {e}")))?;
        self.metrics.sends.inc();
        self.metrics.send_bytes.inc_by(s.bytes_sent);
        info!(
            image = name,
            to,
            bytes_sent = s.bytes_sent,
            holes = s.hole_bytes,
            "sent"
        );
        Ok(v1::BimSendResponse {
            bytes_sent: s.bytes_sent,
            data_bytes: s.data_bytes,
            hole_bytes: s.hole_bytes,
            duration_ms: s.duration_ms,
        })
    }
}

struct SyncJob {
    spec: ImageSpec,
    generation: u64,
    from: String,
    peer: BimClient,
    source: v1::BimImageStatus,
    lease: PortLease,
    receiver: Receiver,
    cancel: CancellationToken,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_shares_map_onto_their_ranges() {
        assert_eq!(percent(50, 100), 50);
        assert_eq!(percent(5, 0), 100);
        assert_eq!(scale(100, 0, SYNC_VERIFY_PROGRESS), SYNC_VERIFY_PROGRESS);
        assert_eq!(scale(0, SYNC_VERIFY_PROGRESS, 99), SYNC_VERIFY_PROGRESS);
        assert_eq!(scale(100, SYNC_VERIFY_PROGRESS, 99), 99);
        assert_eq!(scale(255, 0, 99), 99);
    }
}
