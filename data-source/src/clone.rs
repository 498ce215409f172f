//! `clone`: a sparse copy of another backing image's file on the same disk
//! (`<disk>/backing-images/<name>-<uuid>/backing`, the backing-image manager's layout).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sparse_sync::{FileContent, LayoutMode, Progress, SyncContent};

use crate::error::JobError;
use crate::job::JobContext;

/// `<disk>/backing-images/<name>-<uuid>/backing`.
pub fn backing_file(disk: &Path, name: &str, uuid: &str) -> PathBuf {
    disk.join("backing-images")
        .join(format!("{name}-{uuid}"))
        .join("backing")
}

/// Copies the source image into `work`, holes kept as holes.
pub async fn run(
    ds: &JobContext,
    backing_image: &str,
    backing_image_uuid: &str,
    work: &Path,
) -> Result<(), JobError> {
    let src = backing_file(&ds.config().disk_path, backing_image, backing_image_uuid);
    let content = FileContent::open(&src, LayoutMode::SeekData)
        .map_err(|e| JobError::io("opening the source image", &src, e))?;
    let size = content.size();
    ds.set_size(size);
    let dst = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(work)
        .map_err(|e| JobError::io("creating", work, e))?;
    let progress = Arc::new(Progress::new());
    progress.start(size);
    let cancel = ds.cancel_token().child_token();
    let (p, c) = (progress.clone(), cancel.clone());
    let mut copy = tokio::task::spawn_blocking(move || sparse_sync::copy(&content, &dst, &p, &c));
    let _stop = cancel.clone().drop_guard();
    let summary = loop {
        tokio::select! {
            r = &mut copy => break r,
            () = tokio::time::sleep(Duration::from_millis(200)) => ds.set_processed(progress.done()),
        }
    };
    let summary = summary
        .map_err(|e| JobError::io("copying", &src, std::io::Error::other(e)))?
        .map_err(|e| match e {
            sparse_sync::LocalError::Cancelled => JobError::Cancelled("the data source is shutting down"),
            other => JobError::io("copying", &src, std::io::Error::other(other)),
        })?;
    ds.set_processed(size);
    tracing::info!(src = %src.display(), size, data_bytes = summary.data_bytes, "clone copied");
    Ok(())
}
