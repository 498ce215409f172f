//! The transmission phase of one connection: a pipeline of one reader, `max_in_flight` workers and one
//! writer.
//!
//! - The **reader** parses request headers, validates them against the export, reads write payloads into
//!   pooled buffers and queues the work on a bounded channel. Invalid requests are answered directly (write
//!   payloads are drained first, so the stream stays in sync). When every worker is busy and the queue is
//!   full the reader stops reading the socket: that is the backpressure a client sees.
//! - Each **worker** takes one request at a time, calls the device and hands the reply to the writer. The
//!   workers are spawned once per connection, so a request costs no task spawn; buffers come from a
//!   per-connection [`BufferPool`], so a warm connection allocates nothing per read or write.
//! - The **writer** serialises replies in completion order (the protocol matches them by cookie) and flushes
//!   its buffer only when no further reply is ready, so replies completed together leave in one syscall.
//!
//! NBD_CMD_DISC, end of stream or server shutdown stop the reader; queued and running requests still complete
//! and their replies are sent before the socket is shut down. A request with a bad magic closes the
//! connection (the stream can no longer be framed), as does any socket error.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use data_protocol::{BufferPool, PooledBuf};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use super::handshake::Negotiated;
use super::metrics::{CommandKind, NbdCounters};
use super::wire::{
    BASE_ALLOCATION_ID, REQUEST_HEADER_LEN, RequestHeader, STATE_HOLE, STATE_ZERO, WireError, cflag, chunk,
    cmd, errno,
};
use super::{Allocation, BlockDevice, DeviceError, DeviceErrorKind};

/// Longest error message sent in a structured ERROR chunk (the spec caps strings at 4096 bytes).
const MAX_ERROR_MESSAGE: usize = 1024;
/// Idle buffer capacity a connection keeps for reuse.
const POOL_RETAINED_BYTES: usize = 64 << 20;
/// How long replies still owed at shutdown may take to reach a client.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Why a connection ended abnormally.
#[derive(Debug, Error)]
pub(crate) enum ConnectionError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("protocol violation: {0}")]
    Protocol(#[from] WireError),
}

/// Per-connection settings fixed at handshake time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transmission {
    pub negotiated: Negotiated,
    pub read_only: bool,
    pub max_block: u32,
    pub max_in_flight: usize,
}

struct Work {
    header: RequestHeader,
    kind: CommandKind,
    payload: Option<PooledBuf>,
}

enum ReplyBody {
    Done,
    Data(PooledBuf),
    Extents(Vec<(u32, u32)>),
    Error { errno: u32, message: String },
}

struct Reply {
    cookie: u64,
    offset: u64,
    body: ReplyBody,
}

/// Runs the transmission phase until the client disconnects, the server shuts down or the stream breaks.
pub(crate) async fn transmit<D, R, W>(
    device: Arc<D>,
    t: Transmission,
    reader: R,
    writer: W,
    counters: Arc<NbdCounters>,
    shutdown: CancellationToken,
) -> Result<(), ConnectionError>
where
    D: BlockDevice,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let stop = shutdown.child_token();
    let pool = BufferPool::new(POOL_RETAINED_BYTES);
    let workers_n = t.max_in_flight.max(1);
    let (work_tx, work_rx) = mpsc::channel::<Work>(1);
    let (reply_tx, reply_rx) = mpsc::channel::<Reply>(workers_n);
    let work_rx = Arc::new(Mutex::new(work_rx));

    let writer = tokio::spawn(
        write_replies(writer, reply_rx, t.negotiated.structured_replies, stop.clone()).in_current_span(),
    );
    let mut workers = JoinSet::new();
    for _ in 0..workers_n {
        let worker = run_worker(
            device.clone(),
            work_rx.clone(),
            reply_tx.clone(),
            pool.clone(),
            t.negotiated.structured_replies,
            counters.clone(),
        );
        workers.spawn(worker.in_current_span());
    }

    let read_result = read_requests(&*device, t, reader, &pool, &work_tx, &reply_tx, &counters, &stop).await;
    // Let queued and running requests finish, then the writer drains their replies and exits.
    drop(work_tx);
    drop(reply_tx);
    while workers.join_next().await.is_some() {}
    let write_result = match writer.await {
        Ok(r) => r,
        Err(join) => Err(io::Error::other(format!("reply writer task failed: {join}"))),
    };
    read_result?;
    write_result?;
    Ok(())
}

