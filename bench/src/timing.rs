//! How the arms time their deliveries: a framework arm's sampled deliveries carry a wrapper
//! around their acknowledgers ([`Timed`]) that records each one's delivery-to-ack latency.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use consumer_core::transport::{Acknowledger, Incoming, Settlement, TransportError};
use futures::future::BoxFuture;

/// Whether the framework arms record each delivery's latency (8 bytes a message: off for the
/// long RSS runs, where that vector would be the growth seen).
pub(crate) static RECORD_LATENCY: AtomicBool = AtomicBool::new(true);

/// What the timed deliveries of an arm record, shared by all of them: the latency of each
/// sampled delivery ([`sampled`]), in a slot taken by number, so recording one takes no lock.
pub(crate) struct Acks {
    /// A slot a sampled settlement (none if latencies are not recorded).
    latencies: Vec<AtomicU64>,
    /// Deliveries handed out so far (sampled or not).
    handed: AtomicU64,
    /// Slots taken so far.
    recorded: AtomicUsize,
}

impl Acks {
    /// The record of an arm of `n` messages.
    pub(crate) fn new(n: usize) -> Arc<Acks> {
        let slots = if RECORD_LATENCY.load(Ordering::Relaxed) {
            n
        } else {
            0
        };
        Arc::new(Acks {
            latencies: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            handed: AtomicU64::new(0),
            recorded: AtomicUsize::new(0),
        })
    }

    /// Whether the next delivery handed out is one to time.
    fn sample_next(&self) -> bool {
        !self.latencies.is_empty() && sampled(self.handed.fetch_add(1, Ordering::Relaxed))
    }

    /// A delivery handed out at `delivered` has settled.
    fn settled(&self, delivered: Instant) {
        self.all_settled(&[delivered]);
    }

    /// Deliveries handed out at `delivered` have settled together: one clock read for them
    /// all, as the hand-written arms time a whole batch.
    fn all_settled(&self, delivered: &[Instant]) {
        let first = self.recorded.fetch_add(delivered.len(), Ordering::Relaxed);
        let now = Instant::now();
        for (slot, at) in self.latencies[first.min(self.latencies.len())..]
            .iter()
            .zip(delivered)
        {
            let latency = now.saturating_duration_since(*at).as_micros();
            slot.store(
                u64::try_from(latency).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
    }

    /// The latencies recorded (an arm reads them once, when it is over).
    pub(crate) fn latencies(&self) -> Vec<u64> {
        let recorded = self.recorded.load(Ordering::Acquire);
        self.latencies
            .iter()
            .take(recorded)
            .map(|l| l.load(Ordering::Relaxed))
            .collect()
    }
}

/// Whether the delivery an arm hands out `seq`th (from 0) is one whose latency it records:
/// one in 16, picked by a multiplicative hash of `seq` so that the sampled ones fall at no
/// fixed place in a batch. A timed delivery costs its arm an allocation (the wrapper of its
/// acknowledger, [`Timed`]) that the framework itself does not make; sampled, that costs the
/// framework's arms about what the hand-written batched arms pay for their timing (one clock
/// read a batch), instead of one allocation a message on top of the framework's work.
fn sampled(seq: u64) -> bool {
    seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60 == 0
}

/// Records delivery-to-ack latency around any acknowledger, for a sampled delivery
/// ([`timed`]). A settlement its acknowledger applies at once (a Kafka ack) is recorded at
/// once, with nothing boxed. A batch settled together is timed together, with one clock read:
/// whole when its first acknowledger is timed; otherwise the transport's
/// [`consumer_core::transport::ack_together`] acks the timed ones apart, as a second run of the
/// batch.
struct Timed {
    inner: Box<dyn Acknowledger>,
    delivered: Instant,
    acks: Arc<Acks>,
}

impl Acknowledger for Timed {
    fn settle(self: Box<Self>, s: Settlement) -> BoxFuture<'static, Result<(), TransportError>> {
        use futures::FutureExt as _;
        let Timed {
            inner,
            delivered,
            acks,
        } = *self;
        let mut settling = inner.settle(s);
        match (&mut settling).now_or_never() {
            Some(result) => {
                acks.settled(delivered);
                match result {
                    Ok(()) => consumer_core::transport::settled_now(),
                    Err(e) => Box::pin(std::future::ready(Err(e))),
                }
            }
            None => Box::pin(async move {
                let result = settling.await;
                acks.settled(delivered);
                result
            }),
        }
    }

    /// Passes the batch on to the acknowledgers it wraps, so that their transport acks them
    /// together as it would unwrapped, and records each one's latency when that is done.
    fn ack_with(
        self: Box<Self>,
        others: Vec<Box<dyn Acknowledger>>,
    ) -> BoxFuture<'static, consumer_core::transport::AckResults> {
        use futures::FutureExt as _;
        let Timed {
            inner,
            delivered,
            acks,
        } = *self;
        let mut times = Vec::with_capacity(1 + others.len());
        times.push(delivered);
        let inners = others
            .into_iter()
            .map(
                |other| match consumer_core::transport::downcast_acker::<Timed>(other) {
                    Ok(timed) => {
                        times.push(timed.delivered);
                        timed.inner
                    }
                    Err(untimed) => untimed,
                },
            )
            .collect();
        let mut acking = inner.ack_with(inners);
        let timed = move |results: consumer_core::transport::AckResults| {
            acks.all_settled(&times);
            results
        };
        match (&mut acking).now_or_never() {
            Some(results) => Box::pin(std::future::ready(timed(results))),
            None => Box::pin(acking.map(timed)),
        }
    }

