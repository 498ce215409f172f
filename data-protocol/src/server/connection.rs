//! One client connection: a reader task that admits requests within the window and a writer task that
//! sends replies in completion order.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Shared;
use super::io_pool::{Job, Reply, ReplyBody, truncate_utf8};
use crate::backend::{BackendError, ErrorKind, VolumeInfo};
use crate::codec::{FrameHeader, FrameKind, MAX_NAME_LEN, VERSION};
use crate::transport::{BoxRead, BoxWrite, FrameReader, FrameWriter, ReadError};

/// How the reader stopped.
enum ReaderEnd {
    /// Peer closed cleanly between frames.
    PeerClosed,
    /// The server is shutting down.
    Shutdown,
    /// The writer failed (peer gone); nothing more can be answered.
    WriterGone,
    /// Hello was refused (version mismatch or backend not ready); the refusal is queued.
    Refused,
    /// The peer broke the protocol or the socket failed: drop without answering.
    Violation(String),
    Io(std::io::Error),
}

pub(crate) async fn serve_connection(
    shared: Arc<Shared>,
    read: BoxRead,
    write: BoxWrite,
    shutdown: CancellationToken,
) {
    let window = shared.cfg.window.max(1);
    let window_u32 = u32::try_from(window).unwrap_or(u32::MAX);
    let permits = Arc::new(Semaphore::new(window));
    // Every queued reply holds a window permit, so `window` slots (+1 for a refusal) never block a worker.
    let (reply_tx, reply_rx) = mpsc::channel::<Reply>(window + 1);
    // Cancelled when the connection must die now: violation, or the writer lost the socket.
    let kill = CancellationToken::new();
    let writer = tokio::spawn(writer_loop(FrameWriter::new(write), reply_rx, kill.clone()).in_current_span());

    let mut reader = ConnReader {
        shared: &shared,
        frames: FrameReader::new(read),
        permits: &permits,
        reply_tx: &reply_tx,
        hello_done: false,
    };
    let end = tokio::select! {
        biased;
        () = kill.cancelled() => ReaderEnd::WriterGone,
        end = reader.run(&shutdown) => end,
    };
    match &end {
        ReaderEnd::PeerClosed => tracing::debug!("peer closed the connection"),
        ReaderEnd::Shutdown => tracing::debug!("server shutting down: finishing in-flight requests"),
        ReaderEnd::WriterGone => tracing::debug!("reply stream failed; dropping connection"),
        ReaderEnd::Refused => tracing::info!("hello refused; closing connection"),
        ReaderEnd::Violation(why) => {
            shared.metrics.protocol_violations.fetch_add(1, Relaxed);
            tracing::warn!(reason = %why, "protocol violation; dropping connection");
            kill.cancel();
        }
        ReaderEnd::Io(err) => {
            tracing::info!(error = %err, "connection read failed; dropping connection");
            kill.cancel();
        }
    }
    drop(reader);
    // In-flight requests finish on the workers; each releases its permit once answered (or dropped).
    // A peer that stops reading could hold its replies (and a shutdown) forever: give it a grace period.
    let all_done = permits.acquire_many(window_u32);
    tokio::pin!(all_done);
    if tokio::time::timeout(shared.cfg.shutdown_grace, &mut all_done)
        .await
        .is_err()
    {
        tracing::warn!("peer not taking replies; dropping connection with requests in flight");
        kill.cancel();
        let _ = all_done.await;
    }
    drop(reply_tx);
    if let Ok(Err(err)) = writer.await {
        tracing::debug!(error = %err, "reply writer stopped");
    }
}

async fn writer_loop(
    mut out: FrameWriter<BoxWrite>,
    mut replies: mpsc::Receiver<Reply>,
    kill: CancellationToken,
) -> std::io::Result<()> {
    let result = async {
        loop {
            let first = tokio::select! {
                biased;
                () = kill.cancelled() => return Ok(()),
                r = replies.recv() => r,
            };
            let Some(mut reply) = first else { break };
            loop {
                if matches!(reply.body, ReplyBody::DropConnection) {
                    // Not flushed: the peer loses what was still buffered, as with a real network failure.
                    tracing::warn!(id = reply.header.id, "backend asked to drop the connection");
                    return Err(std::io::Error::other("backend asked to drop the connection"));
                }
                out.write_frame(&reply.header, reply.payload()).await?;
                // Release the buffer and the window slot as soon as the bytes are handed over.
                drop(reply);
                match replies.try_recv() {
                    Ok(next) => reply = next,
                    Err(_) => break,
                }
            }
            out.flush().await?;
        }
        out.shutdown().await
    }
    .await;
    if result.is_err() {
        kill.cancel();
    }
    result
}

struct ConnReader<'a> {
    shared: &'a Shared,
    frames: FrameReader<BoxRead>,
    permits: &'a Arc<Semaphore>,
    reply_tx: &'a mpsc::Sender<Reply>,
    hello_done: bool,
}

