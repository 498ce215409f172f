//! Byte-stream plumbing shared by client and server: the buffered frame reader that drives
//! [`FrameDecoder`], the buffered frame writer, and the boxed stream halves for TCP and unix sockets.

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};

use crate::codec::{DecodeError, Decoded, FrameDecoder, FrameHeader};

/// Socket buffer size for both directions. Small frames are batched through it; payloads larger than it
/// go straight between the socket and the pooled buffer.
pub(crate) const IO_BUF_LEN: usize = 64 << 10;

pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Sync + Unpin>;
pub(crate) type BoxWrite = Box<dyn AsyncWrite + Send + Sync + Unpin>;

/// Why reading the next frame failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("protocol violation: {0}")]
    Protocol(#[from] DecodeError),
    #[error("connection closed in the middle of a frame")]
    TruncatedFrame,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Reads frames from a stream: headers through the decoder, payloads into caller buffers.
pub(crate) struct FrameReader<R> {
    inner: BufReader<R>,
    decoder: FrameDecoder,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner: BufReader::with_capacity(IO_BUF_LEN, inner),
            decoder: FrameDecoder::new(),
        }
    }

    /// The next header, or `None` when the peer closed the stream cleanly between frames.
    /// The previous frame's payload must have been read or skipped.
    pub(crate) async fn next_header(&mut self) -> Result<Option<FrameHeader>, ReadError> {
        debug_assert_eq!(self.decoder.payload_remaining(), 0);
        loop {
            let buf = self.inner.fill_buf().await?;
            if buf.is_empty() {
                return if self.decoder.at_frame_boundary() {
                    Ok(None)
                } else {
                    Err(ReadError::TruncatedFrame)
                };
            }
            let (n, decoded) = self.decoder.decode(buf)?;
            crate::io_counters::kernel(n);
            let header = match decoded {
                Decoded::Header(h) => Some(h),
                Decoded::NeedMore | Decoded::Payload(_) => None,
            };
            self.inner.consume(n);
            if let Some(h) = header {
                return Ok(Some(h));
            }
        }
    }

    /// Reads exactly `dst.len()` payload bytes of the current frame into `dst`.
    pub(crate) async fn read_payload(&mut self, dst: &mut [u8]) -> Result<(), ReadError> {
        debug_assert!(dst.len() <= self.decoder.payload_remaining());
        // What the buffer already holds is copied out of it; the rest is read straight into `dst`.
        crate::io_counters::copy(self.inner.buffer().len().min(dst.len()));
        crate::io_counters::kernel(dst.len());
        // BufReader drains what it holds, then reads large remainders directly into `dst`.
        self.inner.read_exact(dst).await.map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => ReadError::TruncatedFrame,
            _ => ReadError::Io(e),
        })?;
        self.decoder.payload_read(dst.len());
        Ok(())
    }
}

/// Writes frames into a buffered stream; the owner flushes when its queue runs dry.
pub(crate) struct FrameWriter<W> {
    inner: BufWriter<W>,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self {
            inner: BufWriter::with_capacity(IO_BUF_LEN, inner),
        }
    }

    /// Queues one frame. `header.payload_len` must equal `payload.len()`.
    pub(crate) async fn write_frame(&mut self, header: &FrameHeader, payload: &[u8]) -> io::Result<()> {
        debug_assert_eq!(header.payload_usize(), payload.len());
        crate::io_counters::kernel(crate::codec::HEADER_LEN + payload.len());
        if payload.len() < IO_BUF_LEN {
            // BufWriter copies what is smaller than its buffer; larger payloads go straight to the socket.
            crate::io_counters::copy(payload.len());
        }
        self.inner.write_all(&header.encode()).await?;
        if !payload.is_empty() {
            // Payloads at least as large as the buffer bypass it (one copy fewer).
            self.inner.write_all(payload).await?;
        }
        Ok(())
    }

    pub(crate) async fn flush(&mut self) -> io::Result<()> {
        self.inner.flush().await
    }

    pub(crate) async fn shutdown(&mut self) -> io::Result<()> {
        self.inner.shutdown().await
    }
}

/// Where a client connects: `HOST:PORT` or `unix:/path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint<'a> {
    Tcp(&'a str),
    Unix(&'a str),
}

impl<'a> Endpoint<'a> {
    pub(crate) fn parse(addr: &'a str) -> Self {
        match addr.strip_prefix("unix:") {
            Some(path) => Self::Unix(path),
            None => Self::Tcp(addr),
        }
    }

    /// Connects and splits the stream into boxed halves (allocated once per connection). With `tls`, a TCP
    /// connection completes a TLS handshake first, verifying the server's certificate against the host dialled.
    pub(crate) async fn connect(
        &self,
        tls: Option<&Arc<rustls::ClientConfig>>,
    ) -> io::Result<(BoxRead, BoxWrite)> {
        match self {
            Self::Tcp(addr) => {
                let stream = tokio::net::TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                if let Some(tls) = tls {
                    let name = server_name(addr)?;
                    let stream = tokio_rustls::TlsConnector::from(tls.clone())
                        .connect(name, stream)
                        .await
                        .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake with {addr}: {e}")))?;
                    let (r, w) = tokio::io::split(stream);
                    return Ok((Box::new(r), Box::new(w)));
                }
                let (r, w) = stream.into_split();
                Ok((Box::new(r), Box::new(w)))
            }
            Self::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path).await?;
                let (r, w) = stream.into_split();
                Ok((Box::new(r), Box::new(w)))
            }
        }
    }
}

/// The name a server's certificate must carry: the host of `HOST:PORT` (an IP, bracketed for IPv6, or a DNS
/// name).
fn server_name(addr: &str) -> io::Result<rustls::pki_types::ServerName<'static>> {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr}: not a host name for TLS: {e}"),
        )
    })
}
