//! The registry of the images on this disk: their states, the change events watchers receive, the disk identity
//! check, adoption of existing files at start (live upgrade) and the background check that re-verifies files
//! whose mtime changed. Fetch, Sync and Send live in `transfer`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use corral_daemon::disk::{check_path_component, sync_parent_dir, verify_disk};
use corral_proto::v1;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, warn};

use crate::checksum::{check_checksum_syntax, sha512_file};
use crate::error::BimError;
use crate::files::{self, BackingConfig, IMAGES_DIR, ImagePaths};
use crate::metrics::Metrics;
use crate::ports::{PortAllocator, PortRange};
use crate::state::FileState;

/// How a manager runs.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The disk directory (holds `corral-disk.cfg`).
    pub disk_path: PathBuf,
    /// The UUID `corral-disk.cfg` must name.
    pub disk_uuid: String,
    /// Ports sync receivers listen on.
    pub port_range: PortRange,
    /// Address sync receivers bind.
    pub receiver_ip: IpAddr,
    /// Host name or IP other managers reach this one at.
    pub advertise_host: String,
    /// `HOST:PORT` of the HTTP server as others reach it.
    pub http_address: String,
    /// Period of the disk and file check.
    pub check_interval: Duration,
    /// A sync receiver that hears nothing for this long gives up.
    pub sync_idle_timeout: Duration,
    /// Upper bound of data bytes per second of one send (None: unlimited).
    pub send_max_rate: Option<u64>,
}

/// What a caller asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    pub name: String,
    pub uuid: String,
    /// 0 = unknown.
    pub size: u64,
    /// Expected SHA-512; empty = none.
    pub checksum: String,
}

impl ImageSpec {
    /// Checks a spec from the wire: names that stay one path component, a well-formed checksum.
    pub fn from_proto(spec: Option<v1::BimImageSpec>) -> Result<Self, BimError> {
        let s = spec.ok_or_else(|| BimError::InvalidArgument("spec is missing".into()))?;
        check_ref(&s.name, &s.uuid)?;
        check_checksum_syntax(&s.checksum).map_err(BimError::InvalidArgument)?;
        Ok(ImageSpec {
            name: s.name,
            uuid: s.uuid,
            size: s.size,
            checksum: s.checksum,
        })
    }

    pub fn to_proto(&self) -> v1::BimImageSpec {
        v1::BimImageSpec {
            name: self.name.clone(),
            uuid: self.uuid.clone(),
            size: self.size,
            checksum: self.checksum.clone(),
        }
    }
}

/// Checks a name and uuid that become a directory name.
pub fn check_ref(name: &str, uuid: &str) -> Result<(), BimError> {
    check_path_component("image name", name).map_err(BimError::InvalidArgument)?;
    check_path_component("image uuid", uuid).map_err(BimError::InvalidArgument)
}

/// One image in memory.
#[derive(Debug)]
pub(crate) struct Image {
    pub(crate) spec: ImageSpec,
    /// Distinguishes registrations of the same name, so a job of a deleted or replaced image changes nothing.
    pub(crate) generation: u64,
    pub(crate) state: FileState,
    pub(crate) message: String,
    pub(crate) progress: u8,
    pub(crate) current_checksum: String,
    pub(crate) sending: u32,
    pub(crate) sender_address: String,
    pub(crate) size: u64,
    pub(crate) virtual_size: u64,
    pub(crate) real_size: u64,
    /// mtime of `backing` when it was verified.
    pub(crate) modification_time: String,
    /// A fetch, sync or verification runs on the image.
    pub(crate) busy: bool,
    pub(crate) cancel: CancellationToken,
}

impl Image {
    pub(crate) fn new(
        spec: ImageSpec,
        generation: u64,
        state: FileState,
        parent: &CancellationToken,
    ) -> Self {
        Image {
            spec,
            generation,
            state,
            message: String::new(),
            progress: 0,
            current_checksum: String::new(),
            sending: 0,
            sender_address: String::new(),
            size: 0,
            virtual_size: 0,
            real_size: 0,
            modification_time: String::new(),
            busy: false,
            cancel: parent.child_token(),
        }
    }

