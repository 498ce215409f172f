//! Restore of a backup into any [`RestoreSink`] (a replica, a plain file): `concurrency` blocks fetched at once,
//! each verified against its SHA-256 before it is written; ranges without blocks become holes. An incremental
//! restore (a standby volume that already holds an earlier backup of the same volume) writes only the blocks that
//! differ and zeroes the ones that became zeros. Each block is read, verified and written in one blocking call from
//! a reused 4 KiB-aligned buffer (no allocation or copy per block; `O_DIRECT` where the sink takes it).

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use tracing::info;

use crate::buf::{BufPool, DATA_AT};
use crate::config::{BackupConfig, BackupState, BlockRef};
use crate::error::{BackupStoreError, ErrorKind, Result};
use crate::local::local_error;
use crate::lock::LockKind;
use crate::{BackupStore, Progress, block, blockmap, join_error};
use std::os::unix::fs::FileExt;

/// Where restored data goes; called from blocking threads.
pub trait RestoreSink: Send + Sync + 'static {
    /// Writes `data` at `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()>;
    /// Makes `[offset, offset + len)` read as zeros, as a hole where the sink can.
    fn zero_range(&self, offset: u64, len: u64) -> std::io::Result<()>;
    /// The sink's size in bytes, when it can be larger than the backup: a restore makes everything past the
    /// backup's end read as zeros too (a smaller backup restored into a larger volume must not leave the
    /// volume's old data there). `None`: the sink is exactly the backup's size.
    fn size(&self) -> Option<u64> {
        None
    }
    /// Makes `[offset, offset + len)` read as zeros even where a backing image lies under the sink (a zero
    /// marker of the block map). Without a backing image this is `zero_range`.
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.zero_range(offset, len)
    }
}

/// Options of a restore.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Blocks in flight.
    pub concurrency: usize,
    /// The backup the sink already holds (incremental restore), if any.
    pub since: Option<String>,
    /// How long to wait for a conflicting deletion to finish.
    pub lock_wait: Duration,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self {
            concurrency: 8,
            since: None,
            lock_wait: Duration::from_secs(30),
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreOutcome {
    /// Backup restored.
    pub backup: String,
    /// Only the difference from `since` was applied.
    pub incremental: bool,
    /// Blocks fetched and written.
    pub blocks_written: u64,
    /// Their bytes.
    pub bytes_written: u64,
    /// Bytes made zero (holes).
    pub zeroed_bytes: u64,
}

/// A block that failed verification.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BadBlock {
    /// Volume offset.
    pub offset: u64,
    /// Expected SHA-256.
    pub hash: String,
    /// What failed.
    pub reason: String,
}

/// Result of verifying a backup.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyOutcome {
    /// Blocks read and checked.
    pub blocks_checked: u64,
    /// Blocks missing or damaged.
    pub bad: Vec<BadBlock>,
}

/// A stored block to restore: a file of a `file://` target (read in the blocking call) or an object fetched.
enum Fetched {
    Local(std::path::PathBuf),
    Remote(bytes::Bytes),
}

/// Reads (when local), verifies and writes one block (blocking): `want` bytes at `b.offset`.
fn restore_block(
    fetched: &Fetched,
    b: &BlockRef,
    want: u64,
    path: &object_store::path::Path,
    pool: &Arc<BufPool>,
    sink: &dyn RestoreSink,
) -> Result<u64> {
    let corrupt = |reason: String| BackupStoreError::Corrupt {
        path: path.to_string(),
        reason: format!("block at volume offset {}: {reason}", b.offset),
    };
    let mut local = None;
    let stored: &[u8] = match fetched {
        Fetched::Remote(bytes) => bytes,
        Fetched::Local(file) => {
            read_stored(file, local.insert(pool.get()).as_mut_slice()).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => corrupt("block missing".into()),
                std::io::ErrorKind::InvalidData => corrupt(e.to_string()),
                _ => BackupStoreError::store("get", path, local_error(e)),
            })?
        }
    };
    let mut scratch = (!block::is_stored_raw(stored)).then(|| pool.get());
    let out = scratch
        .as_mut()
        .map_or(&mut [][..], |s| &mut s.as_mut_slice()[DATA_AT..]);
    let data = block::decode_into(stored, &b.hash, out).map_err(corrupt)?;
    let len = data.len() as u64;
    if len != want {
        return Err(corrupt(format!("{len} bytes, expected {want}")));
    }
    sink.write_at(b.offset, data)
        .map_err(|source| BackupStoreError::SinkWrite {
            offset: b.offset,
            source,
        })?;
    Ok(len)
}

