//! In-process per-key locks: a second delivery of a key waits here for the first, without
//! holding a database connection while it waits. Also the keys' database lock ids, which
//! the PostgreSQL advisory locks use, and the outbox's rest lock.
//!
//! The table holds one entry per held key: the queue of the tasks waiting for it, empty
//! (no allocation) while nobody waits. Taking a free key is an insert and releasing it a
//! remove, under one hold of the table for a whole batch; only a wait allocates (a
//! one-shot channel, through which the releaser hands the key over).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// The table of held keys: a key's local id ([`KeyLocks::local_id`]) to the tasks waiting
/// for it, oldest first.
#[derive(Debug, Default)]
pub(crate) struct KeyLocks {
    map: LockMap,
    /// Seeds the local ids: they name keys in this process only, so a fast randomly seeded
    /// hash does (foldhash, tuned for quality: the table uses an id's bits as they are),
    /// where the database lock ids ([`lock_id`]) must be the same in every worker.
    ids: foldhash::quality::RandomState,
}

type Table = IdMap<VecDeque<oneshot::Sender<()>>>;

/// A map keyed by local ids ([`KeyLocks::local_id`]), which hashes them as themselves (see
/// [`LockIdHasher`]).
pub(crate) type IdMap<V> = HashMap<i64, V, BuildHasherDefault<LockIdHasher>>;
type LockMap = Arc<Mutex<Table>>;

/// Hashes a local id as itself: it is already a keyed hash of the key, so hashing it again
/// (on every take and release) buys nothing. Only keys in flight are in the table (at most
/// the workers' concurrency times their batch size), so even ids that share buckets cost a
/// bounded probe.
#[derive(Debug, Default)]
pub(crate) struct LockIdHasher(u64);

impl Hasher for LockIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_i64(&mut self, id: i64) {
        self.0 = u64::from_ne_bytes(id.to_ne_bytes());
    }
}

/// Holds the in-process locks of a set of keys; dropping it releases them all.
pub(crate) struct LocalGuards {
    map: LockMap,
    held: Vec<i64>,
}

impl KeyLocks {
    /// The id that `key` of `handler` is locked by in this table. Two keys may share one (a
    /// hash collision): they then take turns, which costs time, never correctness.
    pub(crate) fn local_id(&self, handler: &str, key: &str) -> i64 {
        i64::from_ne_bytes(self.ids.hash_one((handler, key)).to_ne_bytes())
    }

    /// Locks `ids`, which must be sorted and without repeats: every caller takes its locks in
    /// ascending order, so two callers sharing keys cannot deadlock. Free locks are taken
    /// under one hold of the table; from the first busy one on, each is awaited in turn.
    pub(crate) async fn lock_many(&self, ids: &[i64]) -> LocalGuards {
        let mut guards = LocalGuards {
            map: self.map.clone(),
            held: Vec::with_capacity(ids.len()),
        };
        let busy = {
            let mut table = lock(&self.map);
            ids.iter()
                .position(|&id| match table.entry(id) {
                    Entry::Vacant(v) => {
                        v.insert(VecDeque::new());
                        guards.held.push(id);
                        false
                    }
                    Entry::Occupied(_) => true,
                })
                .unwrap_or(ids.len())
        };
        // Taking the rest now would be out of order behind the busy one: wait in turn.
        for &id in &ids[busy..] {
            Waiting::new(&self.map, id).acquired().await;
            guards.held.push(id);
        }
        guards
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

fn lock(map: &LockMap) -> MutexGuard<'_, Table> {
    map.lock().unwrap_or_else(|p| p.into_inner())
}

/// Hands `id` to its oldest waiter still waiting, or frees it if none is.
fn release(table: &mut Table, id: i64) {
    // One lookup of the bucket, for the hand-over and the removal alike.
    let Entry::Occupied(mut held) = table.entry(id) else {
        return;
    };
    while let Some(next) = held.get_mut().pop_front() {
        if next.send(()).is_ok() {
            return;
        }
    }
    held.remove();
}

/// A wait for one key. Dropped before the key is handed over (the lease was cancelled), it
/// leaves the queue; dropped after, it passes the key on.
struct Waiting<'a> {
    map: &'a LockMap,
    id: i64,
    handed: Option<oneshot::Receiver<()>>,
}

