//! [`HeldKeys`]: the keys a layer's requests are running in this process. A duplicate of a
//! running request waits here, holding no database connection, and is let in when the
//! running one ends however it ends (answered, failed, or dropped because its client hung
//! up). Across processes the database holds the key (the claim's row in the running
//! request's open transaction); on SQLite, whose store serves one process, this is what a
//! duplicate waits on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::OwnedMutexGuard;

type Table = HashMap<String, Entry>;

/// A key held or waited for: its lock, and the fingerprint of the request that holds it
/// with when it took the key.
#[derive(Debug, Default)]
struct Entry {
    lock: Arc<tokio::sync::Mutex<()>>,
    holder: Option<(String, Instant)>,
}

/// What asking for a key came to.
pub(crate) enum Hold {
    /// The key is this request's until the [`HeldKey`] is dropped.
    Held(HeldKey),
    /// A request of another fingerprint holds it: the key is not this request's.
    OtherRequest,
    /// A request of this fingerprint still held it at the end of the wait.
    Busy,
}

/// The keys held in this process, each with the queue of the requests waiting for it and
/// the fingerprint of the request holding it (an entry lives while someone holds or waits
/// for its key).
#[derive(Debug, Default)]
pub(crate) struct HeldKeys {
    table: Arc<Mutex<Table>>,
}

/// A key held by one request; dropping it lets the next waiting request in.
pub(crate) struct HeldKey {
    table: Arc<Mutex<Table>>,
    name: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl HeldKeys {
    /// Holds `name` for a request of `fingerprint`, waiting up to `wait` while a request of
    /// the same fingerprint holds it.
    pub(crate) async fn hold(&self, name: String, fingerprint: &str, wait: Duration) -> Hold {
        let key_lock = {
            let mut table = lock(&self.table);
            let entry = table.entry(name.clone()).or_default();
            if entry.holder.as_ref().is_some_and(|(f, _)| f != fingerprint) {
                return Hold::OtherRequest;
            }
            entry.lock.clone()
        };
        // The lock is tried once before the wait is looked at: a wait of zero still takes a
        // free key.
        let guard = tokio::time::timeout(wait, key_lock.lock_owned()).await.ok();
        let held = HeldKey {
            table: self.table.clone(),
            name,
            guard,
        };
        if held.guard.is_none() {
            // Dropping it forgets the entry if nobody else holds or waits for the key.
            return Hold::Busy;
        }
        if let Some(entry) = lock(&self.table).get_mut(&held.name) {
            entry.holder = Some((fingerprint.to_owned(), Instant::now()));
        }
        Hold::Held(held)
    }

    /// How long the longest-running request holding a key has held it (`None`: none).
    pub(crate) fn oldest(&self) -> Option<Duration> {
        let now = Instant::now();
        lock(&self.table)
            .values()
            .filter_map(|e| e.holder.as_ref())
            .map(|(_, since)| now.duration_since(*since))
            .max()
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        let guard = self.guard.take();
        let mut table = lock(&self.table);
        let Some(entry) = table.get_mut(&self.name) else {
            return;
        };
        if guard.is_some() {
            entry.holder = None;
        }
        drop(guard);
        // Clones of an entry's lock are taken under the table's lock only: if the table's
        // is the last, nobody holds or waits for the key.
        if Arc::strong_count(&entry.lock) == 1 {
            table.remove(&self.name);
        }
    }
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    // The table is consistent between statements: a panic elsewhere leaves it usable.
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_held_key_makes_its_duplicate_wait_and_lets_it_in_when_dropped() {
        let keys = HeldKeys::default();
        assert_eq!(keys.oldest(), None);
        let first = keys.hold("k".into(), "f", Duration::ZERO).await;
        assert!(matches!(first, Hold::Held(_)));
        assert!(keys.oldest().is_some());
        assert!(matches!(
            keys.hold("k".into(), "f", Duration::ZERO).await,
            Hold::Busy
        ));
        assert!(matches!(
            keys.hold("k".into(), "g", Duration::from_secs(30)).await,
            Hold::OtherRequest
        ));
        assert!(matches!(
            keys.hold("other".into(), "g", Duration::ZERO).await,
            Hold::Held(_)
        ));
        let waiting = keys.hold("k".into(), "f", Duration::from_secs(30));
        tokio::pin!(waiting);
        assert!(futures::poll!(&mut waiting).is_pending());
        drop(first);
        assert!(matches!(waiting.await, Hold::Held(_)));
        assert!(lock(&keys.table).is_empty(), "every entry forgotten");
        assert_eq!(keys.oldest(), None);
    }
}
