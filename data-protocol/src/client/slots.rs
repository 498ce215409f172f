//! The client's table of in-flight requests: a fixed array of slots, one per window position.
//!
//! A request id is `generation << 32 | slot index`, so a reply finds its slot by indexing (no map, no
//! allocation) and a reply for a recycled slot is recognised as stale. The semaphore counts free slots;
//! callers wait on it when the window is full. A slot whose caller went away (its future was dropped)
//! stays reserved until the reply arrives, so the server never sees more than the window in flight.

use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{Notify, Semaphore};

use super::ClientError;
use crate::codec::FrameKind;
use crate::pool::PooledBuf;

/// What a successful reply carries: its `length` field and its payload (read data, a range list).
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) length: u32,
    pub(crate) payload: Option<PooledBuf>,
}

/// What a completed request yields.
pub(super) type Completion = Result<Answer, ClientError>;

pub(super) struct SlotTable {
    slots: Box<[Slot]>,
    free: Mutex<Vec<usize>>,
    available: Semaphore,
}

struct Slot {
    state: Mutex<SlotState>,
    done: Notify,
}

struct SlotState {
    generation: u32,
    phase: Phase,
    kind: FrameKind,
    length: u32,
}

enum Phase {
    /// Reserved by a caller that has not sent yet.
    Reserved,
    /// Sent; the caller is waiting.
    Pending,
    /// Sent; the caller gave up. The reply frees the slot.
    Abandoned,
    Done(Completion),
}

/// What the reader needs to know about the request a reply answers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Expected {
    pub(super) kind: FrameKind,
    pub(super) length: u32,
}

fn lock(m: &Mutex<SlotState>) -> MutexGuard<'_, SlotState> {
    crate::io_counters::lock();
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SlotTable {
    pub(super) fn new(size: usize) -> Self {
        let size = size.clamp(1, Semaphore::MAX_PERMITS);
        let slots = (0..size)
            .map(|_| Slot {
                state: Mutex::new(SlotState {
                    generation: 0,
                    phase: Phase::Reserved,
                    kind: FrameKind::Ping,
                    length: 0,
                }),
                done: Notify::new(),
            })
            .collect();
        // Ids carry the index in their low 32 bits; `size` is bounded by MAX_PERMITS, far below that.
        let free = (0..size).rev().collect();
        Self {
            slots,
            free: Mutex::new(free),
            available: Semaphore::new(size),
        }
    }

    /// Waits for a free slot. Fails once the table was closed (the client failed).
    pub(super) async fn acquire(&self) -> Option<SlotGuard<'_>> {
        let permit = self.available.acquire().await.ok()?;
        // The permit is given back explicitly when the slot returns to the free list (see `release`),
        // which for an abandoned request is only when its reply arrives.
        permit.forget();
        crate::io_counters::lock();
        let index = self.free.lock().unwrap_or_else(PoisonError::into_inner).pop()?;
        Some(SlotGuard { table: self, index })
    }

    /// Wakes every waiter with `err` and refuses new acquisitions.
    pub(super) fn fail_all(&self, err: &ClientError) {
        self.available.close();
        for slot in &self.slots {
            let mut st = lock(&slot.state);
            if matches!(st.phase, Phase::Pending) {
                st.phase = Phase::Done(Err(err.clone()));
                slot.done.notify_one();
            }
        }
    }

    /// Looks up the request a reply claims to answer.
    pub(super) fn expected(&self, id: u64) -> Option<Expected> {
        let (index, generation) = split_id(id);
        let st = lock(&self.slots.get(index)?.state);
        let live = matches!(st.phase, Phase::Pending | Phase::Abandoned) && st.generation == generation;
        live.then_some(Expected {
            kind: st.kind,
            length: st.length,
        })
    }

    /// Delivers a reply's outcome to its caller (or frees the slot if the caller is gone).
    pub(super) fn complete(&self, id: u64, outcome: Completion) {
        let (index, generation) = split_id(id);
        let Some(slot) = self.slots.get(index) else { return };
        let mut st = lock(&slot.state);
        if st.generation != generation {
            return;
        }
        match st.phase {
            Phase::Pending => {
                st.phase = Phase::Done(outcome);
                slot.done.notify_one();
            }
            Phase::Abandoned => {
                st.phase = Phase::Reserved;
                drop(st);
                self.release(index);
            }
            // Already failed by `fail_all`: the reply lost the race, nothing to do.
            Phase::Reserved | Phase::Done(_) => {}
        }
    }

    fn release(&self, index: usize) {
        crate::io_counters::lock();
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(index);
        self.available.add_permits(1);
    }
}

fn split_id(id: u64) -> (usize, u32) {
    let index = usize::try_from(id & u64::from(u32::MAX)).unwrap_or(usize::MAX);
    let generation = u32::try_from(id >> 32).unwrap_or(0);
    (index, generation)
}

/// A reserved slot. Dropping it frees the slot, or marks it abandoned while its request is in flight.
pub(super) struct SlotGuard<'a> {
    table: &'a SlotTable,
    index: usize,
}

impl SlotGuard<'_> {
    fn slot(&self) -> &Slot {
        &self.table.slots[self.index]
    }

    /// Marks the slot as sent and returns the request id to put on the wire.
    pub(super) fn begin(&self, kind: FrameKind, length: u32) -> u64 {
        let mut st = lock(&self.slot().state);
        st.generation = st.generation.wrapping_add(1);
        st.phase = Phase::Pending;
        st.kind = kind;
        st.length = length;
        (u64::from(st.generation) << 32) | self.index as u64
    }

    /// Waits for the reply (or the client's failure).
    pub(super) async fn wait(&self) -> Completion {
        loop {
            let notified = self.slot().done.notified();
            {
                let mut st = lock(&self.slot().state);
                match std::mem::replace(&mut st.phase, Phase::Reserved) {
                    Phase::Done(outcome) => return outcome,
                    other => st.phase = other,
                }
            }
            // `notify_one` stores a permit when nobody waits yet, so a completion between the check and
            // this await is not lost; a stale permit only costs one extra loop.
            notified.await;
        }
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.slot().state);
        if matches!(st.phase, Phase::Pending) {
            st.phase = Phase::Abandoned;
            return;
        }
        st.phase = Phase::Reserved;
        drop(st);
        self.table.release(self.index);
    }
}
