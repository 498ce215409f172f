//! [`FileSink`]: writes a byte stream (a download, an upload) to a file on a dedicated blocking thread, leaving
//! all-zero 4 KiB blocks as holes, while a second thread computes the stream's SHA-512 (zeros included), so the
//! checksum is ready when the last byte is: no second pass over the file. The async side batches chunks into
//! 1 MiB buffers (shared, not copied, between the two threads) and hands them over through bounded channels, so
//! memory stays bounded whatever the stream's size and the network never waits on one write or one hash.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
// Blocks whose bytes are all zero are not written (the file keeps a hole there).
use corral_disk::BLOCK_BYTES;
use sha2::{Digest, Sha512};
use tokio::sync::{mpsc, oneshot};

use crate::error::JobError;

/// Bytes batched before a hand-over to the writer thread.
const BATCH: usize = 1 << 20;
/// Batches in flight between the stream and the writer thread.
const DEPTH: usize = 4;

enum Cmd {
    Data(Bytes),
    /// Drop everything written so far (a server that cannot resume: start again from byte 0).
    Reset,
    /// Write the tail, size the file, fdatasync; reply with the size.
    Finish(oneshot::Sender<Result<u64, JobError>>),
}

enum HashCmd {
    Data(Bytes),
    Reset,
    Finish(oneshot::Sender<String>),
}

fn hash_stream(mut rx: mpsc::Receiver<HashCmd>) {
    let mut h = Sha512::new();
    while let Some(cmd) = rx.blocking_recv() {
        match cmd {
            HashCmd::Data(b) => h.update(&b),
            HashCmd::Reset => h = Sha512::new(),
            HashCmd::Finish(reply) => {
                let _ = reply.send(hex::encode(h.finalize()));
                return;
            }
        }
    }
}

/// What a finished sink holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// Bytes written (the file's size).
    pub size: u64,
    /// SHA-512 (hex) of those bytes.
    pub sha512: String,
}

/// A file being written from a stream; see the module doc.
pub struct FileSink {
    tx: mpsc::Sender<Cmd>,
    hash_tx: mpsc::Sender<HashCmd>,
    buf: BytesMut,
    /// Bytes accepted so far (= the offset the stream continues at).
    len: u64,
    error: Arc<Mutex<Option<String>>>,
    path: PathBuf,
}

impl FileSink {
    /// Creates (truncating) `path` and starts its writer thread.
    pub fn create(path: &Path) -> Result<FileSink, JobError> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| JobError::io("creating", path, e))?;
        let (tx, rx) = mpsc::channel(DEPTH);
        let error = Arc::new(Mutex::new(None));
        let mut writer = Writer {
            file,
            path: path.to_path_buf(),
            offset: 0,
            carry: Vec::with_capacity(BLOCK_BYTES),
        };
        let err_slot = error.clone();
        tokio::task::spawn_blocking(move || writer.run(rx, &err_slot));
        let (hash_tx, hash_rx) = mpsc::channel(DEPTH);
        tokio::task::spawn_blocking(move || hash_stream(hash_rx));
        Ok(FileSink {
            tx,
            hash_tx,
            buf: BytesMut::with_capacity(BATCH),
            len: 0,
            error,
            path: path.to_path_buf(),
        })
    }

    /// Bytes accepted so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True before the first byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn broken(&self) -> JobError {
        let reason = self
            .error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| "the writer thread stopped".into());
        JobError::io("writing", &self.path, std::io::Error::other(reason))
    }

    async fn send(&self, cmd: Cmd) -> Result<(), JobError> {
        self.tx.send(cmd).await.map_err(|_| self.broken())
    }

    async fn send_hash(&self, cmd: HashCmd) -> Result<(), JobError> {
        self.hash_tx
            .send(cmd)
            .await
            .map_err(|_| JobError::Task("the checksum thread stopped".into()))
    }

    /// Appends `chunk`.
    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), JobError> {
        self.buf.extend_from_slice(chunk);
        self.len += chunk.len() as u64;
        if self.buf.len() >= BATCH {
            let batch = self.buf.split().freeze();
            self.send_hash(HashCmd::Data(batch.clone())).await?;
            self.send(Cmd::Data(batch)).await?;
        }
        Ok(())
    }

    /// Forgets everything written: the file is empty again.
    pub async fn reset(&mut self) -> Result<(), JobError> {
        self.buf.clear();
        self.len = 0;
        self.send_hash(HashCmd::Reset).await?;
        self.send(Cmd::Reset).await
    }

    /// Writes what is buffered, sizes the file to the bytes accepted and flushes it.
    pub async fn finish(mut self) -> Result<Finished, JobError> {
        if !self.buf.is_empty() {
            let batch = self.buf.split().freeze();
            self.send_hash(HashCmd::Data(batch.clone())).await?;
            self.send(Cmd::Data(batch)).await?;
        }
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Finish(tx)).await?;
        let size = rx.await.map_err(|_| self.broken())??;
        let (tx, rx) = oneshot::channel();
        self.send_hash(HashCmd::Finish(tx)).await?;
        let sha512 = rx
            .await
            .map_err(|_| JobError::Task("the checksum thread stopped".into()))?;
        Ok(Finished { size, sha512 })
    }
}

