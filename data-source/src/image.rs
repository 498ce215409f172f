//! Format detection and conversion of the prepared file, through the `disk-image` crate.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use crate::error::JobError;

/// Image formats a data source produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

/// What the finished file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    pub format: Format,
    /// Size of the disk the image describes.
    pub virtual_size: u64,
}

/// Detects the format of `path` (TEMPORARY: magic and header size only, until `disk_image::probe` lands).
pub fn probe(path: &Path) -> Result<Facts, JobError> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).map_err(|e| JobError::io("opening", path, e))?;
    let len = f.metadata().map_err(|e| JobError::io("reading", path, e))?.len();
    let mut head = [0u8; 32];
    if len >= 32 {
        f.read_exact_at(&mut head, 0)
            .map_err(|e| JobError::io("reading", path, e))?;
        if head[..4] == *b"QFI\xfb" {
            let mut vs = [0u8; 8];
            vs.copy_from_slice(&head[24..32]);
            return Ok(Facts {
                format: Format::Qcow2,
                virtual_size: u64::from_be_bytes(vs),
            });
        }
    }
    Ok(Facts {
        format: Format::Raw,
        virtual_size: len,
    })
}

/// Converts `src` into a new `dst` of format `to`, reporting (done, total) bytes and stopping when `cancel` is set.
pub fn convert(
    src: &Path,
    dst: &Path,
    to: Format,
    progress: &(dyn Fn(u64, u64) + Sync),
    cancel: &AtomicBool,
) -> Result<(), JobError> {
    let _ = (src, dst, progress, cancel);
    Err(JobError::Image(format!(
        "conversion to {to:?} is not available yet"
    )))
}
