//! Block objects of a `file://` target, written without one fsync per object but with the same guarantee: a block
//! file appears under its final name only once its data is durable, and every block of a backup is durable (name
//! included) before the backup's record says `complete`.
//!
//! A block is written to a temporary file beside its final name (`<hash>.blk#<digits>`: the object store's own
//! staging suffix, which listings skip). Once the staged blocks hold [`FLUSH_BYTES`], one `syncfs` of the target's
//! filesystem makes them durable (their data, inodes and the new directories), and only then are they renamed to
//! their final names (also once the group's oldest block waited [`FLUSH_AGE`]); [`StagedBlocks::finish`] does this for the rest and one more `syncfs` makes the renames
//! durable, before the caller writes the backup's record. One `syncfs` per group replaces a file fsync and a
//! directory fsync per block (a journal commit each on ext4); it also flushes whatever else is dirty on that
//! filesystem, which a target on a busy shared filesystem pays for.
//!
//! Memory: only the paths of at most one group of staged blocks. A backup that fails removes its staged files; a
//! killed one leaves at most a group of them, invisible to listings and restores; GC removes them
//! ([`remove_stale_staged`]).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// Staged bytes that trigger a group's `syncfs` and renames.
pub(crate) const FLUSH_BYTES: u64 = 64 << 20;
/// A group is also published once its oldest block waited this long: a slow (rate-limited) backup's blocks become
/// visible soon after they are written, so a rerun after a kill deduplicates them.
pub(crate) const FLUSH_AGE: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug, Default)]
struct Group {
    files: Vec<(PathBuf, PathBuf)>,
    bytes: u64,
    since: Option<std::time::Instant>,
}

/// An IO error of a direct file:// access, as the object store reports its own.
pub(crate) fn local_error(e: io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "LocalFileSystem",
        source: Box::new(e),
    }
}

/// Blocks staged under one `file://` target's directory.
#[derive(Debug)]
pub(crate) struct StagedBlocks {
    root: PathBuf,
    group: Mutex<Group>,
}

fn staging_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    // Digits only after '#': object_store's LocalFileSystem treats such files as in-progress uploads and never
    // lists them.
    s.push(format!("#{}", uuid::Uuid::new_v4().as_u128()));
    s.into()
}

impl StagedBlocks {
    /// Stages blocks under `root` (the target's directory).
    pub(crate) fn new(root: PathBuf) -> Self {
        Self {
            root,
            group: Mutex::new(Group::default()),
        }
    }

    fn group(&self) -> std::sync::MutexGuard<'_, Group> {
        self.group.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes `stored` (a whole stored block) to a staging file for `dest` (blocking). When the staged blocks reach
    /// [`FLUSH_BYTES`], makes them durable and renames them (the caller's thread does it; other blocks keep being
    /// staged meanwhile). A 4 KiB-aligned `stored` is written with `O_DIRECT` up to its last whole 4 KiB (no copy
    /// into the page cache) where the file system takes it, its tail buffered.
    pub(crate) fn write(&self, dest: PathBuf, stored: &[u8]) -> io::Result<()> {
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = staging_path(&dest);
        let res = write_new(&tmp, stored);
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let full = {
            let mut g = self.group();
            g.files.push((tmp, dest));
            g.bytes += stored.len() as u64;
            let since = *g.since.get_or_insert_with(std::time::Instant::now);
            (g.bytes >= FLUSH_BYTES || since.elapsed() >= FLUSH_AGE).then(|| std::mem::take(&mut *g))
        };
        match full {
            Some(g) => self.publish(&g),
            None => Ok(()),
        }
    }

    fn sync(&self) -> io::Result<()> {
        let dir = File::open(&self.root)?;
        rustix::fs::syncfs(&dir).map_err(io::Error::from)
    }

    /// Durable first, then visible under the final name.
    fn publish(&self, g: &Group) -> io::Result<()> {
        if g.files.is_empty() {
            return Ok(());
        }
        let res = self.sync().and_then(|()| {
            g.files
                .iter()
                .try_for_each(|(tmp, dest)| std::fs::rename(tmp, dest))
        });
        if res.is_err() {
            for (tmp, _) in &g.files {
                let _ = std::fs::remove_file(tmp);
            }
        }
        res
    }

    /// Publishes the blocks still staged and makes every rename durable (blocking): after this returns, every
    /// block written through [`Self::write`] is durable under its final name.
    pub(crate) fn finish(&self) -> io::Result<()> {
        let g = std::mem::take(&mut *self.group());
        self.publish(&g)?;
        // The renames of earlier groups and of this one.
        self.sync()
    }
}