struct Writer {
    file: File,
    path: PathBuf,
    /// File offset of `carry[0]`; always a multiple of `BLOCK_BYTES`.
    offset: u64,
    /// The start of a block not complete yet.
    carry: Vec<u8>,
}

impl Writer {
    fn run(&mut self, mut rx: mpsc::Receiver<Cmd>, err: &Mutex<Option<String>>) {
        while let Some(cmd) = rx.blocking_recv() {
            let r = match cmd {
                Cmd::Data(b) => self.data(&b),
                Cmd::Reset => self.reset(),
                Cmd::Finish(reply) => {
                    let _ = reply.send(self.finish());
                    return;
                }
            };
            if let Err(e) = r {
                if let Ok(mut slot) = err.lock() {
                    *slot = Some(e.to_string());
                }
                return;
            }
        }
    }

    fn data(&mut self, mut b: &[u8]) -> Result<(), JobError> {
        if !self.carry.is_empty() {
            let take = (BLOCK_BYTES - self.carry.len()).min(b.len());
            self.carry.extend_from_slice(&b[..take]);
            b = &b[take..];
            if self.carry.len() < BLOCK_BYTES {
                return Ok(());
            }
            let block = std::mem::take(&mut self.carry);
            self.write_blocks(&block)?;
            self.carry = block;
            self.carry.clear();
        }
        let whole = b.len() - b.len() % BLOCK_BYTES;
        self.write_blocks(&b[..whole])?;
        self.carry.extend_from_slice(&b[whole..]);
        Ok(())
    }

    /// Writes whole blocks at `offset`, skipping all-zero ones and coalescing the rest into few writes.
    fn write_blocks(&mut self, b: &[u8]) -> Result<(), JobError> {
        let mut run_start: Option<usize> = None;
        for (i, block) in b.chunks(BLOCK_BYTES).enumerate() {
            let zero = block.iter().all(|&x| x == 0);
            match (zero, run_start) {
                (false, None) => run_start = Some(i * BLOCK_BYTES),
                (true, Some(s)) => {
                    self.pwrite(&b[s..i * BLOCK_BYTES], s)?;
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            self.pwrite(&b[s..], s)?;
        }
        self.offset += b.len() as u64;
        Ok(())
    }

    /// Writes `run`, which starts `at` bytes after `offset`.
    fn pwrite(&self, run: &[u8], at: usize) -> Result<(), JobError> {
        let pos = self.offset + at as u64;
        self.file
            .write_all_at(run, pos)
            .map_err(|e| JobError::io("writing", &self.path, e))
    }

    fn reset(&mut self) -> Result<(), JobError> {
        self.file
            .set_len(0)
            .map_err(|e| JobError::io("truncating", &self.path, e))?;
        self.offset = 0;
        self.carry.clear();
        Ok(())
    }

    fn finish(&mut self) -> Result<u64, JobError> {
        let tail = std::mem::take(&mut self.carry);
        let end = self.offset + tail.len() as u64;
        if tail.iter().any(|&x| x != 0) {
            self.file
                .write_all_at(&tail, self.offset)
                .map_err(|e| JobError::io("writing", &self.path, e))?;
        }
        self.file
            .set_len(end)
            .map_err(|e| JobError::io("sizing", &self.path, e))?;
        self.file
            .sync_data()
            .map_err(|e| JobError::io("flushing", &self.path, e))?;
        Ok(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[tokio::test]
    async fn odd_chunks_land_in_place_and_zero_blocks_stay_holes() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("f");
        // 4 MiB: data in the first and last 64 KiB and one unaligned 10-byte run in the middle, zeros elsewhere.
        let mut want = vec![0u8; 4 << 20];
        want[..65536].fill(1);
        want[(2 << 20) + 5..(2 << 20) + 15].fill(2);
        let n = want.len();
        want[n - 65536..].fill(3);
        want.truncate(n - 100); // an unaligned end
        let mut sink = FileSink::create(&path).unwrap();
        // Write "garbage" first, then reset: a server that cannot resume.
        sink.write(&[7u8; 5000]).await.unwrap();
        sink.reset().await.unwrap();
        assert!(sink.is_empty());
        for chunk in want.chunks(4093) {
            sink.write(chunk).await.unwrap();
        }
        assert_eq!(sink.len(), want.len() as u64);
        let done = sink.finish().await.unwrap();
        assert_eq!(done.size, want.len() as u64);
        assert_eq!(
            done.sha512,
            hex::encode(Sha512::digest(&want)),
            "the reset dropped the first bytes"
        );
        assert_eq!(std::fs::read(&path).unwrap(), want);
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(
            allocated <= 256 << 10,
            "zero blocks were written: {allocated} bytes allocated"
        );
    }

    #[tokio::test]
    async fn a_write_error_is_reported_with_the_path() {
        // Every write to /dev/full fails with ENOSPC.
        let path = Path::new("/dev/full");
        let mut sink = FileSink::create(path).unwrap();
        let mut err = None;
        for _ in 0..16 {
            if let Err(e) = sink.write(&[1u8; BATCH]).await {
                err = Some(e);
                break;
            }
        }
        let err = match err {
            Some(e) => e,
            None => sink.finish().await.unwrap_err(),
        };
        let msg = err.to_string();
        assert!(msg.contains("/dev/full") && msg.contains("space"), "{msg}");
    }
}
