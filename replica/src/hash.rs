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

use sha2::{Digest, Sha512};

use corral_disk::{BLOCK_BYTES, BLOCK_SIZE};

use crate::error::{IoContext, ReplicaError, Result};
use crate::jobs::JobControl;
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
    let mut h = Sha512::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    for r in sparse_sync::data_extents(file, 0..len) {
        let r = r?;
        let mut pos = r.start - r.start % BLOCK_SIZE;
        let end = r.end.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        while pos < end {
            if ctl.is_cancelled() {
                return Ok(None);
            }
            let n = usize::try_from((end - pos).min(CHUNK as u64)).unwrap_or(CHUNK);
            let chunk = &mut buf[..n];
            let got = read_up_to(file, chunk, pos)?;
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

impl Replica {
    /// Hashes a snapshot and records the result (blocking). Skips the work when the recorded ctime matches,
    /// unless `rehash`; a rehash that disagrees with an unchanged-ctime record flags silent corruption.
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
        let ctime = ctime_of(&file).ctx("stat", &path)?;
        let rec_name = names::checksum_file(&snap);
        let record: Option<ChecksumRecord> = load_json(&self.dir.join(&rec_name))?;
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
        let Some(sum) = checksum_file(&file, ctl).ctx("read", &path)? else {
            return Err(ReplicaError::Cancelled);
        };
        if ctime_of(&file).ctx("stat", &path)? != ctime {
            return Err(ReplicaError::FailedPrecondition(format!(
                "{snap} changed while it was hashed"
            )));
        }
        if let Some(mut r) = record
            && same_ctime
            && r.checksum != sum
        {
            tracing::error!(
                dir = %self.dir.display(), snapshot = %snap, recorded = %r.checksum, computed = %sum,
                "silent corruption: snapshot content changed without its ctime changing"
            );
            r.silently_corrupted = true;
            write_json_atomic(&self.dir, &rec_name, &r)?;
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
        write_json_atomic(&self.dir, &rec_name, &r)?;
        Ok(HashOutcome {
            checksum: sum,
            skipped: false,
            silently_corrupted: false,
        })
    }
}
