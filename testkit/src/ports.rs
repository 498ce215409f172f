//! The one free-port probe left, for servers that cannot bind port 0 and report what they bound.
//!
//! Corral's own daemons never need it: they take port 0 and write a ready file (see [`crate::daemon`]). A
//! third-party server (etcd, rclone) gets its port from [`unbound_port`], which is racy by nature: the port is free
//! when probed and released before the server binds it, so another process may take it in between. Start such a
//! server through [`retry_on_address_in_use`], which tries again on fresh ports when that happens.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;

use crate::daemon::{Daemon, DaemonError};

/// How many times a spawn that lost its port is retried on fresh ports.
pub const BIND_ATTEMPTS: usize = 5;

/// A loopback TCP port nothing listens on at the moment of the call (the kernel's pick for port 0, released).
///
/// # Panics
/// When no loopback port can be bound.
pub fn unbound_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// `n` consecutive loopback TCP ports nothing listens on at the moment of the call (same race as
/// [`unbound_port`]). For a port range such as the sync-receiver `--port-range` of a `corral-bim`, which skips a
/// port of its range that another process took.
///
/// # Panics
/// When no such run is found in 500 tries.
pub fn unbound_port_run(n: u16) -> u16 {
    for _ in 0..500 {
        let p = unbound_port();
        if p.checked_add(n).is_some_and(|end| end < u16::MAX)
            && (0..n).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok())
        {
            return p;
        }
    }
    panic!("no {n} consecutive unbound loopback ports");
}

/// Calls `start` (which should pick its ports with [`unbound_port`]) until its daemon comes up, retrying up to
/// [`BIND_ATTEMPTS`] times when the daemon failed because an address was in use.
///
/// # Panics
/// On any other failure, or when every attempt lost its port.
pub fn retry_on_address_in_use(mut start: impl FnMut() -> Result<Daemon, DaemonError>) -> Daemon {
    for attempt in 1..=BIND_ATTEMPTS {
        match start() {
            Ok(d) => return d,
            Err(e) if e.is_address_in_use() && attempt < BIND_ATTEMPTS => {
                eprintln!(
                    "attempt {attempt}: a port was taken before the server bound it; trying other ports"
                );
            }
            Err(e) => panic!("{e}"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// A loopback address that refuses connections for as long as this value lives: the port is bound (so no other
/// process can take it) but never listened on. For tests of "nobody answers there".
pub struct RefusedAddr {
    _socket: OwnedFd,
    pub addr: SocketAddr,
}

impl RefusedAddr {
    /// # Panics
    /// When no loopback socket can be bound.
    pub fn new() -> Self {
        use rustix::net::{AddressFamily, SocketType, bind, getsockname, socket};
        let socket = socket(AddressFamily::INET, SocketType::STREAM, None).expect("socket");
        let any: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
        bind(&socket, &any).expect("bind a loopback port");
        let addr = match getsockname(&socket).map(SocketAddr::try_from) {
            Ok(Ok(a)) => a,
            other => panic!("address of a bound socket: {other:?}"),
        };
        Self {
            _socket: socket,
            addr,
        }
    }
}

impl Default for RefusedAddr {
    fn default() -> Self {
        Self::new()
    }
}
