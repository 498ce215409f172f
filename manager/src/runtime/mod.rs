//! The reconcile runtime every controller runs on: a work queue of resource names fed by store watches and a
//! periodic resync ([`feed`], [`feed_node_local`]), and a worker ([`run_worker`]) that reconciles one name at a
//! time towards its spec, retrying a failed reconcile with per-name exponential backoff. It knows the store and
//! no feature.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::store::{Db, Event, Resource};

/// Names waiting for a reconcile; a name is queued at most once, and has at most one delayed add pending.
#[derive(Default)]
pub struct WorkQueue {
    inner: Mutex<(VecDeque<String>, HashSet<String>)>,
    notify: Notify,
    /// When each name's one pending delayed add fires.
    delayed: Mutex<HashMap<String, tokio::time::Instant>>,
}

impl WorkQueue {
    pub fn add(&self, name: &str) {
        let Ok(mut g) = self.inner.lock() else { return };
        if g.1.insert(name.to_owned()) {
            g.0.push_back(name.to_owned());
            drop(g);
            self.notify.notify_one();
        }
    }

    async fn next(&self) -> String {
        loop {
            let notified = self.notify.notified();
            if let Ok(mut g) = self.inner.lock()
                && let Some(n) = g.0.pop_front()
            {
                g.1.remove(&n);
                return n;
            }
            notified.await;
        }
    }

    /// Adds `name` after `delay`, unless an add of it is already due no later: one timer per name. (Every
    /// reconcile asks for its requeue; with a timer each, every event-driven reconcile started one more requeue
    /// chain that never ended, and a name was reconciled several times a second.) A later pending add is
    /// superseded: its timer fires and finds it is not the name's pending one.
    pub fn add_after(self: &Arc<Self>, name: String, delay: Duration) {
        let at = tokio::time::Instant::now() + delay;
        {
            let Ok(mut d) = self.delayed.lock() else { return };
            match d.get(&name) {
                Some(due) if *due <= at => return,
                _ => d.insert(name.clone(), at),
            };
        }
        let q = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let mine = q.delayed.lock().is_ok_and(|mut d| {
                let mine = d.get(&name) == Some(&at);
                if mine {
                    d.remove(&name);
                }
                mine
            });
            if mine {
                q.add(&name);
            }
        });
    }
}

/// What a reconcile asks for next.
pub type Requeue = Option<Duration>;

