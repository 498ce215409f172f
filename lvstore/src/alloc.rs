//! Which physical clusters are in use: a bitmap rebuilt at open from the blobs' cluster maps (the maps are the
//! only record of ownership, so the allocation state is always recoverable and can never disagree with them).
//! Clusters freed by IO (an unmap emptying a cluster) wait in `pending` until the change is committed: until then
//! the committed metadata still names their old owner, and reusing them would let a crash expose another lvol's
//! data there.

/// The cluster allocator.
#[derive(Debug)]
pub struct Allocator {
    used: Vec<u64>,
    count: u64,
    free: u64,
    hint: u64,
    pending: Vec<u64>,
}

impl Allocator {
    /// An allocator over `count` clusters, the ones in `used` taken.
    pub fn new(count: u64, used: impl IntoIterator<Item = u64>) -> Self {
        let words = usize::try_from(count.div_ceil(64)).unwrap_or(usize::MAX);
        let mut a = Allocator {
            used: vec![0; words],
            count,
            free: count,
            hint: 0,
            pending: Vec::new(),
        };
        for c in used {
            a.mark(c);
        }
        a
    }

    fn word(c: u64) -> (usize, u64) {
        (usize::try_from(c / 64).unwrap_or(usize::MAX), 1 << (c % 64))
    }

    fn mark(&mut self, c: u64) {
        let (w, bit) = Self::word(c);
        if let Some(word) = self.used.get_mut(w)
            && *word & bit == 0
        {
            *word |= bit;
            self.free -= 1;
        }
    }

    pub fn is_used(&self, c: u64) -> bool {
        let (w, bit) = Self::word(c);
        self.used.get(w).is_some_and(|word| word & bit != 0)
    }

    /// A free cluster, marked used; `None` when none is left.
    pub fn allocate(&mut self) -> Option<u64> {
        if self.free == 0 {
            return None;
        }
        let words = self.used.len() as u64;
        for i in 0..words {
            let w = (self.hint / 64 + i) % words;
            let word = self.used[usize::try_from(w).unwrap_or(0)];
            if word != u64::MAX {
                let c = w * 64 + u64::from((!word).trailing_zeros());
                if c < self.count {
                    self.mark(c);
                    self.hint = c + 1;
                    return Some(c);
                }
            }
        }
        None
    }

    /// Frees a cluster now (its release is already committed).
    pub fn release(&mut self, c: u64) {
        let (w, bit) = Self::word(c);
        if let Some(word) = self.used.get_mut(w)
            && *word & bit != 0
        {
            *word &= !bit;
            self.free += 1;
        }
    }

    /// Frees a cluster at the next commit.
    pub fn release_after_commit(&mut self, c: u64) {
        self.pending.push(c);
    }

    /// The clusters waiting for a commit, handed to the caller (who releases them once it committed).
    pub fn take_pending(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.pending)
    }

    /// The commit happened: pending clusters become free.
    pub fn committed(&mut self) {
        for c in std::mem::take(&mut self.pending) {
            self.release(c);
        }
    }

    /// Clusters in use (including those waiting for a commit).
    pub fn used(&self) -> u64 {
        self.count - self.free
    }

    /// Clusters waiting for the next commit to become free.
    pub fn pending(&self) -> u64 {
        self.pending.len() as u64
    }

    pub fn free(&self) -> u64 {
        self.free
    }
}