/// Reads the stored block `file` into `buf` so that its payload starts at [`DATA_AT`] (4 KiB-aligned); refuses
/// (`InvalidData`) a file larger than `buf` has room for, which no block of the volume's block size can be.
fn read_stored<'a>(file: &std::path::Path, buf: &'a mut [u8]) -> std::io::Result<&'a [u8]> {
    let f = std::fs::File::open(file)?;
    let n = f.metadata()?.len();
    let start = DATA_AT - block::BLOCK_HEADER_LEN;
    let room = buf.len() - start;
    let n = usize::try_from(n).ok().filter(|&n| n <= room).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("stored block is {n} bytes, more than a block of this volume can be"),
        )
    })?;
    let dst = &mut buf[start..start + n];
    f.read_exact_at(dst, 0)?;
    Ok(dst)
}

impl BackupStore {
    async fn complete_backup(&self, volume: &str, backup: &str) -> Result<BackupConfig> {
        let c = self.backup_config(volume, backup).await?;
        c.check().map_err(|reason| BackupStoreError::Corrupt {
            path: self.backup_cfg_path(volume, backup).to_string(),
            reason,
        })?;
        if c.state != BackupState::Complete {
            return Err(BackupStoreError::FailedPrecondition(format!(
                "backup {backup} of volume {volume} is not complete (in progress, or its upload was interrupted)"
            )));
        }
        Ok(c)
    }

    /// Restores `backup` of `volume` into `sink`.
    pub async fn restore(
        &self,
        volume: &str,
        backup: &str,
        sink: Arc<dyn RestoreSink>,
        opts: &RestoreOptions,
        progress: &Progress,
    ) -> Result<RestoreOutcome> {
        let lock = self.lock(volume, LockKind::Restore, opts.lock_wait).await?;
        let r = tokio::select! {
            r = self.restore_locked(volume, backup, sink, opts, progress) => r,
            e = lock.lost() => Err(e),
        };
        lock.release().await?;
        r
    }

