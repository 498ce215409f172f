//! `clone`: a sparse copy of another backing image, without fetching it from its source again: either its file on
//! the same disk (`<disk>/backing-images/<name>-<uuid>/backing`, the backing-image manager's layout), or — for a
//! v2 image, whose only copies are snapshot lvols in v2 disks' stores — a ready copy that the disk daemon at
//! `lvstore-address` sends read-only to a receiver of the work file (`BackingImageExpose`, the call a sync between
//! two stores uses; [`crate::receive`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_disk::sparse::{FileContent, LayoutMode, SparseRead};
use corral_proto::grpc::GrpcTimeouts;
use corral_proto::v1;
use corral_proto::v1::lvstore_service_client::LvstoreServiceClient;
use sparse_sync::Progress;

use crate::error::JobError;
use crate::job::JobContext;

/// Backstop of the `BackingImageExpose` request, which lasts as long as the transfer (the receiver's idle timeout
/// catches a stall).
const EXPOSE_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

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

/// Receives the ready v2 copy of `backing_image` that the disk daemon at `lvstore` (its `LvstoreService`,
/// `HOST:PORT`) holds into `work`; `size` is the image's size (0: unknown).
pub async fn run_from_lvstore(
    ds: &JobContext,
    backing_image: &str,
    lvstore: &str,
    size: u64,
    work: &Path,
) -> Result<(), JobError> {
    ds.set_size(size);
    let sent = std::sync::Mutex::new(None);
    let ask = |to: std::net::SocketAddr| {
        let sent = &sent;
        async move {
            tracing::info!(lvstore, backing_image, receiver = %to, "asking the disk daemon to expose its v2 copy");
            let timeouts = GrpcTimeouts {
                connect: ds.config().no_data_timeout,
                ..GrpcTimeouts::CONTROL.with_request(EXPOSE_REQUEST_TIMEOUT)
            };
            let channel = corral_proto::grpc::connect(lvstore, timeouts)
                .await
                .map_err(|e| e.to_string())?;
            let r = LvstoreServiceClient::new(channel)
                .backing_image_expose(v1::BackingImageExposeRequest {
                    name: backing_image.to_owned(),
                    to_address: to.to_string(),
                })
                .await
                .map_err(|s| {
                    format!(
                        "BackingImageExpose of {backing_image} on {lvstore}: {}",
                        s.message()
                    )
                })?
                .into_inner();
            *sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r.size);
            Ok(())
        }
    };
    let err = |reason: String| JobError::Clone {
        image: backing_image.to_owned(),
        reason,
    };
    let summary = crate::receive::receive(ds, work, size, ask, err).await?;
    let got = std::fs::metadata(work)
        .map_err(|e| JobError::io("reading the size of", work, e))?
        .len();
    // The copy's size as its daemon announced it (known once the expose answered), else the image's.
    let announced = sent
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .unwrap_or(size);
    if got != announced || (size != 0 && got != size) {
        return Err(JobError::SizeMismatch {
            got,
            expected: if size != 0 { size } else { announced },
        });
    }
    ds.set_processed(got);
    tracing::info!(
        lvstore,
        size = got,
        received = summary.bytes_received,
        written = summary.bytes_written,
        "v2 copy received"
    );
    Ok(())
}
