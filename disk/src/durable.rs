//! Crash-safe file writes. A file that other code trusts after a crash appears under its name only complete and
//! durable: it is written under a temporary name in the same directory (a rename is atomic only within one file
//! system), fsynced, renamed over the name, and the directory is fsynced so the rename itself survives. A crash
//! leaves the old content or the new, never a mix, plus at most a temporary file that the owner's start-up cleanup
//! recognises by [`TEMP_SUFFIX`].

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Suffix of the temporary file [`write_atomic`] writes beside its target (`<path>.tmp`).
pub const TEMP_SUFFIX: &str = ".tmp";

/// The temporary name [`write_atomic`] uses for `path`: `<path>.tmp`, in the same directory.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(TEMP_SUFFIX);
    PathBuf::from(name)
}

/// Replaces `path` with `bytes`: writes `<path>.tmp`, fsyncs it, renames it over `path`, fsyncs the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_inner(path, bytes, None)
}

/// [`write_atomic`] with the file's permission bits set to `mode` (e.g. `0o600` for a private key) before any
/// byte is written, whatever the umask or a stale temporary file had: the content is never readable by more than
/// `mode` allows, not even for a moment.
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_atomic_inner(path, bytes, Some(mode))
}

fn write_atomic_inner(path: &Path, bytes: &[u8], mode: Option<u32>) -> io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = temp_path(path);
    let mut opts = OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if let Some(mode) = mode {
        opts.mode(mode);
    }
    let mut f = opts.open(&tmp)?;
    if let Some(mode) = mode {
        // A temporary file left by a crash keeps its old mode through open(O_CREAT); the umask narrows a new one.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
    }
    f.write_all(bytes)?;
    publish(&f, &tmp, path)
}

/// Publishes a completely written file: fsyncs `file` (open at `from`), renames `from` to `to` (same directory or
/// file system) and fsyncs the directory of `to`. For files written in pieces (a conversion, a download) whose
/// writer chose the temporary name.
pub fn publish(file: &File, from: &Path, to: &Path) -> io::Result<()> {
    file.sync_all()?;
    fs::rename(from, to)?;
    sync_parent_dir(to)
}

/// [`publish`] for a file that is no longer open.
pub fn publish_path(from: &Path, to: &Path) -> io::Result<()> {
    publish(&File::open(from)?, from, to)
}

/// fsyncs `dir`, making creates, renames, links and unlinks in it durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// fsyncs the directory holding `path` (the current directory for a bare file name).
pub fn sync_parent_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => sync_dir(d),
        _ => sync_dir(Path::new(".")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_the_content_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("volume.meta");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new content").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new content");
        assert!(!temp_path(&path).exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn write_atomic_mode_sets_the_mode_even_over_a_stale_temporary_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tls.key");
        fs::write(temp_path(&path), b"stale").unwrap();
        fs::set_permissions(temp_path(&path), fs::Permissions::from_mode(0o666)).unwrap();
        write_atomic_mode(&path, b"secret", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"secret");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_failed_write_leaves_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cfg");
        write_atomic(&path, b"old").unwrap();
        // The temporary name is taken by a directory: the write fails before the rename.
        fs::create_dir(temp_path(&path)).unwrap();
        assert!(write_atomic(&path, b"new").is_err());
        assert_eq!(fs::read(&path).unwrap(), b"old");
    }

    #[test]
    fn publish_moves_a_written_file_into_place() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join(".img.part"), dir.path().join("img"));
        fs::write(&from, b"data").unwrap();
        publish_path(&from, &to).unwrap();
        assert_eq!(fs::read(&to).unwrap(), b"data");
        assert!(!from.exists());
        assert!(publish_path(&from, &to).is_err(), "a missing source is an error");
    }
}
