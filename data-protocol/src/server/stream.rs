//! A connected socket (TCP, TLS over TCP, or unix) used with blocking calls, shared by a connection's thread and the
//! IO pool's workers that write its replies.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// A connected socket, used with blocking calls.
pub(crate) enum Stream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
    /// A TCP connection whose TLS handshake completed (the async side did it, bounded by a deadline).
    Tls(TlsSocket),
}

/// TLS over a blocking TCP socket, split like the plain socket: the connection's thread reads, whoever holds the
/// connection's write lock writes, and both share the one rustls session. The session lock is held only to
/// decrypt or encrypt, never across a blocking socket call, so a reader waiting for the peer never stalls a writer.
/// Writers are already serialized by the connection's write lock, so records reach the socket in the order they
/// were sealed; whatever the session queues on its own while reading (a key update's answer) goes out with the
/// next write.
pub(crate) struct TlsSocket {
    sock: std::net::TcpStream,
    session: Arc<Mutex<rustls::ServerConnection>>,
    /// Ciphertext staging, grown on first use and reused: read from the socket (reading side) or sealed for it
    /// (writing side). Each clone has its own.
    buf: Vec<u8>,
    /// The part of `buf` read from the socket and not yet handed to the session (reading side).
    pending: std::ops::Range<usize>,
}

/// Ciphertext read from the socket per call: a few TLS records.
const TLS_READ_LEN: usize = 64 << 10;

impl TlsSocket {
    pub(crate) fn new(sock: std::net::TcpStream, session: rustls::ServerConnection) -> Self {
        Self {
            sock,
            session: Arc::new(Mutex::new(session)),
            buf: Vec::new(),
            pending: 0..0,
        }
    }

    fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            sock: self.sock.try_clone()?,
            session: self.session.clone(),
            buf: Vec::new(),
            pending: 0..0,
        })
    }

    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            {
                let mut session = lock(&self.session);
                match session.reader().read(out) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if !self.pending.is_empty() {
                    let mut src = &self.buf[self.pending.clone()];
                    let n = session.read_tls(&mut src)?;
                    self.pending.start += n;
                    session.process_new_packets().map_err(invalid_data)?;
                    continue;
                }
            }
            if self.buf.len() < TLS_READ_LEN {
                self.buf.resize(TLS_READ_LEN, 0);
            }
            let n = match self.sock.read(&mut self.buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.pending = 0..n;
            if n == 0 {
                // End of stream: the session answers Ok(0) after the peer's close_notify, an error otherwise.
                let mut session = lock(&self.session);
                session.read_tls(&mut &[][..])?;
                session.process_new_packets().map_err(invalid_data)?;
                return session.reader().read(out);
            }
        }
    }

    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = {
            let mut session = lock(&self.session);
            let n = session.writer().write(data)?;
            self.buf.clear();
            while session.wants_write() {
                session.write_tls(&mut self.buf)?;
            }
            n
        };
        self.sock.write_all(&self.buf)?;
        Ok(n)
    }

    /// Sends the TLS close_notify, so the peer sees a clean end of stream rather than a truncation.
    fn close_notify(&mut self) -> io::Result<()> {
        {
            let mut session = lock(&self.session);
            session.send_close_notify();
            self.buf.clear();
            while session.wants_write() {
                session.write_tls(&mut self.buf)?;
            }
        }
        self.sock.write_all(&self.buf)
    }
}

fn lock(session: &Mutex<rustls::ServerConnection>) -> MutexGuard<'_, rustls::ServerConnection> {
    session.lock().unwrap_or_else(PoisonError::into_inner)
}

fn invalid_data(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
            Self::Tls(s) => Self::Tls(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) {
        // Fails only when the socket is already shut down or disconnected: nothing left to do then.
        let _ = match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
            Self::Tls(s) => s.sock.shutdown(how),
        };
    }

    /// Ends the stream cleanly for the peer: TLS sends its close_notify; a plain socket needs nothing.
    /// Call on the writing side, under its lock.
    pub(crate) fn close_notify(&mut self) -> io::Result<()> {
        match self {
            Self::Tls(s) => s.close_notify(),
            Self::Tcp(_) | Self::Unix(_) => Ok(()),
        }
    }

    pub(crate) fn prepare(&self, write_timeout: std::time::Duration) -> io::Result<()> {
        match self {
            Self::Tcp(s) | Self::Tls(TlsSocket { sock: s, .. }) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(write_timeout))
            }
            Self::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(write_timeout))
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
            Self::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
            Self::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
