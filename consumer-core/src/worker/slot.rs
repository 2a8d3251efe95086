//! A batch's hold on one of the worker's concurrency slots, and when it gives it back.

use tokio::sync::OwnedSemaphorePermit;

/// A batch's hold on one of the worker's concurrency slots (see
/// [`WorkerConfig::concurrency`](super::WorkerConfig::concurrency)).
///
/// The slots bound the batches being worked on: prepared, claimed, run and committed. A batch
/// gives its slot back once its outcomes are durable, before it settles them: a settlement
/// waits on the broker (a RabbitMQ ack is a round trip, and the acks of one channel are sent
/// one at a time), and a slot held through that wait would idle the handlers while the
/// deliveries behind it are ready to run. The deliveries waiting on their settlements are
/// bounded by the transport instead (RabbitMQ's prefetch, a Kafka partition's buffer). A
/// retry's settlement also records its copy in the inbox, so the database may see a few
/// more connections than there are slots while retries settle.
///
/// A batch whose jobs still have to run after its settlement (the second copy of a key it
/// held twice) keeps its slot until they ran: they run within it, one by one.
pub(super) struct Slot(Option<OwnedSemaphorePermit>);

impl Slot {
    /// The hold of a batch that took `permit`.
    pub(super) fn held(permit: OwnedSemaphorePermit) -> Slot {
        Slot(Some(permit))
    }

    /// The hold of work that runs within its caller's slot: nothing to give back.
    pub(super) fn kept_by_caller() -> Slot {
        Slot(None)
    }

    /// Frees the slot for the next batch.
    pub(super) fn give_back(&mut self) {
        self.0 = None;
    }
}
