//! The volume's replica set as an immutable snapshot (an *epoch*), and the IO gate that pauses IO while an
//! operation replaces it.
//!
//! IO never takes a lock. It enters the gate (one atomic add), reads the current [`ReplicaSet`] through a
//! pointer, fans out, and leaves the gate (one atomic subtract). A replica's mode is an atomic inside its
//! [`ReplicaEntry`]: going ERR needs no pause.
//!
//! Operations that must see no IO in flight (snapshot, expand, adding or removing a replica, the end of a
//! rebuild) take the operations lock, then **freeze** the gate: new IO waits at the gate, the freeze waits until
//! the IO already inside has **drained**, the operation runs (and may install a new set, a new epoch), and
//! dropping the freeze **resumes** IO. Operations are serialised by the operations lock, never by IO.
//!
//! Safety argument for the pointer: the set behind `current` is replaced only by the holder of the operations
//! lock while the gate is frozen and drained. IO dereferences it only between entering and leaving the gate,
//! and an IO that enters after the freeze sees the frozen bit in the result of its own `fetch_add` and backs
//! out without reading the pointer. So no IO can hold a reference to a set that is being replaced.

use std::ops::Deref;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::sync::Notify;
use tracing::{debug, info};

use crate::replica_client::ReplicaEntry;

/// Set in `Gate::state` while frozen; the bits below count IO inside the gate.
const FROZEN: u64 = 1 << 63;

/// One epoch of the volume's replica set: which replicas the volume has. It never changes; an operation that
/// adds or removes a replica installs a new one with the next epoch number. Modes change inside the entries.
#[derive(Debug)]
pub struct ReplicaSet {
    /// Increases by one with every set installed.
    pub epoch: u64,
    replicas: Vec<Arc<ReplicaEntry>>,
}

impl Deref for ReplicaSet {
    type Target = [Arc<ReplicaEntry>];

    fn deref(&self) -> &Self::Target {
        &self.replicas
    }
}

/// The replica set and the gate every IO passes.
#[derive(Debug)]
pub(crate) struct Epochs {
    /// `FROZEN` | number of IO inside the gate.
    state: AtomicU64,
    /// Woken when a freeze ends.
    resumed: Notify,
    /// Woken when the last IO leaves a frozen gate.
    drained: Notify,
    /// The current set, owning one strong count (from `Arc::into_raw`). Read by IO inside the gate.
    current: AtomicPtr<ReplicaSet>,
    /// The same set for readers outside the IO path (info, metrics, operations); updated together with
    /// `current`.
    latest: Mutex<Arc<ReplicaSet>>,
    /// Serialises operations; IO never takes it.
    ops: tokio::sync::Mutex<()>,
}

impl Epochs {
    pub(crate) fn new(replicas: Vec<Arc<ReplicaEntry>>) -> Self {
        let set = Arc::new(ReplicaSet { epoch: 1, replicas });
        Self {
            state: AtomicU64::new(0),
            resumed: Notify::new(),
            drained: Notify::new(),
            current: AtomicPtr::new(Arc::into_raw(set.clone()).cast_mut()),
            latest: Mutex::new(set),
            ops: tokio::sync::Mutex::new(()),
        }
    }

    /// The current set, for readers outside the IO path. Never waits for a freeze.
    pub(crate) fn load(&self) -> Arc<ReplicaSet> {
        self.latest.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Number of IO inside the gate (for tests and logs).
    pub(crate) fn in_flight(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !FROZEN
    }

    /// Enters the gate for one IO; waits while the gate is frozen.
    pub(crate) async fn enter(&self) -> IoGuard<'_> {
        loop {
            let prev = self.state.fetch_add(1, Ordering::AcqRel);
            if prev & FROZEN == 0 {
                return IoGuard { epochs: self };
            }
            // Frozen: register for the resume before backing out, so a resume in between is not missed.
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            self.leave();
            if self.state.load(Ordering::Acquire) & FROZEN != 0 {
                resumed.await;
            }
        }
    }

    fn leave(&self) {
        let prev = self.state.fetch_sub(1, Ordering::AcqRel);
        if prev == FROZEN | 1 {
            // The last IO left a frozen gate: the freezer may go on.
            self.drained.notify_one();
        }
    }

