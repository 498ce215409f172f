//! The sending side of the sync protocol: streams a [`SparseRead`] to a receiver.
//!
//! A blocking producer walks the source's layout and feeds a bounded queue of work (2 MiB data batches, runs of
//! holes); several workers take from it, each with its own request in flight. When the receiver already holds
//! content (an older copy, or a transfer being resumed) a worker first asks for the receiver's xxh3-128 of the
//! batch while it reads and hashes its own copy, and sends only batches that differ; holes are sent only then too,
//! since a fresh receiver file is all holes. With `fast`, matching recorded checksums skip the whole file.
//! Transient failures (connection errors, timeouts, 429/502/503/504) are retried with exponential backoff.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

use crate::plan::{DEFAULT_BATCH_SIZE, Work, plan};
use crate::progress::Progress;
use crate::wire::{
    ChecksumReply, CloseReply, CloseRequest, ErrorBody, FileChecksum, OpenReply, RANGE_ENTRY, RANGES_HEADER,
    encode_ranges,
};
use corral_disk::sparse::{SparseRead, read_ranges_into};

/// How a transfer runs.
#[derive(Clone)]
pub struct SendOptions {
    /// Workers, i.e. requests in flight.
    pub workers: usize,
    /// Data bytes per batch.
    pub batch_size: u64,
    /// Ask the receiver to write with `O_DIRECT`.
    pub direct_io: bool,
    /// Skip the whole transfer when the receiver's valid recorded checksum equals `recorded`.
    pub fast: bool,
    /// The source's valid recorded checksum: compared for `fast`, and recorded by the receiver at close.
    pub recorded: Option<FileChecksum>,
    /// Retries of one request on transient errors.
    pub retries: usize,
    /// Deadline of one request.
    pub request_timeout: Duration,
    /// Upper bound of data bytes sent per second.
    pub max_rate: Option<u64>,
    /// Mutual TLS (`None`: plaintext): the receiver is dialled over HTTPS, must present a certificate of the
    /// cluster CA for the host dialled, and is shown this node's.
    pub tls: Option<Arc<corral_tls::rustls::ClientConfig>>,
}

impl std::fmt::Debug for SendOptions {
    // The TLS config only as on or off: it holds the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendOptions")
            .field("workers", &self.workers)
            .field("batch_size", &self.batch_size)
            .field("direct_io", &self.direct_io)
            .field("fast", &self.fast)
            .field("recorded", &self.recorded)
            .field("retries", &self.retries)
            .field("request_timeout", &self.request_timeout)
            .field("max_rate", &self.max_rate)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// Defaults: 4 workers, 2 MiB batches, 8 retries, 60 s per request, the process's TLS config
/// ([`corral_tls::installed`]; plaintext without one).
impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            workers: 4,
            batch_size: DEFAULT_BATCH_SIZE,
            direct_io: false,
            fast: false,
            recorded: None,
            retries: 8,
            request_timeout: Duration::from_secs(60),
            max_rate: None,
            tls: corral_tls::installed().map(|t| t.client.clone()),
        }
    }
}

/// Sender errors.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// A request failed in transport after all retries.
    #[error("{op} to {url} failed: {source}")]
    Http {
        op: &'static str,
        url: String,
        source: reqwest::Error,
    },
    /// The receiver refused a request.
    #[error("receiver refused {op} (HTTP {status}, {kind}): {message}")]
    Rejected {
        op: &'static str,
        status: u16,
        kind: String,
        message: String,
    },
    /// The receiver's reply could not be decoded.
    #[error("receiver's reply to {op} is unreadable: {detail}")]
    BadReply { op: &'static str, detail: String },
    /// The source could not be read or its layout listed.
    #[error("reading the source: {0}")]
    Source(#[source] io::Error),
    /// The transfer was cancelled; the receiver keeps what arrived, for a resume.
    #[error("cancelled")]
    Cancelled,
}

impl SendError {
    /// Worth retrying: the same request may succeed later.
    pub fn is_transient(&self) -> bool {
        match self {
            SendError::Http { .. } => true,
            SendError::Rejected { status, .. } => matches!(status, 429 | 502 | 503 | 504),
            _ => false,
        }
    }
}

/// What a transfer did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SendSummary {
    /// Whole-file skip: recorded checksums matched, nothing was sent.
    pub file_skipped: bool,
    /// The receiver already held content (delta sync or resume).
    pub receiver_had_content: bool,
    /// Data payload bytes sent.
    pub bytes_sent: u64,
    /// Data bytes not sent because the receiver's checksum matched.
    pub bytes_skipped: u64,
    /// Data bytes of the source.
    pub data_bytes: u64,
    pub data_ranges: u64,
    /// Hole bytes of the source.
    pub hole_bytes: u64,
    pub holes: u64,
    /// HTTP requests that succeeded.
    pub requests: u64,
    pub duration_ms: u64,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    skipped: AtomicU64,
    data: AtomicU64,
    data_ranges: AtomicU64,
    holes: AtomicU64,
    hole_bytes: AtomicU64,
    requests: AtomicU64,
}

