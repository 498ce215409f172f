//! Creating a backup: the chain policy decides full or incremental, the source names the changed ranges, and
//! `concurrency` blocks are read, hashed, compressed and uploaded at once. The backup's record is written
//! `in-progress` first and `complete` (with the block map) only after every block is stored, so a killed backup
//! never leaves a record that claims completion.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use tracing::{info, warn};

use bytes::Bytes;

use crate::block::{
    BLOCK_HEADER_LEN, Compression, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, block_hash,
    block_header, compress_into, max_compressed_len, worth_compressing,
};
use crate::buf::{BufPool, PooledBuf};
use crate::config::{
    BackupConfig, BackupState, BackupStats, FORMAT_VERSION, FullReason, VolumeConfig, ZERO_MARKER,
};
use crate::error::{BackupStoreError, Result};
use crate::local::{StagedBlocks, local_error};
mod policy;

use crate::{BackupStore, GcOptions, Progress, blockmap, join_error, now_rfc3339, validate_name};

/// The snapshot being backed up.
#[derive(Debug, Clone, Default)]
pub struct SnapshotInfo {
    /// Snapshot name.
    pub name: String,
    /// Creation time (RFC 3339).
    pub created: String,
    /// Its ancestors, nearest first.
    pub ancestors: Vec<String>,
}

/// What changed in the source since the last backed-up snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changes {
    /// Byte ranges that may differ, computed from local snapshot `diff_from` (empty: from the chain's bottom).
    Since {
        /// The surviving snapshot the ranges are relative to.
        diff_from: String,
        /// Ranges that may hold changed data.
        ranges: Vec<Range<u64>>,
    },
    /// The last backed-up snapshot is not an ancestor of this one (a revert): the chain ends, a full follows.
    ChainEnded(String),
    /// Neither the last backed-up snapshot nor any of its recorded ancestors exists on the volume any more:
    /// there is nothing to compute changes from, a full follows.
    BaseMissing(String),
}

/// A snapshot to back up, read with blocking IO (the store calls it from blocking threads).
pub trait BackupSource: Send + Sync + 'static {
    /// Volume size in bytes.
    fn size(&self) -> u64;
    /// The snapshot.
    fn snapshot(&self) -> SnapshotInfo;
    /// Ranges holding data (what a full backup reads).
    fn allocated(&self) -> std::io::Result<Vec<Range<u64>>>;
    /// Ranges that may differ from `base` (the snapshot of the last backup; `base_ancestors` are its ancestors
    /// recorded then, nearest first, to find a surviving diff base when `base` was deleted locally).
    fn changes_since(&self, base: &str, base_ancestors: &[String]) -> std::io::Result<Changes>;
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
    /// Why the volume's backup chain was ended since its last backup (a backup was restored into it), if it
    /// was: the next backup is full. The replica keeps this marker beside its data.
    fn chain_ended(&self) -> Option<String> {
        None
    }
    /// A backing image lies under the volume: a block the snapshot's own layers hold as zeros hides backing
    /// data, and is recorded as a zero marker (restored as explicit zeros) instead of being left out.
    fn zero_hides_backing(&self) -> bool {
        false
    }
}

/// Full or incremental.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackupMode {
    /// Incremental unless the chain policy says full.
    #[default]
    Auto,
    /// Read everything and upload every block again.
    Full,
    /// Incremental even past `delta_max`; fails when no base exists.
    Incremental,
}

impl std::str::FromStr for BackupMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" | "auto" => Ok(Self::Auto),
            "full" => Ok(Self::Full),
            "incremental" => Ok(Self::Incremental),
            _ => Err(format!("unknown backup mode {s:?} (auto, full, incremental)")),
        }
    }
}

