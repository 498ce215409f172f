//! One operation per volume (or snapshot) at a time: a second call on the same name while the first runs gets
//! ABORTED, as the CSI specification asks, and the CO retries it later.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::error::{CsiError, CsiResult};

#[derive(Clone, Default)]
pub struct InFlight {
    names: Arc<Mutex<HashSet<String>>>,
}

/// Held while an operation runs; releases the name when dropped.
pub struct InFlightGuard {
    names: Arc<Mutex<HashSet<String>>>,
    name: String,
}

impl InFlight {
    pub fn begin(&self, name: &str) -> CsiResult<InFlightGuard> {
        let mut names = self
            .names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !names.insert(name.to_owned()) {
            return Err(CsiError::Aborted(format!(
                "an operation on {name} is already in flight"
            )));
        }
        Ok(InFlightGuard {
            names: Arc::clone(&self.names),
            name: name.to_owned(),
        })
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_operation_on_the_same_name_is_aborted_until_the_first_ends() {
        let f = InFlight::default();
        let g = f.begin("v1").unwrap();
        assert!(matches!(f.begin("v1"), Err(CsiError::Aborted(_))));
        assert!(f.begin("v2").is_ok());
        drop(g);
        assert!(f.begin("v1").is_ok());
    }
}
