//! Client connections: connect + `Hello`, and the per-connection writer and reader tasks, plus the pinger.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::slots::{Answer, Completion, SlotTable};
use super::{ClientConfig, ClientError, Core, DataClient};
use crate::backend::{ErrorKind, VolumeInfo};
use crate::codec::{FrameHeader, FrameKind, MAX_NAME_LEN, VERSION};
use crate::pool::{BufferPool, PooledBuf};
use crate::transport::{BoxRead, BoxWrite, Endpoint, FrameReader, FrameWriter, ReadError};

/// Name the client announces in `Hello`.
const CLIENT_NAME: &str = concat!("corral-data-client/", env!("CARGO_PKG_VERSION"));
/// Idle payload-buffer capacity a client keeps for reuse.
const CLIENT_POOL_BYTES: usize = 32 << 20;

/// A frame queued for a connection's writer.
pub(super) struct Outgoing {
    pub(super) header: FrameHeader,
    /// A write's data: one buffer shared by every replica the write goes to.
    pub(super) payload: Option<Bytes>,
}

pub(super) async fn connect(addr: &str, cfg: ClientConfig) -> Result<DataClient, ClientError> {
    let connections = cfg.connections.max(1);
    let window = cfg.window.max(1);
    let endpoint = Endpoint::parse(addr);
    let mut streams = Vec::with_capacity(connections);
    let mut info: Option<VolumeInfo> = None;
    for _ in 0..connections {
        let handshake = async {
            let (read, write) = endpoint.connect(cfg.tls.as_ref()).await?;
            let mut frames = FrameReader::new(read);
            let mut out = FrameWriter::new(write);
            let conn_info = hello(&mut frames, &mut out, cfg.generation).await?;
            Ok::<_, ClientError>((frames, out, conn_info))
        };
        let (frames, out, conn_info) = tokio::time::timeout(cfg.request_timeout, handshake)
            .await
            .map_err(|_| ClientError::Timeout)??;
        match &info {
            Some(first) if *first != conn_info => {
                return Err(ClientError::Protocol(format!(
                    "connections disagree about the volume: {first:?} vs {conn_info:?}"
                )));
            }
            _ => info = Some(conn_info),
        }
        streams.push((frames, out));
    }
    let info = info.ok_or_else(|| ClientError::Protocol("no connection".to_owned()))?;

    let total_slots = connections.saturating_mul(window);
    let mut outgoing = Vec::with_capacity(connections);
    let mut receivers = Vec::with_capacity(connections);
    for _ in 0..connections {
        let (tx, rx) = mpsc::channel(total_slots);
        outgoing.push(tx);
        receivers.push(rx);
    }
    let cancel = CancellationToken::new();
    let core = Arc::new(Core {
        cfg,
        addr: addr.to_owned(),
        slots: SlotTable::new(total_slots),
        outgoing,
        next_conn: AtomicUsize::new(0),
        buffers: BufferPool::new(CLIENT_POOL_BYTES),
        failure: OnceLock::new(),
        cancel: cancel.clone(),
    });
    let tasks = TaskTracker::new();
    for (i, ((frames, out), rx)) in streams.into_iter().zip(receivers).enumerate() {
        let span = tracing::debug_span!("data_client_conn", replica = %addr, conn = i);
        tasks.spawn(writer_loop(core.clone(), out, rx).instrument(span.clone()));
        tasks.spawn(reader_loop(core.clone(), frames).instrument(span));
    }
    tasks
        .spawn(ping_loop(core.clone()).instrument(tracing::debug_span!("data_client_ping", replica = %addr)));
    tasks.close();
    Ok(DataClient {
        core,
        info: Arc::new(info),
        tasks,
        _stop_on_drop: Arc::new(cancel.drop_guard()),
    })
}

