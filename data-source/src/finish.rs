//! After the data is in: detect the format, convert when the target needs it (v2 engine: qcow2 → raw; an export
//! asked as qcow2: raw → qcow2), pad a raw image to a whole number of 512-byte sectors (v2 engine: 4 KiB blocks,
//! as an lvol holds), compute the SHA-512
//! (streamed, progress reported; a download or upload already computed it while the data arrived, so the file is
//! read again only when conversion or padding changed it), compare it with the expected one, and publish the file
//! at its final name.
//!
//! The expected checksum may name the image as the user has it (before a conversion or padding) or the file as
//! stored; both are accepted, `currentChecksum` is always the file as stored.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use disk_image::{ImageError, ImageFormat, ImageInfo};

use crate::error::JobError;
use crate::info::{DataEngine, FileState};
use crate::job::{Counters, JobContext, TRANSFER_SHARE, remove_if_exists};
use crate::spec::{ExportFileType, SourceSpec};

/// Sector size replicas address a backing image in; a raw image is padded to a multiple of it.
pub const SECTOR: u64 = 512;

/// Block size of a v2 copy (an lvol, a whole number of 4 KiB blocks): a v2 image's raw file is padded to it, so
/// the first v2 copy holds the file byte for byte.
pub const V2_BLOCK: u64 = 4096;

/// Runs `f(progress, cancel)` on the blocking pool, reporting its progress as `[from, to)` of the bar every
/// 200 ms; the shutdown token sets `cancel`.
async fn blocking<T: Send + 'static>(
    ds: &JobContext,
    (from, to): (u8, u8),
    f: impl FnOnce(&dyn Fn(u64, u64), &AtomicBool) -> Result<T, ImageError> + Send + 'static,
) -> Result<T, JobError> {
    let done = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let (d, s) = (done.clone(), stop.clone());
    let mut task = tokio::task::spawn_blocking(move || {
        let report = |n: u64, total: u64| {
            d.0.store(n, Ordering::Relaxed);
            d.1.store(total, Ordering::Relaxed);
        };
        f(&report, &s)
    });
    let cancel = ds.cancel_token();
    loop {
        tokio::select! {
            r = &mut task => {
                let r = r.map_err(|e| JobError::Task(e.to_string()))?;
                return r.map_err(|e| match e {
                    ImageError::Cancelled => JobError::Cancelled("the data source is shutting down"),
                    other => JobError::Image(other),
                });
            }
            () = cancel.cancelled(), if !stop.load(Ordering::Relaxed) => stop.store(true, Ordering::Relaxed),
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                ds.set_phase_progress(from, to, done.0.load(Ordering::Relaxed), done.1.load(Ordering::Relaxed));
            }
        }
    }
}

async fn probe(ds: &JobContext, path: &Path) -> Result<ImageInfo, JobError> {
    let p = path.to_path_buf();
    let info = blocking(ds, (TRANSFER_SHARE, TRANSFER_SHARE), move |_, _| {
        disk_image::probe(&p)
    })
    .await?;
    if let Some(b) = &info.backing_file {
        return Err(JobError::NotUsable(format!(
            "the qcow2 image names a backing file {}: a backing image must be self-contained \
             (flatten it with `qemu-img convert -O qcow2`)",
            b.display()
        )));
    }
    Ok(info)
}

async fn sha512(ds: &JobContext, path: &Path, span: (u8, u8)) -> Result<String, JobError> {
    let p = path.to_path_buf();
    let sum = blocking(ds, span, move |progress, cancel| {
        disk_image::sha512_file(&p, progress, cancel)
    })
    .await?;
    let len = std::fs::metadata(path).map_or(0, |m| m.len());
    Counters::add(&ds.counters.bytes_hashed, len);
    Ok(sum)
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> JobError + 'a {
    move |e| JobError::io(op, path, e)
}

