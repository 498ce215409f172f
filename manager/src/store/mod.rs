//! The manager's state store: documents keyed by kind and name, each with a resource version that changes on every
//! write. Writes name the version they read (optimistic concurrency: a stale version is rejected with
//! [`StoreError::Conflict`]); watches deliver every change of a kind in commit order.
//!
//! Two backends implement [`Store`]: [`embedded::EmbeddedStore`] (a redb file under the data directory, one node)
//! and [`etcd::EtcdStore`] (several nodes; also elects the leader with a lease).
//! [`Db`] is the typed layer the rest of the manager uses.

pub mod embedded;
pub mod etcd;

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use serde::{Serialize, de::DeserializeOwned};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No such document.
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    /// Create of a name that exists.
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: &'static str, name: String },
    /// The document changed since it was read.
    #[error("{kind} {name:?} changed since it was read (version {expected} is stale)")]
    Conflict {
        kind: &'static str,
        name: String,
        expected: u64,
    },
    /// A document that does not decode as its kind.
    #[error("{kind} {name:?} in the store does not decode: {reason}")]
    Decode {
        kind: &'static str,
        name: String,
        reason: String,
    },
    /// A watch fell too far behind the writers; list again and watch anew.
    #[error("watch of {kind} fell behind; list again")]
    WatchLagged { kind: &'static str },
    /// The backend failed (IO, network, database).
    #[error("store backend: {0}")]
    Backend(String),
    /// The backend did not answer in time (etcd without a quorum): nothing was changed; try again later.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// One stored document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawDoc {
    pub name: String,
    pub version: u64,
    pub value: Vec<u8>,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawEvent {
    Put(RawDoc),
    Delete { name: String, version: u64 },
}

pub type RawWatch = Pin<Box<dyn Stream<Item = Result<RawEvent, StoreError>> + Send>>;

/// The backend contract. `kind` is a short static name (`volume`, `node`, ...); names are checked by the caller.
#[async_trait::async_trait]
pub trait Store: Send + Sync {
    async fn get(&self, kind: &'static str, name: &str) -> Result<Option<RawDoc>, StoreError>;
    async fn list(&self, kind: &'static str) -> Result<Vec<RawDoc>, StoreError>;
    /// Creates `name`; fails with `AlreadyExists` when present. Returns the new version.
    async fn create(&self, kind: &'static str, name: &str, value: Vec<u8>) -> Result<u64, StoreError>;
    /// Replaces `name` if its version is still `expected`. Returns the new version.
    async fn update(
        &self,
        kind: &'static str,
        name: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> Result<u64, StoreError>;
    /// Deletes `name` if its version is still `expected`.
    async fn delete(&self, kind: &'static str, name: &str, expected: u64) -> Result<(), StoreError>;
    /// Every change of `kind` committed after the call, in commit order.
    async fn watch(&self, kind: &'static str) -> Result<RawWatch, StoreError>;
    /// Waits until this process leads the cluster-wide controllers (`id` names it); the returned token is
    /// cancelled when leadership is lost. The embedded store leads at once.
    async fn campaign(&self, id: &str) -> Result<tokio_util::sync::CancellationToken, StoreError>;
    /// `embedded` or `etcd`.
    fn backend(&self) -> &'static str;
}

/// A kind of document in the store: a typed spec/status pair.
pub trait Resource: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {
    const KIND: &'static str;
}

/// A typed document with its name and version.
#[derive(Debug, Clone, PartialEq)]
pub struct Object<R> {
    pub name: String,
    pub version: u64,
    pub data: R,
}

/// A typed change.
#[derive(Debug, Clone)]
pub enum Event<R> {
    Put(Object<R>),
    Delete { name: String, version: u64 },
}

impl<R> Event<R> {
    pub fn name(&self) -> &str {
        match self {
            Event::Put(o) => &o.name,
            Event::Delete { name, .. } => name,
        }
    }
}

/// The typed view of a [`Store`].
#[derive(Clone)]
pub struct Db {
    inner: Arc<dyn Store>,
}

fn decode<R: Resource>(raw: RawDoc) -> Result<Object<R>, StoreError> {
    let data = serde_json::from_slice(&raw.value).map_err(|e| StoreError::Decode {
        kind: R::KIND,
        name: raw.name.clone(),
        reason: e.to_string(),
    })?;
    Ok(Object {
        name: raw.name,
        version: raw.version,
        data,
    })
}

fn encode<R: Resource>(r: &R) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(r).map_err(|e| StoreError::Backend(format!("encode {}: {e}", R::KIND)))
}

impl Db {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self { inner }
    }

    pub fn raw(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    pub async fn get<R: Resource>(&self, name: &str) -> Result<Option<Object<R>>, StoreError> {
        self.inner.get(R::KIND, name).await?.map(decode).transpose()
    }

    /// Like [`Db::get`], absent → `NotFound`.
    pub async fn must_get<R: Resource>(&self, name: &str) -> Result<Object<R>, StoreError> {
        self.get(name).await?.ok_or_else(|| StoreError::NotFound {
            kind: R::KIND,
            name: name.to_owned(),
        })
    }

    pub async fn list<R: Resource>(&self) -> Result<Vec<Object<R>>, StoreError> {
        self.inner.list(R::KIND).await?.into_iter().map(decode).collect()
    }

    pub async fn create<R: Resource>(&self, name: &str, data: R) -> Result<Object<R>, StoreError> {
        let version = self.inner.create(R::KIND, name, encode(&data)?).await?;
        Ok(Object {
            name: name.to_owned(),
            version,
            data,
        })
    }

    /// Writes `obj.data` if the stored version is still `obj.version`; updates `obj.version`.
    pub async fn update<R: Resource>(&self, obj: &mut Object<R>) -> Result<(), StoreError> {
        obj.version = self
            .inner
            .update(R::KIND, &obj.name, encode(&obj.data)?, obj.version)
            .await?;
        Ok(())
    }

    /// Read-modify-write with retries on conflict. `f` returns false to leave the document unchanged.
    pub async fn modify<R: Resource>(
        &self,
        name: &str,
        mut f: impl FnMut(&mut R) -> bool + Send,
    ) -> Result<Object<R>, StoreError> {
        loop {
            let mut obj = self.must_get::<R>(name).await?;
            if !f(&mut obj.data) {
                return Ok(obj);
            }
            match self.update(&mut obj).await {
                Ok(()) => return Ok(obj),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn delete<R: Resource>(&self, name: &str, version: u64) -> Result<(), StoreError> {
        self.inner.delete(R::KIND, name, version).await
    }

    /// Deletes whatever version is stored; absent is fine.
    pub async fn delete_any<R: Resource>(&self, name: &str) -> Result<(), StoreError> {
        loop {
            let Some(obj) = self.get::<R>(name).await? else {
                return Ok(());
            };
            match self.delete::<R>(name, obj.version).await {
                Ok(()) | Err(StoreError::NotFound { .. }) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn watch<R: Resource>(
        &self,
    ) -> Result<Pin<Box<dyn Stream<Item = Result<Event<R>, StoreError>> + Send>>, StoreError> {
        let raw = self.inner.watch(R::KIND).await?;
        Ok(Box::pin(raw.map(|ev| match ev? {
            RawEvent::Put(doc) => decode(doc).map(Event::Put),
            RawEvent::Delete { name, version } => Ok(Event::Delete { name, version }),
        })))
    }
}

/// A write to a document that went meanwhile (deleted by another controller) is not an error for the caller.
pub fn absent_ok<T>(r: Result<T, StoreError>) -> Result<Option<T>, StoreError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Opens the store named by `--store`: `embedded` (a redb file under `data_dir`) or `etcd://HOST:PORT[,HOST:PORT]`.
pub async fn open(spec: &str, data_dir: &std::path::Path) -> Result<Arc<dyn Store>, StoreError> {
    if spec == "embedded" || spec.is_empty() {
        let s = embedded::EmbeddedStore::open(&data_dir.join("store.redb")).await?;
        return Ok(Arc::new(s));
    }
    if let Some(rest) = spec.strip_prefix("etcd://") {
        let endpoints: Vec<String> = rest.split(',').map(|e| format!("http://{e}")).collect();
        let s = etcd::EtcdStore::connect(&endpoints, "/corral").await?;
        return Ok(Arc::new(s));
    }
    Err(StoreError::Backend(format!(
        "unknown store {spec:?}: use `embedded` or `etcd://HOST:PORT`"
    )))
}
