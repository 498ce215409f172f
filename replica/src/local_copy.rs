//! Local copy of snapshot files between two replicas on one host, for clone and rebuild: instead of pulling the
//! source's data through sparse-sync over loopback TCP (four copies of every byte, two processes busy), the target
//! opens the source's snapshot files itself and copies their data extents with `copy_file_range` (shared blocks on
//! a reflink file system), fsyncs once and renames, leaving the same files as the network path.
//!
//! Trust: the source's `LocalFiles` lists paths with each file's identity (device, inode, size, mtime) and its boot
//! id. The target never follows a path blindly ([`open_listed`]): the path must be absolute and normalized, name a
//! snapshot file in a replica directory (one holding `volume.meta`), be opened without following any symbolic
//! link (`openat2` with `RESOLVE_NO_SYMLINKS`), be a regular file, and have exactly the listed identity; all files
//! of one listing share one directory. Anything else refuses the local path, and the target falls back to the
//! network transfer, which needs no shared file system at all (another host, another mount namespace, a source
//! without `LocalFiles`, a copy that needs the backing image).
//!
//! Stability: the source counts a listing like an export, so it refuses a purge (the one change that could punch
//! holes in a listed file) until the target closes the `LocalFiles` stream; the target checks after the copy that
//! the stream is still open and every file still has its identity, and fails the copy otherwise.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use corral_proto::ReplicaAddress;
use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{self, sync_agent_service_client::SyncAgentServiceClient};
use futures::FutureExt;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use sparse_sync::{ExtentCopyOptions, ExtentCopySummary, FileExtents, Pace, Progress};
use tokio_util::sync::CancellationToken;

use crate::error::{IoContext, ReplicaError, Result};
use crate::export::SnapshotView;
use crate::names::{self, VOLUME_META};
use crate::replica::Replica;

/// Where the kernel tells which boot this is: equal ids mean the same running host.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This host's boot id.
pub(crate) fn boot_id() -> Result<String> {
    Ok(std::fs::read_to_string(BOOT_ID)
        .ctx("read", Path::new(BOOT_ID))?
        .trim()
        .to_owned())
}

fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime()
        .saturating_mul(1_000_000_000)
        .saturating_add(m.mtime_nsec())
}

fn describe(path: &Path, file: &File) -> Result<v1::LocalFile> {
    let m = file.metadata().ctx("stat", path)?;
    Ok(v1::LocalFile {
        path: path.to_string_lossy().into_owned(),
        dev: m.dev(),
        ino: m.ino(),
        size: m.len(),
        mtime_ns: mtime_ns(&m),
        recorded_checksum: String::new(),
    })
}

/// A recorded checksum as one comparable string.
fn checksum_text(c: &sparse_sync::FileChecksum) -> String {
    format!("{}:{}", c.method, c.checksum)
}

/// Source side of `LocalFiles`: the files of `req.snapshot_file_name` (its whole chain, root first, or the file
/// alone), with their identities. Blocking.
pub(crate) fn list(replica: &Replica, req: &v1::LocalFilesRequest) -> Result<v1::LocalFilesResponse> {
    let dir = std::fs::canonicalize(replica.dir()).ctx("resolve", replica.dir())?;
    let mut files = Vec::new();
    if req.chain {
        let view = SnapshotView::open(
            replica,
            &req.snapshot_file_name,
            req.export_backing_image_if_exist,
        )?;
        if view.has_backing() {
            return Err(ReplicaError::FailedPrecondition(
                "the snapshot's blocks include the backing image's, which a local copy does not read".into(),
            ));
        }
        if req.expected_size != 0 && req.expected_size != view.size_bytes() {
            return Err(ReplicaError::InvalidArgument(format!(
                "snapshot {} is {} bytes but the target volume is {} bytes",
                view.snapshot(),
                view.size_bytes(),
                req.expected_size
            )));
        }
        for (name, file) in view.layer_files() {
            files.push(describe(&dir.join(name), file)?);
        }
    } else {
        let file = crate::export::snapshot_file(&req.snapshot_file_name)?;
        if !replica.status()?.disks.contains_key(&file) {
            return Err(ReplicaError::NotFound(format!("snapshot {file}")));
        }
        let path = dir.join(&file);
        let f = File::open(&path).ctx("open", &path)?;
        let mut d = describe(&path, &f)?;
        if let Ok(Some(c)) = sparse_sync::record::read_valid(&path) {
            d.recorded_checksum = checksum_text(&c);
        }
        files.push(d);
    }
    Ok(v1::LocalFilesResponse {
        boot_id: boot_id()?,
        files,
    })
}

