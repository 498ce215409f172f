//! Removing images: Delete (stop the work, remove the directory) and a failure (remove the files, report
//! `failed`). Nothing is removed while the disk identity cannot be verified.

use tracing::{info, warn};

use crate::error::BimError;
use crate::files;
use crate::image::check_ref;
use crate::manager::Manager;
use crate::state::FileState;

impl Manager {
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
                if let Some(img) = reg.images.remove(name) {
                    self.emit_deleted(self.view(&img, None));
                }
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
}