/// Sends `content` to the receiver at `to` (`HOST:PORT` or a URL; with `opts.tls` always over `https://`).
pub async fn send(
    content: Arc<dyn SparseRead>,
    to: &str,
    opts: &SendOptions,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<SendSummary, SendError> {
    let started = Instant::now();
    let client = Client::new(to, opts)?;
    let counters = Counters::default();
    let size = content.size();
    progress.start(size);

    if opts.fast
        && let Some(local) = &opts.recorded
        && client.recorded().await?.as_ref() == Some(local)
    {
        client.close(None, &CloseRequest::default()).await?;
        progress.add(size);
        return Ok(SendSummary {
            file_skipped: true,
            duration_ms: elapsed_ms(started),
            ..Default::default()
        });
    }

    let opened = client.open(size, opts.direct_io).await?;
    counters.requests.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel::<Work>(opts.workers.max(1) * 2);
    let rx = Mutex::new(rx);
    let batch_size = opts.batch_size;
    let source = content.clone();
    let producer = tokio::task::spawn_blocking(move || {
        plan(
            &*source,
            batch_size,
            |w| {
                tx.blocking_send(w)
                    .map_err(|_| io::Error::other("workers stopped"))
            },
            |e| e,
        )
    });
    let limiter = opts.max_rate.map(|rate| RateLimiter {
        start: Instant::now(),
        rate: rate.max(1),
        sent: AtomicU64::new(0),
    });
    let ctx = Worker {
        client: &client,
        content: &content,
        session: opened.session,
        existing: opened.existing,
        rx: &rx,
        progress,
        counters: &counters,
        cancel,
        limiter: limiter.as_ref(),
    };
    let workers = futures::future::try_join_all((0..opts.workers.max(1)).map(|_| ctx.run())).await;
    // Dropping the queue's receiver stops a producer still blocked on a full queue.
    drop(rx);
    let produced = producer
        .await
        .map_err(|e| SendError::Source(io::Error::other(e)))?;
    workers?;
    produced.map_err(SendError::Source)?;

    client
        .close(
            Some(opened.session),
            &CloseRequest {
                checksum: opts.recorded.clone(),
            },
        )
        .await?;
    counters.requests.fetch_add(1, Ordering::Relaxed);
    let c = &counters;
    Ok(SendSummary {
        file_skipped: false,
        receiver_had_content: opened.existing,
        bytes_sent: c.sent.load(Ordering::Relaxed),
        bytes_skipped: c.skipped.load(Ordering::Relaxed),
        data_bytes: c.data.load(Ordering::Relaxed),
        data_ranges: c.data_ranges.load(Ordering::Relaxed),
        hole_bytes: c.hole_bytes.load(Ordering::Relaxed),
        holes: c.holes.load(Ordering::Relaxed),
        requests: c.requests.load(Ordering::Relaxed),
        duration_ms: elapsed_ms(started),
    })
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

struct RateLimiter {
    start: Instant,
    rate: u64,
    sent: AtomicU64,
}

impl RateLimiter {
    async fn admit(&self, bytes: u64) {
        let total = self.sent.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let due = self.start + Duration::from_secs_f64(total as f64 / self.rate as f64);
        tokio::time::sleep_until(due.into()).await;
    }
}

#[derive(Clone, Copy)]
struct Worker<'a> {
    client: &'a Client,
    content: &'a Arc<dyn SparseRead>,
    session: u64,
    existing: bool,
    rx: &'a Mutex<mpsc::Receiver<Work>>,
    progress: &'a Progress,
    counters: &'a Counters,
    cancel: &'a CancellationToken,
    limiter: Option<&'a RateLimiter>,
}

impl Worker<'_> {
    async fn run(self) -> Result<(), SendError> {
        // This worker's body buffer, taken back after each request: one allocation per worker, not per batch.
        let mut spare = Vec::new();
        loop {
            let work = tokio::select! {
                w = async { self.rx.lock().await.recv().await } => w,
                () = self.cancel.cancelled() => return Err(SendError::Cancelled),
            };
            let Some(work) = work else { return Ok(()) };
            let covers = work.covers();
            match work {
                Work::Holes { ranges, bytes } => {
                    self.counters
                        .holes
                        .fetch_add(ranges.len() as u64, Ordering::Relaxed);
                    self.counters.hole_bytes.fetch_add(bytes, Ordering::Relaxed);
                    if self.existing {
                        let mut body = Vec::with_capacity(RANGES_HEADER + ranges.len() * RANGE_ENTRY);
                        encode_ranges(&ranges, &mut body);
                        self.client
                            .post_ranges("holes", self.session, &body.into())
                            .await?;
                        self.counters.requests.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Work::Data { ranges, bytes } => self.data(ranges, bytes, &mut spare).await?,
            }
            self.progress.add(covers);
        }
    }

    async fn data(
        &self,
        ranges: Vec<std::ops::Range<u64>>,
        bytes: u64,
        spare: &mut Vec<u8>,
    ) -> Result<(), SendError> {
        self.counters.data.fetch_add(bytes, Ordering::Relaxed);
        self.counters
            .data_ranges
            .fetch_add(ranges.len() as u64, Ordering::Relaxed);
        let mut table = Vec::with_capacity(RANGES_HEADER + ranges.len() * RANGE_ENTRY);
        encode_ranges(&ranges, &mut table);
        let header_len = table.len();
        let table = Bytes::from(table);
        let content = self.content.clone();
        let hash = self.existing;
        let read_table = table.clone();
        let mut body = std::mem::take(spare);
        let read = tokio::task::spawn_blocking(move || -> io::Result<(Vec<u8>, Option<String>)> {
            // Shrinking or keeping a reused buffer's length costs nothing; only growth is zeroed.
            body.resize(header_len + usize::try_from(bytes).map_err(io::Error::other)?, 0);
            body[..header_len].copy_from_slice(&read_table);
            let mut scratch = Vec::new();
            read_ranges_into(&*content, &ranges, &mut body[header_len..], &mut scratch)?;
            // A fresh receiver has nothing to compare with: no hashing then.
            let sum = hash.then(|| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&body[header_len..])));
            Ok((body, sum))
        });
        // Ask for the receiver's checksum while reading and hashing the local copy.
        let (read, remote) = if self.existing {
            let (read, remote) = tokio::join!(read, self.client.checksum(self.session, table));
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            (read, Some(remote?))
        } else {
            (read.await, None)
        };
        let (body, local) = read
            .map_err(|e| SendError::Source(io::Error::other(e)))?
            .map_err(SendError::Source)?;
        if let (Some(Some(remote)), Some(local)) = (&remote, &local)
            && remote == local
        {
            self.counters.skipped.fetch_add(bytes, Ordering::Relaxed);
            *spare = body;
            return Ok(());
        }
        if let Some(l) = self.limiter {
            l.admit(bytes).await;
        }
        let body = Bytes::from(body);
        self.client.post_ranges("data", self.session, &body).await?;
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        self.counters.sent.fetch_add(bytes, Ordering::Relaxed);
        // The HTTP client has let go of the body once the reply arrived; if it still holds a reference, the next
        // batch allocates anew.
        if let Ok(buf) = body.try_into_mut() {
            *spare = buf.into();
        }
        Ok(())
    }
}

