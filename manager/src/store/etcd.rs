//! The multi-node store: etcd. A document lives at `<prefix>/<kind>/<name>`; its version is the key's
//! `mod_revision`, and conditional writes are transactions comparing it. Leadership for the cluster-wide
//! controllers is a key bound to a lease kept alive by the leader.
//!
//! The client is etcd v3's gRPC API itself (`corral_proto::etcd`, compiled by protox like Corral's own protos),
//! so building the manager needs no `protoc` and no etcd client crate.

use std::collections::VecDeque;
use std::time::Duration;

use corral_proto::etcd::etcdserverpb::{
    Compare, DeleteRangeRequest, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseRevokeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest, WatchCreateRequest, WatchRequest,
    WatchResponse, compare, kv_client::KvClient, lease_client::LeaseClient, request_op,
    watch_client::WatchClient, watch_request,
};
use corral_proto::etcd::mvccpb::{KeyValue, event::EventType};
use futures::stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

use super::{RawDoc, RawEvent, RawWatch, Store, StoreError};

/// Seconds a leader may stay silent before another manager takes over.
const LEADER_TTL: i64 = 6;
/// How long to wait for a TCP connection to an etcd endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one unary request (or the opening of a stream) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

pub struct EtcdStore {
    kv: KvClient<Channel>,
    watch: WatchClient<Channel>,
    lease: LeaseClient<Channel>,
    prefix: String,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

/// A failed etcd RPC. One that was not answered in time or found no member (what a lost quorum looks like from a
/// client: etcd holds the request until a leader exists) says so, rather than tonic's "operation was cancelled".
fn rpc(e: tonic::Status) -> StoreError {
    match e.code() {
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unavailable => {
            StoreError::Unavailable(format!(
                "etcd did not answer within {}s: no quorum of its members is reachable ({})",
                REQUEST_TIMEOUT.as_secs(),
                e.message()
            ))
        }
        _ => backend(e),
    }
}

fn version(rev: i64) -> u64 {
    u64::try_from(rev).unwrap_or(0)
}

fn rev(version: u64) -> i64 {
    i64::try_from(version).unwrap_or(i64::MAX)
}

/// The end of the key range holding every key that starts with `prefix` (etcd's `[key, range_end)` form): the
/// prefix with its last byte below 0xff incremented and what follows dropped.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Only 0xff bytes: the range is "every key from here on", which etcd spells as a single zero byte.
    vec![0]
}

/// A compare-and-put/delete guard: `key`'s mod revision (0 = absent) equals `mod_revision`.
fn mod_revision_is(key: &str, mod_revision: i64) -> Compare {
    Compare {
        result: compare::CompareResult::Equal.into(),
        target: compare::CompareTarget::Mod.into(),
        key: key.as_bytes().to_vec(),
        target_union: Some(compare::TargetUnion::ModRevision(mod_revision)),
    }
}

/// A guard that `key` does not exist (its create revision is 0).
fn absent(key: &str) -> Compare {
    Compare {
        result: compare::CompareResult::Equal.into(),
        target: compare::CompareTarget::Create.into(),
        key: key.as_bytes().to_vec(),
        target_union: Some(compare::TargetUnion::CreateRevision(0)),
    }
}

fn put_op(key: &str, value: Vec<u8>, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.as_bytes().to_vec(),
            value,
            lease,
        })),
    }
}

fn delete_op(key: &str) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestDeleteRange(DeleteRangeRequest {
            key: key.as_bytes().to_vec(),
            range_end: Vec::new(),
        })),
    }
}

