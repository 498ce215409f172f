//! The transmission phase of one connection, run by one task: it reads whatever one `recv` brings, parses
//! every complete request in it, starts each as a future in a [`FuturesUnordered`] (at most `max_in_flight`
//! at once), and writes the replies of the requests that finished into one buffer, flushed when no further
//! reply is ready — so replies that complete together leave in one syscall. No request is handed to another
//! task on its way through: the only wake-ups are the socket's and the replicas' replies.
//!
//! - Requests are validated against the export as they are parsed; an invalid one is answered at once (a
//!   write's payload is skipped, so the stream stays in sync). With `max_in_flight` requests running the task
//!   stops reading the socket: that is the backpressure a client sees.
//! - Write payloads that arrived with their header are copied once from the input buffer into a pooled
//!   buffer; a payload larger than the input buffer is read straight into its pooled buffer.
//!
//! NBD_CMD_DISC, end of stream or server shutdown stop the reading; running requests still complete and
//! their replies are sent (within a grace period) before the socket is shut down. A request with a bad magic
//! closes the connection (the stream can no longer be framed), as does any socket error — and even then the
//! requests already started run to their end, so every replica sees the outcome of every write it was sent
//! (a replica that failed one goes ERR) before the connection is gone.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use data_protocol::{BufferPool, PooledBuf};
use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

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
/// Input buffer: requests and the write payloads that fit in it are parsed from one read.
const IN_BUF_LEN: usize = 256 << 10;
/// Reply buffer; a read's data at least this large bypasses it.
const OUT_BUF_LEN: usize = 256 << 10;

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
    payload: Option<Bytes>,
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

type Running<'a> = FuturesUnordered<Pin<Box<dyn Future<Output = Reply> + Send + 'a>>>;

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
    let mut session = Session {
        device: &*device,
        t,
        reader,
        out: BufWriter::with_capacity(OUT_BUF_LEN, writer),
        pool: BufferPool::new(POOL_RETAINED_BYTES),
        counters: &counters,
        input: vec![0u8; IN_BUF_LEN],
        start: 0,
        end: 0,
        running: FuturesUnordered::new(),
        ready: Vec::new(),
    };
    let served = session.serve(&shutdown).await;
    // Whatever ended the connection, the requests already started run to their end.
    let finished = session.finish(served.is_ok(), &shutdown).await;
    served?;
    finished?;
    Ok(())
}

/// One connection's state, owned by its task.
struct Session<'a, D, R, W> {
    device: &'a D,
    t: Transmission,
    reader: R,
    out: BufWriter<W>,
    pool: BufferPool,
    counters: &'a NbdCounters,
    /// Bytes read from the socket; `start..end` is not parsed yet.
    input: Vec<u8>,
    start: usize,
    end: usize,
    running: Running<'a>,
    /// Replies collected for one batched write (kept for its capacity).
    ready: Vec<Reply>,
}

/// What parsing the input buffer found.
enum Parsed {
    /// Every complete request was started; read more.
    NeedMore,
    /// The client sent NBD_CMD_DISC.
    Disconnect,
}

impl<'a, D: BlockDevice, R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Session<'a, D, R, W> {
    /// Reads, starts and answers requests until the client disconnects or the connection is stopped.
    async fn serve(&mut self, stop: &CancellationToken) -> Result<(), ConnectionError> {
        let max = self.t.max_in_flight.max(1);
        loop {
            // Requests left in the buffer when the limit was reached start as soon as others finish.
            if let Parsed::Disconnect = self.parse(stop).await? {
                debug!("client sent NBD_CMD_DISC");
                return Ok(());
            }
            let can_read = self.running.len() < max && self.end < self.input.len();
            tokio::select! {
                biased;
                () = stop.cancelled() => return Ok(()),
                Some(reply) = self.running.next(), if !self.running.is_empty() => {
                    within_grace(stop, self.write_ready(reply)).await?;
                }
                n = self.reader.read(&mut self.input[self.end..]), if can_read => {
                    let n = n?;
                    data_protocol::io_counters::kernel(n);
                    if n == 0 {
                        if self.start < self.end {
                            debug!("client closed the connection in the middle of a request");
                        } else {
                            debug!("client closed the connection without NBD_CMD_DISC");
                        }
                        return Ok(());
                    }
                    self.end += n;
                }
            }
        }
    }

    /// Writes `first` and every other reply that is ready now, then flushes. The ready ones are collected
    /// before anything is written, so a slow socket does not hold back requests that could finish.
    async fn write_ready(&mut self, first: Reply) -> io::Result<()> {
        let mut ready = std::mem::take(&mut self.ready);
        ready.push(first);
        while let Some(Some(reply)) = self.running.next().now_or_never() {
            ready.push(reply);
        }
        let structured = self.t.negotiated.structured_replies;
        let mut result = Ok(());
        for reply in ready.drain(..) {
            if result.is_ok() {
                result = write_reply(&mut self.out, reply, structured).await;
            }
        }
        self.ready = ready;
        result?;
        self.out.flush().await
    }

