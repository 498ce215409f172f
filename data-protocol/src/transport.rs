//! Byte-stream plumbing of the client: the buffered frame reader that drives [`FrameDecoder`], and the
//! stream halves for TCP and unix sockets (a boxed read half, a [`RawWrite`] write half).

use std::io;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

use crate::codec::{DecodeError, Decoded, FrameDecoder, FrameHeader};

/// Socket buffer size for both directions. Small frames are batched through it; payloads larger than it
/// go straight between the socket and the pooled buffer.
pub(crate) const IO_BUF_LEN: usize = 64 << 10;

pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Sync + Unpin>;

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
        // BufReader drains what it holds, then reads large remainders directly into `dst`.
        self.inner.read_exact(dst).await.map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => ReadError::TruncatedFrame,
            _ => ReadError::Io(e),
        })?;
        self.decoder.payload_read(dst.len());
        Ok(())
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

    /// Connects and splits the stream: a boxed read half (allocated once per connection) and the write half
    /// that callers write frames to directly ([`RawWrite`]).
    pub(crate) async fn connect(&self) -> io::Result<(BoxRead, RawWrite)> {
        match self {
            Self::Tcp(addr) => {
                let stream = tokio::net::TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                let (r, w) = stream.into_split();
                Ok((Box::new(r), RawWrite::Tcp(w)))
            }
            Self::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path).await?;
                let (r, w) = stream.into_split();
                Ok((Box::new(r), RawWrite::Unix(w)))
            }
        }
    }
}

/// The write half of a client connection, written through `&self`: a caller that finds the connection idle
/// writes its frame with one non-blocking `writev` (no hand-off to another task), and the connection's
/// writer task waits for writability only when the socket is full (see `client::sender`).
#[derive(Debug)]
pub(crate) enum RawWrite {
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    Unix(tokio::net::unix::OwnedWriteHalf),
}

impl RawWrite {
    /// One non-blocking vectored write; `WouldBlock` when the socket buffer is full.
    pub(crate) fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(w) => w.try_write_vectored(bufs),
            Self::Unix(w) => w.try_write_vectored(bufs),
        }
    }

    /// Waits until the socket may take more bytes.
    pub(crate) async fn writable(&self) -> io::Result<()> {
        match self {
            Self::Tcp(w) => w.writable().await,
            Self::Unix(w) => w.writable().await,
        }
    }

    /// Writes all of `data` (waiting for writability as needed); for the handshake, before the writer exists.
    pub(crate) async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            match self.try_write_vectored(&[io::IoSlice::new(data)]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.writable().await?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Shuts the sending direction down, so the replica sees end of stream and closes its side, even while
    /// handles to the client (and so this half) are still alive.
    pub(crate) fn shutdown_write(&self) {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Self::Tcp(w) => AsRef::<tokio::net::TcpStream>::as_ref(w).as_raw_fd(),
            Self::Unix(w) => AsRef::<tokio::net::UnixStream>::as_ref(w).as_raw_fd(),
        };
        // SAFETY: `fd` belongs to the socket `self` borrows, open for at least this call; `shutdown` takes
        // no pointers. An error (already shut down, peer gone) leaves nothing to do.
        unsafe {
            libc::shutdown(fd, libc::SHUT_WR);
        }
    }
}