/// The reader: returns when the client disconnects (DISC or EOF) or the connection is stopped.
#[allow(clippy::too_many_arguments)] // the pipeline's shared parts, borrowed rather than bundled
async fn read_requests<D: BlockDevice, R: AsyncRead + Unpin>(
    device: &D,
    t: Transmission,
    reader: R,
    pool: &BufferPool,
    work_tx: &mpsc::Sender<Work>,
    reply_tx: &mpsc::Sender<Reply>,
    counters: &NbdCounters,
    stop: &CancellationToken,
) -> Result<(), ConnectionError> {
    let mut rd = BufReader::with_capacity(64 * 1024, reader);
    loop {
        let mut raw = [0u8; REQUEST_HEADER_LEN];
        match read_or_stop(stop, rd.read_exact(&mut raw)).await {
            None => return Ok(()),
            Some(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                debug!("client closed the connection without NBD_CMD_DISC");
                return Ok(());
            }
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(_)) => {}
        }
        let header = match RequestHeader::parse(&raw) {
            Ok(h) => h,
            Err(e) => {
                counters
                    .protocol_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Err(e.into());
            }
        };
        let kind = command_kind(header.command);
        match check_request(&header, device.size(), t) {
            Ok(Action::Disconnect) => {
                debug!("client sent NBD_CMD_DISC");
                return Ok(());
            }
            Ok(Action::Execute) => {
                let payload = if header.command == cmd::WRITE {
                    let mut buf = pool.get(header.length as usize);
                    match read_or_stop(stop, rd.read_exact(&mut buf)).await {
                        None => return Ok(()),
                        Some(r) => r?,
                    };
                    Some(buf)
                } else {
                    None
                };
                let work = Work {
                    header,
                    kind,
                    payload,
                };
                // Blocks while every worker is busy (backpressure); a stopped connection gives up waiting.
                if !matches!(read_or_stop(stop, work_tx.send(work)).await, Some(Ok(()))) {
                    return Ok(());
                }
            }
            Err((code, message)) => {
                debug!(
                    command = header.command,
                    offset = header.offset,
                    length = header.length,
                    message,
                    "rejected"
                );
                if header.command == cmd::WRITE {
                    // Resynchronise on the next header by discarding the payload we will not write.
                    let mut payload = (&mut rd).take(u64::from(header.length));
                    match read_or_stop(stop, tokio::io::copy(&mut payload, &mut tokio::io::sink())).await {
                        None => return Ok(()),
                        Some(Ok(n)) if n == u64::from(header.length) => {}
                        Some(Ok(_)) => return Ok(()), // EOF inside the payload: the client is gone
                        Some(Err(e)) => return Err(e.into()),
                    }
                }
                counters.record(kind, 0, false);
                let body = ReplyBody::Error {
                    errno: code,
                    message: message.to_owned(),
                };
                let reply = Reply {
                    cookie: header.cookie,
                    offset: header.offset,
                    body,
                };
                if !matches!(read_or_stop(stop, reply_tx.send(reply)).await, Some(Ok(()))) {
                    return Ok(());
                }
            }
        }
    }
}

/// Awaits `fut` unless the connection is stopped first (`None`).
async fn read_or_stop<T>(stop: &CancellationToken, fut: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        r = fut => Some(r),
    }
}

enum Action {
    Execute,
    Disconnect,
}

