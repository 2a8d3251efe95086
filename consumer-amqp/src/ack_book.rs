//! The consuming channel's unsettled deliveries, so that acks can be coalesced.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// The deliveries of one consuming channel that are not settled yet, so that acks can be
/// coalesced into one `multiple` ack where that is safe.
///
/// A `multiple` ack of tag T settles every unsettled delivery up to T on the channel, so it
/// is sent only for a run of deliveries that starts at the oldest unsettled one and whose
/// outcomes are all durable and waiting for their ack. A delivery still in flight, or one
/// about to be requeued, stops the run: it is never acked by another's `multiple` ack.
///
/// A delivery that finishes while an older one is still in flight (a batch that commits
/// before the batch ahead of it, with several running at once) waits up to
/// [`ACK_WAIT_FOR_OLDER`] for the older one to leave the book, whose `multiple` ack then
/// covers it too; it is acked on its own only if that does not come in time. Concurrent
/// batches then cost the broker one frame each, as a hand-written consumer completing its
/// batches in order sends, not one per delivery; a delivery that never settles (its handler
/// hangs) costs the ones behind it that wait, not a stall.
pub(crate) struct AckBook<A = lapin::Acker> {
    /// Delivery tag to its acker once it only waits for its ack (`None` while in flight).
    pending: Mutex<BTreeMap<u64, Option<A>>>,
    /// Held while an ack or nack is being sent, so that frames leave in the order they were
    /// planned in: a `multiple` ack never overtakes a requeue it must not cover.
    pub(crate) sending: tokio::sync::Mutex<()>,
    /// The number of deliveries in the book, exported (`consumer_amqp_unacked`).
    unacked: metrics::Gauge,
    /// Signalled whenever deliveries leave the book (acked, or requeued), so that those
    /// waiting behind an older delivery plan again.
    changed: tokio::sync::Notify,
}

/// How long a finished delivery waits for an older one still in flight before it is acked
/// on its own (see [`AckBook`]): long enough for the batch ahead of it to commit, short
/// enough that one slow handler does not hold the acks behind it for long.
pub(crate) const ACK_WAIT_FOR_OLDER: std::time::Duration = std::time::Duration::from_millis(25);

impl<A> Default for AckBook<A> {
    fn default() -> Self {
        Self::counted_by(metrics::Gauge::noop())
    }
}

impl<A> AckBook<A> {
    /// An empty book whose size `unacked` follows.
    pub(crate) fn counted_by(unacked: metrics::Gauge) -> Self {
        unacked.set(0.0);
        AckBook {
            pending: Mutex::new(BTreeMap::new()),
            sending: tokio::sync::Mutex::new(()),
            changed: tokio::sync::Notify::new(),
            unacked,
        }
    }

    /// Sets the gauge to the book's size (called with the entries locked).
    fn count(&self, entries: &BTreeMap<u64, Option<A>>) {
        // A channel's deliveries in flight: far below 2^53.
        #[allow(clippy::cast_precision_loss)]
        self.unacked.set(entries.len() as f64);
    }
}

/// What to send to settle one ready delivery.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AckPlan<A> {
    /// Already acked by another delivery's `multiple` ack.
    Done,
    /// Ack the deliveries up to and including this tag, with this acker, in one frame.
    Through(u64, A),
    /// Ack this delivery alone.
    Alone,
}

