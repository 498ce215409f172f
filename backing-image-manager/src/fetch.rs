//! Fetch: the first copy of an image on this disk. With a data source's address, its finished file is taken over
//! (transfer, then rename into the image directory: no copy, same inode) after checking it is the data source's
//! own regular file on this disk; without one, the file already on the disk is reused if its size and checksum
//! match. Either way the file is verified (`verify`) before it becomes `ready`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use corral_disk::durable::sync_parent_dir;
use tracing::{Instrument, info};

use crate::datasource::{DataSourceClient, DataSourceFile, READY_FOR_TRANSFER};
use crate::error::BimError;
use crate::files::{self, ImagePaths};
use crate::image::{ImageSpec, ImageView};
use crate::manager::{Manager, Registered, blocking};
use crate::state::FileState;
use crate::verify::{Reuse, try_reuse};

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

impl Manager {
    /// Fetch: with a data-source address, take its finished file over (transfer, then rename: no copy); without,
    /// reuse the file already on the disk if its size and checksum match the spec.
    pub async fn fetch(self: &Arc<Self>, spec: ImageSpec, address: &str) -> Result<ImageView, BimError> {
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
    ) -> Result<ImageView, BimError> {
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
}
