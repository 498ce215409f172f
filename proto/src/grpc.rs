//! The one way a Corral client opens a gRPC channel (engine → replica, replica → replica, manager → engine,
//! data source → replica, backing-image managers, the CLIs): named timeouts instead of numbers scattered over
//! call sites, a deadline over the whole connect, a request timeout (a peer that accepts TCP but never answers
//! cannot hold a caller), HTTP/2 keepalive so a dead peer is noticed on an idle channel, and unix sockets.
//! Over TCP, mutual TLS once `main` installed the process's configs (`corral_tls::install`, from `--tls-dir`); unix
//! sockets are never wrapped (their file mode guards them). [`incoming`] is the server side: the connections of
//! every tonic server.

use std::sync::{Arc, OnceLock};
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
    #[error("cannot reach {target}: {}", chain(source))]
    Unreachable {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// No HTTP/2 handshake within the connect timeout.
    #[error("no gRPC handshake with {target} within {timeout:?}")]
    Timeout { target: String, timeout: Duration },
}

/// The process's TLS client config (`corral_tls::installed`) with ALPN `h2`, derived once.
fn process_tls() -> Option<&'static Arc<rustls::ClientConfig>> {
    static H2: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    let installed = corral_tls::installed()?;
    Some(H2.get_or_init(|| {
        let mut config = (*installed.client).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }))
}

/// The connections of a tonic server on `listener`
/// (`Server::builder()….serve_with_incoming_shutdown(incoming(l, tls)?, …)`): plain TCP without `tls`; with it,
/// `corral_tls::TcpIncoming` (a handshake per connection in its own task with a deadline, a refused peer logged once
/// per address; ALPN `h2` set here), so only peers whose handshake completed reach the service.
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<impl futures::Stream<Item = std::io::Result<Conn>> + Send + 'static> {
    let tls = tls.map(|config| {
        let mut config = (*config).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    });
    let incoming = corral_tls::TcpIncoming::new(listener, tls)?;
    Ok(futures::stream::unfold(incoming, |mut incoming| async move {
        let (stream, _) = incoming.accept().await;
        Some((Ok(Conn(stream)), incoming))
    }))
}

/// A connection of [`incoming`]: a TCP socket or its TLS session.
pub struct Conn(corral_tls::ServerStream);

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match &self.0 {
            tokio_util::either::Either::Left(tcp) => tcp.connect_info(),
            tokio_util::either::Either::Right(tls) => tls.get_ref().0.connect_info(),
        }
    }
}

impl tokio::io::AsyncRead for Conn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Conn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Opens a channel to `target`: `HOST:PORT`, `http://HOST:PORT`, `tcp://HOST:PORT` or `unix:PATH`; over TCP with
/// the process's TLS client config when `main` installed one (`corral_tls::install`).
pub async fn connect(target: &str, timeouts: GrpcTimeouts) -> Result<Channel, ConnectError> {
    connect_with(target, timeouts, process_tls()).await
}

/// [`connect`] with this TLS client config instead of the process's (`None`: plaintext). For tests and tools that
/// present another identity.
pub async fn connect_with(
    target: &str,
    timeouts: GrpcTimeouts,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Channel, ConnectError> {
    if let Some(path) = target.strip_prefix("unix:") {
        return connect_endpoint(&Endpoint::Unix(path.into()), timeouts).await;
    }
    let hp = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("tcp://"))
        .unwrap_or(target);
    let ep = endpoint(target, format!("http://{hp}"), timeouts)?;
    connect_tcp(target, ep, timeouts, tls).await
}

/// Opens a channel to one endpoint of a replica (or any daemon).
pub async fn connect_endpoint(target: &Endpoint, timeouts: GrpcTimeouts) -> Result<Channel, ConnectError> {
    let name = target.to_string();
    match target {
        Endpoint::Tcp { .. } => {
            let ep = endpoint(&name, target.grpc_uri(), timeouts)?;
            connect_tcp(&name, ep, timeouts, process_tls()).await
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

/// Plain TCP, or TLS with `tls`: tonic's connector dials, a TLS handshake (server name: the host of the URI) wraps
/// the socket. Reconnects of the channel go through the same connector.
async fn connect_tcp(
    target: &str,
    ep: TonicEndpoint,
    t: GrpcTimeouts,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Channel, ConnectError> {
    let Some(tls) = tls else {
        return finish(target, t, ep.connect()).await;
    };
    let tls = tokio_rustls::TlsConnector::from(tls.clone());
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_keepalive(Some(t.keepalive));
    let connector = tower::service_fn(move |uri: Uri| {
        let (tls, mut http) = (tls.clone(), http.clone());
        async move {
            let host = uri.host().unwrap_or_default();
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            let tcp = tower::Service::call(&mut http, uri).await?.into_inner();
            let stream = tls.connect(name, tcp).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    finish(target, t, ep.connect_with_connector(connector)).await
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

/// An error with its causes (tonic's transport error says only "transport error"; the cause — refused, a TLS
/// alert, a certificate not valid for the name — is what the operator needs).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        next = cause.source();
    }
    s
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
