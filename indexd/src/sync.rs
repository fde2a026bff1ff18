//! Lock helpers and the warning gate: what every part of indexd shares and
//! nothing of indexd's own is needed for.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Locks a mutex, ignoring poisoning (no invariant spans a panic: there are
/// none outside tests).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Read-locks, ignoring poisoning.
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Write-locks, ignoring poisoning.
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

/// A warning's gate: open at most once per 10 s. Bad input is counted
/// always and logged sparingly.
#[derive(Debug, Default)]
pub(crate) struct WarnGate(Mutex<Option<Instant>>);

impl WarnGate {
    /// True if the last opening was 10 s ago or more (or never).
    pub(crate) fn open(&self) -> bool {
        let now = Instant::now();
        let mut last = lock(&self.0);
        if last.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(10)) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_gate_opens_once_per_ten_seconds() {
        let gate = WarnGate::default();
        assert!(gate.open());
        assert!(!gate.open(), "again at once");
        *lock(&gate.0) = Instant::now().checked_sub(Duration::from_millis(9_900));
        assert!(!gate.open(), "9.9 s later");
        *lock(&gate.0) = Instant::now().checked_sub(Duration::from_secs(10));
        assert!(gate.open(), "10 s later");
    }
}