impl<A: Clone> AckBook<A> {
    pub(crate) fn delivered(&self, tag: u64) {
        let mut entries = self.entries();
        entries.insert(tag, None);
        self.count(&entries);
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Option<A>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn ready(&self, tag: u64, acker: &A) {
        if let Some(slot) = self.entries().get_mut(&tag) {
            *slot = Some(acker.clone());
        }
    }

    /// [`AckBook::ready`] for several deliveries, under one hold of the lock.
    pub(crate) fn ready_all<'a>(&self, ready: impl IntoIterator<Item = (u64, &'a A)>)
    where
        A: 'a,
    {
        let mut entries = self.entries();
        for (tag, acker) in ready {
            if let Some(slot) = entries.get_mut(&tag) {
                *slot = Some(acker.clone());
            }
        }
    }

    /// Called with `sending` held.
    pub(crate) fn plan(&self, tag: u64) -> AckPlan<A> {
        let entries = self.entries();
        if !entries.contains_key(&tag) {
            return AckPlan::Done;
        }
        // The run of ready deliveries from the oldest unsettled one.
        let mut last = None;
        for (t, acker) in entries.iter() {
            match acker {
                Some(acker) => last = Some((*t, acker)),
                None => break,
            }
        }
        match last {
            // `tag` is ready, so it is in the run exactly when the run reaches it.
            Some((last, acker)) if last >= tag => AckPlan::Through(last, acker.clone()),
            _ => AckPlan::Alone,
        }
    }

    /// Plans the ack of ready `tag` and returns the plan with `sending` held. While an older
    /// delivery is in flight the plan is to ack alone; until `deadline` it waits instead for
    /// deliveries to leave the book and plans again.
    pub(crate) async fn plan_waiting(
        &self,
        tag: u64,
        deadline: tokio::time::Instant,
    ) -> (tokio::sync::MutexGuard<'_, ()>, AckPlan<A>) {
        loop {
            // Registered before planning, so that a change in between is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let sending = self.sending.lock().await;
            match self.plan(tag) {
                AckPlan::Alone if tokio::time::Instant::now() < deadline => drop(sending),
                plan => return (sending, plan),
            }
            // Past the deadline the next round plans to ack alone.
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    /// Forgets the deliveries up to and including `tag` (settled by one `multiple` frame).
    pub(crate) fn settled_through(&self, tag: u64) {
        let mut entries = self.entries();
        entries.retain(|t, _| *t > tag);
        self.count(&entries);
        drop(entries);
        self.changed.notify_waiters();
    }

    pub(crate) fn settled(&self, tag: u64) {
        let mut entries = self.entries();
        entries.remove(&tag);
        self.count(&entries);
        drop(entries);
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_multiple_ack_never_covers_a_delivery_in_flight() {
        let book = AckBook::<&str>::default();
        for tag in 1..=6 {
            book.delivered(tag);
        }
        // 2 is ready but 1 is in flight: 2 is acked alone.
        book.ready(2, &"a2");
        assert_eq!(book.plan(2), AckPlan::Alone);
        book.settled(2);
        // 1, 3 and 4 ready (2 settled): one frame through 4, sent with 4's acker.
        book.ready(3, &"a3");
        book.ready(4, &"a4");
        book.ready(1, &"a1");
        assert_eq!(book.plan(1), AckPlan::Through(4, "a4"));
        book.settled_through(4);
        assert_eq!(book.plan(3), AckPlan::Done);
        assert_eq!(book.plan(4), AckPlan::Done);
        // 5 in flight (say, being requeued), 6 ready: 6 alone, 5 never covered.
        book.ready(6, &"a6");
        assert_eq!(book.plan(6), AckPlan::Alone);
        book.settled(6);
        book.settled(5);
        assert!(book.entries().is_empty());
    }

    /// Each test runs on one thread: a spawned waiter runs only when the test yields, so
    /// `yield_now` lets it plan (to ack alone, 1 in flight) and start waiting.
    fn book_with_2_ready_behind_1() -> Arc<AckBook<&'static str>> {
        let book = Arc::new(AckBook::<&str>::default());
        book.delivered(1);
        book.delivered(2);
        book.ready(2, &"a2");
        book
    }

    fn wait_for_2(
        book: &Arc<AckBook<&'static str>>,
        wait: std::time::Duration,
    ) -> tokio::task::JoinHandle<AckPlan<&'static str>> {
        let book = book.clone();
        let deadline = tokio::time::Instant::now() + wait;
        tokio::spawn(async move { book.plan_waiting(2, deadline).await.1 })
    }

    /// The book of [`book_with_2_ready_behind_1`] and 2 waiting in it (60 s deadline).
    async fn waiting_behind_1() -> (
        Arc<AckBook<&'static str>>,
        tokio::task::JoinHandle<AckPlan<&'static str>>,
    ) {
        let book = book_with_2_ready_behind_1();
        let waiting = wait_for_2(&book, std::time::Duration::from_secs(60));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "2 waits while 1 is in flight");
        (book, waiting)
    }

    /// The waiter's plan once the book changed: well before its 60 s deadline, or it was
    /// not woken.
    async fn woken(
        waiting: tokio::task::JoinHandle<AckPlan<&'static str>>,
    ) -> AckPlan<&'static str> {
        tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .expect("woken by the change, not by its deadline")
            .unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_one_in_flight_is_covered_by_its_multiple_ack() {
        let (book, waiting) = waiting_behind_1().await;
        // 1 finishes: one frame through 2, and 2 has nothing left to send.
        book.ready(1, &"a1");
        let (sending, plan) = book.plan_waiting(1, tokio::time::Instant::now()).await;
        assert_eq!(plan, AckPlan::Through(2, "a2"));
        book.settled_through(2);
        drop(sending);
        assert_eq!(woken(waiting).await, AckPlan::Done);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_a_requeued_one_acks_itself_then() {
        let (book, waiting) = waiting_behind_1().await;
        // 1 is requeued (a nack leaves the book): 2 leads now and acks through itself.
        book.settled(1);
        assert_eq!(woken(waiting).await, AckPlan::Through(2, "a2"));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_one_that_stays_in_flight_is_acked_alone_at_the_deadline() {
        let book = book_with_2_ready_behind_1();
        let start = tokio::time::Instant::now();
        let wait = std::time::Duration::from_millis(20);
        let plan = wait_for_2(&book, wait).await.unwrap();
        assert_eq!(plan, AckPlan::Alone);
        assert!(start.elapsed() >= wait, "acked alone only at the deadline");
    }
}
