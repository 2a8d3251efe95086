//! A worker keeps the connections its transactions release clean and reuses them for its
//! next ones, without the pool's two checks a checkout (a ping out, a ping back). It gives
//! them back to the pool when the pool has no other idle one, when it stops, when it has
//! left them unused for a second, and after a database error on one.
//!
//! Against real PostgreSQL (a fresh schema), per-message mode, the memory broker.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, Context, HandlerError, Inbox, Worker, WorkerConfig};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::{PgPool, Postgres};
use tokio::sync::oneshot;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

/// Records the server process its transaction ran on.
#[handler(name = "pids", backoff = "50ms..100ms")]
async fn pids(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO pids (job_id, pid) VALUES ($1, pg_backend_pid())")
        .bind(&job.id)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// A schema with the `pids` table, and an inbox on a pool of `max` connections, all of
/// them opened first (so the pool has idle ones to hand out in turn).
async fn setup(max: u32) -> (PgEnv, Inbox<Postgres>, PgPool) {
    let env = PgEnv::new().await;
    let pool = env.pool(max).await;
    sqlx::query("CREATE TABLE pids (job_id TEXT NOT NULL, pid INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let opened: Vec<_> = futures::future::try_join_all((0..max).map(|_| pool.acquire()))
        .await
        .unwrap();
    drop(opened);
    common::wait_until("the pool's connections idle", || async {
        pool.num_idle() == max as usize
    })
    .await;
    let inbox = Inbox::new(
        pool.clone(),
        consumer_core::InboxConfig::in_schema(env.schema.clone()),
    )
    .await
    .unwrap();
    (env, inbox, pool)
}

/// A worker of `concurrency` on a new queue of its own memory broker, running until
/// [`Running::finish`].
struct Running {
    broker: MemoryBroker,
    queue: String,
    worker: Worker<Postgres, pids>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(inbox: Inbox<Postgres>, concurrency: usize) -> Running {
        let (broker, queue) = (MemoryBroker::new(), common::unique("q"));
        let config = WorkerConfig::default()
            .with_concurrency(concurrency)
            .with_retention_interval(None)
            .with_inbox_gauge_interval(None)
            .with_jitter(Arc::new(NoJitter));
        let worker = Worker::with_config(inbox, pids, config).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let (w, consume) = (worker.clone(), broker.consume(&queue));
        let task = tokio::spawn(async move {
            w.run(consume, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        Running {
            broker,
            queue,
            worker,
            stop,
            task,
        }
    }

    /// Publishes one job and waits until the worker's `completed` reaches `n`.
    async fn one(&self, n: u64) {
        let id = common::unique("job");
        let message = Message::json(id.as_str(), &json!({ "id": id }));
        self.broker.publish(&self.queue, message);
        common::wait_until("the job completed", || async {
            self.worker.snapshot().completed == n
        })
        .await;
    }

    /// Stops the worker and waits for its run to end.
    async fn finish(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap();
    }
}

/// The distinct server processes the jobs ran on.
async fn distinct_pids(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT pid) FROM pids")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_message_after_another_reuses_the_same_connection() {
    let (_env, inbox, pool) = setup(4).await;
    let run = Running::start(inbox, 1);
    for n in 1..=5 {
        run.one(n).await;
    }
    // The pool hands its four idle connections out in turn; the worker kept its own.
    assert_eq!(distinct_pids(&pool).await, 1);
    run.finish().await;
}

#[tokio::test]
async fn a_pool_without_room_gets_its_connection_back_at_once() {
    let (_env, inbox, pool) = setup(1).await;
    let run = Running::start(inbox, 1);
    run.one(1).await;
    // The pool's only connection was not kept: someone else gets it well before a kept one
    // would go back unused (`Kept::IDLE`, a second).
    let conn = tokio::time::timeout(Duration::from_millis(500), pool.acquire()).await;
    assert!(matches!(conn, Ok(Ok(_))), "the pool's connection was held");
    drop(conn);
    run.finish().await;
}

#[tokio::test]
async fn kept_connections_go_back_to_the_pool_when_left_unused_and_when_the_worker_stops() {
    let (_env, inbox, pool) = setup(4).await;
    let run = Running::start(inbox.clone(), 2);
    run.one(1).await;
    // Left unused, the kept connection goes back within a second or two.
    common::wait_until("every connection idle in the pool", || async {
        pool.num_idle() == 4
    })
    .await;
    run.finish().await;

    // A worker that stops gives back what it kept, at once.
    let run = Running::start(inbox, 2);
    run.one(1).await;
    run.finish().await;
    common::wait_for(
        "every connection idle in the pool",
        Duration::from_millis(500),
        || async { pool.num_idle() == 4 },
    )
    .await;
}

#[tokio::test]
async fn a_kept_connection_the_server_closed_costs_one_retry() {
    let (_env, inbox, pool) = setup(4).await;
    let run = Running::start(inbox, 1);
    run.one(1).await;
    let pid: i32 = sqlx::query_scalar("SELECT pid FROM pids")
        .fetch_one(&pool)
        .await
        .unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended);
    // The next job meets the closed connection (unless it was given back meanwhile), is
    // retried once on another, and that one is not the closed one again.
    run.one(2).await;
    let s = run.worker.snapshot();
    assert!(s.db_errors <= 1, "{s:?}");
    run.finish().await;
}
