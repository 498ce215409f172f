//! Where a replica is reached: its three endpoints (gRPC `ReplicaService` = control, the data protocol, gRPC
//! `SyncAgentService` = sync), each a TCP `HOST:PORT` or a unix socket with its own port or path, and optionally the
//! name of one replica on a daemon that hosts several. Every component that names a replica (engine flags and
//! gRPC, the manager's records, replica-to-replica rebuild and clone, data-source exports) passes this one form, so
//! no one derives a port from another.
//!
//! Text form (documented in `docs/formats.md`):
//!
//! ```text
//! tcp://HOST:PORT?data=ENDPOINT&sync=ENDPOINT[&replica=NAME]
//! unix:PATH?data=ENDPOINT&sync=ENDPOINT[&replica=NAME]
//! ```
//!
//! where the part before `?` is the control endpoint and each `ENDPOINT` is `PORT` (TCP on the control's host),
//! `HOST:PORT` or `unix:PATH`. IPv6 hosts are bracketed (`[::1]:9502`). Paths and names may not hold `?`, `&`,
//! `=` or `#`. `data` and `sync` are required: the old single-port `tcp://HOST:PORT` is refused with a message
//! saying what to add.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// One endpoint of a replica.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// A TCP address; `host` is a name or an IP (IPv6 without brackets).
    Tcp { host: String, port: u16 },
    /// A unix socket.
    Unix(PathBuf),
}

/// Why a replica address was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("replica address {input:?}: {reason}")]
pub struct AddressError {
    pub input: String,
    pub reason: String,
}

impl Endpoint {
    /// A TCP endpoint.
    pub fn tcp(host: impl Into<String>, port: u16) -> Self {
        Self::Tcp {
            host: host.into(),
            port,
        }
    }

    /// `HOST:PORT` (brackets around an IPv6 host) or `unix:PATH`: the form `data_protocol::DataClient::connect`
    /// and the ready file use.
    pub fn to_socket_string(&self) -> String {
        match self {
            Self::Tcp { host, port } => format!("{}:{port}", bracket(host)),
            Self::Unix(p) => format!("unix:{}", p.display()),
        }
    }

    /// The URI a gRPC channel connects to: `http://HOST:PORT`, or for a unix socket `unix:PATH` (which
    /// `corral_proto::grpc` turns into a unix connector).
    pub fn grpc_uri(&self) -> String {
        match self {
            Self::Tcp { .. } => format!("http://{}", self.to_socket_string()),
            Self::Unix(p) => format!("unix:{}", p.display()),
        }
    }

    /// The host of a TCP endpoint.
    pub fn host(&self) -> Option<&str> {
        match self {
            Self::Tcp { host, .. } => Some(host),
            Self::Unix(_) => None,
        }
    }

    /// Parses `HOST:PORT` or `unix:PATH`; a bare `PORT` takes `default_host` when given.
    fn parse_with(s: &str, default_host: Option<&str>) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            return check_text("socket path", path).map(|()| Self::Unix(PathBuf::from(path)));
        }
        if let (Some(host), Ok(port)) = (default_host, s.parse::<u16>()) {
            return Ok(Self::tcp(host, port));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?}: expected HOST:PORT or unix:PATH"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty()
            || host.contains(['/', '?', '&', '=', '#'])
            || (host.contains(':') && !s.contains('['))
        {
            return Err(format!("{s:?}: bad host (bracket IPv6 hosts: [::1]:PORT)"));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("{s:?}: {port:?} is not a port"))?;
        Ok(Self::tcp(host, port))
    }
}

impl FromStr for Endpoint {
    type Err = AddressError;
    fn from_str(s: &str) -> Result<Self, AddressError> {
        Self::parse_with(s, None).map_err(|reason| AddressError {
            input: s.to_owned(),
            reason,
        })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_socket_string())
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

fn check_text(what: &str, s: &str) -> Result<(), String> {
    if s.is_empty() || s.contains(['?', '&', '=', '#']) {
        return Err(format!("{what} {s:?} is empty or holds one of ? & = #"));
    }
    Ok(())
}

/// The endpoints of one replica, and its name on a daemon that hosts several.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaAddress {
    /// gRPC `ReplicaService`.
    pub control: Endpoint,
    /// The data protocol.
    pub data: Endpoint,
    /// gRPC `SyncAgentService` (rebuild, purge, hash, clone, export, backup).
    pub sync: Endpoint,
    /// The replica on a daemon hosting several; `None` for a daemon of one replica.
    pub replica: Option<String>,
}

impl ReplicaAddress {
    /// A replica on TCP ports of one host.
    pub fn tcp(host: &str, control: u16, data: u16, sync: u16) -> Self {
        Self {
            control: Endpoint::tcp(host, control),
            data: Endpoint::tcp(host, data),
            sync: Endpoint::tcp(host, sync),
            replica: None,
        }
    }
}