/// The receiver's routes, with retries on transient errors.
struct Client {
    http: reqwest::Client,
    base: String,
    backoff: ExponentialBuilder,
}

impl Client {
    fn new(to: &str, opts: &SendOptions) -> Result<Self, SendError> {
        let base = crate::tls::http_base(to, opts.tls.is_some());
        let builder = reqwest::Client::builder()
            .pool_max_idle_per_host(opts.workers.max(1) * 2)
            .connect_timeout(Duration::from_secs(5))
            .timeout(opts.request_timeout)
            .tcp_nodelay(true);
        let http = crate::tls::reqwest_tls(builder, opts.tls.as_deref())
            .build()
            .map_err(SendError::Client)?;
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(5))
            .with_max_times(opts.retries)
            .with_jitter();
        Ok(Client { http, base, backoff })
    }

    fn url(&self, route: &str) -> String {
        format!("{}/v1/sync/{route}", self.base)
    }

    /// Sends the request `make` builds, retrying transient failures; a non-2xx reply becomes `Rejected`.
    async fn call(
        &self,
        op: &'static str,
        make: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, SendError> {
        let url = self.url(op);
        let attempt = || async {
            let resp = make(&self.http).send().await.map_err(|source| SendError::Http {
                op,
                url: url.clone(),
                source,
            })?;
            let status = resp.status();
            if status.is_success() {
                return Ok(resp);
            }
            let text = resp.text().await.unwrap_or_default();
            let (kind, message) = match serde_json::from_str::<ErrorBody>(&text) {
                Ok(b) => (b.kind, b.message),
                Err(_) => ("unknown".to_string(), text),
            };
            Err(SendError::Rejected {
                op,
                status: status.as_u16(),
                kind,
                message,
            })
        };
        attempt
            .retry(self.backoff)
            .sleep(tokio::time::sleep)
            .when(SendError::is_transient)
            .notify(
                |e, after| tracing::warn!(error = %e, retry_in = ?after, "transient sync error, retrying"),
            )
            .await
    }

    async fn json<T: serde::de::DeserializeOwned>(
        op: &'static str,
        resp: reqwest::Response,
    ) -> Result<T, SendError> {
        let bytes = resp.bytes().await.map_err(|e| SendError::BadReply {
            op,
            detail: e.to_string(),
        })?;
        serde_json::from_slice(&bytes).map_err(|e| SendError::BadReply {
            op,
            detail: e.to_string(),
        })
    }

    async fn recorded(&self) -> Result<Option<FileChecksum>, SendError> {
        let url = self.url("recorded");
        match self.call("recorded", |c| c.get(&url)).await {
            Ok(resp) => Ok(Some(Self::json("recorded", resp).await?)),
            Err(SendError::Rejected { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn open(&self, size: u64, direct_io: bool) -> Result<OpenReply, SendError> {
        let url = self.url("open");
        let resp = self
            .call("open", |c| {
                c.post(&url)
                    .query(&[("size", size.to_string()), ("direct_io", direct_io.to_string())])
            })
            .await?;
        Self::json("open", resp).await
    }

    async fn post_ranges(
        &self,
        op: &'static str,
        session: u64,
        body: &Bytes,
    ) -> Result<reqwest::Response, SendError> {
        let url = self.url(op);
        self.call(op, |c| {
            c.post(&url).query(&[("session", session)]).body(body.clone())
        })
        .await
    }

    async fn checksum(&self, session: u64, table: Bytes) -> Result<Option<String>, SendError> {
        let resp = self.post_ranges("checksum", session, &table).await?;
        Ok(Self::json::<ChecksumReply>("checksum", resp).await?.xxh3_128)
    }

    async fn close(&self, session: Option<u64>, req: &CloseRequest) -> Result<CloseReply, SendError> {
        let url = self.url("close");
        let resp = self
            .call("close", |c| {
                let b = c.post(&url).json(req);
                match session {
                    Some(s) => b.query(&[("session", s)]),
                    None => b,
                }
            })
            .await?;
        Self::json("close", resp).await
    }
}