async fn hello(
    frames: &mut FrameReader<BoxRead>,
    out: &mut FrameWriter<BoxWrite>,
    generation: u64,
) -> Result<VolumeInfo, ClientError> {
    let name = CLIENT_NAME.as_bytes();
    let mut header = FrameHeader::new(FrameKind::Hello, 0, generation, u32::from(VERSION));
    header.payload_len = u32::try_from(name.len()).unwrap_or(0);
    out.write_frame(&header, name).await?;
    out.flush().await?;
    let reply = match frames.next_header().await {
        Ok(Some(h)) => h,
        Ok(None) => {
            return Err(ClientError::Disconnected(
                "replica closed the connection at hello".to_owned(),
            ));
        }
        Err(e) => return Err(read_error(e)),
    };
    let mut payload = [0u8; MAX_NAME_LEN as usize];
    match reply.kind {
        FrameKind::Ok if reply.payload_len <= MAX_NAME_LEN => {
            let name = &mut payload[..reply.payload_usize()];
            frames.read_payload(name).await.map_err(read_error)?;
            Ok(VolumeInfo {
                size: reply.offset,
                sector_size: reply.length,
                name: String::from_utf8_lossy(name).into_owned(),
            })
        }
        FrameKind::Error => {
            let message = read_message(frames, &reply).await?;
            Err(remote_error(&reply, message, generation))
        }
        other => Err(ClientError::Protocol(format!(
            "unexpected {other:?} reply to hello"
        ))),
    }
}

/// The error an `Error` reply stands for: [`ClientError::Fenced`] (with the replica's generation from the
/// reply's `offset`) for a stale engine, else [`ClientError::Remote`].
fn remote_error(h: &FrameHeader, message: String, generation: u64) -> ClientError {
    match ErrorKind::from_code(h.length) {
        ErrorKind::Fenced => ClientError::Fenced {
            replica: h.offset,
            generation,
            message,
        },
        kind => ClientError::Remote { kind, message },
    }
}

async fn read_message(frames: &mut FrameReader<BoxRead>, h: &FrameHeader) -> Result<String, ClientError> {
    // Error path only: the message is bounded by MAX_MESSAGE_LEN at decode.
    let mut msg = vec![0u8; h.payload_usize()];
    frames.read_payload(&mut msg).await.map_err(read_error)?;
    Ok(String::from_utf8_lossy(&msg).into_owned())
}

fn read_error(e: ReadError) -> ClientError {
    match e {
        ReadError::Protocol(d) => ClientError::Protocol(d.to_string()),
        ReadError::TruncatedFrame => {
            ClientError::Disconnected("connection closed in the middle of a frame".into())
        }
        ReadError::Io(e) => ClientError::Disconnected(e.to_string()),
    }
}

/// How long a client closed while healthy waits for its last frames and the end-of-stream to reach the socket.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

async fn writer_loop(core: Arc<Core>, mut out: FrameWriter<BoxWrite>, mut rx: mpsc::Receiver<Outgoing>) {
    // Cancellation (the client failed or was closed) is watched around every write, not only between batches: a
    // peer that stopped reading (a partition, a stopped process) leaves a send blocked until the kernel gives up,
    // which is minutes over TCP and never on a unix socket. Dropping the half-written socket then closes it.
    let result = tokio::select! {
        biased;
        () = core.cancel.cancelled() => return,
        r = async {
            loop {
                let Some(mut frame) = rx.recv().await else {
                    return Ok::<(), std::io::Error>(());
                };
                loop {
                    let payload = frame.payload.as_deref().unwrap_or(&[]);
                    out.write_frame(&frame.header, payload).await?;
                    drop(frame);
                    match rx.try_recv() {
                        Ok(next) => frame = next,
                        Err(_) => break,
                    }
                }
                out.flush().await?;
            }
        } => r,
    };
    match result {
        Ok(()) => {
            let _ = tokio::time::timeout(SHUTDOWN_WAIT, out.shutdown()).await;
        }
        Err(e) => {
            core.fail(ClientError::Disconnected(format!("write to {}: {e}", core.addr)));
        }
    }
}

async fn reader_loop(core: Arc<Core>, mut frames: FrameReader<BoxRead>) {
    let err = tokio::select! {
        biased;
        () = core.cancel.cancelled() => return,
        err = read_replies(&core, &mut frames) => err,
    };
    core.fail(err);
}