    /// Starts every complete request in the input buffer (up to `max_in_flight` running); keeps a partial
    /// one at the front of the buffer for the next read.
    async fn parse(&mut self, stop: &CancellationToken) -> Result<Parsed, ConnectionError> {
        let max = self.t.max_in_flight.max(1);
        while self.end - self.start >= REQUEST_HEADER_LEN && self.running.len() < max {
            let mut raw = [0u8; REQUEST_HEADER_LEN];
            raw.copy_from_slice(&self.input[self.start..self.start + REQUEST_HEADER_LEN]);
            let header = match RequestHeader::parse(&raw) {
                Ok(h) => h,
                Err(e) => {
                    self.counters
                        .protocol_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Err(e.into());
                }
            };
            let payload_len = if header.command == cmd::WRITE {
                header.length as usize
            } else {
                0
            };
            let have = self.end - self.start - REQUEST_HEADER_LEN;
            if have < payload_len && REQUEST_HEADER_LEN + payload_len <= self.input.len() {
                break; // the rest arrives with the next read
            }
            self.start += REQUEST_HEADER_LEN;
            let kind = command_kind(header.command);
            match check_request(&header, self.device.size(), self.t) {
                Ok(Action::Disconnect) => return Ok(Parsed::Disconnect),
                Ok(Action::Execute) => {
                    let payload = if header.command == cmd::WRITE {
                        let mut buf = self.pool.get(payload_len);
                        let now = have.min(payload_len);
                        data_protocol::io_counters::copy(now);
                        data_protocol::io_counters::kernel(payload_len - now);
                        buf[..now].copy_from_slice(&self.input[self.start..self.start + now]);
                        self.start += now;
                        if now < payload_len {
                            // Larger than the input buffer: the rest straight from the socket.
                            match read_or_stop(stop, self.reader.read_exact(&mut buf[now..])).await {
                                None => return Ok(Parsed::Disconnect),
                                Some(r) => r?,
                            };
                        }
                        Some(Bytes::from_owner(buf))
                    } else {
                        None
                    };
                    let work = Work {
                        header,
                        kind,
                        payload,
                    };
                    let (device, pool, counters) = (self.device, self.pool.clone(), self.counters);
                    let structured = self.t.negotiated.structured_replies;
                    self.running.push(Box::pin(async move {
                        execute(device, work, &pool, structured, counters).await
                    }));
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
                        let now = have.min(payload_len);
                        self.start += now;
                        let rest = (payload_len - now) as u64;
                        if rest > 0 {
                            let mut skip = (&mut self.reader).take(rest);
                            match read_or_stop(stop, tokio::io::copy(&mut skip, &mut tokio::io::sink())).await
                            {
                                None => return Ok(Parsed::Disconnect),
                                Some(Ok(n)) if n == rest => {}
                                Some(Ok(_)) => return Ok(Parsed::Disconnect), // EOF inside the payload
                                Some(Err(e)) => return Err(e.into()),
                            }
                        }
                    }
                    self.counters.record(kind, 0, false);
                    let reply = Reply {
                        cookie: header.cookie,
                        offset: header.offset,
                        body: ReplyBody::Error {
                            errno: code,
                            message: message.to_owned(),
                        },
                    };
                    let structured = self.t.negotiated.structured_replies;
                    within_grace(stop, async {
                        write_reply(&mut self.out, reply, structured).await?;
                        self.out.flush().await
                    })
                    .await?;
                }
            }
        }
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.start > 0 {
            data_protocol::io_counters::copy(self.end - self.start);
            self.input.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        Ok(Parsed::NeedMore)
    }

    /// Lets the running requests finish. After a clean end their replies are sent (within a grace period
    /// once the server is stopping) and the socket is shut down; after an error they only run out.
    async fn finish(&mut self, clean: bool, stop: &CancellationToken) -> io::Result<()> {
        let structured = self.t.negotiated.structured_replies;
        let result = async {
            while let Some(reply) = self.running.next().await {
                if clean {
                    write_reply(&mut self.out, reply, structured).await?;
                }
            }
            Ok(())
        };
        let r = within_grace(stop, result).await;
        // Requests still running (the client stopped reading, or a write failed) finish without a reply.
        while self.running.next().await.is_some() {}
        if !clean {
            return Ok(());
        }
        r?;
        self.out.flush().await?;
        self.out.shutdown().await
    }
}

/// Awaits a write of replies; once the server is stopping it gets [`SHUTDOWN_GRACE`], so a client that stopped
/// reading cannot hold the server.
async fn within_grace<T>(
    stop: &CancellationToken,
    fut: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let give_up = async {
        stop.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        r = fut => r,
        () = give_up => Err(io::Error::new(io::ErrorKind::TimedOut, "client did not take its replies")),
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
        cmd::WRITE => match w.payload {
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

/// Counts (io-counters builds) a read reply's data on its way out: copied into the output `BufWriter` when
/// smaller than its buffer, then copied by the kernel with its `header` bytes.
fn count_reply_data(len: usize, header: usize) {
    if len < OUT_BUF_LEN {
        data_protocol::io_counters::copy(len);
    }
    data_protocol::io_counters::kernel(header + len);
}

async fn write_reply<W: AsyncWrite + Unpin>(w: &mut W, reply: Reply, structured: bool) -> io::Result<()> {
    let cookie = reply.cookie;
    if !structured {
        return match reply.body {
            ReplyBody::Done | ReplyBody::Extents(_) => {
                w.write_all(&super::wire::simple_reply(0, cookie)).await
            }
            ReplyBody::Data(buf) => {
                count_reply_data(buf.len(), 16);
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
            count_reply_data(buf.len(), 32);
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