impl<'a> Waiting<'a> {
    fn new(map: &'a LockMap, id: i64) -> Self {
        Waiting {
            map,
            id,
            handed: None,
        }
    }

    /// Resolves once `id` is this task's.
    async fn acquired(mut self) {
        loop {
            let rx = {
                let mut table = lock(self.map);
                match table.entry(self.id) {
                    Entry::Vacant(v) => {
                        // Free (released meanwhile).
                        v.insert(VecDeque::new());
                        return;
                    }
                    Entry::Occupied(mut o) => {
                        let (tx, rx) = oneshot::channel();
                        o.get_mut().push_back(tx);
                        rx
                    }
                }
            };
            let handed = self.handed.insert(rx).await.is_ok();
            self.handed = None;
            // A sender is only dropped unsent with its entry, once nobody waits: never while
            // this task does. Should it be, the key is asked for again, never assumed.
            if handed {
                return;
            }
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.handed.take() else {
            return;
        };
        rx.close();
        if rx.try_recv().is_ok() {
            // Handed over just as the wait was given up: pass it on.
            release(&mut lock(self.map), self.id);
        }
    }
}

impl Drop for LocalGuards {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let mut table = lock(&self.map);
        for id in self.held.drain(..) {
            release(&mut table, id);
        }
    }
}

/// The first key of the outbox's rest lock (`"outb"`), the second being the outbox table's
/// oid: a resting relay holds it, and the outbox trigger notifies only when it cannot take it
/// shared (see the migration `0010_outbox_quiet_notify.sql`). Fixed: the migration renders it.
pub(crate) const OUTBOX_REST_LOCK: i32 = 0x6f75_7462;

/// The database lock id of a key: the first 8 bytes of the SHA-256 of (namespace, handler,
/// key), big-endian. Workers of different versions must agree on it: keep it stable.
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
        assert_eq!(second.held, [2, 3]);
        drop(second);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn a_wait_given_up_after_the_handover_passes_the_key_on() {
        let locks = KeyLocks::default();
        let first = locks.lock_many(&[1]).await;
        let mut second = Box::pin(locks.lock_many(&[1]));
        assert!(futures::poll!(second.as_mut()).is_pending(), "1 is held");
        // Handed to the waiting lease, which is then dropped before it sees it.
        drop(first);
        drop(second);
        assert_eq!(
            locks.len(),
            0,
            "the key went back, not to a lease that is gone"
        );
        let third = tokio::time::timeout(Duration::from_secs(5), locks.lock_many(&[1]))
            .await
            .expect("1 is free again");
        drop(third);
    }

    #[tokio::test]
    async fn waiters_get_the_key_in_turn() {
        let locks = Arc::new(KeyLocks::default());
        let held = locks.lock_many(&[7]).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..3 {
            let (locks, order) = (locks.clone(), order.clone());
            let mut wait = Box::pin(async move {
                let g = locks.lock_many(&[7]).await;
                order.lock().unwrap().push(n);
                drop(g);
            });
            // Queued in this order before any runs on.
            assert!(futures::poll!(wait.as_mut()).is_pending());
            tasks.push(tokio::spawn(wait));
        }
        drop(held);
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .expect("every waiter gets the key")
                .unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
        assert_eq!(locks.len(), 0);
    }

    #[test]
    fn a_table_gives_a_key_one_local_id_and_tells_keys_and_handlers_apart() {
        let locks = KeyLocks::default();
        let id = locks.local_id("bench", "m-1");
        assert_eq!(locks.local_id("bench", "m-1"), id);
        assert_ne!(locks.local_id("bench", "m-2"), id);
        assert_ne!(locks.local_id("other", "m-1"), id);
        // The handler and the key are hashed as two fields, not as one joined text.
        assert_ne!(
            locks.local_id("bench", "m-1"),
            locks.local_id("benchm", "-1")
        );
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