/// Post-processes the work file and publishes it; the job is `ready-for-transfer` after.
pub async fn run(ds: &JobContext) -> Result<(), JobError> {
    let cfg = ds.config();
    let work = cfg.work_path();
    ds.set_state(FileState::InProgress);
    let mut info = probe(ds, &work).await?;
    let target = match (cfg.data_engine, ds.spec(), info.format) {
        (DataEngine::V2, _, ImageFormat::Qcow2) => Some(ImageFormat::Raw),
        (
            _,
            SourceSpec::ExportFromVolume {
                file_type: ExportFileType::Qcow2,
                ..
            },
            ImageFormat::Raw,
        ) => Some(ImageFormat::Qcow2),
        _ => None,
    };
    let expected = cfg.expected_checksum.clone();
    // Checksums the expected one may name: the image as received, before conversion and padding.
    let mut accepted = Vec::new();
    let mut notes = Vec::new();
    // The SHA-512 of the work file as it is now, when the fetch computed it while the data arrived.
    let mut as_is = ds.received_checksum();
    if let Some(to) = target {
        if expected.is_some() {
            let sum = match as_is.take() {
                Some(sum) => sum,
                None => sha512(ds, &work, (TRANSFER_SHARE, 85)).await?,
            };
            accepted.push(sum);
        }
        as_is = None;
        let out = cfg.convert_path();
        let (src, dst) = (work.clone(), out.clone());
        blocking(ds, (85, 92), move |progress, cancel| {
            disk_image::convert(&src, &dst, to, progress, cancel)
        })
        .await
        .inspect_err(|_| remove_if_exists(&out))?;
        std::fs::rename(&out, &work).map_err(io_err("renaming the converted file to", &work))?;
        notes.push(format!("converted {} to {to}", info.format));
        info = probe(ds, &work).await?;
    }
    let hash_from = if target.is_some() { 92 } else { TRANSFER_SHARE };

    let size = std::fs::metadata(&work).map_err(io_err("reading", &work))?.len();
    let unit = if cfg.data_engine == DataEngine::V2 {
        V2_BLOCK
    } else {
        SECTOR
    };
    let pad = if info.format == ImageFormat::Raw && size % unit != 0 {
        unit - size % unit
    } else {
        0
    };
    if pad > 0 {
        // Rare (sector-aligned images are the rule): hash as received for the expected checksum, then padded.
        let sum = match as_is.take() {
            Some(sum) => sum,
            None => sha512(ds, &work, (hash_from, 96)).await?,
        };
        accepted.push(sum);
        let f = File::options()
            .write(true)
            .open(&work)
            .map_err(io_err("opening", &work))?;
        f.set_len(size + pad).map_err(io_err("padding", &work))?;
        notes.push(if unit == V2_BLOCK {
            format!(
                "raw image of {size} bytes padded with {pad} zero bytes to a whole number of 4 KiB blocks \
                 (a v2 copy is an lvol)"
            )
        } else {
            format!(
                "raw image of {size} bytes padded with {pad} zero bytes to a whole number of 512-byte sectors"
            )
        });
        info.virtual_size = size + pad;
    }
    let current = match as_is {
        Some(sum) => sum,
        None => sha512(ds, &work, (if pad > 0 { 96 } else { hash_from }, 100)).await?,
    };
    if let Some(exp) = &expected {
        let ok = accepted
            .iter()
            .chain([&current])
            .any(|s| s.eq_ignore_ascii_case(exp));
        if !ok {
            return Err(JobError::ChecksumMismatch {
                expected: exp.clone(),
                got: accepted.first().unwrap_or(&current).clone(),
            });
        }
    }
    let final_path = publish(&work, &cfg.file_path())?;
    let md = std::fs::metadata(&final_path).map_err(io_err("reading", &final_path))?;
    ds.update(|i| {
        i.size = md.len();
        i.virtual_size = info.virtual_size;
        i.real_size = md.blocks() * 512;
        i.current_checksum = current;
        i.message = notes.join("; ");
        i.progress = 100;
        i.state = FileState::ReadyForTransfer;
    });
    tracing::info!(
        path = %final_path.display(), size = md.len(), virtual_size = info.virtual_size,
        format = %info.format, "file ready for transfer"
    );
    Ok(())
}

/// fsyncs `work`, renames it to `final_path` and fsyncs the directory.
fn publish(work: &Path, final_path: &Path) -> Result<PathBuf, JobError> {
    corral_disk::durable::publish_path(work, final_path).map_err(io_err("publishing", work))?;
    Ok(final_path.to_path_buf())
}
