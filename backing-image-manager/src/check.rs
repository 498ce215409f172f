//! The periodic check of a manager: the disk identity (lost → every image `unknown`, nothing touched), then every
//! ready file's presence and mtime. A file whose mtime changed is re-hashed (`unknown` meanwhile) and becomes ready
//! again only if its content is what was verified; a missing file fails.

use std::path::PathBuf;
use std::sync::Arc;

use corral_disk::identity::verify_disk;
use tracing::{Instrument, info, warn};

use crate::checksum::sha512_file;
use crate::files::{self, BackingConfig};
use crate::manager::Manager;
use crate::state::FileState;

impl Manager {
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