/// Validates a request against the export; an error is the errno and a message for the client.
fn check_request(h: &RequestHeader, size: u64, t: Transmission) -> Result<Action, (u32, &'static str)> {
    let allowed_flags = match h.command {
        cmd::DISC => return Ok(Action::Disconnect),
        cmd::READ | cmd::WRITE | cmd::FLUSH | cmd::TRIM => cflag::FUA,
        cmd::WRITE_ZEROES => cflag::FUA | cflag::NO_HOLE,
        cmd::BLOCK_STATUS => cflag::REQ_ONE,
        _ => return Err((errno::EINVAL, "unknown command")),
    };
    if h.flags & !allowed_flags != 0 {
        return Err((errno::EINVAL, "flag not valid for this command"));
    }
    if h.command == cmd::FLUSH {
        return Ok(Action::Execute);
    }
    let writes = matches!(h.command, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    if writes && t.read_only {
        return Err((errno::EPERM, "export is read-only"));
    }
    if h.command == cmd::BLOCK_STATUS && !t.negotiated.base_allocation {
        return Err((errno::EINVAL, "base:allocation was not negotiated"));
    }
    if h.length == 0 {
        return Err((errno::EINVAL, "zero-length request"));
    }
    if matches!(h.command, cmd::READ | cmd::WRITE) && h.length > t.max_block {
        return Err((errno::EINVAL, "request larger than the maximum block size"));
    }
    let in_bounds = h
        .offset
        .checked_add(u64::from(h.length))
        .is_some_and(|end| end <= size);
    if !in_bounds {
        let errno = if matches!(h.command, cmd::WRITE | cmd::WRITE_ZEROES) {
            errno::ENOSPC
        } else {
            errno::EINVAL
        };
        return Err((errno, "request extends past the end of the export"));
    }
    Ok(Action::Execute)
}

fn command_kind(command: u16) -> CommandKind {
    match command {
        cmd::READ => CommandKind::Read,
        cmd::WRITE => CommandKind::Write,
        cmd::FLUSH => CommandKind::Flush,
        cmd::TRIM => CommandKind::Trim,
        cmd::WRITE_ZEROES => CommandKind::WriteZeroes,
        cmd::BLOCK_STATUS => CommandKind::BlockStatus,
        _ => CommandKind::Other,
    }
}

async fn run_worker<D: BlockDevice>(
    device: Arc<D>,
    work: Arc<Mutex<mpsc::Receiver<Work>>>,
    replies: mpsc::Sender<Reply>,
    pool: BufferPool,
    structured: bool,
    counters: Arc<NbdCounters>,
) {
    loop {
        let next = work.lock().await.recv().await;
        let Some(w) = next else { return };
        let reply = execute(&*device, w, &pool, structured, &counters).await;
        if replies.send(reply).await.is_err() {
            return;
        }
    }
}

async fn execute<D: BlockDevice>(
    device: &D,
    w: Work,
    pool: &BufferPool,
    structured: bool,
    counters: &NbdCounters,
) -> Reply {
    let h = w.header;
    let len = u64::from(h.length);
    let fua = h.flags & cflag::FUA != 0;
    let result = match h.command {
        cmd::READ => {
            let mut buf = pool.get(h.length as usize);
            device
                .read(h.offset, &mut buf)
                .await
                .map(|()| ReplyBody::Data(buf))
        }
        cmd::WRITE => match &w.payload {
            Some(data) => device.write(h.offset, data, fua).await.map(|()| ReplyBody::Done),
            None => Err(DeviceError::invalid("write without payload")),
        },
        cmd::FLUSH => device.flush().await.map(|()| ReplyBody::Done),
        cmd::TRIM => device.trim(h.offset, len).await.map(|()| ReplyBody::Done),
        cmd::WRITE_ZEROES => {
            let may_trim = h.flags & cflag::NO_HOLE == 0;
            device
                .write_zeroes(h.offset, len, may_trim)
                .await
                .map(|()| ReplyBody::Done)
        }
        cmd::BLOCK_STATUS if structured => device
            .block_status(h.offset, len)
            .await
            .map(|pieces| ReplyBody::Extents(descriptors(&pieces, h.length, h.flags & cflag::REQ_ONE != 0))),
        _ => Err(DeviceError::invalid("command not executable")),
    };
    let counted = if h.command == cmd::FLUSH { 0 } else { len };
    let body = match result {
        Ok(body) => {
            counters.record(w.kind, counted, true);
            body
        }
        Err(e) => {
            counters.record(w.kind, 0, false);
            let (command, offset, length) = (h.command, h.offset, h.length);
            warn!(command, offset, length, error = %e, "device request failed");
            let code = match e.kind {
                DeviceErrorKind::Io => errno::EIO,
                DeviceErrorKind::Invalid => errno::EINVAL,
                DeviceErrorKind::NoSpace => errno::ENOSPC,
            };
            ReplyBody::Error {
                errno: code,
                message: e.message,
            }
        }
    };
    Reply {
        cookie: h.cookie,
        offset: h.offset,
        body,
    }
}

/// Turns the device's allocation pieces into `base:allocation` descriptors covering at most `len` bytes:
/// zero-length pieces dropped, neighbours with the same status merged, only the first kept with REQ_ONE. A
/// device that reported nothing gets one "data" descriptor for the whole range, which is always a truthful
/// answer.
fn descriptors(pieces: &[(u64, Allocation)], len: u32, req_one: bool) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(pieces.len().min(64));
    let mut left = len;
    for &(piece_len, alloc) in pieces {
        if left == 0 {
            break;
        }
        let n = u32::try_from(piece_len).unwrap_or(u32::MAX).min(left);
        if n == 0 {
            continue;
        }
        left -= n;
        let status = match alloc {
            Allocation::Data => 0,
            Allocation::Hole => STATE_HOLE | STATE_ZERO,
            Allocation::Zero => STATE_ZERO,
        };
        match out.last_mut() {
            Some((l, s)) if *s == status => *l += n,
            _ => out.push((n, status)),
        }
    }
    if out.is_empty() {
        out.push((len, 0));
    }
    if req_one {
        out.truncate(1);
    }
    out
}

