//! The single-node store: one redb file. A global revision (like etcd's) is bumped by every write and becomes the
//! written document's version; writers are serialised by one mutex that also orders the watch broadcast, so watches
//! see changes in commit order.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

use super::{RawDoc, RawEvent, RawWatch, Store, StoreError};

/// key `kind/name` → 8-byte little-endian version ++ JSON document.
const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
/// `revision` → the last revision handed out.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// Events kept for slow watchers before they are told to re-list.
const WATCH_BACKLOG: usize = 16 * 1024;

pub struct EmbeddedStore {
    db: Arc<Database>,
    write_lock: Arc<Mutex<()>>,
    events: broadcast::Sender<(&'static str, RawEvent)>,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn key(kind: &str, name: &str) -> String {
    format!("{kind}/{name}")
}

fn split_value(name: &str, v: &[u8]) -> Result<(u64, Vec<u8>), StoreError> {
    if v.len() < 8 {
        return Err(StoreError::Backend(format!("record {name:?} is truncated")));
    }
    let (ver, doc) = v.split_at(8);
    let mut b = [0u8; 8];
    b.copy_from_slice(ver);
    Ok((u64::from_le_bytes(b), doc.to_vec()))
}

enum Write {
    Create,
    Update(u64),
    Delete(u64),
}

impl EmbeddedStore {
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_owned();
        let db = tokio::task::spawn_blocking(move || -> Result<Database, StoreError> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| backend(format!("{}: {e}", dir.display())))?;
            }
            let db = Database::create(&path).map_err(|e| backend(format!("{}: {e}", path.display())))?;
            let txn = db.begin_write().map_err(backend)?;
            txn.open_table(OBJECTS).map_err(backend)?;
            txn.open_table(META).map_err(backend)?;
            txn.commit().map_err(backend)?;
            Ok(db)
        })
        .await
        .map_err(backend)??;
        let (events, _) = broadcast::channel(WATCH_BACKLOG);
        Ok(Self {
            db: Arc::new(db),
            write_lock: Arc::new(Mutex::new(())),
            events,
        })
    }

    async fn write(
        &self,
        kind: &'static str,
        name: &str,
        value: Option<Vec<u8>>,
        op: Write,
    ) -> Result<u64, StoreError> {
        let db = self.db.clone();
        let lock = self.write_lock.clone();
        let events = self.events.clone();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || {
            let _g = lock.lock().map_err(|_| backend("store writer panicked"))?;
            let k = key(kind, &name);
            let txn = db.begin_write().map_err(backend)?;
            let rev;
            {
                let mut objects = txn.open_table(OBJECTS).map_err(backend)?;
                let current = match objects.get(k.as_str()).map_err(backend)? {
                    Some(g) => Some(split_value(&name, g.value())?.0),
                    None => None,
                };
                match (&op, current) {
                    (Write::Create, Some(_)) => return Err(StoreError::AlreadyExists { kind, name }),
                    (Write::Update(_) | Write::Delete(_), None) => {
                        return Err(StoreError::NotFound { kind, name });
                    }
                    (Write::Update(e) | Write::Delete(e), Some(c)) if *e != c => {
                        return Err(StoreError::Conflict {
                            kind,
                            name,
                            expected: *e,
                        });
                    }
                    _ => {}
                }
                let mut meta = txn.open_table(META).map_err(backend)?;
                rev = meta.get("revision").map_err(backend)?.map_or(0, |g| g.value()) + 1;
                meta.insert("revision", rev).map_err(backend)?;
                match &value {
                    Some(v) => {
                        let mut rec = rev.to_le_bytes().to_vec();
                        rec.extend_from_slice(v);
                        objects.insert(k.as_str(), rec.as_slice()).map_err(backend)?;
                    }
                    None => {
                        objects.remove(k.as_str()).map_err(backend)?;
                    }
                }
            }
            txn.commit().map_err(backend)?;
            let ev = match value {
                Some(value) => RawEvent::Put(RawDoc {
                    name,
                    version: rev,
                    value,
                }),
                None => RawEvent::Delete { name, version: rev },
            };
            // No receivers is fine: nobody watches this kind yet.
            let _ = events.send((kind, ev));
            Ok(rev)
        })
        .await
        .map_err(backend)?
    }
}

#[async_trait::async_trait]
impl Store for EmbeddedStore {
    async fn get(&self, kind: &'static str, name: &str) -> Result<Option<RawDoc>, StoreError> {
        let db = self.db.clone();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_read().map_err(backend)?;
            let t = txn.open_table(OBJECTS).map_err(backend)?;
            match t.get(key(kind, &name).as_str()).map_err(backend)? {
                Some(g) => {
                    let (version, value) = split_value(&name, g.value())?;
                    Ok(Some(RawDoc { name, version, value }))
                }
                None => Ok(None),
            }
        })
        .await
        .map_err(backend)?
    }

    async fn list(&self, kind: &'static str) -> Result<Vec<RawDoc>, StoreError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_read().map_err(backend)?;
            let t = txn.open_table(OBJECTS).map_err(backend)?;
            let start = format!("{kind}/");
            // '0' sorts right after '/': the end of the `kind/` prefix range.
            let end = format!("{kind}0");
            let mut out = Vec::new();
            for item in t.range(start.as_str()..end.as_str()).map_err(backend)? {
                let (k, v) = item.map_err(backend)?;
                let name = k.value()[start.len()..].to_owned();
                let (version, value) = split_value(&name, v.value())?;
                out.push(RawDoc { name, version, value });
            }
            Ok(out)
        })
        .await
        .map_err(backend)?
    }

    async fn create(&self, kind: &'static str, name: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        self.write(kind, name, Some(value), Write::Create).await
    }

    async fn update(
        &self,
        kind: &'static str,
        name: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> Result<u64, StoreError> {
        self.write(kind, name, Some(value), Write::Update(expected)).await
    }

    async fn delete(&self, kind: &'static str, name: &str, expected: u64) -> Result<(), StoreError> {
        self.write(kind, name, None, Write::Delete(expected))
            .await
            .map(|_| ())
    }

    async fn watch(&self, kind: &'static str) -> Result<RawWatch, StoreError> {
        let rx = self.events.subscribe();
        let s = BroadcastStream::new(rx)
            .filter_map(move |r| async move {
                match r {
                    Ok((k, ev)) if k == kind => Some(Ok(ev)),
                    Ok(_) => None,
                    Err(BroadcastStreamRecvError::Lagged(_)) => Some(Err(StoreError::WatchLagged { kind })),
                }
            })
            // After a lag the stream ends: the caller re-lists.
            .scan(false, |ended, r| {
                let out = if *ended { None } else { Some(r) };
                if matches!(out, Some(Err(_))) {
                    *ended = true;
                }
                futures::future::ready(out)
            });
        Ok(Box::pin(s))
    }

    async fn campaign(&self, _id: &str) -> Result<tokio_util::sync::CancellationToken, StoreError> {
        Ok(tokio_util::sync::CancellationToken::new())
    }

    fn backend(&self) -> &'static str {
        "embedded"
    }
}
