//! The multi-node store: etcd. A document lives at `<prefix>/<kind>/<name>`; its version is the key's
//! `mod_revision`, and conditional writes are transactions comparing it. Leadership for the cluster-wide
//! controllers is a key bound to a lease kept alive by the leader.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use futures::stream;
use tokio_util::sync::CancellationToken;

use super::{RawDoc, RawEvent, RawWatch, Store, StoreError};

/// Seconds a leader may stay silent before another manager takes over.
const LEADER_TTL: i64 = 6;

pub struct EtcdStore {
    client: Client,
    prefix: String,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

fn version(rev: i64) -> u64 {
    u64::try_from(rev).unwrap_or(0)
}

fn rev(version: u64) -> i64 {
    i64::try_from(version).unwrap_or(i64::MAX)
}

impl EtcdStore {
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, StoreError> {
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10));
        let client = Client::connect(endpoints, Some(opts)).await.map_err(backend)?;
        let s = Self {
            client,
            prefix: prefix.trim_end_matches('/').to_owned(),
        };
        // Fail at start, not at the first request, when etcd is unreachable.
        s.client.kv_client().get("probe", None).await.map_err(backend)?;
        Ok(s)
    }

    fn key(&self, kind: &str, name: &str) -> String {
        format!("{}/{kind}/{name}", self.prefix)
    }

    fn kind_prefix(&self, kind: &str) -> String {
        format!("{}/{kind}/", self.prefix)
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

    async fn conditional(&self, key: &str, expected_mod: i64, op: TxnOp) -> Result<Option<u64>, StoreError> {
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, expected_mod)])
            .and_then([op]);
        let resp = self.client.kv_client().txn(txn).await.map_err(backend)?;
        if !resp.succeeded() {
            return Ok(None);
        }
        let r = resp.header().map_or(0, etcd_client::ResponseHeader::revision);
        Ok(Some(version(r)))
    }
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn get(&self, _kind: &'static str, name: &str) -> Result<Option<RawDoc>, StoreError> {
        let resp = self
            .client
            .kv_client()
            .get(self.key(_kind, name), None)
            .await
            .map_err(backend)?;
        Ok(resp.kvs().first().map(|kv| RawDoc {
            name: name.to_owned(),
            version: version(kv.mod_revision()),
            value: kv.value().to_vec(),
        }))
    }

    async fn list(&self, kind: &'static str) -> Result<Vec<RawDoc>, StoreError> {
        let p = self.kind_prefix(kind);
        let resp = self
            .client
            .kv_client()
            .get(p.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(backend)?;
        let mut out = Vec::new();
        for kv in resp.kvs() {
            let k = kv.key_str().map_err(backend)?;
            out.push(RawDoc {
                name: k[p.len()..].to_owned(),
                version: version(kv.mod_revision()),
                value: kv.value().to_vec(),
            });
        }
        Ok(out)
    }

    async fn create(&self, kind: &'static str, name: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        let key = self.key(kind, name);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value, None)]);
        let resp = self.client.kv_client().txn(txn).await.map_err(backend)?;
        if !resp.succeeded() {
            return Err(StoreError::AlreadyExists {
                kind,
                name: name.to_owned(),
            });
        }
        Ok(version(
            resp.header().map_or(0, etcd_client::ResponseHeader::revision),
        ))
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
            .conditional(&key, rev(expected), TxnOp::put(key.as_str(), value, None))
            .await?
        {
            Some(v) => Ok(v),
            None => Err(self.why_not(kind, name, expected).await),
        }
    }

    async fn delete(&self, kind: &'static str, name: &str, expected: u64) -> Result<(), StoreError> {
        let key = self.key(kind, name);
        match self
            .conditional(&key, rev(expected), TxnOp::delete(key.as_str(), None))
            .await?
        {
            Some(_) => Ok(()),
            None => Err(self.why_not(kind, name, expected).await),
        }
    }

    async fn watch(&self, kind: &'static str) -> Result<RawWatch, StoreError> {
        let p = self.kind_prefix(kind);
        let mut w = self
            .client
            .watch_client()
            .watch(p.clone(), Some(WatchOptions::new().with_prefix()))
            .await
            .map_err(backend)?;
        // The first response confirms the watch exists: every later write is seen.
        match w.message().await.map_err(backend)? {
            Some(r) if r.created() => {}
            _ => return Err(backend("watch was not created")),
        }
        let s = stream::unfold(
            (w, std::collections::VecDeque::<RawEvent>::new(), false),
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
                        match w.message().await {
                            Ok(Some(resp)) => {
                                if resp.canceled() {
                                    return Some((Err(StoreError::WatchLagged { kind }), (w, pending, true)));
                                }
                                for e in resp.events() {
                                    let Some(kv) = e.kv() else { continue };
                                    let Ok(k) = kv.key_str() else { continue };
                                    let name = k[p.len().min(k.len())..].to_owned();
                                    let v = version(kv.mod_revision());
                                    pending.push_back(match e.event_type() {
                                        EventType::Put => RawEvent::Put(RawDoc {
                                            name,
                                            version: v,
                                            value: kv.value().to_vec(),
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
        let mut client = self.client.clone();
        loop {
            let lease = client.lease_grant(LEADER_TTL, None).await.map_err(backend)?.id();
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.as_str(),
                    id.as_bytes().to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            let won = client.txn(txn).await.map_err(backend)?.succeeded();
            if won {
                let token = CancellationToken::new();
                let (mut keeper, mut responses) = client.lease_keep_alive(lease).await.map_err(backend)?;
                let t = token.clone();
                let mut c2 = client.clone();
                tokio::spawn(async move {
                    let period = Duration::from_secs(u64::try_from(LEADER_TTL / 3).unwrap_or(1));
                    loop {
                        tokio::select! {
                            () = t.cancelled() => break,
                            () = tokio::time::sleep(period) => {}
                        }
                        let alive = keeper.keep_alive().await.is_ok()
                            && matches!(responses.message().await, Ok(Some(r)) if r.ttl() > 0);
                        if !alive {
                            tracing::warn!("leader lease lost");
                            t.cancel();
                            break;
                        }
                    }
                    let _ = c2.lease_revoke(lease).await;
                });
                return Ok(token);
            }
            let _ = client.lease_revoke(lease).await;
            // Wait for the current leader's key to go, then try again.
            let mut w = client.watch(key.as_str(), None).await.map_err(backend)?;
            let still_there = !client
                .get(key.as_str(), None)
                .await
                .map_err(backend)?
                .kvs()
                .is_empty();
            if still_there {
                loop {
                    match w.message().await {
                        Ok(Some(r)) if r.events().iter().any(|e| e.event_type() == EventType::Delete) => {
                            break;
                        }
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