    pub(crate) fn set_ready(&mut self, cfg: &BackingConfig) {
        self.state = FileState::Ready;
        self.message.clear();
        self.progress = 100;
        self.current_checksum.clone_from(&cfg.current_checksum);
        self.size = cfg.size;
        self.virtual_size = cfg.virtual_size;
        self.real_size = cfg.real_size;
        self.modification_time.clone_from(&cfg.modification_time);
        self.busy = false;
    }
}

pub(crate) struct Registry {
    pub(crate) images: BTreeMap<String, Image>,
    /// Why the disk cannot be verified; `Some` reports every image unknown and freezes file changes.
    pub(crate) disk_problem: Option<String>,
    next_generation: u64,
}

impl Registry {
    pub(crate) fn next_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    /// The registered image of another name whose directory `<name>-<uuid>` is also the directory of `name`/`uuid`
    /// (`a`/`b-c` and `a-b`/`c` share `a-b-c`): its files must not be taken, rewritten or removed for `name`.
    pub(crate) fn dir_owner(&self, name: &str, uuid: &str) -> Option<&Image> {
        let dir = files::dir_name(name, uuid);
        self.images
            .values()
            .find(|i| i.spec.name != name && files::dir_name(&i.spec.name, &i.spec.uuid) == dir)
    }
}

/// The manager of one disk.
pub struct Manager {
    pub(crate) cfg: ManagerConfig,
    registry: Mutex<Registry>,
    events: broadcast::Sender<v1::BimImageEvent>,
    pub(crate) ports: PortAllocator,
    pub(crate) metrics: Metrics,
    pub(crate) cancel: CancellationToken,
    pub(crate) tasks: TaskTracker,
}

