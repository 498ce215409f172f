//! What the node plugin staged, kept on disk so a restarted plugin finds it again: one JSON record per volume
//! under `<state-dir>/volumes/`, written atomically (temp, fsync, rename) before and after every step that makes
//! something on the host, so a crash at any point leaves a record naming what may need undoing. And the block
//! device itself: `nbdfuse` exposes the volume's NBD export as a file, a loop device turns the file into a block
//! device (this kernel kind has no NBD client).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{CsiError, CsiResult};
use crate::node::host;

/// How long nbdfuse may take to show the export.
const FUSE_READY: Duration = Duration::from_secs(20);
/// How long nbdfuse may take to exit after its file system was unmounted.
const FUSE_EXIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StagedVolume {
    pub volume_id: String,
    pub staging_path: PathBuf,
    /// The NBD URI nbdfuse connects to.
    pub uri: String,
    pub block: bool,
    /// The file system made or found (mount access only).
    pub fs_type: Option<String>,
    pub read_only: bool,
    pub mount_flags: Vec<String>,
    pub fuse_pid: Option<i32>,
    pub loop_device: Option<String>,
    /// NodePublish targets.
    pub targets: Vec<PathBuf>,
}

/// The plugin's state directory.
#[derive(Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn open(root: &Path) -> CsiResult<StateDir> {
        for d in ["volumes", "fuse"] {
            std::fs::create_dir_all(root.join(d))
                .map_err(|e| CsiError::Internal(format!("cannot create {}: {e}", root.join(d).display())))?;
        }
        Ok(StateDir {
            root: root.to_owned(),
        })
    }

    fn record_path(&self, volume: &str) -> PathBuf {
        self.root.join("volumes").join(format!("{volume}.json"))
    }

    /// The directory nbdfuse mounts its file system on for `volume`.
    pub fn fuse_dir(&self, volume: &str) -> PathBuf {
        self.root.join("fuse").join(volume)
    }

    pub fn load(&self, volume: &str) -> CsiResult<Option<StagedVolume>> {
        let p = self.record_path(volume);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| CsiError::Internal(format!("state record {} is unreadable: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CsiError::Internal(format!("cannot read {}: {e}", p.display()))),
        }
    }

    pub fn save(&self, v: &StagedVolume) -> CsiResult<()> {
        let p = self.record_path(&v.volume_id);
        let bytes = serde_json::to_vec_pretty(v).map_err(|e| CsiError::Internal(e.to_string()))?;
        corral_disk::durable::write_atomic(&p, &bytes)
            .map_err(|e| CsiError::Internal(format!("cannot write {}: {e}", p.display())))
    }

    pub fn remove(&self, volume: &str) -> CsiResult<()> {
        let p = self.record_path(volume);
        match std::fs::remove_file(&p) {
            Ok(()) => corral_disk::durable::sync_parent_dir(&p)
                .map_err(|e| CsiError::Internal(format!("cannot sync {}: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CsiError::Internal(format!("cannot remove {}: {e}", p.display()))),
        }
    }

    pub fn all(&self) -> CsiResult<Vec<StagedVolume>> {
        let dir = self.root.join("volumes");
        let rd =
            std::fs::read_dir(&dir).map_err(|e| CsiError::Internal(format!("{}: {e}", dir.display())))?;
        let mut out = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(vol) = name.strip_suffix(".json")
                && let Some(v) = self.load(vol)?
            {
                out.push(v);
            }
        }
        Ok(out)
    }
}

/// The file nbdfuse shows the export as.
pub fn fuse_file(fuse_dir: &Path) -> PathBuf {
    fuse_dir.join("nbd")
}

/// Whether `pid` is a live nbdfuse serving `fuse_dir` (a recycled pid runs something else).
pub fn is_our_nbdfuse(pid: i32, fuse_dir: &Path) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rsplit_once(')')
        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmd = String::from_utf8_lossy(&cmd);
    !zombie && cmd.contains("nbdfuse") && cmd.contains(&*fuse_dir.to_string_lossy())
}

/// Starts nbdfuse for `uri` on `fuse_dir` in its own process group (it outlives a plugin restart) and waits
/// until the export shows; returns its pid.
pub async fn start_nbdfuse(fuse_dir: &Path, uri: &str, log: &Path) -> CsiResult<(i32, std::process::Child)> {
    std::fs::create_dir_all(fuse_dir)
        .map_err(|e| CsiError::Internal(format!("cannot create {}: {e}", fuse_dir.display())))?;
    let logf =
        std::fs::File::create(log).map_err(|e| CsiError::Internal(format!("{}: {e}", log.display())))?;
    let err = logf.try_clone().map_err(|e| CsiError::Internal(e.to_string()))?;
    let mut child = std::process::Command::new("nbdfuse")
        .arg(fuse_dir)
        .arg(uri)
        .stdin(Stdio::null())
        .stdout(logf)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|e| CsiError::Internal(format!("cannot start nbdfuse: {e}")))?;
    let pid = i32::try_from(child.id()).unwrap_or(0);
    let file = fuse_file(fuse_dir);
    let end = Instant::now() + FUSE_READY;
    loop {
        if std::fs::metadata(&file).is_ok_and(|m| m.len() > 0) && host::is_mount_point(fuse_dir) {
            return Ok((pid, child));
        }
        if let Ok(Some(status)) = child.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            return Err(CsiError::Internal(format!(
                "nbdfuse for {uri} exited ({status}): {}",
                text.trim()
            )));
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CsiError::Internal(format!(
                "nbdfuse did not show {uri} within {FUSE_READY:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Unmounts nbdfuse's file system (nbdfuse then exits) and waits for the process to go; SIGKILL when it hangs.
pub async fn stop_nbdfuse(
    fuse_dir: &Path,
    pid: Option<i32>,
    child: Option<std::process::Child>,
) -> CsiResult<()> {
    if host::is_mount_point(fuse_dir) {
        host::run("fusermount3", &["-u", &fuse_dir.to_string_lossy()]).await?;
    }
    let end = Instant::now() + FUSE_EXIT;
    if let Some(mut child) = child {
        loop {
            if child
                .try_wait()
                .map_err(|e| CsiError::Internal(e.to_string()))?
                .is_some()
            {
                break;
            }
            if Instant::now() >= end {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    } else if let Some(pid) = pid {
        // Not our child any more (the plugin restarted): whoever adopted it reaps it.
        while is_our_nbdfuse(pid, fuse_dir) {
            if Instant::now() >= end {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    match std::fs::remove_dir(fuse_dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::Internal(format!(
            "cannot remove {}: {e}",
            fuse_dir.display()
        ))),
    }
}

/// Detaches every loop device over the fuse file, waiting until the kernel lets go of it.
pub async fn detach_loops(fuse_dir: &Path) -> CsiResult<()> {
    let file = fuse_file(fuse_dir);
    if !file.exists() {
        return Ok(());
    }
    let end = Instant::now() + FUSE_EXIT;
    loop {
        let loops = host::loops_of(&file).await?;
        if loops.is_empty() {
            return Ok(());
        }
        for dev in &loops {
            host::run("losetup", &["-d", dev]).await?;
        }
        if Instant::now() >= end {
            return Err(CsiError::Internal(format!(
                "loop devices {} still hold {}",
                loops.join(", "),
                file.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_removal_is_idempotent() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::open(d.path()).unwrap();
        let v = StagedVolume {
            volume_id: "pvc-1".into(),
            staging_path: "/stage".into(),
            uri: "nbd+unix:///pvc-1?socket=/s".into(),
            block: false,
            fs_type: Some("ext4".into()),
            read_only: false,
            mount_flags: vec![],
            fuse_pid: Some(42),
            loop_device: Some("/dev/loop3".into()),
            targets: vec!["/t".into()],
        };
        s.save(&v).unwrap();
        let s2 = StateDir::open(d.path()).unwrap();
        assert_eq!(s2.load("pvc-1").unwrap(), Some(v.clone()));
        assert_eq!(s2.all().unwrap(), vec![v]);
        s2.remove("pvc-1").unwrap();
        s2.remove("pvc-1").unwrap();
        assert_eq!(s2.load("pvc-1").unwrap(), None);
    }

    #[test]
    fn a_pid_that_is_not_nbdfuse_is_not_ours() {
        assert!(!is_our_nbdfuse(
            i32::try_from(std::process::id()).unwrap(),
            Path::new("/x")
        ));
    }
}
