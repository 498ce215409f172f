//! SHA-256/512 of bytes, of a file, of a directory's files, and of an NBD export (read by `nbdcopy`, the libnbd
//! client), in lower-case hex.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256, Sha512};

pub fn sha256_bytes(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

pub fn sha512_bytes(data: &[u8]) -> String {
    hex::encode(Sha512::digest(data))
}

/// SHA-256 of a file's logical content (holes read as zeros).
///
/// # Panics
/// When the file cannot be read.
pub fn sha256_file(path: &Path) -> String {
    stream_digest::<Sha256>(&mut open(path), &path.display().to_string())
}

/// Every file directly in `dir` (a v1 replica directory, say) with its SHA-256, sorted by name: compared before
/// and after an operation, it shows that nothing in the directory changed.
///
/// # Panics
/// When the directory or one of its files cannot be read.
pub fn sha256_dir(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap_or_else(|e| panic!("read {}: {e}", dir.display())).path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                sha256_file(&p),
            )
        })
        .collect();
    v.sort();
    v
}

/// SHA-512 of a file's logical content (holes read as zeros): the checksum backing images are named by.
///
/// # Panics
/// When the file cannot be read.
pub fn sha512_file(path: &Path) -> String {
    stream_digest::<Sha512>(&mut open(path), &path.display().to_string())
}

/// SHA-256 of the whole content of the NBD export at `uri` (`nbd://…`, `nbd+unix://…`), read by `nbdcopy` to
/// stdout: a real client, as a user would read the volume.
///
/// # Panics
/// When `nbdcopy` is missing (Debian package `libnbd-bin`) or fails.
pub fn nbd_sha256(uri: &str) -> String {
    let mut child = Command::new("nbdcopy")
        .args(["--", uri, "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nbdcopy (apt-get install libnbd-bin)");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let sum = stream_digest::<Sha256>(&mut stdout, uri);
    let out = child.wait_with_output().expect("wait for nbdcopy");
    assert!(
        out.status.success(),
        "nbdcopy {uri}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    sum
}

fn open(path: &Path) -> std::fs::File {
    std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn stream_digest<D: Digest>(r: &mut impl Read, what: &str) -> String {
    let mut h = D::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).unwrap_or_else(|e| panic!("read {what}: {e}"));
        if n == 0 {
            return hex::encode(h.finalize());
        }
        h.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_bytes_digests_agree_over_a_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(3 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"corral", 2 << 20).unwrap();
        let mut want = vec![0u8; 3 << 20];
        want[2 << 20..(2 << 20) + 6].copy_from_slice(b"corral");
        assert_eq!(sha256_file(&p), sha256_bytes(&want));
        assert_eq!(sha512_file(&p), sha512_bytes(&want));
        assert_eq!(
            sha256_bytes(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