    async fn restore_locked(
        &self,
        volume: &str,
        backup: &str,
        sink: Arc<dyn RestoreSink>,
        opts: &RestoreOptions,
        progress: &Progress,
    ) -> Result<RestoreOutcome> {
        let to = self.complete_backup(volume, backup).await?;
        let bs = to.block_size;
        let since = match &opts.since {
            Some(s) if s == backup => {
                return Err(BackupStoreError::FailedPrecondition(format!(
                    "backup {backup} is already restored here"
                )));
            }
            Some(s) => match self.complete_backup(volume, s).await {
                Ok(c) if c.block_size == bs => Some(c),
                Ok(_) => None,
                // The earlier backup was deleted: fall back to a full restore.
                Err(e) if e.kind() == ErrorKind::NotFound => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let (writes, mut zeros): (Vec<BlockRef>, Vec<std::ops::Range<u64>>) = match &since {
            Some(from) => {
                let d = blockmap::diff(&from.blocks, &to.blocks);
                let z = d
                    .zero
                    .iter()
                    .map(|&o| o..(o + bs).min(to.size))
                    .filter(|r| r.start < r.end)
                    .collect();
                (d.write, z)
            }
            None => (to.blocks.clone(), blockmap::holes(&to.blocks, bs, to.size)),
        };
        // Zero markers: zeros written over the backing image, made explicit (not holes).
        let (markers, writes): (Vec<BlockRef>, Vec<BlockRef>) =
            writes.into_iter().partition(BlockRef::is_zero);
        let explicit: Vec<std::ops::Range<u64>> = markers
            .iter()
            .map(|b| b.offset..(b.offset + bs).min(to.size))
            .collect();
        // Past the backup's end the volume held something else: the restored volume reads zeros there.
        if let Some(n) = sink.size().filter(|&n| n > to.size) {
            zeros.push(to.size..n);
        }
        info!(
            volume,
            backup,
            incremental = since.is_some(),
            blocks = writes.len(),
            zero_ranges = zeros.len(),
            "restore started"
        );
        progress.set_total(writes.len() as u64 + 1);
        let zeroed: u64 = zeros.iter().map(|r| r.end - r.start).sum();
        let zeroed = zeroed + explicit.iter().map(|r| r.end - r.start).sum::<u64>();
        let s = sink.clone();
        tokio::task::spawn_blocking(move || {
            for r in zeros {
                s.zero_range(r.start, r.end - r.start)
                    .map_err(|source| BackupStoreError::SinkWrite {
                        offset: r.start,
                        source,
                    })?;
            }
            for r in explicit {
                s.write_zeroes(r.start, r.end - r.start)
                    .map_err(|source| BackupStoreError::SinkWrite {
                        offset: r.start,
                        source,
                    })?;
            }
            Ok::<_, BackupStoreError>(())
        })
        .await
        .map_err(|e| join_error(&e))??;
        progress.step(0);
        let n = writes.len() as u64;
        let size = to.size;
        // One buffer per block in flight (and one more for a compressed block's data), reused: the stored block
        // is read with its payload 4 KiB-aligned, verified where it lies and written from there (O_DIRECT where
        // the sink takes it), in one blocking call.
        let pool = BufPool::new(
            DATA_AT + usize::try_from(bs).unwrap_or(usize::MAX),
            2 * opts.concurrency.max(1),
        );
        let bytes: u64 = futures::stream::iter(writes)
            .map(|b| {
                let (sink, pool) = (sink.clone(), pool.clone());
                async move {
                    progress.check()?;
                    let path = self.block_path(volume, &b.hash);
                    let fetched = match &self.local_root {
                        Some(root) => Fetched::Local(root.join(path.as_ref())),
                        None => Fetched::Remote(self.get_bytes(&path).await?.ok_or_else(|| {
                            BackupStoreError::Corrupt {
                                path: path.to_string(),
                                reason: format!("block at volume offset {}: block missing", b.offset),
                            }
                        })?),
                    };
                    let want = bs.min(size - b.offset);
                    let len = tokio::task::spawn_blocking(move || {
                        restore_block(&fetched, &b, want, &path, &pool, sink.as_ref())
                    })
                    .await
                    .map_err(|e| join_error(&e))??;
                    progress.step(len);
                    Ok::<_, BackupStoreError>(len)
                }
            })
            .buffer_unordered(opts.concurrency.max(1))
            .try_fold(0, |acc, l| async move { Ok(acc + l) })
            .await?;
        info!(volume, backup, bytes, "restore complete");
        Ok(RestoreOutcome {
            backup: backup.to_owned(),
            incremental: since.is_some(),
            blocks_written: n,
            bytes_written: bytes,
            zeroed_bytes: zeroed,
        })
    }

    /// Reads every block of a backup and checks it; never stops at the first bad one.
    pub async fn verify(&self, volume: &str, backup: &str, concurrency: usize) -> Result<VerifyOutcome> {
        let c = self.complete_backup(volume, backup).await?;
        let stored: Vec<BlockRef> = c.blocks.into_iter().filter(|b| !b.is_zero()).collect();
        let n = stored.len() as u64;
        let bad: Vec<BadBlock> = futures::stream::iter(stored)
            .map(|b| async move {
                match self.read_block(volume, &b.hash).await {
                    Ok(_) => Ok(None),
                    Err(BackupStoreError::Corrupt { reason, .. }) => Ok(Some(BadBlock {
                        offset: b.offset,
                        hash: b.hash,
                        reason,
                    })),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(concurrency.max(1))
            .try_filter_map(|x| async move { Ok(x) })
            .try_collect()
            .await?;
        let mut bad = bad;
        bad.sort_by_key(|b| b.offset);
        Ok(VerifyOutcome {
            blocks_checked: n,
            bad,
        })
    }
}
