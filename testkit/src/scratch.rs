//! Scratch directories for tests that care about the filesystem under them.

/// A temporary directory (removed on drop) under `/var/tmp`: a disk filesystem where holes, `SEEK_DATA`, FIEMAP and
/// `O_DIRECT` behave as on a user's disk, unlike the tmpfs `/tmp` often is.
///
/// # Panics
/// When the directory cannot be created.
pub fn disk_tempdir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap_or_else(|e| panic!("create a scratch directory under /var/tmp: {e}"))
}
