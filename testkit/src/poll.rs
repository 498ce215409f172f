//! Waiting for a condition with a deadline: the one replacement for sleeps in tests.

use std::time::{Duration, Instant};

/// How often a condition is polled: fast enough that a test does not idle, slow enough not to spin.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `f` until it returns `Some`, and returns that value.
///
/// # Panics
/// After `timeout`, naming `what` it was waiting for.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// The async form of [`wait_for`]: polls `f` (sleeping on the tokio timer in between) until it returns `Some`.
///
/// # Panics
/// After `timeout`, naming `what` it was waiting for.
pub async fn wait_for_async<T>(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_for_returns_the_first_value() {
        let mut n = 0;
        let v = wait_for("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            (n == 3).then_some(n)
        });
        assert_eq!(v, 3);
    }

    #[test]
    #[should_panic(expected = "timed out after 50ms waiting for never")]
    fn wait_for_panics_at_the_deadline() {
        wait_for("never", Duration::from_millis(50), || None::<()>);
    }

    #[tokio::test]
    async fn wait_for_async_polls_an_async_condition() {
        let mut n = 0;
        let v = wait_for_async("n to reach 2", Duration::from_secs(5), async || {
            n += 1;
            (n == 2).then_some("done")
        })
        .await;
        assert_eq!(v, "done");
    }
}
