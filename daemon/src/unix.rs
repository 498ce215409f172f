//! The unix sockets a daemon serves (the engine's NBD socket, the replica's local data socket, the CSI socket):
//! nothing on them authenticates a peer, so who may connect is the socket file's mode. connect(2) needs write
//! permission on the socket, so [`SOCKET_MODE`] (0600) admits the daemon's user and root only, whatever the
//! process umask.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// The mode of every socket [`bind_private`] makes: read and write for the owner only.
pub const SOCKET_MODE: u32 = 0o600;

/// Binds a unix socket at `path` that only this process's user (and root) can connect to.
///
/// The socket is bound under a temporary name beside `path`, given [`SOCKET_MODE`], then renamed over `path`: no
/// client ever finds a socket at `path` with a wider mode, not even between bind(2) and chmod(2) under a permissive
/// umask. A socket left at `path` by a killed daemon is replaced; any other file there is refused and left as it
/// is. Errors name the path.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    let named =
        |what: &str, p: &Path, e: io::Error| io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()));
    remove_stale_socket(path)?;
    let tmp = temp_name(path);
    remove_stale_socket(&tmp)?;
    let listener = UnixListener::bind(&tmp).map_err(|e| named("bind unix socket", &tmp, e))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(|e| named("set the mode of", &tmp, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| named("rename the socket to", path, e)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

/// `<path>.bind`: beside the socket, so the rename stays in one directory.
fn temp_name(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".bind");
    PathBuf::from(name)
}

/// Removes a socket file at `path` (a killed process's); refuses any other kind of file.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(|e| io::Error::new(e.kind(), format!("remove stale socket {}: {e}", path.display()))),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{}: exists and is not a socket; not replacing it", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running_as_root() -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_socket_is_private_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let first = bind_private(&path).unwrap();
        assert_eq!(mode(&path), SOCKET_MODE);
        drop(first);
        // A killed daemon's socket file is still there: replaced, and the new one serves.
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_socket());
        let l = bind_private(&path).unwrap();
        assert_eq!(mode(&path), SOCKET_MODE);
        let _c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        assert!(!temp_name(&path).exists(), "no temporary name left");
    }

    #[test]
    fn another_file_at_the_path_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, b"not a socket").unwrap();
        let e = bind_private(&path).unwrap_err();
        assert!(e.to_string().contains("exists and is not a socket"), "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }

    /// Another user cannot connect, whatever the umask (connect(2) as `nobody` through `setpriv`; root, which runs
    /// the tests, passes every permission check). Skipped where that cannot run.
    #[test]
    fn another_user_cannot_connect_even_under_umask_0() {
        let probe = std::process::Command::new("setpriv").arg("--version").output();
        let python = Path::new("/usr/bin/python3").exists();
        if !probe.is_ok_and(|o| o.status.success()) || !python || !running_as_root() {
            eprintln!("skipped: needs root, setpriv and /usr/bin/python3");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("s.sock");
        // The widest umask: the socket's mode must not come from it. Restored right after the bind.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let bound = bind_private(&path);
        nix::sys::stat::umask(old);
        let _l = bound.unwrap();
        let connect_as_nobody = |p: &Path| {
            std::process::Command::new("setpriv")
                .args([
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    "/usr/bin/python3",
                    "-c",
                ])
                .arg("import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])")
                .arg(p)
                .output()
                .unwrap()
        };
        let out = connect_as_nobody(&path);
        assert!(!out.status.success(), "nobody connected to a private socket");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("PermissionError"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The control: the same socket opened to everyone admits nobody, so the refusal above is the mode's.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let out = connect_as_nobody(&path);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}
