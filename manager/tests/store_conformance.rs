//! One conformance suite for both store backends: the embedded redb file and a real etcd started by the test.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use manager::store::{Event, Object, Resource, Store, StoreError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Counter {
    n: u64,
    owner: String,
}

impl Resource for Counter {
    const KIND: &'static str = "counter";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Other {
    x: u32,
}

impl Resource for Other {
    const KIND: &'static str = "other";
}

fn db(s: Arc<dyn Store>) -> manager::store::Db {
    manager::store::Db::new(s)
}

async fn crud_and_versions(s: Arc<dyn Store>) {
    let db = db(s);
    assert!(db.get::<Counter>("a").await.unwrap().is_none());
    let a = db
        .create(
            "a",
            Counter {
                n: 1,
                owner: "x".into(),
            },
        )
        .await
        .unwrap();
    let err = db
        .create(
            "a",
            Counter {
                n: 2,
                owner: "y".into(),
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
    // Kinds do not see each other's names.
    db.create("a", Other { x: 7 }).await.unwrap();
    db.create(
        "b",
        Counter {
            n: 5,
            owner: "x".into(),
        },
    )
    .await
    .unwrap();
    let got: Object<Counter> = db.must_get("a").await.unwrap();
    assert_eq!(got, a);
    let names: Vec<String> = db
        .list::<Counter>()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(db.list::<Other>().await.unwrap().len(), 1);

    let mut first = got.clone();
    let mut second = got.clone();
    first.data.n = 10;
    db.update(&mut first).await.unwrap();
    assert!(first.version > got.version);
    second.data.n = 20;
    let err = db.update(&mut second).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Conflict { .. }),
        "stale update accepted: {err}"
    );
    assert_eq!(db.must_get::<Counter>("a").await.unwrap().data.n, 10);
    // A stale delete is refused too; the current version deletes.
    let err = db.delete::<Counter>("a", got.version).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    db.delete::<Counter>("a", first.version).await.unwrap();
    assert!(db.get::<Counter>("a").await.unwrap().is_none());
    let err = db.delete::<Counter>("a", first.version).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    let mut gone = first.clone();
    let err = db.update(&mut gone).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

/// 8 writers race on one document, each read-modify-writing 25 times: every stale write is rejected and retried,
/// so no increment is lost; and among writers holding the same version exactly one wins.
async fn concurrent_updates_lose_nothing(s: Arc<dyn Store>) {
    let db = db(s);
    let base = db
        .create(
            "c",
            Counter {
                n: 0,
                owner: String::new(),
            },
        )
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let mut mine = base.clone();
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            mine.data.owner = format!("w{i}");
            db.update(&mut mine).await.is_ok()
        }));
    }
    let mut wins = 0;
    for t in tasks {
        wins += usize::from(t.await.unwrap());
    }
    assert_eq!(wins, 1, "exactly one writer of a version may win");

    let mut tasks = Vec::new();
    for _ in 0..8 {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..25 {
                db.modify::<Counter>("c", |c| {
                    c.n += 1;
                    true
                })
                .await
                .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(db.must_get::<Counter>("c").await.unwrap().data.n, 200);
}

/// A watch sees every put and delete of its kind, in commit order (versions increasing), and nothing else.
async fn watch_sees_every_change_in_order(s: Arc<dyn Store>) {
    let db = db(s);
    let mut w = db.watch::<Counter>().await.unwrap();
    let writers: Vec<_> = (0..3)
        .map(|t| {
            let db = db.clone();
            tokio::spawn(async move {
                for i in 0..20 {
                    let name = format!("w{t}-{}", i % 4);
                    match db.get::<Counter>(&name).await.unwrap() {
                        None => {
                            db.create(
                                &name,
                                Counter {
                                    n: i,
                                    owner: String::new(),
                                },
                            )
                            .await
                            .unwrap();
                        }
                        Some(o) if i % 5 == 4 => db.delete::<Counter>(&name, o.version).await.unwrap(),
                        Some(mut o) => {
                            o.data.n = i;
                            db.update(&mut o).await.unwrap();
                        }
                    }
                    db.create(&format!("o{t}-{i}"), Other { x: 1 }).await.unwrap();
                }
            })
        })
        .collect();
    for t in writers {
        t.await.unwrap();
    }
    let expected: BTreeMap<String, Option<u64>> = {
        let mut m = BTreeMap::new();
        for t in 0..3 {
            for k in 0..4 {
                m.insert(format!("w{t}-{k}"), None);
            }
        }
        for o in db
            .list::<Counter>()
            .await
            .unwrap()
            .into_iter()
            .filter(|o| o.name.starts_with('w'))
        {
            m.insert(o.name, Some(o.data.n));
        }
        m
    };
    let mut seen: BTreeMap<String, Option<u64>> = BTreeMap::new();
    let mut last = 0;
    let mut count = 0;
    while count < 60 {
        let ev = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("watch event within 10 s")
            .expect("watch stream open")
            .unwrap();
        let (name, v, val) = match ev {
            Event::Put(o) => (o.name, o.version, Some(o.data.n)),
            Event::Delete { name, version } => (name, version, None),
        };
        assert!(name.starts_with('w'), "watch of counters saw {name}");
        assert!(v > last, "events out of order: {v} after {last}");
        last = v;
        seen.insert(name, val);
        count += 1;
    }
    for (k, v) in &expected {
        assert_eq!(seen.get(k).copied().flatten(), *v, "final state of {k} differs");
    }
}

/// Engine generations (`manager::engine_generation::next`, a compare-and-set on the volume's document) taken by 16
/// racing starts, half through each of two clients of the store (two managers): exactly 1..=16, none twice.
async fn generations_are_taken_once_each(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let db = db(if i % 2 == 0 { a.clone() } else { b.clone() });
            tokio::spawn(async move { manager::engine_generation::next(&db, "vol-gen").await.unwrap() })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    got.sort_unstable();
    assert_eq!(
        got,
        (1..=16).collect::<Vec<u64>>(),
        "each generation handed out once"
    );
    assert_eq!(
        manager::engine_generation::current(&db(b), "vol-gen")
            .await
            .unwrap(),
        16
    );
}

async fn conformance(s: Arc<dyn Store>) {
    crud_and_versions(s.clone()).await;
    concurrent_updates_lose_nothing(s.clone()).await;
    watch_sees_every_change_in_order(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_conforms_and_keeps_state_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = manager::store::open("embedded", dir.path()).await.unwrap();
    conformance(s.clone()).await;
    generations_are_taken_once_each(s.clone(), s.clone()).await;
    let before = db(s.clone()).must_get::<Counter>("c").await.unwrap();
    drop(s);
    let s = manager::store::open("embedded", dir.path()).await.unwrap();
    let after = db(s.clone()).must_get::<Counter>("c").await.unwrap();
    assert_eq!(before, after);
    // Versions keep growing after a restart: an old version never becomes valid again.
    let mut o = after.clone();
    db(s).update(&mut o).await.unwrap();
    assert!(o.version > after.version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_conforms_and_keeps_state_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = testkit::servers::Etcd::start(dir.path());
    let spec = format!("etcd://{}", etcd.endpoint());
    let s = manager::store::open(&spec, dir.path()).await.unwrap();
    conformance(s.clone()).await;
    let other = manager::store::open(&spec, dir.path()).await.unwrap();
    generations_are_taken_once_each(s.clone(), other).await;
    let before = db(s.clone()).must_get::<Counter>("c").await.unwrap();
    drop(s);
    etcd.restart();
    let s = manager::store::open(&spec, dir.path()).await.unwrap();
    let after = db(s).must_get::<Counter>("c").await.unwrap();
    assert_eq!(before, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leadership_moves_when_the_leader_stops() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = testkit::servers::Etcd::start(dir.path());
    let spec = format!("etcd://{}", etcd.endpoint());
    let a = manager::store::open(&spec, dir.path()).await.unwrap();
    let b = manager::store::open(&spec, dir.path()).await.unwrap();
    let lead_a = a.campaign("a").await.unwrap();
    let b2 = b.clone();
    let mut wait_b = tokio::spawn(async move { b2.campaign("b").await.unwrap() });
    // Held well past the lease's 6 s TTL: the leader keeps renewing it.
    assert!(
        tokio::time::timeout(Duration::from_secs(14), &mut wait_b)
            .await
            .is_err(),
        "two leaders at once"
    );
    assert!(!lead_a.is_cancelled(), "the leader lost its lease");
    // Stepping down revokes the lease: b takes over well within the lease TTL.
    lead_a.cancel();
    let lead_b = tokio::time::timeout(Duration::from_secs(10), wait_b)
        .await
        .expect("b leads after a steps down")
        .unwrap();
    assert!(!lead_b.is_cancelled());
}
