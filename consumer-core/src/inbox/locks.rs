//! In-process per-key locks: a second delivery of a key waits here for the first, without
//! holding a database connection while it waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A map of key lock id to its lock; entries are removed when nobody holds or waits on them.
#[derive(Debug, Default)]
pub(crate) struct KeyLocks {
    map: Arc<Mutex<HashMap<i64, Arc<AsyncMutex<()>>>>>,
}

/// Holds one key's in-process lock.
pub(crate) struct LocalGuard {
    id: i64,
    map: Arc<Mutex<HashMap<i64, Arc<AsyncMutex<()>>>>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyLocks {
    pub(crate) async fn lock(&self, id: i64) -> LocalGuard {
        let mutex = {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(id).or_default().clone()
        };
        let guard = mutex.lock_owned().await;
        LocalGuard {
            id,
            map: self.map.clone(),
            guard: Some(guard),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or_default()
    }
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map holds it now: nobody holds or waits on this key.
        if map.get(&self.id).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn second_holder_waits_and_map_is_cleaned() {
        let locks = KeyLocks::default();
        let g = locks.lock(1).await;
        let waiter = tokio::time::timeout(Duration::from_millis(50), locks.lock(1)).await;
        assert!(waiter.is_err(), "a second lock of the same key must wait");
        let other = locks.lock(2).await;
        drop(other);
        drop(g);
        let again = locks.lock(1).await;
        drop(again);
        assert_eq!(locks.len(), 0);
    }
}
