//! The range of TCP ports sync receivers listen on, handed out one at a time and returned when the lease drops.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

/// An inclusive port range `A-B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl FromStr for PortRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("port range {s:?}: expected A-B"))?;
        let parse = |v: &str| {
            v.trim()
                .parse::<u16>()
                .map_err(|_| format!("port range {s:?}: {v:?} is not a port"))
        };
        let (first, last) = (parse(a)?, parse(b)?);
        if first == 0 || first > last {
            return Err(format!("port range {s:?}: expected 0 < A <= B"));
        }
        Ok(PortRange { first, last })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// Hands out ports of a range.
#[derive(Debug, Clone)]
pub struct PortAllocator {
    range: PortRange,
    used: Arc<Mutex<BTreeSet<u16>>>,
}

/// A port taken from the allocator; dropping it returns the port.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    used: Arc<Mutex<BTreeSet<u16>>>,
}

impl PortLease {
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for PortLease {
    fn drop(&mut self) {
        self.used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.port);
    }
}

impl PortAllocator {
    pub fn new(range: PortRange) -> Self {
        PortAllocator {
            range,
            used: Arc::new(Mutex::new(BTreeSet::new())),
        }
    }

    pub fn range(&self) -> PortRange {
        self.range
    }

    /// Ports leased now.
    pub fn in_use(&self) -> usize {
        self.used.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Leases the lowest free port not in `skip` (ports found busy by another process), or `None`.
    pub fn lease(&self, skip: &BTreeSet<u16>) -> Option<PortLease> {
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        let port = (self.range.first..=self.range.last).find(|p| !used.contains(p) && !skip.contains(p))?;
        used.insert(port);
        Some(PortLease {
            port,
            used: self.used.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_returned_on_drop_and_the_range_runs_out() {
        let a = PortAllocator::new("40000-40001".parse().unwrap());
        let l1 = a.lease(&BTreeSet::new()).unwrap();
        let l2 = a.lease(&BTreeSet::new()).unwrap();
        assert_eq!((l1.port(), l2.port()), (40000, 40001));
        assert!(a.lease(&BTreeSet::new()).is_none());
        drop(l1);
        assert_eq!(a.in_use(), 1);
        assert_eq!(a.lease(&BTreeSet::new()).unwrap().port(), 40000);
        assert!(a.lease(&BTreeSet::from([40000])).is_none());
        for bad in ["", "5", "0-3", "9-3", "a-b", "1-70000"] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad:?} accepted");
        }
    }
}