    /// As the acknowledger it wraps: a timed dead letter is kept where it would be.
    fn keeps_dead_letters(&self) -> bool {
        self.inner.keeps_dead_letters()
    }
}

/// Wraps a delivery as it is handed to the consumer, if it is one to time ([`sampled`]).
pub(crate) fn timed(incoming: Incoming, acks: &Arc<Acks>) -> Incoming {
    if !acks.sample_next() {
        return incoming;
    }
    Incoming {
        delivery: incoming.delivery,
        acker: Box::new(Timed {
            inner: incoming.acker,
            delivered: Instant::now(),
            acks: acks.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One delivery in 16 is timed, and they fall evenly over the places in a batch of 64
    /// (or of any other size): no place is timed much more often than another.
    #[test]
    fn one_delivery_in_sixteen_is_timed_at_every_place_in_a_batch() {
        let n = 64 * 4096;
        let timed = (0..n).filter(|&seq| sampled(seq)).count();
        assert!(
            (n / 16 - n / 256..=n / 16 + n / 256).contains(&(timed as u64)),
            "{timed}"
        );
        for batch in [64u64, 50, 16, 8] {
            let mut places = vec![0u64; batch as usize];
            for seq in (0..n).filter(|&seq| sampled(seq)) {
                places[(seq % batch) as usize] += 1;
            }
            let even = n / 16 / batch;
            for (place, &count) in places.iter().enumerate() {
                assert!(
                    count > even / 2 && count < even * 3 / 2,
                    "batch {batch}: place {place} timed {count} times, {even} expected"
                );
            }
        }
    }

    /// Only the sampled deliveries take a slot, each its own, and an arm reads back those
    /// that settled.
    #[test]
    fn the_sampled_deliveries_settled_are_the_latencies_read() {
        let acks = Acks::new(1000);
        let picked = (0..1000).filter(|_| acks.sample_next()).count();
        assert_eq!(picked, (0..1000).filter(|&seq| sampled(seq)).count());
        let at = Instant::now();
        acks.settled(at);
        acks.all_settled(&[at, at]);
        assert_eq!(acks.latencies().len(), 3);
    }
}