impl FromStr for ReplicaAddress {
    type Err = AddressError;
    fn from_str(s: &str) -> Result<Self, AddressError> {
        let err = |reason: String| AddressError {
            input: s.to_owned(),
            reason,
        };
        let (base, query) = s.split_once('?').unwrap_or((s, ""));
        let control = if let Some(hp) = base.strip_prefix("tcp://") {
            Endpoint::parse_with(hp, None).map_err(err)?
        } else if base.starts_with("unix:") {
            Endpoint::parse_with(base, None).map_err(err)?
        } else {
            return Err(err(
                "expected tcp://HOST:PORT?data=…&sync=… or unix:PATH?data=…&sync=…".into(),
            ));
        };
        let host = control.host().map(ToOwned::to_owned);
        let (mut data, mut sync, mut replica) = (None, None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| err(format!("{pair:?}: expected KEY=VALUE")))?;
            let slot = match k {
                "data" => &mut data,
                "sync" => &mut sync,
                "replica" => {
                    check_text("replica name", v).map_err(err)?;
                    if replica.replace(v.to_owned()).is_some() {
                        return Err(err("replica given twice".into()));
                    }
                    continue;
                }
                other => {
                    return Err(err(format!(
                        "unknown key {other:?} (expected data, sync, replica)"
                    )));
                }
            };
            let ep = Endpoint::parse_with(v, host.as_deref()).map_err(err)?;
            if slot.replace(ep).is_some() {
                return Err(err(format!("{k} given twice")));
            }
        }
        match (data, sync) {
            (Some(data), Some(sync)) => Ok(Self {
                control,
                data,
                sync,
                replica,
            }),
            _ => Err(err(
                "the data and sync endpoints are missing: give them explicitly, e.g. \
                 tcp://HOST:PORT?data=PORT&sync=PORT (ports are not derived from the control port)"
                    .into(),
            )),
        }
    }
}

impl fmt::Display for ReplicaAddress {
    /// The canonical text: ports on the control's host are written as bare ports.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.control {
            Endpoint::Tcp { .. } => write!(f, "tcp://{}", self.control)?,
            Endpoint::Unix(_) => write!(f, "{}", self.control)?,
        }
        let short = |e: &Endpoint| match (e, &self.control) {
            (Endpoint::Tcp { host, port }, Endpoint::Tcp { host: ch, .. }) if host == ch => port.to_string(),
            _ => e.to_string(),
        };
        write!(f, "?data={}&sync={}", short(&self.data), short(&self.sync))?;
        if let Some(r) = &self.replica {
            write!(f, "&replica={r}")?;
        }
        Ok(())
    }
}

impl serde::Serialize for ReplicaAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ReplicaAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_address_round_trips_with_bare_ports_on_the_control_host() {
        let a = ReplicaAddress::tcp("10.0.0.1", 9502, 9610, 9720);
        let text = a.to_string();
        assert_eq!(text, "tcp://10.0.0.1:9502?data=9610&sync=9720");
        assert_eq!(text.parse::<ReplicaAddress>().unwrap(), a);
        assert_eq!(a.data.to_socket_string(), "10.0.0.1:9610");
        assert_eq!(a.sync.grpc_uri(), "http://10.0.0.1:9720");
    }

    #[test]
    fn endpoints_may_be_other_hosts_unix_sockets_and_ipv6_and_carry_a_replica_name() {
        let text = "unix:/run/r/ctl.sock?data=unix:/run/r/data.sock&sync=[::1]:7000&replica=pvc-1-r-0";
        let a: ReplicaAddress = text.parse().unwrap();
        assert_eq!(a.control, Endpoint::Unix("/run/r/ctl.sock".into()));
        assert_eq!(a.data.to_socket_string(), "unix:/run/r/data.sock");
        assert_eq!(a.sync, Endpoint::tcp("::1", 7000));
        assert_eq!(a.replica.as_deref(), Some("pvc-1-r-0"));
        assert_eq!(a.to_string(), text);
        let v6: ReplicaAddress = "tcp://[fd00::5]:1?data=2&sync=host-b:3".parse().unwrap();
        assert_eq!(v6.data, Endpoint::tcp("fd00::5", 2));
        assert_eq!(v6.sync, Endpoint::tcp("host-b", 3));
        assert_eq!(v6.to_string(), "tcp://[fd00::5]:1?data=2&sync=host-b:3");
        assert_eq!(v6.control.grpc_uri(), "http://[fd00::5]:1");
    }

    #[test]
    fn old_single_port_form_and_garbage_are_refused_with_a_reason() {
        let e = "tcp://127.0.0.1:9502".parse::<ReplicaAddress>().unwrap_err();
        assert!(e.to_string().contains("data and sync"), "{e}");
        for bad in [
            "",
            "127.0.0.1:9502?data=1&sync=2",
            "tcp://127.0.0.1?data=1&sync=2",
            "tcp://127.0.0.1:70000?data=1&sync=2",
            "tcp://127.0.0.1:1?data=1&sync=2&data=3",
            "tcp://127.0.0.1:1?data=1&sync=2&color=red",
            "tcp://127.0.0.1:1?data=x&sync=2",
            "tcp://::1:1?data=1&sync=2",
            "unix:/a?data=1&sync=2",
            "unix:?data=unix:/b&sync=unix:/c",
            "tcp://h:1?data=1&sync=2&replica=",
        ] {
            assert!(bad.parse::<ReplicaAddress>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn serde_uses_the_text_form() {
        let a = ReplicaAddress::tcp("h", 1, 2, 3);
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(j, "\"tcp://h:1?data=2&sync=3\"");
        assert_eq!(serde_json::from_str::<ReplicaAddress>(&j).unwrap(), a);
        assert!(serde_json::from_str::<ReplicaAddress>("\"tcp://h:1\"").is_err());
    }
}