impl ConnReader<'_> {
    async fn run(&mut self, shutdown: &CancellationToken) -> ReaderEnd {
        loop {
            // Backpressure: with the window full we stop reading, and TCP pushes back on the client.
            let permit = tokio::select! {
                biased;
                () = shutdown.cancelled() => return ReaderEnd::Shutdown,
                p = self.permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return ReaderEnd::Shutdown,
                },
            };
            let step = tokio::select! {
                biased;
                () = shutdown.cancelled() => return ReaderEnd::Shutdown,
                step = self.next_request(permit) => step,
            };
            if let Some(end) = step {
                return end;
            }
        }
    }

    /// Reads and dispatches one frame; `Some` ends the connection.
    async fn next_request(&mut self, permit: OwnedSemaphorePermit) -> Option<ReaderEnd> {
        let header = match self.frames.next_header().await {
            Ok(Some(h)) => h,
            Ok(None) => return Some(ReaderEnd::PeerClosed),
            Err(ReadError::Io(e)) => return Some(ReaderEnd::Io(e)),
            Err(e) => return Some(ReaderEnd::Violation(e.to_string())),
        };
        if !header.kind.is_request() {
            return Some(ReaderEnd::Violation(format!(
                "client sent a {:?} reply",
                header.kind
            )));
        }
        if !self.hello_done {
            if header.kind != FrameKind::Hello {
                return Some(ReaderEnd::Violation(format!("{:?} before Hello", header.kind)));
            }
            return self.hello(header, permit).await;
        }
        self.shared.metrics.requests.fetch_add(1, Relaxed);
        let payload = match header.kind {
            FrameKind::Hello => return Some(ReaderEnd::Violation("second Hello".to_owned())),
            FrameKind::Ping => {
                return self
                    .reply(Reply::empty(FrameKind::Ok, header.id, Some(permit)))
                    .await;
            }
            FrameKind::Write => {
                let mut buf = self.shared.buffers.get(header.payload_usize());
                if let Err(e) = self.frames.read_payload(&mut buf).await {
                    return Some(read_error_end(e));
                }
                Some(buf)
            }
            _ => None,
        };
        let job = Job {
            header,
            payload,
            reply_to: self.reply_tx.clone(),
            permit,
        };
        if self.shared.io.submit(job).await.is_err() {
            return Some(ReaderEnd::Shutdown);
        }
        None
    }

    async fn hello(&mut self, header: FrameHeader, permit: OwnedSemaphorePermit) -> Option<ReaderEnd> {
        let mut name = [0u8; MAX_NAME_LEN as usize];
        let name = &mut name[..header.payload_usize()];
        if let Err(e) = self.frames.read_payload(name).await {
            return Some(read_error_end(e));
        }
        let client = String::from_utf8_lossy(name);
        tracing::debug!(client = %client, version = header.length, "hello");
        if header.length != u32::from(VERSION) {
            let err = BackendError::new(
                ErrorKind::Invalid,
                format!(
                    "protocol version {} not supported; this server speaks {VERSION}",
                    header.length
                ),
            );
            self.reply(Reply::failure(header.id, err, false, Some(permit)))
                .await;
            return Some(ReaderEnd::Refused);
        }
        let backend = self.shared.backend.clone();
        let info = tokio::task::spawn_blocking(move || backend.info())
            .await
            .unwrap_or_else(|e| {
                Err(BackendError::new(
                    ErrorKind::Unavailable,
                    format!("volume info failed: {e}"),
                ))
            });
        match info {
            Ok(VolumeInfo {
                size,
                sector_size,
                mut name,
            }) => {
                truncate_utf8(&mut name, MAX_NAME_LEN);
                let header = FrameHeader {
                    kind: FrameKind::Ok,
                    id: header.id,
                    offset: size,
                    length: sector_size,
                    payload_len: u32::try_from(name.len()).unwrap_or(MAX_NAME_LEN),
                };
                self.hello_done = true;
                self.reply(Reply {
                    header,
                    body: ReplyBody::Text(name),
                    _permit: Some(permit),
                })
                .await
            }
            Err(err) => {
                self.reply(Reply::failure(header.id, err, false, Some(permit)))
                    .await;
                Some(ReaderEnd::Refused)
            }
        }
    }

    async fn reply(&self, reply: Reply) -> Option<ReaderEnd> {
        match self.reply_tx.send(reply).await {
            Ok(()) => None,
            Err(_) => Some(ReaderEnd::WriterGone),
        }
    }
}

fn read_error_end(e: ReadError) -> ReaderEnd {
    match e {
        ReadError::Io(e) => ReaderEnd::Io(e),
        other => ReaderEnd::Violation(other.to_string()),
    }
}
