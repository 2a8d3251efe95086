//! The invoice job on the embedded default: an in-memory broker and an SQLite inbox in a
//! temporary directory. Nothing to install but cargo.
//!
//! Run with:
//!
//! ```text
//! cargo run -p quickstart
//! ```
//!
//! It publishes invoice jobs, republishes some of them (the broker's at-least-once delivery
//! in miniature), adds one poison job whose handler always fails, crashes the worker once
//! after a commit but before the ack and once before a commit, restarts it each time, and
//! prints a tally. It exits non-zero if the effects differ from the unique jobs.

// A command-line tally is this program's output.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::stats::StatsSnapshot;
use consumer_core::{
    handler, Context, Error, FlagGuard, HandlerError, Inbox, Worker, WorkerConfig,
};
use serde::Deserialize;
use sqlx::Sqlite;

const QUEUE: &str = "invoices";
const ORDERS: i64 = 20;
const REPUBLISHED: i64 = 5;
/// This order's invoice always fails: it ends in the dead-letter list after 3 attempts.
const POISON_ORDER: i64 = 999;

/// An invoice job: `{"order_id", "amount", "email"}`.
#[derive(Debug, Deserialize)]
struct InvoiceJob {
    order_id: i64,
    amount: i64,
    email: String,
}

/// Creates the invoice and, once per order, records the "invoice ready" email. Both writes
/// commit with the inbox entry, so a redelivery can repeat neither.
#[handler(
    name = "send_invoice",
    key = "invoice-{order_id}",
    max_attempts = 3,
    backoff = "20ms..200ms"
)]
async fn send_invoice(ctx: &mut Context<'_, Sqlite>, job: InvoiceJob) -> Result<(), HandlerError> {
    if job.order_id == POISON_ORDER {
        return Err(HandlerError::transient(format!(
            "order {} does not exist",
            job.order_id
        )));
    }
    sqlx::query("INSERT INTO invoices (order_id, amount) VALUES (?1, ?2)")
        .bind(job.order_id)
        .bind(job.amount)
        .execute(ctx.db())
        .await?;
    // The guard: whichever attempt commits first sets the flag; any other sees `false`.
    let invoice_sent = FlagGuard::new("orders", "invoice_sent", "id")?;
    if invoice_sent.set(ctx, job.order_id).await? {
        let idempotency_key = ctx.idempotency_key("invoice-email");
        sqlx::query("INSERT INTO emails (order_id, address, idempotency_key) VALUES (?1, ?2, ?3)")
            .bind(job.order_id)
            .bind(&job.email)
            .bind(idempotency_key)
            .execute(ctx.db())
            .await?;
    }
    Ok(())
}

fn job(order_id: i64) -> Message {
    Message::json(
        format!("msg-{order_id}"),
        &serde_json::json!({
            "order_id": order_id,
            "amount": 100 * order_id,
            "email": format!("customer{order_id}@example.com"),
        }),
    )
}

async fn count(inbox: &Inbox<Sqlite>, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(inbox.pool()).await?)
}

fn add(total: &mut StatsSnapshot, s: StatsSnapshot) {
    total.received += s.received;
    total.handler_runs += s.handler_runs;
    // A duplicate of a message whose retry copy is pending is superseded by that copy.
    total.duplicates += s.duplicates + s.superseded;
    total.retries += s.retries;
    total.dead_lettered += s.dead_lettered;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,consumer_core=error".into()),
        )
        .init();

    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let inbox = Inbox::open_sqlite(dir.path().join("quickstart.db")).await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, invoice_sent BOOLEAN NOT NULL DEFAULT false);
         CREATE TABLE invoices (order_id INTEGER NOT NULL, amount INTEGER NOT NULL);
         CREATE TABLE emails (order_id INTEGER NOT NULL, address TEXT NOT NULL, idempotency_key TEXT NOT NULL);",
    )
    .execute(inbox.pool())
    .await?;
    for id in (1..=ORDERS).chain([POISON_ORDER]) {
        sqlx::query("INSERT INTO orders (id) VALUES (?1)")
            .bind(id)
            .execute(inbox.pool())
            .await?;
    }

    let broker = MemoryBroker::new();
    let mut published = 0;
    for id in 1..=ORDERS {
        broker.publish(QUEUE, job(id));
        published += 1;
    }
    // At-least-once in miniature: the same messages again, same message ids.
    for id in 1..=REPUBLISHED {
        broker.publish(QUEUE, job(id));
        published += 1;
    }
    broker.publish(QUEUE, job(POISON_ORDER));
    published += 1;

    // Crash once after order 3's commit (before its ack) and once before order 7's commit.
    let crashes = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [
            (FaultPoint::AfterCommit, "invoice-3".to_owned()),
            (FaultPoint::BeforeCommit, "invoice-7".to_owned()),
        ],
    ));
    let config = WorkerConfig::default()
        .with_concurrency(4)
        .with_faults(crashes.clone());

    let mut total = StatsSnapshot::default();
    let mut restarts = 0;
    loop {
        let worker = Worker::with_config(inbox.clone(), send_invoice, config.clone())?;
        let drained = broker.drained(QUEUE);
        let result = worker.run(broker.consume(QUEUE), drained).await;
        add(&mut total, worker.snapshot());
        match result {
            Ok(()) if broker.depth(QUEUE).is_drained() => break,
            Ok(()) => {}
            Err(Error::Crashed(point)) => {
                restarts += 1;
                println!(
                    "worker crashed at {point}; restarting (unacked messages are redelivered)"
                );
            }
            Err(e) => return Err(e.into()),
        }
        if restarts > 10 {
            bail!("too many restarts");
        }
    }
    // Let the drained signal settle the last acks (`drained` fires once nothing is in flight).
    tokio::time::timeout(Duration::from_secs(5), broker.drained(QUEUE)).await?;

    let unique = ORDERS;
    let invoices = count(&inbox, "SELECT count(*) FROM invoices").await?;
    let distinct_invoices = count(&inbox, "SELECT count(DISTINCT order_id) FROM invoices").await?;
    let emails = count(&inbox, "SELECT count(*) FROM emails").await?;
    let dead = broker.dead_letters(QUEUE);

    println!();
    println!("{:<28}{:>6}", "published", published);
    println!("{:<28}{:>6}", "unique jobs", unique);
    println!("{:<28}{:>6}", "poison jobs", 1);
    println!("{:<28}{:>6}", "worker crashes (simulated)", crashes.fired());
    println!("{:<28}{:>6}", "deliveries", total.received);
    println!("{:<28}{:>6}", "handler runs", total.handler_runs);
    println!("{:<28}{:>6}", "invoices created", invoices);
    println!("{:<28}{:>6}", "emails recorded", emails);
    println!("{:<28}{:>6}", "duplicates skipped", total.duplicates);
    println!("{:<28}{:>6}", "retries", total.retries);
    println!("{:<28}{:>6}", "dead-lettered", dead.len());
    for d in &dead {
        println!(
            "  dead letter: key={} reason={} attempts={} error={}",
            d.dead_letter.key.as_deref().unwrap_or("-"),
            d.dead_letter.reason,
            d.dead_letter.attempts,
            d.dead_letter.error
        );
    }

    let ok = invoices == unique
        && distinct_invoices == unique
        && emails == unique
        && dead.len() == 1
        && crashes.fired() == 2;
    if !ok {
        bail!("effects differ from unique jobs: {invoices} invoices, {emails} emails for {unique} jobs");
    }
    println!("\nOK: every job's effects happened exactly once.");
    Ok(())
}
