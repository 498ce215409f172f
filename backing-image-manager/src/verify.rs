//! Verification of a file before it becomes an image: reuse of a file already on the disk (its checksum from
//! `backing.cfg` while the mtime is the recorded one, else hashed), and the SHA-512 of a fetched or received
//! `backing.tmp` checked against the spec and the source before `backing.cfg` is recorded and the file renamed onto
//! `backing`.

use std::sync::Arc;

use corral_disk::durable::sync_parent_dir;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use crate::checksum::sha512_file;
use crate::error::BimError;
use crate::files::{self, BackingConfig, ImagePaths};
use crate::image::ImageSpec;
use crate::manager::Manager;

/// What an existing `backing` is worth for a spec.
pub(crate) enum Reuse {
    Reused(BackingConfig),
    Absent,
    Mismatch(String),
    /// The file may match but only hashing it would tell.
    NeedsHash,
}

/// Maps a percentage onto `from..=to`.
pub(crate) fn scale(pct: u8, from: u8, to: u8) -> u8 {
    let share = u16::from(pct.min(100)) * u16::from(to.saturating_sub(from)) / 100;
    u8::try_from(u16::from(from) + share).unwrap_or(to)
}

pub(crate) fn percent(done: u64, total: u64) -> u8 {
    u8::try_from((done.saturating_mul(100) / total.max(1)).min(100)).unwrap_or(100)
}

/// Looks at `backing` for `spec`: its checksum comes from `backing.cfg` when the mtime is the recorded one, else
/// from hashing it (only when `hash` is given). A reused file gets its `backing.cfg` rewritten if anything changed.
pub(crate) fn try_reuse(
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

impl Manager {
    /// Verifies `backing.tmp` and makes it the image (in the background); progress runs from `progress_from`
    /// to 99 while it is hashed.
    pub(crate) fn spawn_commit(
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_shares_map_onto_their_ranges() {
        assert_eq!(percent(50, 100), 50);
        assert_eq!(percent(5, 0), 100);
        assert_eq!(scale(100, 0, 80), 80);
        assert_eq!(scale(0, 80, 99), 80);
        assert_eq!(scale(100, 80, 99), 99);
        assert_eq!(scale(255, 0, 99), 99);
    }
}