/// Dispatches replies until something goes wrong; returns why.
async fn read_replies(core: &Core, frames: &mut FrameReader<BoxRead>) -> ClientError {
    loop {
        let h = match frames.next_header().await {
            Ok(Some(h)) => h,
            Ok(None) => return ClientError::Disconnected(format!("{} closed the connection", core.addr)),
            Err(e) => return read_error(e),
        };
        if h.kind.is_request() {
            return ClientError::Protocol(format!("replica sent a {:?} request", h.kind));
        }
        // The replica's notice that a higher engine generation took over, sent with id 0 (no request's id) just
        // before it closes the connection: the whole client fails with it.
        if h.kind == FrameKind::Error && ErrorKind::from_code(h.length) == ErrorKind::Fenced {
            return match read_message(frames, &h).await {
                Ok(message) => remote_error(&h, message, core.cfg.generation),
                Err(e) => e,
            };
        }
        let Some(expected) = core.slots.expected(h.id) else {
            return ClientError::Protocol(format!("reply for unknown request id {:#x}", h.id));
        };
        let outcome: Completion = match h.kind {
            FrameKind::Ok if expected.kind == FrameKind::Read => {
                if h.payload_len != expected.length {
                    return ClientError::Protocol(format!(
                        "read of {} bytes answered with {} bytes",
                        expected.length, h.payload_len
                    ));
                }
                match read_pooled(core, frames, &h).await {
                    Ok(buf) => Ok(Answer {
                        length: h.length,
                        payload: Some(buf),
                    }),
                    Err(e) => return e,
                }
            }
            FrameKind::Ok if expected.kind == FrameKind::BlockStatus => {
                // The range list itself is checked by `DataClient::block_status`, which knows the span.
                if h.length == 0 || h.length > expected.length {
                    return ClientError::Protocol(format!(
                        "BlockStatus of {} bytes answered for {} bytes",
                        expected.length, h.length
                    ));
                }
                match read_pooled(core, frames, &h).await {
                    Ok(buf) => Ok(Answer {
                        length: h.length,
                        payload: Some(buf),
                    }),
                    Err(e) => return e,
                }
            }
            FrameKind::Ok if h.payload_len == 0 => Ok(Answer {
                length: h.length,
                payload: None,
            }),
            FrameKind::Ok => {
                return ClientError::Protocol(format!("{:?} answered with a payload", expected.kind));
            }
            FrameKind::Error => match read_message(frames, &h).await {
                Ok(message) => Err(remote_error(&h, message, core.cfg.generation)),
                Err(e) => return e,
            },
            FrameKind::Eof => Err(ClientError::Eof),
            FrameKind::NoSpace => Err(ClientError::NoSpace),
            other => return ClientError::Protocol(format!("unexpected {other:?} frame")),
        };
        core.slots.complete(h.id, outcome);
    }
}

/// Reads the current frame's payload into a pooled buffer.
async fn read_pooled(
    core: &Core,
    frames: &mut FrameReader<BoxRead>,
    h: &FrameHeader,
) -> Result<PooledBuf, ClientError> {
    let mut buf = core.buffers.get(h.payload_usize());
    frames.read_payload(&mut buf).await.map_err(read_error)?;
    Ok(buf)
}

async fn ping_loop(core: Arc<Core>) {
    let mut ticker = tokio::time::interval(core.cfg.ping_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate; the handshake just proved liveness
    loop {
        tokio::select! {
            biased;
            () = core.cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        for conn in 0..core.outgoing.len() {
            // Only the previous ping is awaited before the next (as in Longhorn); a failure has already
            // failed the client inside `request`.
            let ping = core.request(FrameKind::Ping, 0, 0, None, Some(conn));
            let result = tokio::select! {
                biased;
                () = core.cancel.cancelled() => return,
                r = ping => r,
            };
            if let Err(e) = result {
                // A replica that cannot answer a ping is not healthy, whatever the reason.
                core.fail(e);
                return;
            }
        }
    }
}