async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut replies: mpsc::Receiver<Reply>,
    structured: bool,
    stop: CancellationToken,
) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(256 * 1024, writer);
    let result = async {
        loop {
            let reply = match replies.try_recv() {
                Ok(r) => r,
                Err(mpsc::error::TryRecvError::Empty) => {
                    w.flush().await?;
                    match replies.recv().await {
                        Some(r) => r,
                        None => break,
                    }
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            };
            write_reply(&mut w, reply, structured).await?;
        }
        w.flush().await?;
        w.shutdown().await
    };
    // Replies still owed at shutdown get a grace period; a client that stopped reading cannot hold the server.
    let give_up = async {
        stop.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    let result = tokio::select! {
        r = result => r,
        () = give_up => Err(io::Error::new(io::ErrorKind::TimedOut, "client did not take its replies")),
    };
    if result.is_err() {
        // Nobody can receive replies any more: stop reading requests too.
        stop.cancel();
    }
    result
}

async fn write_reply<W: AsyncWrite + Unpin>(w: &mut W, reply: Reply, structured: bool) -> io::Result<()> {
    let cookie = reply.cookie;
    if !structured {
        return match reply.body {
            ReplyBody::Done | ReplyBody::Extents(_) => {
                w.write_all(&super::wire::simple_reply(0, cookie)).await
            }
            ReplyBody::Data(buf) => {
                w.write_all(&super::wire::simple_reply(0, cookie)).await?;
                w.write_all(&buf).await
            }
            ReplyBody::Error { errno, .. } => w.write_all(&super::wire::simple_reply(errno, cookie)).await,
        };
    }
    let header = super::wire::chunk_header;
    match reply.body {
        ReplyBody::Done => {
            w.write_all(&header(chunk::FLAG_DONE, chunk::NONE, cookie, 0))
                .await
        }
        ReplyBody::Data(buf) => {
            let len = u32::try_from(buf.len() + 8).map_err(io::Error::other)?;
            w.write_all(&header(chunk::FLAG_DONE, chunk::OFFSET_DATA, cookie, len))
                .await?;
            w.write_all(&reply.offset.to_be_bytes()).await?;
            w.write_all(&buf).await
        }
        ReplyBody::Extents(extents) => {
            let len = u32::try_from(4 + extents.len() * 8).map_err(io::Error::other)?;
            w.write_all(&header(chunk::FLAG_DONE, chunk::BLOCK_STATUS, cookie, len))
                .await?;
            w.write_all(&BASE_ALLOCATION_ID.to_be_bytes()).await?;
            for (length, status) in extents {
                w.write_all(&length.to_be_bytes()).await?;
                w.write_all(&status.to_be_bytes()).await?;
            }
            Ok(())
        }
        ReplyBody::Error { errno, message } => {
            let mut end = message.len().min(MAX_ERROR_MESSAGE);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            let text = &message.as_bytes()[..end];
            let text_len = u16::try_from(text.len()).unwrap_or(0);
            let len = 6 + u32::from(text_len);
            w.write_all(&header(chunk::FLAG_DONE, chunk::ERROR, cookie, len))
                .await?;
            w.write_all(&errno.to_be_bytes()).await?;
            w.write_all(&text_len.to_be_bytes()).await?;
            w.write_all(&text[..usize::from(text_len)]).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_merge_clamp_and_honour_req_one() {
        let pieces = [
            (4096, Allocation::Data),
            (4096, Allocation::Data),
            (8192, Allocation::Hole),
        ];
        assert_eq!(
            descriptors(&pieces, 10_000, false),
            vec![(8192, 0), (1808, STATE_HOLE | STATE_ZERO)]
        );
        assert_eq!(descriptors(&pieces, 10_000, true), vec![(8192, 0)]);
        assert_eq!(descriptors(&[], 512, false), vec![(512, 0)]);
    }

    #[test]
    fn requests_are_checked_against_the_export() {
        let t = Transmission {
            negotiated: Negotiated {
                structured_replies: true,
                base_allocation: false,
            },
            read_only: false,
            max_block: 1 << 20,
            max_in_flight: 4,
        };
        let req = |command, offset, length| RequestHeader {
            flags: 0,
            command,
            cookie: 1,
            offset,
            length,
        };
        assert!(matches!(
            check_request(&req(cmd::READ, 0, 4096), 8192, t),
            Ok(Action::Execute)
        ));
        assert_eq!(
            check_request(&req(cmd::READ, 8192, 1), 8192, t)
                .err()
                .map(|e| e.0),
            Some(errno::EINVAL)
        );
        assert_eq!(
            check_request(&req(cmd::WRITE, 8000, 512), 8192, t)
                .err()
                .map(|e| e.0),
            Some(errno::ENOSPC)
        );
        assert_eq!(
            check_request(&req(cmd::READ, u64::MAX, 2), 8192, t)
                .err()
                .map(|e| e.0),
            Some(errno::EINVAL)
        );
        assert_eq!(
            check_request(&req(cmd::TRIM, 0, 0), 8192, t).err().map(|e| e.0),
            Some(errno::EINVAL)
        );
        assert_eq!(
            check_request(&req(cmd::BLOCK_STATUS, 0, 1), 8192, t)
                .err()
                .map(|e| e.0),
            Some(errno::EINVAL)
        );
        assert_eq!(
            check_request(&req(99, 0, 1), 8192, t).err().map(|e| e.0),
            Some(errno::EINVAL)
        );
        assert!(matches!(
            check_request(&req(cmd::FLUSH, 0, 0), 8192, t),
            Ok(Action::Execute)
        ));
    }
}
