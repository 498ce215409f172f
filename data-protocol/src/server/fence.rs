//! Fencing a stale engine by its generation.
//!
//! Every engine start gets a generation, presented in each connection's `Hello` (`offset`; 0 = none). The
//! backend keeps the highest one it accepted durably ([`BlockBackend::generation`],
//! [`BlockBackend::record_generation`]); this module applies the rule at `Hello`, once per connection:
//! - lower than the record (or none once there is one): refused with a `Fenced` error naming both numbers;
//! - equal: accepted;
//! - higher: recorded durably first, then every open connection of a lower generation is shut down and
//!   waited for (its in-flight requests finish or are not run; the ones it had not started are never run)
//!   before the `Hello` is answered, so no write of the stale engine lands after the new engine's first.
//!
//! The per-request cost is one atomic load: a connection runs no request once the current generation is
//! above its own ([`Fence::is_stale`]). That closes the gap between a higher `Hello` and a lower connection
//! seeing its socket shut down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::stream::Stream;
use crate::backend::{BackendError, BlockBackend, ErrorKind};

/// One connection that passed `Hello`.
struct Open {
    id: u64,
    generation: u64,
    /// A handle on the connection's socket, to shut it down when a higher generation connects.
    socket: Stream,
}

/// The server's view of the generations of its connections.
#[derive(Default)]
pub(crate) struct Fence {
    /// The highest generation accepted (0: none), mirrored from the backend's record.
    current: AtomicU64,
    /// Open connections by id; the condvar is told when one closes.
    open: Mutex<Vec<Open>>,
    closed: Condvar,
    /// Serialises admissions: reading, raising and recording the generation is one step.
    admit: Mutex<()>,
    next_id: AtomicU64,
}

/// Why a `Hello` was refused.
pub(crate) enum Refusal {
    /// The engine is stale: the replica accepted `replica`, higher than what it presented.
    Stale { replica: u64, message: String },
    /// The backend cannot tell or record the generation, or the lower connections did not end in time.
    Backend(BackendError),
}

/// A connection admitted under a generation; [`Fence::leave`] it when the connection ended.
pub(crate) struct Admission {
    id: u64,
    pub(crate) generation: u64,
}

impl Fence {
    /// Whether a connection of `generation` must stop: a higher generation was accepted since its `Hello`.
    /// One relaxed-ordering load would do for the rule; acquire orders it after the record write.
    #[inline]
    pub(crate) fn is_stale(&self, generation: u64) -> bool {
        generation < self.current.load(Ordering::Acquire)
    }

    /// The highest generation accepted.
    pub(crate) fn current(&self) -> u64 {
        self.current.load(Ordering::Acquire)
    }

    /// Applies the rule to a `Hello` presenting `generation` on `socket`. `wait` bounds how long lower
    /// connections may take to end.
    pub(crate) fn admit(
        &self,
        backend: &dyn BlockBackend,
        generation: u64,
        socket: &Stream,
        wait: Duration,
    ) -> Result<Admission, Refusal> {
        let _admitting = self.admit.lock().unwrap_or_else(PoisonError::into_inner);
        let recorded = backend.generation().map_err(|e| {
            tracing::error!(error = %e, "cannot read the engine generation record: refusing the connection");
            Refusal::Backend(e)
        })?;
        self.current.fetch_max(recorded, Ordering::AcqRel);
        if generation < recorded {
            let message = if generation == 0 {
                format!(
                    "fenced by generation {recorded} > 0: this engine presents no generation but the replica \
                     has accepted generation {recorded}; upgrade the engine (corral-engine --generation)"
                )
            } else {
                format!(
                    "fenced by generation {recorded} > {generation}: the replica has accepted engine \
                     generation {recorded}; this engine (generation {generation}) is stale"
                )
            };
            tracing::warn!(presented = generation, recorded, "refused a stale engine");
            return Err(Refusal::Stale {
                replica: recorded,
                message,
            });
        }
        let socket = socket.try_clone().map_err(|e| {
            Refusal::Backend(BackendError::new(
                ErrorKind::Io,
                format!("cannot keep a handle on the connection: {e}"),
            ))
        })?;
        if generation > recorded {
            backend.record_generation(generation).map_err(|e| {
                tracing::error!(generation, error = %e, "cannot record the engine generation");
                Refusal::Backend(e)
            })?;
            self.current.store(generation, Ordering::Release);
            tracing::info!(
                generation,
                previous = recorded,
                "accepted a new engine generation"
            );
            self.close_lower(generation, wait).map_err(Refusal::Backend)?;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Open {
                id,
                generation,
                socket,
            });
        Ok(Admission { id, generation })
    }

    /// Shuts the read side of every connection below `generation` down and waits until each has ended (its
    /// thread answered or dropped what it held, its flushes and pool requests finished).
    fn close_lower(&self, generation: u64, wait: Duration) -> Result<(), BackendError> {
        let deadline = Instant::now() + wait;
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let mut closed = 0usize;
        for c in open.iter().filter(|c| c.generation < generation) {
            c.socket.shutdown(std::net::Shutdown::Read);
            closed += 1;
        }
        if closed > 0 {
            tracing::warn!(
                generation,
                connections = closed,
                "closing the connections of older engine generations"
            );
        }
        while let Some(old) = open.iter().find(|c| c.generation < generation) {
            let now = Instant::now();
            if now >= deadline {
                return Err(BackendError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "a connection of engine generation {} did not end within {wait:?}; retry",
                        old.generation
                    ),
                ));
            }
            open = self
                .closed
                .wait_timeout(open, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Forgets an admitted connection once it has ended.
    pub(crate) fn leave(&self, admission: &Admission) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.retain(|c| c.id != admission.id);
        drop(open);
        self.closed.notify_all();
    }
}