impl Manager {
    /// Checks the disk identity (refusing another disk's directory) and adopts every image recorded on it.
    pub async fn open(cfg: ManagerConfig, cancel: CancellationToken) -> Result<Arc<Self>, BimError> {
        let (disk, uuid) = (cfg.disk_path.clone(), cfg.disk_uuid.clone());
        let adopted = tokio::task::spawn_blocking(move || {
            verify_disk(&disk, &uuid).map_err(|e| BimError::DiskUnavailable(e.to_string()))?;
            adopt(&disk)
        })
        .await
        .map_err(|e| BimError::Internal(e.to_string()))??;
        let (events, _) = broadcast::channel(1024);
        let m = Arc::new(Manager {
            ports: PortAllocator::new(cfg.port_range),
            cfg,
            registry: Mutex::new(Registry {
                images: BTreeMap::new(),
                disk_problem: None,
                next_generation: 0,
            }),
            events,
            metrics: Metrics::default(),
            cancel,
            tasks: TaskTracker::new(),
        });
        {
            let mut reg = m.lock();
            for (cfg, state, message) in adopted {
                let generation = reg.next_generation();
                let spec = ImageSpec {
                    name: cfg.name.clone(),
                    uuid: cfg.uuid.clone(),
                    size: cfg.size,
                    checksum: cfg.expected_checksum.clone(),
                };
                let mut img = Image::new(spec, generation, state, &m.cancel);
                img.set_ready(&cfg);
                img.state = state;
                img.message = message;
                reg.images.insert(cfg.name.clone(), img);
            }
        }
        Ok(m)
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn paths(&self, name: &str, uuid: &str) -> ImagePaths {
        ImagePaths::new(&self.cfg.disk_path, name, uuid)
    }

    /// The wire form of an image, as the disk state makes it look.
    pub(crate) fn image_proto(&self, img: &Image, disk_problem: Option<&str>) -> v1::BimImage {
        let (state, message) = match disk_problem {
            Some(p) => (FileState::Unknown, p.to_owned()),
            None => (img.state, img.message.clone()),
        };
        v1::BimImage {
            spec: Some(img.spec.to_proto()),
            status: Some(v1::BimImageStatus {
                state: state.as_str().to_owned(),
                message,
                progress: u32::from(img.progress),
                current_checksum: img.current_checksum.clone(),
                sending_reference: img.sending,
                sender_address: img.sender_address.clone(),
                size: img.size,
                virtual_size: img.virtual_size,
                real_size: img.real_size,
            }),
            disk_uuid: self.cfg.disk_uuid.clone(),
            path: self
                .paths(&img.spec.name, &img.spec.uuid)
                .backing
                .display()
                .to_string(),
        }
    }

    /// Tells watchers about `name` (call with the registry locked, after the change).
    pub(crate) fn emit(&self, reg: &Registry, name: &str) {
        if let Some(img) = reg.images.get(name) {
            let image = self.image_proto(img, reg.disk_problem.as_deref());
            let _ = self.events.send(v1::BimImageEvent {
                image: Some(image),
                deleted: false,
                resync: false,
            });
        }
    }

    fn emit_all(&self, reg: &Registry) {
        for name in reg.images.keys() {
            self.emit(reg, name);
        }
    }

    /// Applies `f` to the image if it is still registration `generation`, and tells watchers.
    pub(crate) fn update(&self, name: &str, generation: u64, f: impl FnOnce(&mut Image)) -> bool {
        let mut reg = self.lock();
        match reg.images.get_mut(name) {
            Some(img) if img.generation == generation => {
                f(img);
                self.emit(&reg, name);
                true
            }
            _ => false,
        }
    }

    /// Sets the progress without an event when the percentage did not move.
    pub(crate) fn set_progress(&self, name: &str, generation: u64, progress: u8) {
        let moved = {
            let reg = self.lock();
            reg.images
                .get(name)
                .is_some_and(|i| i.generation == generation && i.progress != progress)
        };
        if moved {
            self.update(name, generation, |i| i.progress = progress);
        }
    }

    /// Marks the image failed and removes its files (not when the disk cannot be verified: then nothing is touched).
    pub(crate) async fn fail(&self, name: &str, generation: u64, message: String) {
        // The files go first and the state after: a client that sees `failed` (and retries at once) finds no
        // leftovers, and its retry cannot race with this removal (the image stays busy until then).
        let (paths, disk_ok) = {
            let reg = self.lock();
            match reg.images.get(name) {
                Some(img) if img.generation == generation => {
                    (self.paths(name, &img.spec.uuid), reg.disk_problem.is_none())
                }
                _ => return,
            }
        };
        warn!(image = name, error = %message, "backing image failed");
        // The daemon stopping leaves the files: the next start removes temp files and re-adopts the rest.
        if disk_ok && !self.cancel.is_cancelled() {
            let _ = tokio::task::spawn_blocking(move || {
                if let Err(e) = paths.remove_all() {
                    warn!(dir = %paths.dir.display(), error = %e, "cannot remove the files of a failed image");
                }
            })
            .await;
        }
        let current = self.update(name, generation, |i| {
            i.state = FileState::Failed;
            i.message.clone_from(&message);
            i.progress = 0;
            i.busy = false;
        });
        if current && !self.cancel.is_cancelled() {
            self.metrics.failures.inc();
        }
    }

    /// Watch stream source.
    pub fn subscribe(&self) -> broadcast::Receiver<v1::BimImageEvent> {
        self.events.subscribe()
    }

    /// Refuses changes while the disk identity is unverified.
    pub(crate) fn check_disk(&self) -> Result<(), BimError> {
        match &self.lock().disk_problem {
            Some(p) => Err(BimError::DiskUnavailable(p.clone())),
            None => Ok(()),
        }
    }

    pub fn get(&self, name: &str, uuid: &str) -> Result<v1::BimImage, BimError> {
        check_path_component("image name", name).map_err(BimError::InvalidArgument)?;
        let reg = self.lock();
        match reg.images.get(name) {
            Some(img) if uuid.is_empty() || img.spec.uuid == uuid => {
                Ok(self.image_proto(img, reg.disk_problem.as_deref()))
            }
            Some(img) => Err(BimError::NotFound(format!(
                "image {name} with uuid {uuid} (this disk holds uuid {})",
                img.spec.uuid
            ))),
            None => Err(BimError::NotFound(format!("image {name} is not on this disk"))),
        }
    }

    pub fn list(&self) -> v1::BimImageList {
        let reg = self.lock();
        v1::BimImageList {
            images: reg
                .images
                .values()
                .map(|i| self.image_proto(i, reg.disk_problem.as_deref()))
                .collect(),
            disk_uuid: self.cfg.disk_uuid.clone(),
            disk_message: reg.disk_problem.clone().unwrap_or_default(),
        }
    }

    /// Counts of images per reported state (metrics).
    pub fn state_counts(&self) -> BTreeMap<FileState, u64> {
        let reg = self.lock();
        let mut out = BTreeMap::new();
        for img in reg.images.values() {
            let st = if reg.disk_problem.is_some() {
                FileState::Unknown
            } else {
                img.state
            };
            *out.entry(st).or_default() += 1;
        }
        out
    }

    /// Stops work on the image and removes its directory. An image that is not registered but has a directory on
    /// the disk (a leftover) is removed too.
    pub async fn delete(&self, name: &str, uuid: &str) -> Result<(), BimError> {
        check_ref(name, uuid)?;
        self.check_disk()?;
        {
            let mut reg = self.lock();
            if let Some(img) = reg.images.get(name) {
                if img.spec.uuid != uuid {
                    return Err(BimError::NotFound(format!(
                        "image {name} with uuid {uuid} (this disk holds uuid {})",
                        img.spec.uuid
                    )));
                }
                img.cancel.cancel();
                let img = reg.images.remove(name).map(|i| self.image_proto(&i, None));
                let _ = self.events.send(v1::BimImageEvent {
                    image: img,
                    deleted: true,
                    resync: false,
                });
            } else if let Some(owner) = reg.dir_owner(name, uuid) {
                return Err(BimError::NotFound(format!(
                    "image {name} with uuid {uuid} is not on this disk (its directory {} belongs to image {} with uuid {})",
                    files::dir_name(name, uuid),
                    owner.spec.name,
                    owner.spec.uuid
                )));
            }
        }
        let paths = self.paths(name, uuid);
        tokio::task::spawn_blocking(move || {
            paths
                .remove_all()
                .map_err(|e| BimError::io("remove", &paths.dir, e))
        })
        .await
        .map_err(|e| BimError::Internal(e.to_string()))??;
        info!(image = name, uuid, "backing image deleted");
        Ok(())
    }

    /// The file to serve for a download of `name`: only a ready image whose file still has the verified mtime.
    /// Returns its path, size and verified SHA-512.
    pub async fn download_target(&self, name: &str) -> Result<(PathBuf, u64, String), BimError> {
        check_path_component("image name", name).map_err(BimError::InvalidArgument)?;
        let (path, mtime, size, checksum) = {
            let reg = self.lock();
            if let Some(p) = &reg.disk_problem {
                return Err(BimError::DiskUnavailable(p.clone()));
            }
            let img = reg
                .images
                .get(name)
                .ok_or_else(|| BimError::NotFound(format!("image {name} is not on this disk")))?;
            if img.state != FileState::Ready {
                return Err(BimError::FailedPrecondition(format!(
                    "image {name} is {}, not ready: {}",
                    img.state, img.message
                )));
            }
            (
                self.paths(name, &img.spec.uuid).backing,
                img.modification_time.clone(),
                img.size,
                img.current_checksum.clone(),
            )
        };
        let p = path.clone();
        let now = tokio::task::spawn_blocking(move || files::facts(&p))
            .await
            .map_err(|e| BimError::Internal(e.to_string()))?
            .map_err(|e| BimError::io("stat", &path, e))?;
        match now {
            Some(f) if f.modification_time == mtime && f.size == size => Ok((path, size, checksum)),
            _ => Err(BimError::FailedPrecondition(format!(
                "image {name} changed on disk since it was verified; it is being checked again"
            ))),
        }
    }

    /// Runs the disk and file check every `check_interval` until cancelled.
    pub async fn run_checks(self: Arc<Self>) {
        loop {
            self.check_once().await;
            tokio::select! {
                () = self.cancel.cancelled() => return,
                () = tokio::time::sleep(self.cfg.check_interval) => {}
            }
        }
    }

    /// One pass: the disk identity, then every ready file's presence and mtime. A file whose mtime changed is
    /// re-hashed in the background (unknown meanwhile); a missing one fails.
    pub async fn check_once(self: &Arc<Self>) {
        let (disk, uuid) = (self.cfg.disk_path.clone(), self.cfg.disk_uuid.clone());
        let verified =
            tokio::task::spawn_blocking(move || verify_disk(&disk, &uuid).map_err(|e| e.to_string()))
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
        {
            let mut reg = self.lock();
            let problem = verified.err();
            if problem != reg.disk_problem {
                match &problem {
                    Some(p) => {
                        warn!(problem = %p, "disk identity lost: every image is unknown, no file is touched");
                    }
                    None => info!("disk identity verified again"),
                }
                reg.disk_problem = problem;
                self.emit_all(&reg);
            }
            if reg.disk_problem.is_some() {
                return;
            }
        }
        // Ready images, and those a failed stat left unknown (not busy: no job runs on them).
        let candidates: Vec<(String, u64, String, u64, PathBuf, FileState)> = {
            let reg = self.lock();
            reg.images
                .values()
                .filter(|i| matches!(i.state, FileState::Ready | FileState::Unknown) && !i.busy)
                .map(|i| {
                    (
                        i.spec.name.clone(),
                        i.generation,
                        i.modification_time.clone(),
                        i.size,
                        self.paths(&i.spec.name, &i.spec.uuid).backing,
                        i.state,
                    )
                })
                .collect()
        };
        for (name, generation, mtime, size, backing, state) in candidates {
            let p = backing.clone();
            let facts = tokio::task::spawn_blocking(move || files::facts(&p))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match facts {
                Ok(Some(f)) if f.modification_time == mtime && f.size == size => {
                    if state == FileState::Unknown {
                        info!(image = %name, "backing file can be checked again: unchanged");
                        self.update(&name, generation, |i| {
                            i.state = FileState::Ready;
                            i.message.clear();
                        });
                    }
                }
                Ok(Some(_)) => self.reverify(&name, generation),
                Ok(None) => {
                    self.fail(&name, generation, format!("{} disappeared", backing.display()))
                        .await;
                }
                // A stat that fails (EIO, EACCES, a file replaced by something else) says nothing about the data:
                // the image is unknown (not served) and its files stay until a check can tell.
                Err(e) => {
                    let message = format!("cannot stat {}: {e}", backing.display());
                    if state == FileState::Ready {
                        warn!(image = %name, error = %message, "backing file cannot be checked");
                    }
                    self.update(&name, generation, |i| {
                        i.state = FileState::Unknown;
                        i.message = message;
                    });
                }
            }
        }
    }

    /// The file changed under a ready image: unknown while hashing; ready if the content is what was verified,
    /// failed otherwise.
    fn reverify(self: &Arc<Self>, name: &str, generation: u64) {
        let mut job = None;
        self.update(name, generation, |i| {
            i.state = FileState::Unknown;
            i.message = "backing file modified on disk: verifying its checksum again".into();
            i.busy = true;
            job = Some((i.spec.clone(), i.current_checksum.clone(), i.cancel.clone()));
        });
        let Some((spec, verified, cancel)) = job else {
            return;
        };
        warn!(image = name, "backing file modified on disk: re-verifying");
        self.metrics.reverifications.inc();
        let m = self.clone();
        let name = name.to_owned();
        let span = tracing::info_span!("reverify", image = %name, uuid = %spec.uuid);
        self.tasks.spawn(
            async move {
                let paths = m.paths(&spec.name, &spec.uuid);
                let expected = spec.checksum.clone();
                let r = tokio::task::spawn_blocking(move || -> Result<BackingConfig, String> {
                    let (sum, facts) =
                        sha512_file(&paths.backing, &cancel, |_, _| {}).map_err(|e| e.to_string())?;
                    if sum != verified || (!expected.is_empty() && sum != expected) {
                        return Err(format!(
                            "backing file corrupted: its SHA-512 is now {sum}, verified was {verified}"
                        ));
                    }
                    let cfg = BackingConfig::verified(
                        &spec.name,
                        &spec.uuid,
                        &expected,
                        sum,
                        facts,
                        &paths.backing,
                    );
                    files::write_config(&paths.config, &cfg).map_err(|e| e.to_string())?;
                    Ok(cfg)
                })
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
                match r {
                    Ok(cfg) => {
                        info!(image = %name, "modified backing file verified: content unchanged");
                        m.update(&name, generation, |i| i.set_ready(&cfg));
                    }
                    Err(e) => m.fail(&name, generation, e).await,
                }
            }
            .instrument(span),
        );
    }
}

/// Reads every `backing.cfg` on the disk (blocking): each image comes back ready as recorded (the first check
/// compares mtimes), or failed when its file is gone. Temp files of interrupted work are removed.
fn adopt(disk: &Path) -> Result<Vec<(BackingConfig, FileState, String)>, BimError> {
    let root = disk.join(IMAGES_DIR);
    let entries = match std::fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(BimError::io("read", &root, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| BimError::io("read", &root, e))?;
        let dir = entry.path();
        if !dir.is_dir() {
            continue;
        }
        let cfg_path = dir.join(files::CONFIG_FILE);
        let cfg = match files::read_config(&cfg_path) {
            Ok(Some(c)) => c,
            Ok(None) => {
                // Work that never finished: its temp files go, an emptied directory too.
                let _ = remove_leftovers(&dir);
                continue;
            }
            Err(e) => {
                warn!(path = %cfg_path.display(), error = %e, "unreadable backing.cfg: leaving the directory alone");
                continue;
            }
        };
        let dir_ok = check_ref(&cfg.name, &cfg.uuid).is_ok()
            && entry.file_name().to_str() == Some(files::dir_name(&cfg.name, &cfg.uuid).as_str());
        if !dir_ok {
            warn!(path = %cfg_path.display(), "backing.cfg does not match its directory name: ignored");
            continue;
        }
        let paths = ImagePaths::new(disk, &cfg.name, &cfg.uuid);
        if let Err(e) = finish_interrupted_commit(&paths, &cfg) {
            warn!(path = %paths.temp.display(), error = %e, "cannot finish the rename of a verified file");
        }
        let _ = paths.remove_temp_files();
        let (state, message) = match files::facts(&paths.backing) {
            Ok(Some(_)) => (FileState::Ready, String::new()),
            Ok(None) => (
                FileState::Failed,
                format!("{} is missing", paths.backing.display()),
            ),
            Err(e) => (
                FileState::Failed,
                format!("cannot stat {}: {e}", paths.backing.display()),
            ),
        };
        info!(image = %cfg.name, uuid = %cfg.uuid, state = %state, "adopted backing image from backing.cfg");
        out.push((cfg, state, message));
    }
    Ok(out)
}

/// `backing.cfg` is written before the verified `backing.tmp` is renamed onto `backing` (the rename keeps the mtime
/// the config records): a crash between the two leaves the verified file under its temporary name. When `backing`
/// is missing and `backing.tmp` has the recorded size and mtime, the rename is finished instead of the file removed.
fn finish_interrupted_commit(paths: &ImagePaths, cfg: &BackingConfig) -> std::io::Result<()> {
    if files::facts(&paths.backing)?.is_some() {
        return Ok(());
    }
    match files::facts(&paths.temp)? {
        Some(f) if f.size == cfg.size && f.modification_time == cfg.modification_time => {
            std::fs::rename(&paths.temp, &paths.backing)?;
            sync_parent_dir(&paths.backing)?;
            info!(image = %cfg.name, uuid = %cfg.uuid, "finished the interrupted rename of a verified backing file");
        }
        _ => {}
    }
    Ok(())
}

fn remove_leftovers(dir: &Path) -> std::io::Result<()> {
    for f in [files::TEMP_FILE, "backing.tmp.sync-partial", "backing.cfg.tmp"] {
        files::remove_if_exists(&dir.join(f))?;
    }
    if std::fs::read_dir(dir)?.next().is_none() {
        std::fs::remove_dir(dir)?;
        info!(dir = %dir.display(), "removed the directory of an unfinished fetch or sync");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(disk: &Path) -> ManagerConfig {
        ManagerConfig {
            disk_path: disk.to_owned(),
            disk_uuid: "disk-1".into(),
            port_range: "40000-40001".parse().unwrap(),
            receiver_ip: IpAddr::from([127, 0, 0, 1]),
            advertise_host: "127.0.0.1".into(),
            http_address: "127.0.0.1:1".into(),
            check_interval: Duration::from_secs(3600),
            sync_idle_timeout: Duration::from_secs(5),
            send_max_rate: None,
        }
    }

    /// A disk holding `backing.tmp` verified and recorded in `backing.cfg`, as `verify_and_commit` leaves it just
    /// before its rename.
    fn verified_temp(disk: &Path, name: &str, uuid: &str, content: &[u8]) -> ImagePaths {
        corral_daemon::disk::write_disk_config(disk, "disk-1").unwrap();
        let paths = ImagePaths::new(disk, name, uuid);
        paths.create_dir().unwrap();
        std::fs::write(&paths.temp, content).unwrap();
        let (sum, facts) = sha512_file(&paths.temp, &CancellationToken::new(), |_, _| {}).unwrap();
        let cfg = BackingConfig::verified(name, uuid, "", sum, facts, &paths.temp);
        files::write_config(&paths.config, &cfg).unwrap();
        paths
    }

    fn state_of(m: &Manager, name: &str) -> String {
        m.get(name, "").unwrap().status.unwrap().state
    }

    #[tokio::test]
    async fn a_crash_between_config_and_rename_keeps_the_verified_file() {
        let disk = tempfile::tempdir().unwrap();
        let paths = verified_temp(disk.path(), "img", "u1", b"verified content");
        let m = Manager::open(config(disk.path()), CancellationToken::new())
            .await
            .unwrap();
        m.check_once().await;
        assert_eq!(state_of(&m, "img"), "ready");
        assert_eq!(std::fs::read(&paths.backing).unwrap(), b"verified content");
        assert!(!paths.temp.exists());
    }

    #[tokio::test]
    async fn a_failing_stat_leaves_the_image_unknown_and_its_files_alone() {
        let disk = tempfile::tempdir().unwrap();
        let paths = verified_temp(disk.path(), "img", "u1", b"verified content");
        let aside = paths.dir.join("aside");
        std::fs::rename(&paths.temp, &paths.backing).unwrap();
        let m = Manager::open(config(disk.path()), CancellationToken::new())
            .await
            .unwrap();
        m.check_once().await;
        assert_eq!(state_of(&m, "img"), "ready");
        // `backing` becomes a symlink loop: stat fails with ELOOP.
        std::fs::rename(&paths.backing, &aside).unwrap();
        std::os::unix::fs::symlink(&paths.backing, &paths.backing).unwrap();
        m.check_once().await;
        m.check_once().await;
        assert_eq!(state_of(&m, "img"), "unknown");
        assert!(m.download_target("img").await.is_err());
        assert_eq!(std::fs::read(&aside).unwrap(), b"verified content");
        // The file is back as it was verified: ready again, without hashing.
        std::fs::remove_file(&paths.backing).unwrap();
        std::fs::rename(&aside, &paths.backing).unwrap();
        m.check_once().await;
        assert_eq!(state_of(&m, "img"), "ready");
        assert!(m.download_target("img").await.is_ok());
    }

    #[tokio::test]
    async fn names_sharing_a_directory_cannot_take_or_remove_each_others_files() {
        let disk = tempfile::tempdir().unwrap();
        let a = verified_temp(disk.path(), "a", "b-c", b"image a");
        std::fs::rename(&a.temp, &a.backing).unwrap();
        let m = Manager::open(config(disk.path()), CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(state_of(&m, "a"), "ready");
        let other = ImageSpec {
            name: "a-b".into(),
            uuid: "c".into(),
            size: 0,
            checksum: String::new(),
        };
        let e = m.fetch(other, "").await.unwrap_err();
        assert!(matches!(e, BimError::AlreadyExists(_)), "{e:?}");
        let e = m.delete("a-b", "c").await.unwrap_err();
        assert!(matches!(e, BimError::NotFound(_)), "{e:?}");
        m.tasks.close();
        m.tasks.wait().await;
        assert_eq!(std::fs::read(&a.backing).unwrap(), b"image a");
        assert_eq!(files::read_config(&a.config).unwrap().unwrap().name, "a");
        assert_eq!(state_of(&m, "a"), "ready");
        assert!(m.get("a-b", "").is_err());
    }
}
