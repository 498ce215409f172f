//! SHA-512 of an image file as stored (not of its virtual content): the identity backing images are verified by.

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha512};

use crate::error::{ImageError, IoContext};

/// Hex SHA-512 of the bytes of `path`. `progress(done, total)` is called per MiB; `cancel` stops it.
pub fn sha512_file(
    path: &Path,
    progress: &dyn Fn(u64, u64),
    cancel: &AtomicBool,
) -> Result<String, ImageError> {
    let mut f = File::open(path).ctx("open", path)?;
    let total = f.metadata().ctx("stat", path)?.len();
    let mut h = Sha512::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(ImageError::Cancelled);
        }
        let n = f.read(&mut buf).ctx("read", path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done, total);
    }
    Ok(hex::encode(h.finalize()))
}
