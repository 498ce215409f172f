//! `corral-replica image info|convert`: offline inspection and conversion of backing images (raw, qcow2).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use corral_daemon::output::{emit, field_table};
use corral_daemon::{human_bytes, percent_bar};
use disk_image::{DiskImage, ImageFormat, ImageInfo};
use serde::Serialize;

/// What `image info --json` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageReport {
    /// Resolved path of the image file.
    pub path: PathBuf,
    #[serde(flatten)]
    pub info: ImageInfo,
    /// Bytes of the virtual disk that hold data across the backing chain (the rest reads as zeros).
    pub data_bytes: u64,
    /// Hex SHA-512 of the file as stored.
    pub sha512: String,
}

/// Sets `flag` when `cancel` fires (Ctrl-C / SIGTERM), so blocking work can stop between chunks.
fn cancel_flag(cancel: &tokio_util::sync::CancellationToken) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let (f, c) = (Arc::clone(&flag), cancel.clone());
    tokio::spawn(async move {
        c.cancelled().await;
        f.store(true, Ordering::Relaxed);
    });
    flag
}

fn percent(done: u64, total: u64) -> u64 {
    done.saturating_mul(100).checked_div(total).unwrap_or(100)
}

/// `image info PATH [--json]`: format, sizes, backing chain and SHA-512 (a directory holding one image works).
pub async fn image_info(path: &Path, json: bool) -> anyhow::Result<()> {
    let cancel = cancel_flag(&corral_daemon::shutdown_on_signal());
    let path = crate::backing::resolve_image_path(path)?;
    let report = tokio::task::spawn_blocking(move || -> anyhow::Result<ImageReport> {
        let image = DiskImage::open(&path)?;
        let data_bytes = image
            .allocated_ranges(0..image.size())
            .with_context(|| format!("data layout of {}", path.display()))?
            .iter()
            .map(|r| r.end - r.start)
            .sum();
        let bar = percent_bar("sha512");
        let sha512 = disk_image::sha512_file(&path, &|d, t| bar.set_position(percent(d, t)), &cancel)?;
        bar.finish_and_clear();
        Ok(ImageReport {
            info: image.info().clone(),
            path,
            data_bytes,
            sha512,
        })
    })
    .await??;
    if json {
        corral_daemon::output::print(true, &report, String::new)?;
        return Ok(());
    }
    let i = &report.info;
    let size = |v: u64| format!("{} ({v})", human_bytes(v));
    let mut rows: Vec<(&str, String)> = vec![
        ("path", report.path.display().to_string()),
        ("format", i.format.as_str().to_owned()),
        ("virtual size", size(i.virtual_size)),
        ("file size", size(i.file_size)),
        ("allocated size", size(i.allocated_size)),
        ("data", size(report.data_bytes)),
    ];
    if let Some(cs) = i.cluster_size {
        rows.push(("cluster size", size(cs)));
    }
    if let Some(v) = i.qcow2_version {
        rows.push(("qcow2 version", v.to_string()));
    }
    if let Some(b) = &i.backing_file {
        let fmt = i.backing_format.as_deref().unwrap_or("probed");
        rows.push(("backing file", format!("{} ({fmt})", b.display())));
    }
    if i.dirty {
        rows.push((
            "dirty",
            "yes (refcounts may be stale; data is read normally)".to_owned(),
        ));
    }
    rows.push(("sha512", report.sha512.clone()));
    emit(&field_table(rows).to_string());
    Ok(())
}

/// `image convert --to raw|qcow2 SRC DST` with a progress bar; Ctrl-C cancels and leaves DST untouched.
pub async fn image_convert(src: PathBuf, dst: PathBuf, to: ImageFormat) -> anyhow::Result<()> {
    let cancel = cancel_flag(&corral_daemon::shutdown_on_signal());
    let src = crate::backing::resolve_image_path(&src)?;
    let (s, d) = (src.clone(), dst.clone());
    tokio::task::spawn_blocking(move || {
        let bar = percent_bar(&format!("converting to {to}"));
        let r = disk_image::convert(
            &s,
            &d,
            to,
            &|done, total| bar.set_position(percent(done, total)),
            &cancel,
        );
        bar.finish_and_clear();
        r
    })
    .await?
    .with_context(|| format!("convert {} to {to} at {}", src.display(), dst.display()))?;
    emit(&format!("{} → {} ({to})", src.display(), dst.display()));
    Ok(())
}
