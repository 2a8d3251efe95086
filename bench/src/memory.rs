//! The in-memory broker's arms (`memory:`): a hand-written consumer, and the framework in
//! both modes. Each arm fills a broker of its own before its clock starts.

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::transport::Settlement;
use consumer_core::{BatchConfig, Handler, Inbox};
use futures::StreamExt;
use sqlx::{PgPool, Postgres};

use crate::framework::{bench_worker, ensure_completed};
use crate::measure::{Clock, Figures};
use crate::postgres::{hand_one, payload, Job};
use crate::timing::{timed, Acks};
use crate::Options;

/// Publishes the arm's `o.messages` jobs, from `first` on, to `queue` of `broker`.
fn fill(broker: &MemoryBroker, queue: &str, first: u64, o: &Options) {
    for id in first..first + o.messages as u64 {
        broker.publish(
            queue,
            Message {
                id: Some(format!("m-{id}")),
                payload: payload(id, o.size).into(),
                ..Message::default()
            },
        );
    }
}

/// A hand-written consumer of the in-memory broker: one transaction per message, then ack.
pub(crate) async fn hand_written(
    pool: &PgPool,
    first: u64,
    o: &Options,
) -> anyhow::Result<Figures> {
    let broker = MemoryBroker::new();
    fill(&broker, "q", first, o);
    let acks = Acks::new(o.messages);
    let clock = Clock::start();
    let consumer = broker.consume("q").take(o.messages);
    let work = consumer.map(|incoming| {
        let pool = pool.clone();
        let acks = acks.clone();
        async move {
            let incoming = timed(incoming?, &acks);
            let job: Job = serde_json::from_slice(&incoming.delivery.payload)?;
            let key = incoming.delivery.message_id.as_deref().unwrap_or_default();
            hand_one(&pool, key, &job).await?;
            incoming.acker.settle(Settlement::Ack).await?;
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = work.buffer_unordered(o.concurrency).collect().await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    let stopped = clock.stop();
    Ok(stopped.figures(o.messages, &mut acks.latencies()))
}

/// The framework on the in-memory broker.
pub(crate) async fn framework<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    first: u64,
    o: &Options,
    batch: Option<BatchConfig>,
) -> anyhow::Result<Figures> {
    let broker = MemoryBroker::new();
    fill(&broker, "q", first, o);
    let acks = Acks::new(o.messages);
    let worker = bench_worker(inbox, handler, o, batch)?;
    let clock = Clock::start();
    let a2 = acks.clone();
    let consumer = broker.consume("q").map(move |r| r.map(|i| timed(i, &a2)));
    worker.run(consumer, broker.drained("q")).await?;
    let stopped = clock.stop();
    ensure_completed(o, &worker.snapshot())?;
    Ok(stopped.figures(o.messages, &mut acks.latencies()))
}
