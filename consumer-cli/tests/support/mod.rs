//! What the `consumer` tests share: running the binary, the [`orders`] handler and its
//! five dead letters, and waiting for replayed keys to complete.

#![allow(dead_code)]

use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::{handler, Context, HandlerError, Inbox};
use consumer_tests::amqp::{self, config, init_tracing, wait_for, worker_config, Rabbit, Running};
use consumer_tests::common::PgEnv;
use serde::Deserialize;
use serde_json::Value;
use sqlx::Postgres;

/// The cause of the `rejected` jobs' failures: a test fixes it before it replays them.
pub(crate) static FIXED: AtomicBool = AtomicBool::new(false);

/// The name of [`orders`].
pub(crate) const HANDLER: &str = "cli_orders";

/// A job of [`orders`]: `kind` `rejected` fails for good until [`FIXED`], `flaky` fails
/// for a while every time, any other kind writes its ledger row.
#[derive(Debug, Deserialize)]
pub(crate) struct Job {
    id: String,
    kind: String,
}

/// The handler whose dead letters the tests list, show, replay and discard.
#[handler(name = "cli_orders", max_attempts = 2, backoff = "200ms..1s")]
pub(crate) async fn orders(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    match job.kind.as_str() {
        "rejected" if !FIXED.load(Ordering::SeqCst) => Err(HandlerError::permanent(format!(
            "order {} rejected by the provider",
            job.id
        ))),
        "flaky" => Err(HandlerError::transient(format!(
            "order {} timed out after 30s",
            job.id
        ))),
        _ => {
            sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
                .bind(&job.id)
                .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
                .execute(ctx.db())
                .await?;
            Ok(())
        }
    }
}

/// Runs `consumer ARGS` as a process with the servers' environment plus `env`, and shows
/// what it printed in the test's output.
pub(crate) async fn consumer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_consumer"));
    command.args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the command's task")
        .expect("run consumer");
    eprintln!(
        "$ consumer {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `consumer ARGS --json`, which must succeed: its JSON result.
pub(crate) async fn json_of(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = consumer(&args, env).await;
    assert!(out.status.success(), "consumer {args:?} failed");
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// A worker of [`orders`] on a fresh queue and schema that has dead-lettered five messages
/// for two reasons: three `rejected` (`permanent_error`) and two `flaky`
/// (`max_attempts_exceeded`), all in the DLQ.
pub(crate) struct FiveDeadLetters {
    pub(crate) pg: PgEnv,
    pub(crate) cfg: consumer_amqp::AmqpConfig,
    pub(crate) dlq: String,
    pub(crate) inbox: consumer_core::Inbox<Postgres>,
    pub(crate) running: Running<orders>,
    pub(crate) publisher: consumer_amqp::AmqpPublisher,
    pub(crate) rejected: Vec<String>,
    pub(crate) flaky: Vec<String>,
}

impl FiveDeadLetters {
    /// Runs the worker on a queue named after `prefix` and waits for the five dead letters.
    pub(crate) async fn new(prefix: &str) -> Self {
        init_tracing();
        let pg = PgEnv::new().await;
        let cfg = config(&amqp::unique_name(prefix));
        let dlq = cfg.dead_letter_queue_name();
        let inbox = pg.inbox().await;
        let worker = consumer_core::Worker::with_config(inbox.clone(), orders, worker_config(4))
            .expect("the worker");
        let running = Running::start(worker, cfg.clone()).await;
        let rejected: Vec<String> = (0..3).map(|i| format!("{}-r{i}", cfg.queue)).collect();
        let flaky: Vec<String> = (0..2).map(|i| format!("{}-f{i}", cfg.queue)).collect();
        let publisher = consumer_amqp::AmqpPublisher::connect(cfg.clone())
            .await
            .expect("a publisher");
        for (ids, kind) in [(&rejected, "rejected"), (&flaky, "flaky")] {
            for id in ids {
                publisher
                    .publish_json(&cfg.queue, id, &serde_json::json!({"id": id, "kind": kind}))
                    .await
                    .expect("publish");
            }
        }
        wait_for("5 dead letters", Duration::from_secs(60), || async {
            Rabbit::ready(&dlq).await == 5
        })
        .await;
        FiveDeadLetters {
            pg,
            cfg,
            dlq,
            inbox,
            running,
            publisher,
            rejected,
            flaky,
        }
    }
}

/// Waits, up to `limit`, until every key of `ids` is completed under `handler` in `inbox`;
/// panics naming the keys if one is not by then.
pub(crate) async fn wait_completed(
    inbox: &Inbox<Postgres>,
    handler: &str,
    ids: &[String],
    limit: Duration,
) {
    let what = format!("{handler}'s keys {} completed", ids.join(", "));
    wait_for(&what, limit, || async {
        for id in ids {
            let e = inbox.entry(handler, id).await.expect("read the key's row");
            if e.map(|e| e.status) != Some(EntryStatus::Completed) {
                return false;
            }
        }
        true
    })
    .await;
}
