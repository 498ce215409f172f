//! The host tools the node plugin drives (mount, umount, losetup, mkfs, blkid, resize2fs, xfs_growfs, blockdev)
//! and what it reads from the kernel (`/proc/self/mountinfo`). Each failure names the command and its stderr.

use std::path::{Path, PathBuf};

use crate::error::{CsiError, CsiResult};

/// Runs `program args...`, returning its stdout; a non-zero exit is INTERNAL with the command and stderr.
pub async fn run(program: &str, args: &[&str]) -> CsiResult<String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|e| CsiError::Internal(format!("cannot run {program}: {e}")))?;
    if !out.status.success() {
        return Err(CsiError::Internal(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Undoes the octal escapes (`\040` for a space) mountinfo uses in paths.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// (mount point, mount source) of every mount this process sees.
fn mounts() -> Vec<(PathBuf, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let point = f.get(4)?;
            let sep = f.iter().position(|x| *x == "-")?;
            let source = f.get(sep + 2)?;
            Some((PathBuf::from(unescape(point)), unescape(source)))
        })
        .collect()
}

/// Whether something is mounted on `path` (the path itself, not a parent).
pub fn is_mount_point(path: &Path) -> bool {
    let Ok(p) = path.canonicalize() else {
        return false;
    };
    mounts().iter().any(|(m, _)| *m == p)
}

/// Size of a block device in bytes.
pub async fn device_size(dev: &str) -> CsiResult<u64> {
    let out = run("blockdev", &["--getsize64", dev]).await?;
    out.trim()
        .parse()
        .map_err(|e| CsiError::Internal(format!("blockdev --getsize64 {dev} printed {out:?}: {e}")))
}

/// The file system on a device, None when blank.
pub async fn fs_on(dev: &str) -> CsiResult<Option<String>> {
    let out = tokio::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE", dev])
        .output()
        .await
        .map_err(|e| CsiError::Internal(format!("cannot run blkid: {e}")))?;
    // blkid exits 2 when it finds nothing.
    match out.status.code() {
        Some(0) => {
            let t = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            Ok((!t.is_empty()).then_some(t))
        }
        Some(2) => Ok(None),
        _ => Err(CsiError::Internal(format!(
            "blkid -p {dev} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

pub async fn make_fs(dev: &str, fs: &str) -> CsiResult<()> {
    match fs {
        "xfs" => run("mkfs.xfs", &["-q", dev]).await.map(drop),
        _ => run("mkfs.ext4", &["-q", "-F", dev]).await.map(drop),
    }
}

/// Grows the file system mounted at `mount_point` from `dev` to the device's size (online).
pub async fn grow_fs(dev: &str, fs: &str, mount_point: &Path) -> CsiResult<()> {
    match fs {
        "xfs" => run("xfs_growfs", &[&mount_point.to_string_lossy()])
            .await
            .map(drop),
        _ => run("resize2fs", &[dev]).await.map(drop),
    }
}

/// Bytes an ext4 file system on `dev` spans (block count × block size, from its superblock).
pub async fn ext4_size(dev: &str) -> CsiResult<u64> {
    let out = run("dumpe2fs", &["-h", dev]).await?;
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    match (field("Block count:"), field("Block size:")) {
        (Some(n), Some(b)) => Ok(n * b),
        _ => Err(CsiError::Internal(format!(
            "dumpe2fs -h {dev}: no block count or size"
        ))),
    }
}

/// Whether the ext4 file system on `dev` is smaller than the device (by more than resize2fs can use: a partial
/// last block group).
pub async fn ext4_smaller_than_device(dev: &str) -> CsiResult<bool> {
    Ok(ext4_size(dev).await? + (1 << 20) <= device_size(dev).await?)
}

/// Grows an unmounted ext4 file system to its device: a forced check first (resize2fs insists), then the resize.
/// Offline growth needs no CAP_SYS_RESOURCE, which the kernel asks of an online ext4 resize.
pub async fn grow_ext4_offline(dev: &str) -> CsiResult<()> {
    let out = tokio::process::Command::new("e2fsck")
        .args(["-f", "-p", dev])
        .output()
        .await
        .map_err(|e| CsiError::Internal(format!("cannot run e2fsck: {e}")))?;
    // 0: clean, 1: errors corrected; anything else leaves the file system untouched by the resize.
    if !matches!(out.status.code(), Some(0 | 1)) {
        return Err(CsiError::Internal(format!(
            "e2fsck -f -p {dev} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim()
        )));
    }
    run("resize2fs", &[dev]).await.map(drop)
}

pub async fn mount(source: &str, target: &Path, fs: Option<&str>, options: &[String]) -> CsiResult<()> {
    let target = target.to_string_lossy();
    let mut args: Vec<&str> = Vec::new();
    if let Some(fs) = fs {
        args.extend(["-t", fs]);
    }
    let opts = options.join(",");
    if !opts.is_empty() {
        args.extend(["-o", &opts]);
    }
    args.extend([source, &target]);
    run("mount", &args).await.map(drop)
}

pub async fn bind_mount(source: &str, target: &Path, read_only: bool) -> CsiResult<()> {
    let t = target.to_string_lossy();
    run("mount", &["--bind", source, &t]).await?;
    if read_only {
        run("mount", &["-o", "remount,bind,ro", &t]).await?;
    }
    Ok(())
}

/// Unmounts `path` when something is mounted there.
pub async fn unmount(path: &Path) -> CsiResult<()> {
    if is_mount_point(path) {
        run("umount", &[&path.to_string_lossy()]).await?;
    }
    Ok(())
}

/// Loop devices backed by `file`.
pub async fn loops_of(file: &Path) -> CsiResult<Vec<String>> {
    let out = run("losetup", &["-j", &file.to_string_lossy()]).await?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|d| !d.is_empty())
        .map(str::to_owned)
        .collect())
}

/// A loop device over `file` (the one already there, or a new one with direct IO: the page cache stays with the
/// file system above, not twice).
pub async fn attach_loop(file: &Path) -> CsiResult<String> {
    if let Some(dev) = loops_of(file).await?.into_iter().next() {
        return Ok(dev);
    }
    let out = run(
        "losetup",
        &["-f", "--show", "--direct-io=on", &file.to_string_lossy()],
    )
    .await?;
    Ok(out.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/var/lib/a\040b"), "/var/lib/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/x\\"), r"/x\\");
    }

    #[test]
    fn the_root_is_a_mount_point_and_a_plain_directory_is_not() {
        assert!(is_mount_point(Path::new("/")));
        let d = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(&d.path().join("sub")));
    }
}
