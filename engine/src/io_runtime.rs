//! The data path's own thread: one current-thread tokio runtime on a thread named `engine-io` that accepts NBD
//! clients, runs every NBD session and owns every replica data connection (`data_protocol::ClientConfig::runtime`).
//! gRPC, metrics, the connection watcher, rebuild and backup stay on the process's multi-thread runtime, so a slow
//! control call never runs on the IO thread, and IO never waits for a control task.
//!
//! Why one thread: an IO hands off between the NBD session, the replica client's writer and its reader several
//! times. On a multi-thread runtime each hand-off to a task the other worker picks up is a futex wake-up (and an
//! IPI in a VM) for a microsecond of work; on one thread it is a queue push. Measured with `bench/datapath` (the
//! run is in git 7ac3b98's `bench/datapath/README.md`): the engine's whole runtime on one worker took 4–27 % of
//! the CPU per qd1 IO off and lifted 1-replica qd32 reads 1.17× → 1.70× of nbdkit.
//!
//! The cost: one engine's IO uses at most one core (in the bench's perf profile the thread took 11 % of the two
//! cores at 29k 4 KiB writes/s). A host where one volume's IO needs more would run several such threads, each owning whole
//! NBD sessions with their own replica connections, so a session's hand-offs still stay on one thread.

use std::sync::Mutex;

use tokio::runtime::Handle;

static IO_RUNTIME: Mutex<Option<Handle>> = Mutex::new(None);

/// The handle of the data path's runtime, starting its thread on first use. The thread lives as long as the
/// process: sessions and connections end by cancellation, never by dropping the runtime under them.
pub fn handle() -> std::io::Result<Handle> {
    let mut slot = IO_RUNTIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(h) = slot.as_ref() {
        return Ok(h.clone());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("engine-io-blocking")
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("engine-io".to_owned())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    *slot = Some(handle.clone());
    Ok(handle)
}
