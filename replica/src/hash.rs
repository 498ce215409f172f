//! Snapshot checksums: recorded in `<snapshot>.img.checksum` with the file's ctime, so a rebuild can skip a whole
//! file whose checksum matches the source's and a rehash can detect silent corruption.
//!
//! Method `sha512-layout`: SHA-512 over the file size (u64 LE), then, for every allocated 4 KiB block (inside a
//! `SEEK_DATA` extent), its block index (u64 LE) followed by its 4096 bytes (the last block zero-padded). Holes do
//! not contribute, so the cost follows the data, not the file size (Longhorn's CRC64 reads every byte of a 1 TiB
//! sparse file). Allocation is part of the checksum on purpose: in a chain layer a hole means "not written here"
//! (the parent shows through) while an allocated zero block hides the parent, so two layers with equal bytes but
//! different holes are different layers, and a rebuild must not skip one for the other.
//!
//! The record (`<snapshot>.img.checksum`) is sparse-sync's [`ChecksumRecord`], the same file whole-file skip reads.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};

use std::sync::Arc;

use corral_proto::v1;
use sha2::{Digest, Sha512};

use corral_disk::{BLOCK_BYTES, BLOCK_SIZE};

use crate::error::{IoContext, ReplicaError, Result};
use crate::jobs::{JobControl, JobState, JobStatus, JobTable};
use sparse_sync::record::ChecksumRecord;

use crate::meta::{load_json, now_rfc3339, write_json_atomic};
use crate::names;
use crate::replica::Replica;

/// Checksum method name written to records.
pub const METHOD: &str = "sha512-layout";
const CHUNK: usize = 1 << 20;

/// Result of a hash job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashOutcome {
    /// Hex checksum (the recorded one when corruption was detected).
    pub checksum: String,
    /// The recorded checksum was reused: ctime unchanged and no rehash asked.
    pub skipped: bool,
    /// Rehash with an unchanged ctime gave another checksum.
    pub silently_corrupted: bool,
}

fn ctime_of(file: &File) -> std::io::Result<String> {
    let md = file.metadata()?;
    Ok(format!("{}.{:09}", md.ctime(), md.ctime_nsec()))
}

/// Computes the `sha512-layout` checksum of an open file, checking `ctl` for cancellation.
pub fn checksum_file(file: &File, ctl: &JobControl) -> std::io::Result<Option<String>> {
    let len = file.metadata()?.len();
    layout_checksum(
        len,
        corral_disk::sparse::data_extents(file, 0..len),
        |buf, off| read_up_to(file, buf, off),
        ctl,
    )
}

/// The `sha512-layout` checksum of sparse content (a v2 snapshot lvol's own blocks, the layout of a v1 snapshot
/// file), so a v1 file and the v2 lvol received from it (or sent to it) hash the same.
pub fn checksum_content(
    content: &dyn corral_disk::sparse::SparseRead,
    ctl: &JobControl,
) -> std::io::Result<Option<String>> {
    let len = content.size();
    layout_checksum(
        len,
        content.data_ranges(0..len),
        |buf, off| {
            let n = usize::try_from(len.saturating_sub(off)).map_or(buf.len(), |left| left.min(buf.len()));
            content.read_exact_at(&mut buf[..n], off)?;
            Ok(n)
        },
        ctl,
    )
}

