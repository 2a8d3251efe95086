//! In-process per-key locks: a second delivery of a key waits here for the first, without
//! holding a database connection while it waits. Also the keys' lock ids, which the
//! PostgreSQL advisory locks use too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A map of key lock id to its lock; entries are removed when nobody holds or waits on them.
#[derive(Debug, Default)]
pub(crate) struct KeyLocks {
    map: LockMap,
}

type LockMap = Arc<Mutex<HashMap<i64, Arc<AsyncMutex<()>>>>>;

/// Holds the in-process locks of a set of keys; dropping it releases them all.
pub(crate) struct LocalGuards {
    map: LockMap,
    held: Vec<(i64, OwnedMutexGuard<()>)>,
}

impl KeyLocks {
    /// Locks `ids`, which must be sorted and without repeats: every caller takes its locks in
    /// ascending order, so two callers sharing keys cannot deadlock. Free locks are taken
    /// under one hold of the map; from the first busy one on, each is awaited in turn.
    pub(crate) async fn lock_many(&self, ids: &[i64]) -> LocalGuards {
        let mut guards = LocalGuards {
            map: self.map.clone(),
            held: Vec::with_capacity(ids.len()),
        };
        let mut busy = Vec::new();
        {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            for &id in ids {
                let mutex = map.entry(id).or_default().clone();
                if busy.is_empty() {
                    if let Ok(guard) = mutex.clone().try_lock_owned() {
                        guards.held.push((id, guard));
                        continue;
                    }
                }
                // Taking it now would be out of order behind the busy one: wait in turn.
                busy.push((id, mutex));
            }
        }
        for (id, mutex) in busy {
            guards.held.push((id, mutex.lock_owned().await));
        }
        guards
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or_default()
    }
}

impl Drop for LocalGuards {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let ids: Vec<i64> = self.held.drain(..).map(|(id, _guard)| id).collect();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            // Only the map holds it now: nobody holds or waits on this key.
            if map.get(&id).is_some_and(|m| Arc::strong_count(m) == 1) {
                map.remove(&id);
            }
        }
    }
}

/// The first 8 bytes of the SHA-256 of (namespace, handler, key), big-endian. Workers of
/// different versions must agree on it: keep it stable.
pub(super) fn lock_id(namespace: &str, handler: &str, key: &str) -> i64 {
    let digest = crate::key::sha256(&[namespace.as_bytes(), handler.as_bytes(), key.as_bytes()]);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn second_holder_waits_and_map_is_cleaned() {
        let locks = KeyLocks::default();
        let g = locks.lock_many(&[1]).await;
        let waiter = tokio::time::timeout(Duration::from_millis(50), locks.lock_many(&[1])).await;
        assert!(waiter.is_err(), "a second lock of the same key must wait");
        let other = locks.lock_many(&[2]).await;
        drop(other);
        drop(g);
        let again = locks.lock_many(&[1]).await;
        drop(again);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn a_waiting_set_takes_nothing_past_its_first_busy_key() {
        let locks = KeyLocks::default();
        let first = locks.lock_many(&[1, 2]).await;
        // [2, 3] waits at 2 and must not hold 3 meanwhile (taking locks out of order could
        // deadlock with a set that holds 3 and waits for 2).
        let second = locks.lock_many(&[2, 3]);
        tokio::pin!(second);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut second)
                .await
                .is_err(),
            "2 is held"
        );
        let third = tokio::time::timeout(Duration::from_secs(5), locks.lock_many(&[3]))
            .await
            .expect("3 is free while [2, 3] waits for 2");
        drop(third);
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("[2, 3] gets both once 2 is released");
        assert_eq!(second.held.len(), 2);
        drop(second);
        assert_eq!(locks.len(), 0);
    }

    #[test]
    fn lock_ids_are_stable() {
        // Workers of different versions lock the same key: this value must never change.
        assert_eq!(
            lock_id("\"consumer_inbox\"", "bench", "m-1"),
            5434538691312428815
        );
    }
}