/// Creates `path` (which must not exist) holding `data`: its 4 KiB-aligned whole pages through `O_DIRECT` when
/// `data` starts 4 KiB-aligned and the file system takes it, the rest buffered.
fn write_new(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let align = corral_disk::sparse::DIRECT_IO_ALIGN;
    let direct_len = if (data.as_ptr() as usize).is_multiple_of(align) {
        data.len() / align * align
    } else {
        0
    };
    let open = |flags| {
        File::options()
            .write(true)
            .create_new(true)
            .custom_flags(flags)
            .open(path)
    };
    let mut written = 0;
    let f = if direct_len > 0 {
        match open(libc::O_DIRECT) {
            Ok(f) => {
                match f.write_all_at(&data[..direct_len], 0) {
                    Ok(()) => written = direct_len,
                    // Refused at write time: everything goes through the page cache.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(e) => return Err(e),
                }
                rustix::fs::fcntl_setfl(&f, rustix::fs::OFlags::empty()).map_err(io::Error::from)?;
                f
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0)?,
            Err(e) => return Err(e),
        }
    } else {
        open(0)?
    };
    f.write_all_at(&data[written..], written as u64)
}

impl Drop for StagedBlocks {
    fn drop(&mut self) {
        // A failed or cancelled backup: its staged files are never published.
        for (tmp, _) in std::mem::take(&mut self.group().files) {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Whether `name` is a staged block (`<hash>.blk#<digits>`) that [`StagedBlocks`] writes and a killed backup leaves.
fn is_staged_block(name: &str) -> bool {
    name.split_once(".blk#")
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the staged blocks under `dir` last modified before `cutoff` (blocking): what backups killed before
/// publishing them left. Called by GC, which holds the volume's `deletion` lock, so no backup of the volume is
/// staging meanwhile; the age check is a second guard. Returns how many it removed.
pub(crate) fn remove_stale_staged(dir: &Path, cutoff: std::time::SystemTime) -> io::Result<u64> {
    let mut removed = 0;
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let ty = entry.file_type()?;
            if ty.is_dir() {
                dirs.push(entry.path());
            } else if ty.is_file()
                && entry.file_name().to_str().is_some_and(is_staged_block)
                && entry.metadata()?.modified()? <= cutoff
            {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn a_block_gets_its_name_only_when_published_and_a_dropped_group_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("blocks/ab/cd");
        let s = StagedBlocks::new(dir.path().to_owned());
        s.write(d.join("x.blk"), b"data").unwrap();
        let staged = names(&d);
        assert_eq!(staged.len(), 1, "{staged:?}");
        assert!(
            staged[0].starts_with("x.blk#"),
            "staged under a hidden name: {staged:?}"
        );
        s.finish().unwrap();
        assert_eq!(names(&d), ["x.blk"]);
        assert_eq!(std::fs::read(d.join("x.blk")).unwrap(), b"data");

        // A group fills: published without waiting for finish.
        let big = vec![7u8; usize::try_from(FLUSH_BYTES).unwrap()];
        s.write(d.join("y.blk"), &big).unwrap();
        assert_eq!(names(&d), ["x.blk", "y.blk"]);

        // A backup that fails before finish: its staged files go away with it.
        s.write(d.join("z.blk"), b"zz").unwrap();
        assert_eq!(names(&d).len(), 3);
        drop(s);
        assert_eq!(names(&d), ["x.blk", "y.blk"]);
    }

    #[test]
    fn an_aligned_block_is_written_direct_and_its_tail_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let s = StagedBlocks::new(dir.path().to_owned());
        let len = 2 * corral_disk::sparse::DIRECT_IO_ALIGN + 52;
        let mut buf = corral_disk::sparse::AlignedBuf::new(len);
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = u8::try_from(i % 251).unwrap();
        }
        let data = &buf.as_slice()[..len];
        s.write(dir.path().join("a.blk"), data).unwrap();
        // Shorter than one page, and not aligned: buffered only.
        s.write(dir.path().join("b.blk"), &data[1..100]).unwrap();
        s.finish().unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.blk")).unwrap(), data);
        assert_eq!(std::fs::read(dir.path().join("b.blk")).unwrap(), &data[1..100]);
    }

    #[test]
    fn only_old_staged_blocks_are_removed() {
        let t = tempfile::tempdir().unwrap();
        let sub = t.path().join("ab/cd");
        std::fs::create_dir_all(&sub).unwrap();
        for n in ["abcd.blk#123", "abcd.blk", "abcd.blk#", "abcd.blk#12x", "other#5"] {
            std::fs::write(sub.join(n), b"x").unwrap();
        }
        // Nothing is older than a cutoff in the past.
        let past = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        assert_eq!(remove_stale_staged(t.path(), past).unwrap(), 0);
        let future = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        assert_eq!(remove_stale_staged(t.path(), future).unwrap(), 1);
        let mut left: Vec<_> = std::fs::read_dir(&sub)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["abcd.blk", "abcd.blk#", "abcd.blk#12x", "other#5"]);
        assert_eq!(remove_stale_staged(&t.path().join("missing"), future).unwrap(), 0);
    }
}
