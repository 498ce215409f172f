//! A seeded pseudo-random generator for test data: small, dependency-free, and replayable.

/// Environment variable that overrides every [`TestRng::seeded`] seed, to replay a failing run.
pub const SEED_ENV: &str = "CORRAL_TEST_SEED";

/// xorshift64*: fast, deterministic per seed, good enough for offsets and data patterns (not for cryptography).
#[derive(Debug, Clone)]
pub struct TestRng {
    state: u64,
    seed: u64,
}

impl TestRng {
    /// A generator for `seed`, without printing or overrides: for data that must be the same on every run (a
    /// pattern written and later compared, a benchmark's stream).
    pub fn new(seed: u64) -> Self {
        // The multiply spreads small seeds over the state; `| 1` keeps it non-zero (zero is a fixed point).
        Self {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            seed,
        }
    }

    /// A generator for `default_seed`, or for `$CORRAL_TEST_SEED` when set; prints the seed it uses (with `what`)
    /// so that a failure names the run to replay.
    ///
    /// # Panics
    /// When `$CORRAL_TEST_SEED` is set but not a number.
    pub fn seeded(what: &str, default_seed: u64) -> Self {
        let seed = match std::env::var(SEED_ENV) {
            Ok(s) => s
                .parse()
                .unwrap_or_else(|e| panic!("{SEED_ENV}={s:?} is not a u64: {e}")),
            Err(_) => default_seed,
        };
        eprintln!("{what}: seed {seed} (replay with {SEED_ENV}={seed})");
        Self::new(seed)
    }

    /// The seed this generator started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n` (0 when `n` is 0; the modulo bias is negligible for `n` far below 2^64).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64().checked_rem(n).unwrap_or(0)
    }

    /// Fills `buf` with pseudo-random bytes (so no layer under test can shortcut zeros).
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_stream() {
        let (mut a, mut b) = (TestRng::new(7), TestRng::new(7));
        let xs: Vec<u64> = (0..10).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..10).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs[0], TestRng::new(8).next_u64());
    }

    #[test]
    fn zero_seed_and_zero_bound_are_usable() {
        let mut r = TestRng::new(0);
        assert_ne!(r.next_u64(), 0);
        assert_eq!(r.below(0), 0);
        assert!(r.below(10) < 10);
        let mut buf = [0u8; 13];
        r.fill(&mut buf);
        assert!(buf.iter().any(|&b| b != 0));
    }
}