/// Options of one backup.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Backup volume name.
    pub volume: String,
    /// Backup name.
    pub name: String,
    /// Mode.
    pub mode: BackupMode,
    /// `backup-delta-max`: backups per chain, the full one included (0 and 1: every backup is full).
    pub delta_max: u32,
    /// `backup-incremental`: false makes every backup full, each ending its own chain.
    pub incremental: bool,
    /// `backup-max-count`: refuse a new backup when the volume already has this many completed backups (after
    /// the ones `retain` will delete are discounted).
    pub max_count: Option<u32>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Keep only this many completed backups of the volume (oldest deleted after this one completes).
    pub retain: Option<u32>,
    /// Blocks in flight.
    pub concurrency: usize,
    /// Block size of a new backup volume (an existing volume keeps its own).
    pub block_size: Option<u64>,
    /// Compression of a new backup volume.
    pub compression: Option<Compression>,
    /// Backing image name and checksum (`sha512:HEX`), recorded in the backup's record and `volume.cfg`.
    pub backing_image: Option<(String, String)>,
    /// Upload at most this many bytes of block data (before compression) per second (0: unlimited).
    pub max_upload_rate: u64,
    /// How long to wait for a conflicting deletion to finish.
    pub lock_wait: Duration,
    /// Garbage collection settings for retention deletes.
    pub gc: GcOptions,
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            volume: String::new(),
            name: String::new(),
            mode: BackupMode::Auto,
            delta_max: crate::config::DEFAULT_DELTA_MAX,
            incremental: true,
            max_count: None,
            labels: BTreeMap::new(),
            retain: None,
            concurrency: 8,
            block_size: None,
            compression: None,
            backing_image: None,
            max_upload_rate: 0,
            lock_wait: Duration::from_secs(30),
            gc: GcOptions::default(),
        }
    }
}

/// Refuses a new backup when the volume already has `max` completed backups, counting only those that stay
/// after `retain` deletes the oldest once the new backup completes (retention runs before the limit).
fn check_max_count(volume: &str, completed: usize, max: u32, retain: Option<u32>) -> Result<()> {
    let staying = match retain {
        Some(keep) => completed.min(usize::try_from(keep.max(1) - 1).unwrap_or(usize::MAX)),
        None => completed,
    };
    if staying >= usize::try_from(max).unwrap_or(usize::MAX) {
        return Err(BackupStoreError::FailedPrecondition(format!(
            "backup volume {volume} has {completed} completed backups and backup-max-count is {max}: \
             delete backups (or lower the retention) before creating another"
        )));
    }
    Ok(())
}

/// A block size a new backup volume can take: a power of two from [`MIN_BLOCK_SIZE`] (4 KiB) to [`MAX_BLOCK_SIZE`]
/// (16 MiB).
pub fn check_block_size(bs: u64) -> Result<u64> {
    if (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) && bs.is_power_of_two() {
        Ok(bs)
    } else {
        Err(BackupStoreError::InvalidArgument(format!(
            "block size {bs}: a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}"
        )))
    }
}

/// Block-aligned offsets covering `ranges`, clipped to `size`.
fn block_offsets(ranges: &[Range<u64>], bs: u64, size: u64) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for r in ranges {
        let mut o = r.start / bs * bs;
        while o < r.end.min(size) {
            out.insert(o);
            o += bs;
        }
    }
    out
}

/// Result of reading one block.
enum Read {
    Zero,
    /// The data at `data[BLOCK_HEADER_LEN..][..len]`.
    Data {
        hash: String,
        data: PooledBuf,
    },
}

/// The stored block (header and payload) of the `len` bytes of data at `data[BLOCK_HEADER_LEN..]`: the header is
/// written in front of the data when it is stored raw, so the block is one 4 KiB-aligned slice of `data`; a
/// compressed block is assembled in a buffer taken from `pool` into `scratch`. Compression is tried only when
/// [`worth_compressing`] says so (not on random data).
fn encode_in_buffer<'a>(
    data: &'a mut PooledBuf,
    len: usize,
    hash: &str,
    method: Compression,
    pool: &Arc<BufPool>,
    scratch: &'a mut Option<PooledBuf>,
) -> &'a [u8] {
    const H: usize = BLOCK_HEADER_LEN;
    let raw = &data.as_slice()[H..H + len];
    if worth_compressing(raw, method) {
        let out = scratch.insert(pool.get());
        if let Some(c) = compress_into(raw, method, &mut out.as_mut_slice()[H..]) {
            out.as_mut_slice()[..H].copy_from_slice(&block_header(method, len, c, hash));
            return &out.as_slice()[..H + c];
        }
    }
    let header = block_header(Compression::None, len, len, hash);
    data.as_mut_slice()[..H].copy_from_slice(&header);
    &data.as_slice()[..H + len]
}