/// SHA-512 over `len`, then every 4 KiB block touching `ranges` (index, bytes; the part past what `read` returns
/// zero-padded). `None` when cancelled.
fn layout_checksum(
    len: u64,
    ranges: impl Iterator<Item = std::io::Result<std::ops::Range<u64>>>,
    read: impl Fn(&mut [u8], u64) -> std::io::Result<usize>,
    ctl: &JobControl,
) -> std::io::Result<Option<String>> {
    let mut h = Sha512::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    for r in ranges {
        let r = r?;
        let mut pos = r.start - r.start % BLOCK_SIZE;
        let end = r.end.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        while pos < end {
            if ctl.is_cancelled() {
                return Ok(None);
            }
            let n = usize::try_from((end - pos).min(CHUNK as u64)).unwrap_or(CHUNK);
            let chunk = &mut buf[..n];
            let got = read(chunk, pos)?;
            chunk[got..].fill(0);
            for (i, block) in chunk.chunks(BLOCK_BYTES).enumerate() {
                h.update((pos / BLOCK_SIZE + i as u64).to_le_bytes());
                h.update(block);
            }
            pos += n as u64;
            done += n as u64;
            ctl.set_progress(u32::try_from(done.min(len) * 100 / len.max(1)).unwrap_or(100));
        }
    }
    Ok(Some(hex::encode(h.finalize())))
}

fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

/// Where a replica keeps a snapshot's [`ChecksumRecord`] and what tells it the snapshot changed: a v1 replica's
/// `<snapshot>.img.checksum` beside the file and the file's ctime, a v2 replica's `corral.checksum` xattr on the
/// snapshot lvol and the lvol's identity (`super::v2::hash`).
pub(crate) trait ChecksumStore {
    /// The recorded checksum, if any.
    fn record(&self) -> Result<Option<ChecksumRecord>>;
    /// Replaces the record (crash-atomic).
    fn save(&self, record: &ChecksumRecord) -> Result<()>;
    /// The snapshot's change marker now (a v1 file's ctime).
    fn change_time(&self) -> Result<String>;
    /// The `sha512-layout` checksum of the snapshot's own blocks; `None` when cancelled.
    fn compute(&self, ctl: &JobControl) -> Result<Option<String>>;
    /// Names the snapshot in errors and logs.
    fn describe(&self) -> String;
}

/// Hashes a snapshot and records the result (blocking). Skips the work when the recorded change marker matches,
/// unless `rehash`; a rehash that disagrees with an unchanged-marker record flags silent corruption.
pub(crate) fn hash_recorded(s: &dyn ChecksumStore, rehash: bool, ctl: &JobControl) -> Result<HashOutcome> {
    let ctime = s.change_time()?;
    let record = s.record()?;
    let same_ctime = record
        .as_ref()
        .is_some_and(|r| r.method == METHOD && r.change_time == ctime);
    if let Some(r) = &record
        && same_ctime
        && !rehash
    {
        return Ok(HashOutcome {
            checksum: r.checksum.clone(),
            skipped: true,
            silently_corrupted: r.silently_corrupted,
        });
    }
    let Some(sum) = s.compute(ctl)? else {
        return Err(ReplicaError::Cancelled);
    };
    if s.change_time()? != ctime {
        return Err(ReplicaError::FailedPrecondition(format!(
            "{} changed while it was hashed",
            s.describe()
        )));
    }
    if let Some(mut r) = record
        && same_ctime
        && r.checksum != sum
    {
        tracing::error!(
            snapshot = %s.describe(), recorded = %r.checksum, computed = %sum,
            "silent corruption: snapshot content changed without its change marker changing"
        );
        r.silently_corrupted = true;
        s.save(&r)?;
        return Ok(HashOutcome {
            checksum: r.checksum,
            skipped: false,
            silently_corrupted: true,
        });
    }
    let r = ChecksumRecord {
        method: METHOD.into(),
        checksum: sum.clone(),
        change_time: ctime,
        last_hashed_at: now_rfc3339(),
        silently_corrupted: false,
    };
    s.save(&r)?;
    Ok(HashOutcome {
        checksum: sum,
        skipped: false,
        silently_corrupted: false,
    })
}

/// A v1 snapshot file and its record file.
struct SnapshotFile {
    dir: std::path::PathBuf,
    snap: String,
    file: File,
}

impl ChecksumStore for SnapshotFile {
    fn record(&self) -> Result<Option<ChecksumRecord>> {
        load_json(&self.dir.join(names::checksum_file(&self.snap)))
    }

