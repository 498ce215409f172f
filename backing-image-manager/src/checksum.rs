//! SHA-512 of a whole file, the checksum every backing image is identified by (hex, lower case).

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

use crate::files::{FileFacts, facts};

/// Length of a SHA-512 in hex.
pub const SHA512_HEX_LEN: usize = 128;

/// Checks an expected checksum given by a caller (empty = none).
pub fn check_checksum_syntax(checksum: &str) -> Result<(), String> {
    if checksum.is_empty()
        || (checksum.len() == SHA512_HEX_LEN
            && checksum
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    {
        Ok(())
    } else {
        Err(format!(
            "checksum {checksum:?} is not a SHA-512: expected {SHA512_HEX_LEN} lower-case hex digits"
        ))
    }
}

/// Hashes `path` (with `disk_image::sha512_file`), calling `progress(done, total)` as bytes are hashed. Fails if the
/// file changed while it was hashed (its mtime or size differ before and after), so a checksum always describes one
/// version of the file.
pub fn sha512_file(
    path: &Path,
    cancel: &CancellationToken,
    progress: impl Fn(u64, u64),
) -> io::Result<(String, FileFacts)> {
    let missing = |what: &str| io::Error::new(io::ErrorKind::NotFound, format!("{} {what}", path.display()));
    let before = facts(path)?.ok_or_else(|| missing("is missing"))?;
    let stop = AtomicBool::new(false);
    let sum = disk_image::sha512_file(
        path,
        &|done, total| {
            if cancel.is_cancelled() {
                stop.store(true, Ordering::Relaxed);
            }
            progress(done, total);
        },
        &stop,
    )
    .map_err(io::Error::other)?;
    let after = facts(path)?.ok_or_else(|| missing("vanished while it was hashed"))?;
    if after != before {
        return Err(io::Error::other(format!(
            "{} was modified while it was hashed",
            path.display()
        )));
    }
    Ok((sum, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_sha512sum_and_syntax_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"abc").unwrap();
        let (sum, facts) = sha512_file(&p, &CancellationToken::new(), |_, _| {}).unwrap();
        assert!(sum.starts_with("ddaf35a193617aba"), "{sum}");
        assert_eq!(facts.size, 3);
        check_checksum_syntax(&sum).unwrap();
        check_checksum_syntax("").unwrap();
        assert!(check_checksum_syntax("abc").is_err());
        assert!(check_checksum_syntax(&sum.to_uppercase()).is_err());
    }
}
