//! A small bounded cache of immutable values (qcow2 L2 tables, decompressed clusters) shared by reader threads.
//! Lookups take a mutex for a hash probe and an `Arc` clone; the value's bytes are never copied or read under it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

struct Slots<V: ?Sized> {
    map: HashMap<u64, (Arc<V>, u64)>,
    tick: u64,
}

/// Least-recently-used cache of at most `capacity` values keyed by a file offset.
pub(crate) struct LruCache<V: ?Sized> {
    slots: Mutex<Slots<V>>,
    capacity: usize,
}

impl<V: ?Sized> LruCache<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        LruCache {
            slots: Mutex::new(Slots {
                map: HashMap::with_capacity(capacity),
                tick: 0,
            }),
            capacity: capacity.max(1),
        }
    }

    pub(crate) fn get(&self, key: u64) -> Option<Arc<V>> {
        let mut s = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        s.tick += 1;
        let tick = s.tick;
        s.map.get_mut(&key).map(|(v, used)| {
            *used = tick;
            Arc::clone(v)
        })
    }

    pub(crate) fn insert(&self, key: u64, value: Arc<V>) {
        let mut s = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        s.tick += 1;
        let tick = s.tick;
        if s.map.len() >= self.capacity && !s.map.contains_key(&key) {
            let oldest = s.map.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k);
            if let Some(k) = oldest {
                s.map.remove(&k);
            }
        }
        s.map.insert(key, (value, tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used_value() {
        let c: LruCache<u64> = LruCache::new(2);
        c.insert(1, Arc::new(10));
        c.insert(2, Arc::new(20));
        assert_eq!(c.get(1).as_deref(), Some(&10));
        c.insert(3, Arc::new(30));
        assert!(c.get(2).is_none());
        assert_eq!(c.get(1).as_deref(), Some(&10));
        assert_eq!(c.get(3).as_deref(), Some(&30));
    }
}
