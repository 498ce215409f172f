//! Adoption after a restart (live upgrade): every image recorded in a `backing.cfg` on the disk comes back as it
//! was verified, without copying or re-hashing; work a crash or a stop interrupted is finished or removed.
//! Blocking file IO: run on `spawn_blocking`.

use std::path::Path;

use corral_disk::durable::sync_parent_dir;
use tracing::{info, warn};

use crate::error::BimError;
use crate::files::{self, BackingConfig, IMAGES_DIR, ImagePaths};
use crate::image::check_ref;
use crate::state::FileState;

/// Reads every `backing.cfg` on the disk (blocking): each image comes back ready as recorded (the first check
/// compares mtimes), or failed when its file is gone. Temp files of interrupted work are removed.
pub(crate) fn adopt(disk: &Path) -> Result<Vec<(BackingConfig, FileState, String)>, BimError> {
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