/// Why a step of a long operation (a clone, a backup, a restore) did not go on.
pub enum Stop {
    /// The operation cannot complete: it ends failed with this reason.
    Fail(String),
    /// Something transient (the store, a daemon not answering): retried with backoff.
    Retry(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for Stop {
    fn from(e: E) -> Self {
        Self::Retry(e.into())
    }
}

/// One name's failures in a row, and when the retry after the last one is due. A failure before that (an event
/// queued the name again meanwhile: controllers are level-triggered) does not lengthen the backoff, which grows
/// with the time spent failing, not with how many watch events arrived meanwhile (a burst of events used to take
/// it to 30 s within a second, and a rebuild waited that long after its cause was gone).
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
    due: Option<tokio::time::Instant>,
}

impl Backoff {
    /// Records a failure at `now`; returns the delay before the next retry.
    fn failed(&mut self, now: tokio::time::Instant) -> Duration {
        if self.due.is_none_or(|due| now >= due) {
            self.failures = self.failures.saturating_add(1);
        }
        let delay = crate::process::restart_backoff(self.failures);
        self.due = Some(now + delay);
        delay
    }
}

/// Runs `reconcile` over the queue until `cancel`. Errors back off per name with the manager's one policy (`process::restart_backoff`).
pub async fn run_worker<F, Fut>(
    controller: &'static str,
    queue: Arc<WorkQueue>,
    cancel: CancellationToken,
    metrics: crate::metrics::Metrics,
    reconcile: F,
) where
    F: Fn(String) -> Fut,
    Fut: Future<Output = anyhow::Result<Requeue>>,
{
    let mut failures: HashMap<String, Backoff> = HashMap::new();
    loop {
        let name = tokio::select! {
            () = cancel.cancelled() => return,
            n = queue.next() => n,
        };
        match reconcile(name.clone()).await {
            Ok(requeue) => {
                metrics.reconciled(controller, true);
                failures.remove(&name);
                if let Some(d) = requeue {
                    queue.add_after(name, d);
                }
            }
            Err(e) => {
                metrics.reconciled(controller, false);
                let delay = failures
                    .entry(name.clone())
                    .or_default()
                    .failed(tokio::time::Instant::now());
                tracing::warn!(
                    controller,
                    name,
                    error = format!("{e:#}"),
                    ?delay,
                    "reconcile failed"
                );
                queue.add_after(name, delay);
            }
        }
    }
}

/// Feeds `queue` from the changes of `R` (mapped to a queue name by `key`) and from a full list every `resync`.
pub fn feed<R: Resource>(
    db: Db,
    queue: Arc<WorkQueue>,
    cancel: CancellationToken,
    resync: Duration,
    key: impl Fn(&Event<R>) -> Option<String> + Send + Sync + 'static,
    list_key: impl Fn(&crate::store::Object<R>) -> Option<String> + Send + Sync + 'static,
) {
    let db2 = db.clone();
    let q2 = queue.clone();
    let c2 = cancel.clone();
    tokio::spawn(async move {
        loop {
            match db2.watch::<R>().await {
                Ok(mut w) => loop {
                    tokio::select! {
                        () = c2.cancelled() => return,
                        ev = w.next() => match ev {
                            Some(Ok(ev)) => if let Some(k) = key(&ev) { q2.add(&k) },
                            Some(Err(e)) => { tracing::debug!(error = %e, "watch ended"); break }
                            None => break,
                        }
                    }
                },
                Err(e) => tracing::warn!(kind = R::KIND, error = %e, "cannot watch"),
            }
            tokio::select! {
                () = c2.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
    tokio::spawn(async move {
        loop {
            match db.list::<R>().await {
                Ok(all) => {
                    for o in &all {
                        if let Some(k) = list_key(o) {
                            queue.add(&k);
                        }
                    }
                }
                Err(e) => tracing::warn!(kind = R::KIND, error = %e, "cannot list for resync"),
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(resync) => {}
            }
        }
    });
}

/// Feeds `queue` with the names of this node's `R` documents (`node` says whose a document is): every change of
/// one, every deletion (the node may have started its daemon), and a full list every `resync`.
pub fn feed_node_local<R: Resource>(
    ctx: &crate::context::Ctx,
    queue: Arc<WorkQueue>,
    cancel: CancellationToken,
    resync: Duration,
    node: fn(&R) -> &str,
) {
    let me = ctx.cfg.node_id.clone();
    let me2 = me.clone();
    feed::<R>(
        ctx.db.clone(),
        queue,
        cancel,
        resync,
        move |ev| match ev {
            Event::Put(o) => (node(&o.data) == me).then(|| o.name.clone()),
            Event::Delete { name, .. } => Some(name.clone()),
        },
        move |o| (node(&o.data) == me2).then(|| o.name.clone()),
    );
}

/// Unix seconds now.
pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_name_has_one_delayed_add_at_a_time_the_earliest() {
        let q = Arc::new(WorkQueue::default());
        // Every reconcile of a name asks for its requeue: ten asks make one timer, not ten requeue chains.
        for _ in 0..10 {
            q.add_after("a".into(), Duration::from_millis(300));
        }
        // An earlier ask supersedes the later one, whose timer then adds nothing.
        q.add_after("b".into(), Duration::from_millis(600));
        q.add_after("b".into(), Duration::from_millis(100));
        assert_eq!(q.next().await, "b");
        assert_eq!(q.next().await, "a");
        // Past every timer (b's superseded one at 600 ms included): nothing else was queued.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let queued = q.inner.lock().unwrap().0.len();
        assert_eq!(queued, 0, "a superseded or repeated timer queued a name again");
        assert!(q.delayed.lock().unwrap().is_empty());
    }

    #[test]
    fn backoff_grows_with_time_spent_failing_not_with_events_during_it() {
        let t0 = tokio::time::Instant::now();
        let mut b = Backoff::default();
        let first = b.failed(t0);
        // Twenty event-driven failures within the first delay: the delay stays the first one.
        for i in 1..=20 {
            assert_eq!(b.failed(t0 + Duration::from_millis(i * 10)), first);
        }
        // Failures each at its due retry: the delay doubles.
        let mut at = t0 + Duration::from_millis(200) + first;
        let mut last = first;
        for _ in 0..3 {
            let d = b.failed(at);
            assert_eq!(d, last * 2);
            last = d;
            at += d;
        }
    }
}