    fn save(&self, record: &ChecksumRecord) -> Result<()> {
        write_json_atomic(&self.dir, &names::checksum_file(&self.snap), record)
    }

    fn change_time(&self) -> Result<String> {
        ctime_of(&self.file).ctx("stat", self.dir.join(&self.snap))
    }

    fn compute(&self, ctl: &JobControl) -> Result<Option<String>> {
        checksum_file(&self.file, ctl).ctx("read", self.dir.join(&self.snap))
    }

    fn describe(&self) -> String {
        self.dir.join(&self.snap).display().to_string()
    }
}

impl Replica {
    /// Hashes a snapshot and records the result (blocking), see `hash_recorded`.
    pub fn hash_snapshot(&self, name: &str, rehash: bool, ctl: &JobControl) -> Result<HashOutcome> {
        let snap = names::resolve_snapshot(name)?;
        {
            let chain = self.chain_read_open()?;
            if !chain.disks.contains_key(&snap) {
                return Err(ReplicaError::NotFound(format!("snapshot {snap}")));
            }
        }
        let path = self.dir.join(&snap);
        let file = File::open(&path).ctx("open", &path)?;
        hash_recorded(
            &SnapshotFile {
                dir: self.dir.clone(),
                snap,
                file,
            },
            rehash,
            ctl,
        )
    }
}

/// Job key of a snapshot's hash in a replica's [`JobTable`].
fn job_key(file: &str) -> String {
    format!("hash/{file}")
}

/// `SnapshotHash` of a v1 or v2 replica: runs `hash` in the background as the hash job of `snapshot_name`
/// (refused while one runs), recording its outcome in the table `jobs` gives.
pub(crate) fn start_job<H: Send + Sync + 'static>(
    host: Arc<H>,
    jobs: fn(&H) -> &JobTable,
    snapshot_name: &str,
    hash: impl FnOnce(&str, &JobControl) -> Result<HashOutcome> + Send + 'static,
) -> Result<()> {
    let file = names::resolve_snapshot(snapshot_name)?;
    let key = job_key(&file);
    let Some(ctl) = jobs(&host).start(&key) else {
        return Err(ReplicaError::FailedPrecondition(format!(
            "{file} is already being hashed"
        )));
    };
    tokio::task::spawn_blocking(move || {
        let status = match hash(&file, &ctl) {
            Ok(o) => {
                tracing::info!(snapshot = %file, checksum = %o.checksum, skipped = o.skipped, "snapshot hashed");
                JobStatus {
                    state: JobState::Complete,
                    checksum: o.checksum,
                    silently_corrupted: o.silently_corrupted,
                    skipped: o.skipped,
                    ..Default::default()
                }
            }
            Err(e) => crate::model::job_failure(&e),
        };
        jobs(&host).finish(&key, status);
    });
    Ok(())
}

/// `SnapshotHashStatus`: the hash job of `snapshot_name` in `jobs`.
pub(crate) fn job_status(jobs: &JobTable, snapshot_name: &str) -> Result<v1::SnapshotHashStatusResponse> {
    let file = names::resolve_snapshot(snapshot_name)?;
    let s = jobs.status(&job_key(&file));
    Ok(v1::SnapshotHashStatusResponse {
        state: s.state.as_str().to_owned(),
        progress: s.progress,
        checksum: s.checksum,
        error: s.error,
        silently_corrupted: s.silently_corrupted,
        skipped: s.skipped,
    })
}

/// `SnapshotHashCancel`: cancels the running hash job of `snapshot_name` in `jobs`.
pub(crate) fn cancel_job(jobs: &JobTable, snapshot_name: &str) -> Result<()> {
    let file = names::resolve_snapshot(snapshot_name)?;
    if jobs.cancel(&job_key(&file)) {
        Ok(())
    } else {
        Err(ReplicaError::FailedPrecondition(format!(
            "no hash of {file} is running"
        )))
    }
}
