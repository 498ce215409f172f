//! The one way a Corral client opens a gRPC channel (engine → replica, replica → replica, manager → engine,
//! data source → replica, backing-image managers, the CLIs): named timeouts instead of numbers scattered over
//! call sites, a deadline over the whole connect, a request timeout (a peer that accepts TCP but never answers
//! cannot hold a caller), HTTP/2 keepalive so a dead peer is noticed on an idle channel, and unix sockets.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint as TonicEndpoint, Uri};

use crate::replica_address::Endpoint;

/// How long a gRPC client waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcTimeouts {
    /// To open the channel: TCP connect plus the HTTP/2 handshake.
    pub connect: Duration,
    /// Until a request's response starts (the messages of a stream are not bounded by it).
    pub request: Duration,
    /// Interval of HTTP/2 and TCP keepalive probes; a peer silent for as long again is dropped.
    pub keepalive: Duration,
}

impl GrpcTimeouts {
    /// Control calls between daemons and from CLIs: answers come within seconds; long work runs as jobs polled
    /// by status calls.
    pub const CONTROL: Self = Self {
        connect: Duration::from_secs(3),
        request: Duration::from_secs(60),
        keepalive: Duration::from_secs(10),
    };

    /// A person's command (CLIs): some calls do the work before answering (a snapshot of every replica, a
    /// backup's first steps); the person, not a timer, decides when to give up (Ctrl-C).
    pub const OPERATOR: Self = Self {
        request: Duration::from_secs(3600),
        ..Self::CONTROL
    };

    /// [`CONTROL`](Self::CONTROL) with another request timeout (streams that last as long as a transfer).
    pub const fn with_request(self, request: Duration) -> Self {
        Self { request, ..self }
    }
}

impl Default for GrpcTimeouts {
    fn default() -> Self {
        Self::CONTROL
    }
}

/// Why a channel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The target is not a usable address.
    #[error("gRPC address {target:?}: {reason}")]
    Address { target: String, reason: String },
    /// The peer refused or the connection broke during the handshake.
    #[error("cannot reach {target}: {source}")]
    Unreachable {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// No HTTP/2 handshake within the connect timeout.
    #[error("no gRPC handshake with {target} within {timeout:?}")]
    Timeout { target: String, timeout: Duration },
}

/// Opens a channel to `target`: `HOST:PORT`, `http://HOST:PORT`, `tcp://HOST:PORT` or `unix:PATH`.
pub async fn connect(target: &str, timeouts: GrpcTimeouts) -> Result<Channel, ConnectError> {
    if let Some(path) = target.strip_prefix("unix:") {
        return connect_endpoint(&Endpoint::Unix(path.into()), timeouts).await;
    }
    let hp = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("tcp://"))
        .unwrap_or(target);
    let ep = endpoint(target, format!("http://{hp}"), timeouts)?;
    finish(target, timeouts, ep.connect()).await
}

/// Opens a channel to one endpoint of a replica (or any daemon).
pub async fn connect_endpoint(target: &Endpoint, timeouts: GrpcTimeouts) -> Result<Channel, ConnectError> {
    let name = target.to_string();
    match target {
        Endpoint::Tcp { .. } => {
            let ep = endpoint(&name, target.grpc_uri(), timeouts)?;
            finish(&name, timeouts, ep.connect()).await
        }
        Endpoint::Unix(path) => {
            // The URI is required by tonic but unused: the connector dials the socket.
            let ep = endpoint(&name, "http://unix.socket".to_owned(), timeouts)?;
            let path = path.clone();
            let connector = tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            });
            finish(&name, timeouts, ep.connect_with_connector(connector)).await
        }
    }
}

fn endpoint(target: &str, uri: String, t: GrpcTimeouts) -> Result<TonicEndpoint, ConnectError> {
    let ep = TonicEndpoint::from_shared(uri).map_err(|e| ConnectError::Address {
        target: target.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(ep
        .connect_timeout(t.connect)
        .timeout(t.request)
        .tcp_keepalive(Some(t.keepalive))
        .http2_keep_alive_interval(t.keepalive)
        .keep_alive_timeout(t.keepalive))
}

async fn finish(
    target: &str,
    t: GrpcTimeouts,
    connecting: impl Future<Output = Result<Channel, tonic::transport::Error>>,
) -> Result<Channel, ConnectError> {
    match tokio::time::timeout(t.connect, connecting).await {
        Ok(Ok(ch)) => Ok(ch),
        Ok(Err(source)) => Err(ConnectError::Unreachable {
            target: target.to_owned(),
            source,
        }),
        Err(_) => Err(ConnectError::Timeout {
            target: target.to_owned(),
            timeout: t.connect,
        }),
    }
}

impl From<ConnectError> for tonic::Status {
    fn from(e: ConnectError) -> Self {
        tonic::Status::unavailable(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_peer_that_never_answers_fails_the_request_at_the_request_timeout() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let t = GrpcTimeouts {
            connect: Duration::from_millis(300),
            request: Duration::from_millis(300),
            ..GrpcTimeouts::CONTROL
        };
        // Accepts the TCP connection and holds it open without a word.
        let held = tokio::spawn(async move {
            let conn = silent.accept().await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(conn);
        });
        let started = std::time::Instant::now();
        let answer = match connect(&addr.to_string(), t).await {
            Err(e) => Err(e.to_string()),
            Ok(ch) => crate::v1::replica_service_client::ReplicaServiceClient::new(ch)
                .replica_get(crate::v1::Empty {})
                .await
                .map(|_| ())
                .map_err(|s| s.to_string()),
        };
        assert!(answer.is_err(), "a silent peer answered");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        held.abort();
    }

    #[tokio::test]
    async fn a_closed_port_and_a_bad_address_are_errors_naming_the_target() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let err = connect(&format!("tcp://{addr}"), GrpcTimeouts::CONTROL)
            .await
            .unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        let err = connect("http://bad host:1", GrpcTimeouts::CONTROL)
            .await
            .unwrap_err();
        assert!(matches!(err, ConnectError::Address { .. }), "{err}");
        let err = connect("unix:/nonexistent/x.sock", GrpcTimeouts::CONTROL)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/x.sock"), "{err}");
    }
}
