//! A connected socket (TCP or unix) used with blocking calls, shared by a connection's thread and the IO pool's
//! workers that write its replies.

use std::io::{self, Read, Write};
use std::net::Shutdown;

/// A connected socket, used with blocking calls.
pub(crate) enum Stream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) {
        // Fails only when the socket is already shut down or disconnected: nothing left to do then.
        let _ = match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        };
    }

    pub(crate) fn prepare(&self, write_timeout: std::time::Duration) -> io::Result<()> {
        match self {
            Self::Tcp(s) => {
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
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