/// Why a listed file was not opened: the local path is refused, the network path is used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    /// The path is not an absolute, normalized path of a snapshot file.
    #[error("{0:?} is not an absolute path of a snapshot file without . or .. components")]
    BadPath(String),
    /// The files of one listing are in different directories.
    #[error("{0:?} is not in the directory of the other listed files")]
    OtherDirectory(String),
    /// The directory holds no replica.
    #[error("{0} holds no {VOLUME_META}: not a replica directory")]
    NotReplica(String),
    /// Opening failed (a symbolic link on the way, a missing file, another mount namespace).
    #[error("opening {path}: {source}")]
    Open { path: String, source: std::io::Error },
    /// The file opened is not the one listed.
    #[error("{path} is not the file the source listed: {what} differs")]
    Identity { path: String, what: &'static str },
}

fn open_no_symlinks(path: &Path, flags: OFlags) -> std::result::Result<File, std::io::Error> {
    let fd = rustix::fs::openat2(
        rustix::fs::CWD,
        path,
        // NONBLOCK: a FIFO or device under a listed name must not hang the open (it is refused right after).
        flags | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    Ok(File::from(fd))
}

/// Opens a file a source listed, refusing every path trick (see the module doc). `dir` is the directory of the
/// listing's earlier files, set by the first.
pub(crate) fn open_listed(
    listed: &v1::LocalFile,
    dir: &mut Option<PathBuf>,
) -> std::result::Result<(String, File), Refused> {
    let path = Path::new(&listed.path);
    let bad = || Refused::BadPath(listed.path.clone());
    let normalized: PathBuf = path.components().collect();
    if !path.is_absolute()
        || normalized.as_os_str() != path.as_os_str()
        || path
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(bad());
    }
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(bad)?;
    if names::snapshot_name(name).is_none() || names::head_index(name).is_some() {
        return Err(bad());
    }
    let parent = path.parent().ok_or_else(bad)?;
    match dir {
        Some(d) if d != parent => return Err(Refused::OtherDirectory(listed.path.clone())),
        Some(_) => {}
        None => {
            let meta = parent.join(VOLUME_META);
            let is_replica = open_no_symlinks(&meta, OFlags::RDONLY)
                .and_then(|f| f.metadata())
                .is_ok_and(|m| m.is_file());
            if !is_replica {
                return Err(Refused::NotReplica(parent.display().to_string()));
            }
            *dir = Some(parent.to_owned());
        }
    }
    let open = |source| Refused::Open {
        path: listed.path.clone(),
        source,
    };
    let file = open_no_symlinks(path, OFlags::RDONLY).map_err(open)?;
    let m = file.metadata().map_err(open)?;
    let differs = |what| Refused::Identity {
        path: listed.path.clone(),
        what,
    };
    if !m.is_file() {
        return Err(differs("file type"));
    }
    if (m.dev(), m.ino()) != (listed.dev, listed.ino) {
        return Err(differs("device/inode"));
    }
    if m.len() != listed.size {
        return Err(differs("size"));
    }
    if mtime_ns(&m) != listed.mtime_ns {
        return Err(differs("mtime"));
    }
    Ok((name.to_owned(), file))
}

/// A source's files opened on this host, held unchanged by the source until this is dropped.
#[derive(Debug)]
pub(crate) struct LocalSource {
    /// Directory of the files.
    pub(crate) dir: PathBuf,
    /// (file name, open file) in the listed order.
    pub(crate) files: Vec<(String, File)>,
    listed: Vec<v1::LocalFile>,
    lease: tonic::Streaming<v1::LocalFilesResponse>,
}

impl LocalSource {
    /// The source's recorded checksum of the (single) listed file, if any.
    pub(crate) fn recorded_checksum(&self) -> Option<&str> {
        self.listed
            .first()
            .map(|f| f.recorded_checksum.as_str())
            .filter(|c| !c.is_empty())
    }

