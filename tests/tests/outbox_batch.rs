//! A batch function's `BatchContext::publish_all` on PostgreSQL (one statement for the
//! batch) writes the same outbox rows, with the same ids and in the same order, as
//! `Context::publish` of each message when the messages run alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::outbox::OutboxMessage;
use consumer_core::{
    BatchConfig, BatchContext, Context, Handler, HandlerError, HandlerOptions, Inbox, Worker,
    WorkerConfig,
};
use consumer_tests::common::PgEnv;
use futures::future::BoxFuture;
use serde_json::{json, Value};
use sqlx::Postgres;

/// Publishes two events a job: alone through `Context::publish`, in a batch through one
/// `BatchContext::publish_all`; counts the batches that wrote them.
#[derive(Clone)]
struct TwoEvents {
    batches: bool,
    batches_written: Arc<AtomicUsize>,
}

/// Job `job`'s `n`th event, keyed by the job.
fn event(job: &Value, n: u32) -> OutboxMessage {
    let id = job["id"].as_str().expect("an id").to_owned();
    OutboxMessage::json("events", &json!({"job": id, "n": n}))
        .expect("json")
        .key(id)
}

impl Handler<Postgres> for TwoEvents {
    type Message = Value;

    fn options(&self) -> HandlerOptions {
        HandlerOptions::new("two_events")
    }

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut Context<'c, Postgres>,
        job: Value,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            for n in 0..2 {
                ctx.publish(event(&job, n)).await?;
            }
            Ok(())
        })
    }

    fn handles_batches(&self) -> bool {
        self.batches
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        ctx: &'a mut BatchContext<'c, Postgres>,
        jobs: Vec<Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let events = jobs
                .iter()
                .enumerate()
                .flat_map(|(i, job)| (0..2).map(move |n| (i, event(job, n))));
            let ids = ctx.publish_all(events).await?;
            assert_eq!(ids.len(), 2 * jobs.len());
            self.batches_written.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
}

/// The outbox's rows in id order: message id, ordering key, headers, payload.
async fn outbox_rows(inbox: &Inbox<Postgres>) -> Vec<(String, Option<String>, String, Vec<u8>)> {
    let sql = format!(
        "SELECT message_id, ordering_key, headers, payload FROM {} ORDER BY id",
        inbox.outbox().table()
    );
    sqlx::query_as(&sql)
        .fetch_all(inbox.pool())
        .await
        .expect("read the outbox")
}

/// Runs jobs `a`, `b` and `c` through `TwoEvents` in batches of up to 8 (or one by one);
/// the outbox's rows, and how many batches wrote them.
async fn run(batches: bool) -> (Vec<(String, Option<String>, String, Vec<u8>)>, usize) {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let broker = MemoryBroker::new();
    for id in ["a", "b", "c"] {
        broker.publish("q", Message::json(id, &json!({"id": id})));
    }
    let handler = TwoEvents {
        batches,
        batches_written: Arc::default(),
    };
    let config = WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_batch(Some(BatchConfig::new(8, Duration::from_millis(200))));
    let worker = Worker::with_config(inbox.clone(), handler.clone(), config).expect("worker");
    tokio::time::timeout(
        Duration::from_secs(60),
        worker.run(broker.consume("q"), broker.drained("q")),
    )
    .await
    .expect("the queue drains in time")
    .expect("the worker runs");
    assert_eq!(worker.snapshot().batch_reruns, 0, "no batch failed");
    let written = handler.batches_written.load(Ordering::Relaxed);
    (outbox_rows(&inbox).await, written)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batchs_publish_all_writes_the_rows_and_ids_its_messages_write_alone() {
    let (alone, none) = run(false).await;
    let (batched, written) = run(true).await;
    assert_eq!(none, 0);
    assert!(written >= 1, "a batch wrote the events");
    assert_eq!(alone.len(), 6, "{alone:?}");
    assert_eq!(batched, alone);
}