/// `HOST:PORT` (what `--store etcd://` takes) or a full URL.
fn endpoint(spec: &str) -> Result<Endpoint, StoreError> {
    let url = if spec.contains("://") {
        spec.to_owned()
    } else {
        format!("http://{spec}")
    };
    Ok(Endpoint::from_shared(url)
        .map_err(|e| backend(format!("bad endpoint {spec:?}: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT))
}

/// One open etcd watch stream. The request side stays open for as long as the watch is read: etcd ends the whole
/// stream when the client closes its half.
struct WatchStream {
    _requests: mpsc::Sender<WatchRequest>,
    responses: Streaming<WatchResponse>,
}

impl WatchStream {
    /// Opens a watch of `[key, range_end)` (an empty `range_end`: the key alone) and waits for etcd to confirm
    /// it, so every write after this returns is seen.
    async fn open(
        client: &mut WatchClient<Channel>,
        key: &[u8],
        range_end: Vec<u8>,
    ) -> Result<Self, StoreError> {
        let (tx, rx) = mpsc::channel(1);
        tx.send(WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(WatchCreateRequest {
                key: key.to_vec(),
                range_end,
                start_revision: 0,
            })),
        })
        .await
        .map_err(backend)?;
        let mut responses = client
            .watch(ReceiverStream::new(rx))
            .await
            .map_err(backend)?
            .into_inner();
        match responses.message().await.map_err(backend)? {
            Some(r) if r.created && !r.canceled => Ok(Self {
                _requests: tx,
                responses,
            }),
            Some(r) => Err(backend(format!("watch was not created: {}", r.cancel_reason))),
            None => Err(backend("watch was not created: stream closed")),
        }
    }

    async fn next(&mut self) -> Result<Option<WatchResponse>, tonic::Status> {
        self.responses.message().await
    }
}

impl EtcdStore {
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, StoreError> {
        let endpoints = endpoints
            .iter()
            .map(|e| endpoint(e))
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(backend("no endpoint given"));
        }
        let channel = Channel::balance_list(endpoints.into_iter());
        let s = Self {
            kv: KvClient::new(channel.clone()),
            watch: WatchClient::new(channel.clone()),
            lease: LeaseClient::new(channel),
            prefix: prefix.trim_end_matches('/').to_owned(),
        };
        // Fail at start, not at the first request, when etcd is unreachable.
        s.range(b"probe".to_vec(), Vec::new()).await?;
        Ok(s)
    }

    fn key(&self, kind: &str, name: &str) -> String {
        format!("{}/{kind}/{name}", self.prefix)
    }

    fn kind_prefix(&self, kind: &str) -> String {
        format!("{}/{kind}/", self.prefix)
    }

    async fn range(&self, key: Vec<u8>, range_end: Vec<u8>) -> Result<Vec<KeyValue>, StoreError> {
        let resp = self
            .kv
            .clone()
            .range(RangeRequest {
                key,
                range_end,
                ..Default::default()
            })
            .await
            .map_err(rpc)?;
        Ok(resp.into_inner().kvs)
    }

    /// Runs `success` if every guard holds; `Some(new store revision)` then, `None` when a guard failed.
    async fn txn(&self, guards: Vec<Compare>, success: Vec<RequestOp>) -> Result<Option<u64>, StoreError> {
        let resp = self
            .kv
            .clone()
            .txn(TxnRequest {
                compare: guards,
                success,
                failure: Vec::new(),
            })
            .await
            .map_err(rpc)?
            .into_inner();
        if !resp.succeeded {
            return Ok(None);
        }
        Ok(Some(version(resp.header.map_or(0, |h| h.revision))))
    }

    /// After a failed conditional write: NotFound or Conflict.
    async fn why_not(&self, kind: &'static str, name: &str, expected: u64) -> StoreError {
        match self.get(kind, name).await {
            Ok(None) => StoreError::NotFound {
                kind,
                name: name.to_owned(),
            },
            Ok(Some(_)) => StoreError::Conflict {
                kind,
                name: name.to_owned(),
                expected,
            },
            Err(e) => e,
        }
    }

    async fn revoke(&self, lease: i64) {
        let _ = self
            .lease
            .clone()
            .lease_revoke(LeaseRevokeRequest { id: lease })
            .await;
    }
}

/// Keeps `lease` alive until `token` is cancelled (then revokes it), cancelling `token` itself when etcd stops
/// renewing the lease.
async fn keep_alive(lease_client: LeaseClient<Channel>, lease: i64, token: CancellationToken) {
    let mut client = lease_client.clone();
    let (tx, rx) = mpsc::channel(1);
    // The first renewal is queued before the stream opens: etcd answers the call's headers only once a request
    // arrived, so awaiting the open with nothing sent never returned and the lease expired after its TTL (a
    // second leader took over while this one still led).
    let _ = tx.try_send(LeaseKeepAliveRequest { id: lease });
    let opened = client.lease_keep_alive(ReceiverStream::new(rx)).await;
    let period = Duration::from_secs(u64::try_from(LEADER_TTL / 3).unwrap_or(1));
    match opened {
        Ok(resp) => {
            let mut responses = resp.into_inner();
            // Each renewal's answer must come within one period: the last good renewal is then at most two periods
            // old when this leader steps down, before the lease (three periods) can expire and another one lead.
            // The first answer is the queued renewal's.
            let mut alive = renewed(&mut responses, period).await;
            while alive {
                tokio::select! {
                    () = token.cancelled() => break,
                    () = tokio::time::sleep(period) => {}
                }
                alive = tx.send(LeaseKeepAliveRequest { id: lease }).await.is_ok()
                    && renewed(&mut responses, period).await;
            }
            if !alive {
                tracing::warn!("leader lease lost");
                token.cancel();
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "leader lease keep-alive could not start");
            token.cancel();
        }
    }
    let _ = client.lease_revoke(LeaseRevokeRequest { id: lease }).await;
}

/// Whether etcd answered the next keep-alive within `within` with the lease still alive.
async fn renewed(responses: &mut Streaming<LeaseKeepAliveResponse>, within: Duration) -> bool {
    matches!(
        tokio::time::timeout(within, responses.message()).await,
        Ok(Ok(Some(r))) if r.ttl > 0
    )
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn get(&self, kind: &'static str, name: &str) -> Result<Option<RawDoc>, StoreError> {
        let kvs = self.range(self.key(kind, name).into_bytes(), Vec::new()).await?;
        Ok(kvs.into_iter().next().map(|kv| RawDoc {
            name: name.to_owned(),
            version: version(kv.mod_revision),
            value: kv.value,
        }))
    }

    async fn list(&self, kind: &'static str) -> Result<Vec<RawDoc>, StoreError> {
        let p = self.kind_prefix(kind);
        let kvs = self
            .range(p.clone().into_bytes(), prefix_end(p.as_bytes()))
            .await?;
        let mut out = Vec::with_capacity(kvs.len());
        for kv in kvs {
            let k = String::from_utf8(kv.key).map_err(backend)?;
            out.push(RawDoc {
                name: k[p.len()..].to_owned(),
                version: version(kv.mod_revision),
                value: kv.value,
            });
        }
        Ok(out)
    }

    async fn create(&self, kind: &'static str, name: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        let key = self.key(kind, name);
        self.txn(vec![absent(&key)], vec![put_op(&key, value, 0)])
            .await?
            .ok_or_else(|| StoreError::AlreadyExists {
                kind,
                name: name.to_owned(),
            })
    }

    async fn update(
        &self,
        kind: &'static str,
        name: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> Result<u64, StoreError> {
        let key = self.key(kind, name);
        match self
            .txn(
                vec![mod_revision_is(&key, rev(expected))],
                vec![put_op(&key, value, 0)],
            )
            .await?
        {
            Some(v) => Ok(v),
            None => Err(self.why_not(kind, name, expected).await),
        }
    }

    async fn delete(&self, kind: &'static str, name: &str, expected: u64) -> Result<(), StoreError> {
        let key = self.key(kind, name);
        match self
            .txn(vec![mod_revision_is(&key, rev(expected))], vec![delete_op(&key)])
            .await?
        {
            Some(_) => Ok(()),
            None => Err(self.why_not(kind, name, expected).await),
        }
    }

    async fn watch(&self, kind: &'static str) -> Result<RawWatch, StoreError> {
        let p = self.kind_prefix(kind);
        let w = WatchStream::open(&mut self.watch.clone(), p.as_bytes(), prefix_end(p.as_bytes())).await?;
        let s = stream::unfold(
            (w, VecDeque::<RawEvent>::new(), false),
            move |(mut w, mut pending, done)| {
                let p = p.clone();
                async move {
                    loop {
                        if let Some(ev) = pending.pop_front() {
                            return Some((Ok(ev), (w, pending, done)));
                        }
                        if done {
                            return None;
                        }
                        match w.next().await {
                            Ok(Some(resp)) => {
                                // etcd drops a watcher that falls too far behind (or whose history was
                                // compacted): the consumer must re-list.
                                if resp.canceled {
                                    return Some((Err(StoreError::WatchLagged { kind }), (w, pending, true)));
                                }
                                for e in resp.events {
                                    let event_type = e.r#type();
                                    let Some(kv) = e.kv else { continue };
                                    let Ok(k) = String::from_utf8(kv.key) else {
                                        continue;
                                    };
                                    let name = k[p.len().min(k.len())..].to_owned();
                                    let v = version(kv.mod_revision);
                                    pending.push_back(match event_type {
                                        EventType::Put => RawEvent::Put(RawDoc {
                                            name,
                                            version: v,
                                            value: kv.value,
                                        }),
                                        EventType::Delete => RawEvent::Delete { name, version: v },
                                    });
                                }
                            }
                            Ok(None) => return None,
                            Err(e) => return Some((Err(backend(e)), (w, pending, true))),
                        }
                    }
                }
            },
        );
        Ok(Box::pin(s))
    }

    async fn campaign(&self, id: &str) -> Result<CancellationToken, StoreError> {
        let key = format!("{}/leader", self.prefix);
        loop {
            let lease = self
                .lease
                .clone()
                .lease_grant(LeaseGrantRequest {
                    ttl: LEADER_TTL,
                    id: 0,
                })
                .await
                .map_err(rpc)?
                .into_inner();
            if !lease.error.is_empty() {
                return Err(backend(format!("lease grant: {}", lease.error)));
            }
            let lease = lease.id;
            let won = self
                .txn(
                    vec![absent(&key)],
                    vec![put_op(&key, id.as_bytes().to_vec(), lease)],
                )
                .await?
                .is_some();
            if won {
                let token = CancellationToken::new();
                tokio::spawn(keep_alive(self.lease.clone(), lease, token.clone()));
                return Ok(token);
            }
            self.revoke(lease).await;
            // Wait for the current leader's key to go, then try again. The watch opens before the check so a
            // deletion in between is not missed.
            let mut w = WatchStream::open(&mut self.watch.clone(), key.as_bytes(), Vec::new()).await?;
            let still_there = !self.range(key.clone().into_bytes(), Vec::new()).await?.is_empty();
            if still_there {
                loop {
                    match w.next().await {
                        Ok(Some(r)) if r.events.iter().any(|e| e.r#type() == EventType::Delete) => break,
                        Ok(Some(_)) => {}
                        _ => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            break;
                        }
                    }
                }
            }
        }
    }

    fn backend(&self) -> &'static str {
        "etcd"
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_covers_exactly_the_prefix() {
        assert_eq!(prefix_end(b"/corral/volume/"), b"/corral/volume0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }
}