    /// Takes the operations lock (waits for another operation; never for IO).
    pub(crate) async fn lock_ops(&self) -> OpsGuard<'_> {
        OpsGuard {
            epochs: self,
            _ops: self.ops.lock().await,
        }
    }
}

impl Drop for Epochs {
    fn drop(&mut self) {
        let p = *self.current.get_mut();
        // SAFETY: `current` always holds a pointer from `Arc::into_raw` that owns one strong count; `&mut self`
        // means nothing else can read it any more.
        drop(unsafe { Arc::from_raw(p) });
    }
}

/// One IO inside the gate; leaving on drop (also when the IO future is cancelled).
#[derive(Debug)]
pub(crate) struct IoGuard<'a> {
    epochs: &'a Epochs,
}

impl IoGuard<'_> {
    /// The replica set this IO runs against; it cannot change before the guard is dropped.
    pub(crate) fn set(&self) -> &ReplicaSet {
        let p = self.epochs.current.load(Ordering::Acquire);
        // SAFETY: this IO is inside the gate, so the set cannot be replaced (and its strong count dropped) until
        // the guard leaves, and the guard borrows `self` (see the module comment).
        unsafe { &*p }
    }
}

impl Drop for IoGuard<'_> {
    fn drop(&mut self) {
        self.epochs.leave();
    }
}

/// The operations lock: the holder may freeze IO and install a new replica set.
#[derive(Debug)]
pub(crate) struct OpsGuard<'a> {
    epochs: &'a Epochs,
    _ops: tokio::sync::MutexGuard<'a, ()>,
}

impl<'a> OpsGuard<'a> {
    /// The current set (it changes only under this lock).
    pub(crate) fn set(&self) -> Arc<ReplicaSet> {
        self.epochs.load()
    }

    /// Freezes the gate and waits until every IO inside has finished. IO resumes when the returned guard is
    /// dropped (also when the operation's future is cancelled).
    pub(crate) async fn freeze(&mut self, why: &str) -> Frozen<'_, 'a> {
        let start = Instant::now();
        let prev = self.epochs.state.fetch_or(FROZEN, Ordering::AcqRel);
        debug_assert_eq!(
            prev & FROZEN,
            0,
            "the gate is frozen by one holder of the operations lock at a time"
        );
        let frozen = Frozen { ops: self };
        let e = frozen.ops.epochs;
        loop {
            let drained = e.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if e.in_flight() == 0 {
                break;
            }
            drained.await;
        }
        debug!(
            epoch = e.load().epoch,
            why,
            in_flight_at_freeze = prev & !FROZEN,
            drain_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
            "IO frozen and drained"
        );
        frozen
    }
}

/// IO is paused and none is in flight until this is dropped.
#[derive(Debug)]
pub(crate) struct Frozen<'g, 'a> {
    ops: &'g mut OpsGuard<'a>,
}

impl Frozen<'_, '_> {
    /// The current set.
    pub(crate) fn set(&self) -> Arc<ReplicaSet> {
        self.ops.epochs.load()
    }

    /// Installs `replicas` as the next epoch; IO after the resume uses it.
    pub(crate) fn install(&mut self, replicas: Vec<Arc<ReplicaEntry>>) -> u64 {
        let e = self.ops.epochs;
        let mut latest = e.latest.lock().unwrap_or_else(PoisonError::into_inner);
        let set = Arc::new(ReplicaSet {
            epoch: latest.epoch + 1,
            replicas,
        });
        let old = e
            .current
            .swap(Arc::into_raw(set.clone()).cast_mut(), Ordering::AcqRel);
        // SAFETY: `old` came from `Arc::into_raw` and owned one strong count. The gate is frozen and drained
        // (this guard exists) and we hold the operations lock, so no IO holds a reference obtained from it.
        drop(unsafe { Arc::from_raw(old) });
        let epoch = set.epoch;
        *latest = set;
        info!(epoch, replicas = latest.len(), "replica set replaced");
        epoch
    }
}

impl Drop for Frozen<'_, '_> {
    fn drop(&mut self) {
        let e = self.ops.epochs;
        e.state.fetch_and(!FROZEN, Ordering::AcqRel);
        e.resumed.notify_waiters();
    }
}