    /// After the copy: the source still holds its files and none of them changed.
    pub(crate) fn confirm(mut self) -> std::result::Result<(), String> {
        if let Some(m) = self.lease.message().now_or_never() {
            return Err(format!(
                "the source released its files during the copy: {}",
                m.err()
                    .map_or_else(|| "stream ended".to_owned(), |s| s.message().to_owned())
            ));
        }
        for ((name, f), l) in self.files.iter().zip(&self.listed) {
            let m = f.metadata().map_err(|e| format!("stat {name}: {e}"))?;
            if m.len() != l.size || mtime_ns(&m) != l.mtime_ns {
                return Err(format!("{name} of the source changed during the copy"));
            }
        }
        Ok(())
    }
}

/// Asks `source` for the files of `req` and opens them here. `Err` says why the local path is not available (the
/// caller uses the network); it is never an error of the clone or rebuild itself.
pub(crate) async fn offer(
    source: &ReplicaAddress,
    req: v1::LocalFilesRequest,
    generation: u64,
) -> std::result::Result<LocalSource, String> {
    let ch = connect_endpoint(&source.sync, GrpcTimeouts::CONTROL)
        .await
        .map_err(|e| format!("source replica {source}: {e}"))?;
    let generation = corral_proto::engine_generation::EngineGeneration(generation);
    let mut lease = SyncAgentServiceClient::with_interceptor(ch, generation)
        .local_files(req)
        .await
        .map_err(|s| format!("LocalFiles on {source}: {}", s.message()))?
        .into_inner();
    let listing = lease
        .message()
        .await
        .map_err(|s| format!("LocalFiles on {source}: {}", s.message()))?
        .ok_or_else(|| format!("LocalFiles on {source} listed nothing"))?;
    let here = boot_id().map_err(|e| e.to_string())?;
    if listing.boot_id != here {
        return Err(format!("source replica {source} runs on another host"));
    }
    if listing.files.is_empty() {
        return Err(format!("LocalFiles on {source} listed no file"));
    }
    tokio::task::spawn_blocking(move || {
        let mut dir = None;
        let mut files = Vec::with_capacity(listing.files.len());
        for l in &listing.files {
            files.push(open_listed(l, &mut dir).map_err(|e| e.to_string())?);
        }
        Ok(LocalSource {
            dir: dir.unwrap_or_default(),
            files,
            listed: listing.files,
            lease,
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

impl LocalSource {
    /// Resolves when the source stops holding its files (it stopped, died, or closed the listing).
    async fn released(&mut self) -> String {
        match self.lease.message().await {
            Ok(None) => "the source closed its listing".to_owned(),
            Ok(Some(_)) => "the source sent an unexpected listing".to_owned(),
            Err(s) => s.message().to_owned(),
        }
    }

    /// Copies `content` (read from this source's files) into `dst` on a thread of its own at a lower CPU and IO
    /// priority (foreground IO of the replicas goes first): written to `tmp`, fsynced, renamed over `dst`; a failed
    /// or cancelled copy leaves nothing. The copy stops as soon as the source lets go of its files. `progress`
    /// advances in logical bytes.
    pub(crate) async fn copy(
        &mut self,
        content: Arc<dyn FileExtents>,
        (dst, tmp): (PathBuf, PathBuf),
        (max_rate, pace): (Option<u64>, Option<Arc<dyn Pace>>),
        progress: Arc<Progress>,
        cancel: &CancellationToken,
    ) -> std::result::Result<ExtentCopySummary, String> {
        let stop = cancel.child_token();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread_stop = stop.clone();
        std::thread::Builder::new()
            .name("local-copy".into())
            .spawn(move || {
                lower_priority();
                let result = (|| {
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .open(&tmp)
                        .map_err(|e| format!("create {}: {e}", tmp.display()))?;
                    let opts = ExtentCopyOptions { max_rate, pace };
                    let s = sparse_sync::copy_extents(&*content, &f, &opts, &progress, &thread_stop)
                        .map_err(|e| format!("copy into {}: {e}", tmp.display()))?;
                    corral_disk::durable::publish(&f, &tmp, &dst)
                        .map_err(|e| format!("publish {}: {e}", dst.display()))?;
                    Ok(s)
                })();
                if result.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                let _ = tx.send(result);
            })
            .map_err(|e| format!("local copy thread: {e}"))?;
        tokio::pin!(rx);
        tokio::select! {
            r = &mut rx => r.map_err(|_| "the local copy thread died".to_owned())?,
            why = self.released() => {
                stop.cancel();
                let _ = rx.await;
                Err(why)
            }
        }
    }
}

/// Lowers this thread's CPU priority (nice 10) and IO priority (best effort, lowest level). Advisory.
fn lower_priority() {
    // SAFETY: plain syscalls on the calling thread (`who` 0), no memory passed.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, u32::try_from(tid).unwrap_or(0), 10);
        // IOPRIO_WHO_PROCESS = 1; IOPRIO_CLASS_BE = 2 in the top 3 of 16 bits; level 7 is the lowest.
        let _ = libc::syscall(libc::SYS_ioprio_set, 1, tid, (2 << 13) | 7);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> (tempfile::TempDir, PathBuf, v1::LocalFile) {
        let t = tempfile::tempdir_in("/var/tmp").unwrap();
        let dir = std::fs::canonicalize(t.path()).unwrap().join("replica");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(VOLUME_META), b"{}").unwrap();
        let path = dir.join("volume-snap-s1.img");
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let f = File::open(&path).unwrap();
        let listed = describe(&path, &f).unwrap();
        (t, dir, listed)
    }

    #[test]
    fn a_listed_snapshot_file_opens_with_its_identity() {
        let (_t, _dir, listed) = fixture();
        let (name, _) = open_listed(&listed, &mut None).unwrap();
        assert_eq!(name, "volume-snap-s1.img");
    }

    #[test]
    fn path_tricks_are_refused() {
        let (t, dir, listed) = fixture();
        let with = |path: &str| v1::LocalFile {
            path: path.to_owned(),
            ..listed.clone()
        };
        let d = dir.display();
        // Relative, `..` and `.` components, and a name that is no snapshot file.
        for p in [
            "replica/volume-snap-s1.img".to_owned(),
            format!("{d}/../replica/volume-snap-s1.img"),
            format!("{d}/./volume-snap-s1.img"),
            format!("{d}//volume-snap-s1.img"),
            format!("{d}/volume.meta"),
            format!("{d}/volume-head-000.img"),
            "/etc/passwd".to_owned(),
        ] {
            let e = open_listed(&with(&p), &mut None).unwrap_err();
            assert!(matches!(e, Refused::BadPath(_)), "{p}: {e}");
        }
        // A symbolic link: as the file, and as a directory on the way, even when it leads to the listed file.
        std::os::unix::fs::symlink(dir.join("volume-snap-s1.img"), dir.join("volume-snap-link.img")).unwrap();
        let e = open_listed(&with(&format!("{d}/volume-snap-link.img")), &mut None).unwrap_err();
        assert!(matches!(e, Refused::Open { .. }), "{e}");
        let alias = t.path().join("alias");
        std::os::unix::fs::symlink(&dir, &alias).unwrap();
        let e = open_listed(
            &with(&format!("{}/volume-snap-s1.img", alias.display())),
            &mut None,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Refused::Open { .. } | Refused::NotReplica(_) | Refused::BadPath(_)
            ),
            "{e}"
        );
        // A snapshot-named file outside a replica directory.
        let outside = std::fs::canonicalize(t.path()).unwrap().join("volume-snap-x.img");
        std::fs::write(&outside, b"secret").unwrap();
        let f = File::open(&outside).unwrap();
        let e = open_listed(&describe(&outside, &f).unwrap(), &mut None).unwrap_err();
        assert!(matches!(e, Refused::NotReplica(_)), "{e}");
        // Another file than the one listed (its identity), a file changed since, and a second directory.
        std::fs::write(dir.join("volume-snap-s2.img"), vec![7u8; 8192]).unwrap();
        let e = open_listed(&with(&format!("{d}/volume-snap-s2.img")), &mut None).unwrap_err();
        assert!(
            matches!(
                e,
                Refused::Identity {
                    what: "device/inode",
                    ..
                }
            ),
            "{e}"
        );
        let e = open_listed(
            &v1::LocalFile {
                mtime_ns: listed.mtime_ns + 1,
                ..listed.clone()
            },
            &mut None,
        )
        .unwrap_err();
        assert!(matches!(e, Refused::Identity { what: "mtime", .. }), "{e}");
        let mut elsewhere = Some(PathBuf::from("/var/lib/other"));
        let e = open_listed(&listed, &mut elsewhere).unwrap_err();
        assert!(matches!(e, Refused::OtherDirectory(_)), "{e}");
    }
}
