//! The manager of one disk: the registry of its images and their states, the change events watchers receive,
//! registration of new work, and the reads callers make (get, list, the file to download). The work on images is
//! in its own modules: `fetch`, `sync` (receive), `send`, `verify`, `check` (the periodic disk and file check),
//! `adopt` (after a restart), `cleanup` (delete, failure). Nothing here knows the wire format; `grpc` converts.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use corral_disk::identity::{check_path_component, verify_disk};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::adopt::adopt;
use crate::error::BimError;
use crate::files::{self, BackingConfig, ImagePaths};
use crate::image::Image;
pub use crate::image::{DiskImages, ImageEvent, ImageSpec, ImageView, check_ref};
use crate::metrics::{ImageStats, Metrics};
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

/// The outcome of registering new work on an image.
pub(crate) enum Registered {
    New {
        generation: u64,
        cancel: CancellationToken,
    },
    /// Registered meanwhile by another request: report it.
    Existing,
}

/// Runs blocking file work off the reactor.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BimError> + Send + 'static,
) -> Result<T, BimError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BimError::Internal(e.to_string()))?
}

/// The manager of one disk.
pub struct Manager {
    pub(crate) cfg: ManagerConfig,
    registry: Mutex<Registry>,
    events: broadcast::Sender<ImageEvent>,
    pub(crate) ports: PortAllocator,
    pub(crate) metrics: Metrics,
    pub(crate) cancel: CancellationToken,
    pub(crate) tasks: TaskTracker,
}

impl Manager {
    /// Checks the disk identity (refusing another disk's directory) and adopts every image recorded on it.
    pub async fn open(cfg: ManagerConfig, cancel: CancellationToken) -> Result<Arc<Self>, BimError> {
        let (disk, uuid) = (cfg.disk_path.clone(), cfg.disk_uuid.clone());
        let adopted = blocking(move || {
            verify_disk(&disk, &uuid).map_err(|e| BimError::DiskUnavailable(e.to_string()))?;
            adopt(&disk)
        })
        .await?;
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

    /// An image as callers see it, as the disk state makes it look.
    pub(crate) fn view(&self, img: &Image, disk_problem: Option<&str>) -> ImageView {
        let (state, message) = match disk_problem {
            Some(p) => (FileState::Unknown, p.to_owned()),
            None => (img.state, img.message.clone()),
        };
        ImageView {
            spec: img.spec.clone(),
            state,
            message,
            progress: img.progress,
            current_checksum: img.current_checksum.clone(),
            sending: img.sending,
            sender_address: img.sender_address.clone(),
            size: img.size,
            virtual_size: img.virtual_size,
            real_size: img.real_size,
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
            let _ = self
                .events
                .send(ImageEvent::Changed(self.view(img, reg.disk_problem.as_deref())));
        }
    }

    pub(crate) fn emit_all(&self, reg: &Registry) {
        for name in reg.images.keys() {
            self.emit(reg, name);
        }
    }

    /// Tells watchers that an image is gone (its last view).
    pub(crate) fn emit_deleted(&self, view: ImageView) {
        let _ = self.events.send(ImageEvent::Deleted(view));
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

    /// Every change from now on (Watch). A receiver that lags behind loses events and must list again.
    pub fn subscribe(&self) -> broadcast::Receiver<ImageEvent> {
        self.events.subscribe()
    }

    /// Refuses changes while the disk identity is unverified.
    pub(crate) fn check_disk(&self) -> Result<(), BimError> {
        match &self.lock().disk_problem {
            Some(p) => Err(BimError::DiskUnavailable(p.clone())),
            None => Ok(()),
        }
    }

    pub fn get(&self, name: &str, uuid: &str) -> Result<ImageView, BimError> {
        check_path_component("image name", name).map_err(BimError::InvalidArgument)?;
        let reg = self.lock();
        match reg.images.get(name) {
            Some(img) if uuid.is_empty() || img.spec.uuid == uuid => {
                Ok(self.view(img, reg.disk_problem.as_deref()))
            }
            Some(img) => Err(BimError::NotFound(format!(
                "image {name} with uuid {uuid} (this disk holds uuid {})",
                img.spec.uuid
            ))),
            None => Err(BimError::NotFound(format!("image {name} is not on this disk"))),
        }
    }

    pub fn list(&self) -> DiskImages {
        let reg = self.lock();
        DiskImages {
            images: reg
                .images
                .values()
                .map(|i| self.view(i, reg.disk_problem.as_deref()))
                .collect(),
            disk_uuid: self.cfg.disk_uuid.clone(),
            disk_message: reg.disk_problem.clone().unwrap_or_default(),
        }
    }

    /// The registered image when it is not failed (such a request just reports it); an error when the name is
    /// taken by another uuid or the spec disagrees with what is registered.
    pub(crate) fn existing(&self, spec: &ImageSpec) -> Result<Option<ImageView>, BimError> {
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
        Ok(Some(self.view(img, reg.disk_problem.as_deref())))
    }

    /// Registers new work on `spec` (busy, in `state`), unless the image is registered and not failed.
    pub(crate) fn register(
        &self,
        spec: &ImageSpec,
        state: FileState,
        sender: &str,
    ) -> Result<Registered, BimError> {
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

    /// Registers an image whose file on the disk was found verified (reused without work).
    pub(crate) fn register_ready(
        &self,
        spec: &ImageSpec,
        cfg: &BackingConfig,
    ) -> Result<ImageView, BimError> {
        if let Registered::New { generation, .. } = self.register(spec, FileState::Pending, "")? {
            self.update(&spec.name, generation, |i| i.set_ready(cfg));
            info!(image = %spec.name, uuid = %spec.uuid, "reused the backing file already on the disk");
        }
        self.get(&spec.name, &spec.uuid)
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
}

impl ImageStats for Manager {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn state_counts(&self) -> BTreeMap<FileState, u64> {
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

    fn receiver_ports_in_use(&self) -> usize {
        self.ports.in_use()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::checksum::sha512_file;

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
        corral_disk::identity::write_disk_config(disk, "disk-1").unwrap();
        let paths = ImagePaths::new(disk, name, uuid);
        paths.create_dir().unwrap();
        std::fs::write(&paths.temp, content).unwrap();
        let (sum, facts) = sha512_file(&paths.temp, &CancellationToken::new(), |_, _| {}).unwrap();
        let cfg = BackingConfig::verified(name, uuid, "", sum, facts, &paths.temp);
        files::write_config(&paths.config, &cfg).unwrap();
        paths
    }

    fn state_of(m: &Manager, name: &str) -> String {
        m.get(name, "").unwrap().state.to_string()
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