struct Throttle {
    rate: u64,
    start: Instant,
    sent: Mutex<u64>,
}

impl Throttle {
    async fn account(&self, n: u64) {
        if self.rate == 0 {
            return;
        }
        let total = {
            let mut s = self.sent.lock().unwrap_or_else(PoisonError::into_inner);
            *s += n;
            *s
        };
        #[allow(clippy::cast_precision_loss)] // a pacing target, not an exact count
        let due = Duration::from_secs_f64(total as f64 / self.rate as f64);
        if let Some(wait) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

impl BackupStore {
    /// Ends the volume's current backup chain: its newest completed backup records `endOfChain` with `reason`,
    /// so the next backup is full (`chain-ended`). Call it after reverting the volume or restoring a backup into
    /// it. Returns the backup marked (`None` when the volume has no completed backup).
    pub async fn end_chain(&self, volume: &str, reason: &str) -> Result<Option<String>> {
        validate_name("volume", volume)?;
        let newest = self
            .list_backups(volume)
            .await?
            .into_iter()
            .filter(|b| b.state == BackupState::Complete)
            .max_by(|a, b| (&a.completed, &a.name).cmp(&(&b.completed, &b.name)));
        let Some(b) = newest else {
            return Ok(None);
        };
        self.mark_end_of_chain(volume, &b.name, FullReason::ChainEnded(reason.to_owned()))
            .await?;
        info!(volume, backup = %b.name, reason, "backup chain ended");
        Ok(Some(b.name))
    }

    async fn mark_end_of_chain(&self, volume: &str, backup: &str, reason: FullReason) -> Result<()> {
        let p = self.backup_cfg_path(volume, backup);
        let Some(mut c) = self.get_json::<BackupConfig>(&p).await? else {
            return Err(BackupStoreError::NotFound(format!(
                "backup {backup} of volume {volume}"
            )));
        };
        c.end_of_chain = true;
        c.chain_end_reason = Some(reason);
        self.put_json(&p, &c).await
    }

    /// Backs up `source` into `opts.volume` and returns the completed record.
    pub async fn create_backup(
        &self,
        source: Arc<dyn BackupSource>,
        opts: &CreateOptions,
        progress: &Progress,
    ) -> Result<BackupConfig> {
        validate_name("volume", &opts.volume)?;
        validate_name("backup", &opts.name)?;
        let concurrency = opts.concurrency.max(1);
        // The backup lock names the backup: a second process creating the same name waits or fails here, so the
        // "already exists" check below cannot pass in both.
        let lock = self.lock_backup(&opts.volume, &opts.name, opts.lock_wait).await?;
        // A lost lock (not refreshed, or removed by another process) stops the upload: a deletion may already
        // be collecting the blocks this backup references.
        let result = tokio::select! {
            r = self.create_locked(source, opts, concurrency, progress, &lock) => r,
            e = lock.lost() => Err(e),
        };
        lock.release().await?;
        let cfg = result?;
        if let Some(n) = opts.retain {
            self.apply_retention(&opts.volume, n, &cfg.name, &opts.gc).await?;
        }
        Ok(cfg)
    }

    async fn create_locked(
        &self,
        source: Arc<dyn BackupSource>,
        opts: &CreateOptions,
        concurrency: usize,
        progress: &Progress,
        lock: &crate::lock::VolumeLock,
    ) -> Result<BackupConfig> {
        let volume = opts.volume.as_str();
        let size = source.size();
        let snap = source.snapshot();
        let cfg_path = self.backup_cfg_path(volume, &opts.name);
        if self.exists(&cfg_path).await? {
            return Err(BackupStoreError::FailedPrecondition(format!(
                "backup {} of volume {volume} already exists",
                opts.name
            )));
        }
        let mut vol = self.volume_config_or_new(opts).await?;
        let bs = vol.block_size;
        let last = self.newest_complete(opts).await?;
        let delta_max = opts.delta_max.max(1);
        let src = source.clone();
        let chain_ended = blocking(move || Ok(src.chain_ended())).await?;
        let decision = match policy::decide(
            last.as_ref(),
            opts.mode,
            opts.incremental,
            chain_ended.as_deref(),
            delta_max,
        ) {
            policy::Decision::Full(reason) => Err(reason),
            policy::Decision::On(l) => self.changes_since_base(volume, l, bs, &source).await?,
        };
        let (base, diff_from, ranges, full_reason) = match decision {
            Ok((base, diff_from, ranges)) => (Some(base), diff_from, ranges, None),
            Err(reason) => {
                if opts.mode == BackupMode::Incremental {
                    return Err(BackupStoreError::FailedPrecondition(format!(
                        "an incremental backup is not possible: {reason}"
                    )));
                }
                (None, String::new(), allocated(&source).await?, Some(reason))
            }
        };
        let chain_position = base.as_ref().map_or(0, |b| b.chain_position + 1);
        let chain_end_reason = policy::chain_end(opts.incremental, chain_position, delta_max);
        let (bi_name, bi_sum) = opts.backing_image.clone().unwrap_or_default();
        let mut cfg = BackupConfig {
            format_version: FORMAT_VERSION,
            name: opts.name.clone(),
            volume: volume.to_owned(),
            state: BackupState::InProgress,
            snapshot: snap.name.clone(),
            snapshot_created: snap.created.clone(),
            snapshot_ancestors: snap.ancestors.clone(),
            started: now_rfc3339(),
            completed: String::new(),
            size,
            block_size: bs,
            compression: vol.compression,
            labels: opts.labels.clone(),
            is_incremental: base.is_some(),
            chain_position,
            full_reason: full_reason.clone(),
            end_of_chain: chain_end_reason.is_some(),
            chain_end_reason,
            backing_image_name: bi_name,
            backing_image_checksum: bi_sum,
            base_backup: base.as_ref().map(|b| b.name.clone()).unwrap_or_default(),
            diff_from_snapshot: diff_from,
            stats: BackupStats::default(),
            blocks: Vec::new(),
        };
        if self.get_bytes(&self.volume_cfg_path(volume)).await?.is_none() {
            self.put_json(&self.volume_cfg_path(volume), &vol).await?;
        }
        self.put_json(&cfg_path, &cfg).await?; // the in-progress marker
        let offsets = block_offsets(&ranges, bs, size);
        info!(
            volume, backup = %opts.name, snapshot = %snap.name, full = base.is_none(), reason = ?full_reason,
            base = %cfg.base_backup, diff_from = %cfg.diff_from_snapshot, blocks = offsets.len(),
            "backup started"
        );
        progress.set_total(offsets.len() as u64);
        let up = Upload {
            volume,
            size,
            bs,
            full: base.is_none(),
            method: vol.compression,
            zero_marker: source.zero_hides_backing(),
            concurrency,
        };
        let (changes, stats) = self
            .upload_blocks(&source, &up, offsets, opts.max_upload_rate, progress)
            .await?;

        let base_blocks = base.as_ref().map_or(&[][..], |b| &b.blocks[..]);
        cfg.blocks = blockmap::merge(base_blocks, &changes, size);
        cfg.stats = stats;
        cfg.state = BackupState::Complete;
        cfg.completed = now_rfc3339();
        lock.check()?;
        self.put_json(&cfg_path, &cfg).await?; // commit point
        self.after_commit(opts, &cfg, &mut vol, last.as_ref()).await;
        info!(
            volume, backup = %cfg.name, incremental = cfg.is_incremental, chain_position = cfg.chain_position,
            new_blocks = cfg.stats.new_blocks, new_bytes = cfg.stats.new_bytes, "backup complete"
        );
        Ok(cfg)
    }

    /// The backup volume's `volume.cfg`, or a new one from `opts` (not written yet).
    async fn volume_config_or_new(&self, opts: &CreateOptions) -> Result<VolumeConfig> {
        let volume = opts.volume.as_str();
        if let Some(v) = self
            .get_json::<VolumeConfig>(&self.volume_cfg_path(volume))
            .await?
        {
            return Ok(v);
        }
        Ok(VolumeConfig {
            format_version: FORMAT_VERSION,
            name: volume.to_owned(),
            block_size: check_block_size(opts.block_size.unwrap_or(DEFAULT_BLOCK_SIZE))?,
            compression: opts.compression.unwrap_or_default(),
            created: now_rfc3339(),
            ..Default::default()
        })
    }

    /// The newest completed backup of the volume (the base of an incremental), after refusing a new one past
    /// `backup-max-count`.
    async fn newest_complete(&self, opts: &CreateOptions) -> Result<Option<BackupConfig>> {
        let done: Vec<BackupConfig> = self
            .list_backups(&opts.volume)
            .await?
            .into_iter()
            .filter(|b| b.state == BackupState::Complete)
            .collect();
        if let Some(max) = opts.max_count {
            check_max_count(&opts.volume, done.len(), max, opts.retain)?;
        }
        Ok(done
            .into_iter()
            .max_by(|a, b| (&a.completed, &a.name).cmp(&(&b.completed, &b.name))))
    }

    /// The ranges to read for an incremental on `l`: `Ok((base, diff_from, ranges))`, or `Err(reason)` when the
    /// source finds the chain ended or its base gone (a full follows). A base record that fails its check is an
    /// error: nothing is built on it.
    async fn changes_since_base(
        &self,
        volume: &str,
        l: &BackupConfig,
        bs: u64,
        source: &Arc<dyn BackupSource>,
    ) -> Result<std::result::Result<(BackupConfig, String, Vec<Range<u64>>), FullReason>> {
        l.check()
            .and_then(|()| {
                (l.block_size == bs)
                    .then_some(())
                    .ok_or_else(|| format!("block size {} differs from the volume's {bs}", l.block_size))
            })
            .map_err(|reason| BackupStoreError::Corrupt {
                path: self.backup_cfg_path(volume, &l.name).to_string(),
                reason,
            })?;
        let (src, base, anc) = (source.clone(), l.snapshot.clone(), l.snapshot_ancestors.clone());
        Ok(match blocking(move || src.changes_since(&base, &anc)).await? {
            Changes::ChainEnded(why) => Err(FullReason::ChainEnded(why)),
            Changes::BaseMissing(why) => Err(FullReason::BaseMissing(why)),
            Changes::Since { diff_from, ranges } if diff_from == l.snapshot => {
                Ok((l.clone(), diff_from, ranges))
            }
            // The base snapshot is gone locally: the ranges are relative to a surviving ancestor, whose content is
            // not the base backup's (the base may have been reverted away before it was deleted, so what it wrote
            // is in no layer of this chain). Read every allocated block and every block of the base map;
            // unchanged ones deduplicate against the store.
            Changes::Since { diff_from, .. } => {
                let mut r = allocated(source).await?;
                r.extend(l.blocks.iter().map(|b| b.offset..b.offset + bs));
                Ok((l.clone(), diff_from, r))
            }
        })
    }

    /// Reads, hashes, compresses and stores the blocks at `offsets`, `up.concurrency` at once; returns the block
    /// map's changes (offset → hash, `None` for a zero block left out) and the statistics. Every block is durable
    /// under its final name when this returns.
    async fn upload_blocks(
        &self,
        source: &Arc<dyn BackupSource>,
        up: &Upload<'_>,
        offsets: BTreeSet<u64>,
        max_upload_rate: u64,
        progress: &Progress,
    ) -> Result<(BTreeMap<u64, Option<String>>, BackupStats)> {
        let staged = self
            .local_root
            .as_ref()
            .map(|r| (Arc::new(StagedBlocks::new(r.clone())), r.clone()));
        // One buffer per block in flight (two while a compressible block is encoded), reused.
        let pool = BufPool::new(
            BLOCK_HEADER_LEN + max_compressed_len(usize::try_from(up.bs).unwrap_or(usize::MAX)),
            2 * up.concurrency,
        );
        let ctx = BlockCtx {
            up,
            source,
            progress,
            staged: &staged,
            pool: &pool,
            stats: Mutex::new(BackupStats::default()),
            seen: Mutex::new(HashSet::new()),
            throttle: Throttle {
                rate: max_upload_rate,
                start: Instant::now(),
                sent: Mutex::new(0),
            },
        };
        let changes: BTreeMap<u64, Option<String>> = futures::stream::iter(offsets)
            .map(|off| self.upload_block(&ctx, off))
            .buffer_unordered(up.concurrency)
            .try_collect()
            .await?;
        // Every block durable under its final name before the record says complete.
        if let Some((staged, _)) = &staged {
            let st = staged.clone();
            tokio::task::spawn_blocking(move || st.finish())
                .await
                .map_err(|e| join_error(&e))?
                .map_err(|e| BackupStoreError::store("put", &self.blocks_dir(up.volume), local_error(e)))?;
        }
        Ok((
            changes,
            ctx.stats.into_inner().unwrap_or_else(PoisonError::into_inner),
        ))
    }

    /// One block: read it, leave it out (or mark it) when zero, store it unless an identical block is already in
    /// the store (an incremental) or was stored by this backup.
    async fn upload_block(&self, ctx: &BlockCtx<'_>, off: u64) -> Result<(u64, Option<String>)> {
        let up = ctx.up;
        ctx.progress.check()?;
        let len = up.bs.min(up.size - off);
        let blen = usize::try_from(len).unwrap_or(usize::MAX);
        let (src, p) = (ctx.source.clone(), ctx.pool.clone());
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Read> {
            // Read into a reused buffer, after room for the stored block's header (see `encode_in_buffer`).
            let mut buf = p.get();
            let data = &mut buf.as_mut_slice()[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + blen];
            src.read_at(off, data)?;
            if data.iter().all(|&b| b == 0) {
                return Ok(Read::Zero);
            }
            Ok(Read::Data {
                hash: block_hash(data),
                data: buf,
            })
        })
        .await
        .map_err(|e| join_error(&e))?
        .map_err(|source| BackupStoreError::SourceRead { offset: off, source })?;
        let lock_stats = || ctx.stats.lock().unwrap_or_else(PoisonError::into_inner);
        lock_stats().read_bytes += len;
        let (hash, data) = match read {
            Read::Zero => {
                lock_stats().zero_blocks += 1;
                ctx.progress.step(len);
                return Ok((off, up.zero_marker.then(|| ZERO_MARKER.to_owned())));
            }
            Read::Data { hash, data } => (hash, data),
        };
        let first_here = ctx
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(hash.clone());
        let path = self.block_path(up.volume, &hash);
        let existed = if first_here {
            self.exists(&path).await?
        } else {
            true
        };
        if first_here && (up.full || !existed) {
            ctx.throttle.account(len).await;
            let n = self.store_block(ctx, &path, data, blen, hash.clone()).await?;
            let mut s = lock_stats();
            if existed {
                s.reuploaded_blocks += 1;
                s.reuploaded_bytes += len;
            } else {
                s.new_blocks += 1;
                s.new_bytes += len;
                s.new_stored_bytes += n;
            }
        } else {
            lock_stats().deduplicated_blocks += 1;
        }
        ctx.progress.step(len);
        Ok((off, Some(hash)))
    }

    /// Encodes the `blen` bytes of `data` and stores them at `path`; returns the stored length.
    async fn store_block(
        &self,
        ctx: &BlockCtx<'_>,
        path: &object_store::path::Path,
        data: PooledBuf,
        blen: usize,
        hash: String,
    ) -> Result<u64> {
        let (method, pool) = (ctx.up.method, ctx.pool.clone());
        match ctx.staged {
            // file://: encoded and written in one blocking call from where the data lies (no copy; O_DIRECT where
            // the file system takes it), made durable in groups (see `local`).
            Some((staged, root)) => {
                let (staged, dest) = (staged.clone(), root.join(path.as_ref()));
                tokio::task::spawn_blocking(move || {
                    let (mut data, mut scratch) = (data, None);
                    let stored = encode_in_buffer(&mut data, blen, &hash, method, &pool, &mut scratch);
                    staged.write(dest, stored).map(|()| stored.len() as u64)
                })
                .await
                .map_err(|e| join_error(&e))?
                .map_err(|e| BackupStoreError::store("put", path, local_error(e)))
            }
            None => {
                let enc = tokio::task::spawn_blocking(move || {
                    let (mut data, mut scratch) = (data, None);
                    Bytes::copy_from_slice(encode_in_buffer(
                        &mut data,
                        blen,
                        &hash,
                        method,
                        &pool,
                        &mut scratch,
                    ))
                })
                .await
                .map_err(|e| join_error(&e))?;
                let n = enc.len() as u64;
                self.put_bytes(path, enc).await?;
                Ok(n)
            }
        }
    }

    /// After the commit point: `volume.cfg`'s last-backup fields (a cache: a failure is only logged) and, for a
    /// full backup, the end of the previous chain (recorded for listings).
    async fn after_commit(
        &self,
        opts: &CreateOptions,
        cfg: &BackupConfig,
        vol: &mut VolumeConfig,
        last: Option<&BackupConfig>,
    ) {
        let volume = opts.volume.as_str();
        vol.size = cfg.size;
        vol.last_backup_name.clone_from(&cfg.name);
        vol.last_backup_at.clone_from(&cfg.completed);
        vol.labels.clone_from(&cfg.labels);
        if let Some((n, c)) = &opts.backing_image {
            vol.backing_image_name.clone_from(n);
            vol.backing_image_checksum.clone_from(c);
        }
        if let Err(e) = self.put_json(&self.volume_cfg_path(volume), vol).await {
            warn!(volume, error = %e, "updating volume.cfg failed");
        }
        if let (Some(reason), Some(prev)) = (&cfg.full_reason, last)
            && !prev.end_of_chain
            && let Err(e) = self.mark_end_of_chain(volume, &prev.name, reason.clone()).await
        {
            warn!(volume, backup = %prev.name, error = %e, "recording the end of the previous chain failed");
        }
    }
}

/// What every block of one backup shares.
struct Upload<'a> {
    volume: &'a str,
    size: u64,
    bs: u64,
    /// A full backup stores every block again, even one the store holds.
    full: bool,
    method: Compression,
    /// A zero block is recorded as [`ZERO_MARKER`] (a backing image lies under the volume), not left out.
    zero_marker: bool,
    concurrency: usize,
}

/// The state the blocks in flight share.
struct BlockCtx<'a> {
    up: &'a Upload<'a>,
    source: &'a Arc<dyn BackupSource>,
    progress: &'a Progress,
    staged: &'a Option<(Arc<StagedBlocks>, std::path::PathBuf)>,
    pool: &'a Arc<BufPool>,
    stats: Mutex<BackupStats>,
    seen: Mutex<HashSet<String>>,
    throttle: Throttle,
}

/// `f` on a blocking thread; an IO error is a read of the source.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| join_error(&e))?
        .map_err(|source| BackupStoreError::SourceRead { offset: 0, source })
}

/// The ranges holding data (what a full backup reads).
async fn allocated(source: &Arc<dyn BackupSource>) -> Result<Vec<Range<u64>>> {
    let src = source.clone();
    blocking(move || src.allocated()).await
}
