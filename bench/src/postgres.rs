//! The work every arm does in PostgreSQL, the same rows whoever writes them: for each
//! message (a [`Job`], as [`payload`] writes it), an inbox row and an effect row. The
//! framework writes them through the bench's handler ([`record`]; [`record_each`] without its
//! batch function), the hand-written consumers with a transaction of their own a message or a
//! batch ([`hand_one`], [`hand_batch`]), and the `db floor` arms with no broker at all
//! ([`db_floor`]). [`reset`] empties the tables between arms.

use std::time::Duration;

use consumer_core::{handler, BatchContext, Context, HandlerError};
use futures::StreamExt;
use serde::Deserialize;
use sqlx::{PgPool, Postgres};

use crate::measure::{Clock, Figures};
use crate::Options;

/// A message of the bench, as [`payload`] writes it.
#[derive(Debug, Deserialize)]
pub(crate) struct Job {
    /// Its number: its effect row's `job_id`.
    pub(crate) id: u64,
    /// Its body (`--size` bytes).
    body: String,
}

/// Job `id`'s payload, with a body of `size` bytes: what the arms' queues are filled with.
pub(crate) fn payload(id: u64, size: usize) -> String {
    serde_json::json!({"id": id, "body": "x".repeat(size)}).to_string()
}

/// The bench's handler: one effect row per job. In batched mode its batch function writes a
/// batch's rows with one statement.
#[handler(name = "bench", retention = "1h", batch = "record_batch")]
pub(crate) async fn record(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
        .bind(i64::try_from(job.id).unwrap_or(i64::MAX))
        .bind(&job.body)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// `record`'s batch function: the same rows, one `INSERT ... SELECT FROM unnest` a batch.
pub(crate) async fn record_batch(
    ctx: &mut BatchContext<'_, Postgres>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, bodies): (Vec<i64>, Vec<String>) = jobs
        .into_iter()
        .map(|j| (i64::try_from(j.id).unwrap_or(i64::MAX), j.body))
        .unzip();
    sqlx::query(
        "INSERT INTO effects (job_id, body) SELECT * FROM unnest($1::bigint[], $2::text[])",
    )
    .bind(ids)
    .bind(bodies)
    .execute(ctx.db())
    .await?;
    Ok(())
}

/// `record` without a batch function: batched mode then calls it once per message, in the
/// batch's transaction.
#[handler(name = "bench", retention = "1h")]
pub(crate) async fn record_each(
    ctx: &mut Context<'_, Postgres>,
    job: Job,
) -> Result<(), HandlerError> {
    record::call(ctx, job).await
}

/// The batch window of the batched arms (framework and hand-written alike).
pub(crate) const BATCH_WAIT: Duration = Duration::from_millis(5);

/// Empties the tables the arms write (the effects, the floor's inbox, the framework's inbox
/// and outbox), before every arm.
pub(crate) async fn reset(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "TRUNCATE effects; TRUNCATE floor_inbox; TRUNCATE consumer_inbox; \
         TRUNCATE consumer_inbox_outbox;",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// What a `db floor` arm writes in each of its transactions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Floor {
    /// Messages a transaction.
    per_tx: usize,
    /// The effects inserted one statement a message (as a handler called once a message
    /// does) rather than one statement a transaction; the inbox rows still in one.
    effect_per_message: bool,
    /// Also one outbox event a message, with the framework's statement
    /// ([`OUTBOX_INSERT_ALL`]): what the handler side of the `+ outbox` arms writes at best,
    /// before any relay reads, publishes or deletes it.
    event: bool,
}

impl Floor {
    /// `per_tx` messages a transaction, the effects in one statement, no event.
    pub(crate) fn new(per_tx: usize) -> Self {
        Floor {
            per_tx,
            effect_per_message: false,
            event: false,
        }
    }

    /// The effects one statement a message.
    pub(crate) fn statement_per_message(self) -> Self {
        Floor {
            effect_per_message: true,
            ..self
        }
    }

    /// Also an outbox event a message.
    pub(crate) fn with_event(self) -> Self {
        Floor {
            event: true,
            ..self
        }
    }
}

/// The framework's statement for a batch of outbox rows (`Context::publish_all`), so the
/// floor's event costs what the framework's does.
const OUTBOX_INSERT_ALL: &str =
    "INSERT INTO consumer_inbox_outbox (message_id, destination, ordering_key, headers, payload) \
     SELECT m, d, k, h, p FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], \
     $5::bytea[]) WITH ORDINALITY AS r(m, d, k, h, p, n) ORDER BY n";

/// The floor: inbox insert plus effect insert per message (and the event, with
/// [`Floor::event`]), [`Floor::per_tx`] messages a transaction.
pub(crate) async fn db_floor(
    pool: &PgPool,
    first: u64,
    o: &Options,
    floor: Floor,
) -> anyhow::Result<Figures> {
    let Floor {
        per_tx,
        effect_per_message,
        event,
    } = floor;
    let clock = Clock::start();
    let ids: Vec<u64> = (first..first + o.messages as u64).collect();
    let body = "x".repeat(o.size);
    // The same concurrency as the framework arms, so neither side is starved of connections.
    let chunks: Vec<Vec<u64>> = ids.chunks(per_tx).map(<[u64]>::to_vec).collect();
    let work = futures::stream::iter(chunks).map(|chunk| {
        let pool = pool.clone();
        let body = body.clone();
        async move {
            let mut tx = pool.begin().await?;
            let keys: Vec<String> = chunk.iter().map(|id| format!("m-{id}")).collect();
            let job_ids: Vec<i64> = chunk.iter().map(|id| *id as i64).collect();
            sqlx::query(
                "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
                 SELECT 'bench', k, 'h', 'completed', 1 FROM unnest($1::text[]) AS k \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&keys)
            .execute(&mut *tx)
            .await?;
            if effect_per_message {
                for id in &job_ids {
                    sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
                        .bind(id)
                        .bind(&body)
                        .execute(&mut *tx)
                        .await?;
                }
            } else {
                sqlx::query(
                    "INSERT INTO effects (job_id, body) SELECT j, $2 FROM unnest($1::bigint[]) AS j",
                )
                .bind(&job_ids)
                .bind(&body)
                .execute(&mut *tx)
                .await?;
            }
            if event {
                insert_events(&mut tx, &job_ids).await?;
            }
            tx.commit().await?;
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = work.buffer_unordered(o.concurrency).collect().await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    Ok(clock.figures(o.messages, &mut []))
}

/// Writes the events of `job_ids` to the outbox in `tx`, as the `+ outbox` arms' handler
/// does (the same message ids, keys, headers and JSON bodies), in one statement.
async fn insert_events(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    job_ids: &[i64],
) -> anyhow::Result<()> {
    let column = |f: &dyn Fn(i64) -> String| job_ids.iter().map(|&j| f(j)).collect::<Vec<_>>();
    let message_ids = column(&|j| format!("floor-event-{j}"));
    let destinations = column(&|_| "bench_floor_events".to_owned());
    let keys = column(&|j| format!("job-{j}"));
    let headers = column(&|_| r#"{"content-type":"application/json"}"#.to_owned());
    let bodies: Vec<Vec<u8>> = job_ids
        .iter()
        .map(|j| serde_json::json!({ "job_id": j }).to_string().into_bytes())
        .collect();
    sqlx::query(OUTBOX_INSERT_ALL)
        .bind(&message_ids)
        .bind(&destinations)
        .bind(&keys)
        .bind(&headers)
        .bind(&bodies)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A hand-written per-message consumer's transaction: claims `key` in the inbox and, if it
/// was not claimed before, writes the message's effect; commits.
pub(crate) async fn hand_one(pool: &PgPool, key: &str, job: &Job) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(
        "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
         VALUES ('bench', $1, 'h', 'completed', 1) ON CONFLICT DO NOTHING",
    )
    .bind(key)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if fresh {
        sqlx::query("INSERT INTO effects (job_id, body) VALUES ($1, $2)")
            .bind(job.id as i64)
            .bind(&job.body)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A hand-written batched consumer's transaction: claims the batch's keys with one inbox
/// insert, writes the effects of the keys it claimed with one insert, commits.
pub(crate) async fn hand_batch(pool: &PgPool, batch: Vec<(String, Job)>) -> anyhow::Result<()> {
    let keys: Vec<&str> = batch.iter().map(|(k, _)| k.as_str()).collect();
    let mut tx = pool.begin().await?;
    let claimed: std::collections::HashSet<String> = sqlx::query_scalar(
        "INSERT INTO floor_inbox (handler, key, payload_hash, status, attempts) \
         SELECT 'bench', k, 'h', 'completed', 1 FROM unnest($1::text[]) AS k \
         ON CONFLICT DO NOTHING RETURNING key",
    )
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    let (ids, bodies): (Vec<i64>, Vec<&str>) = batch
        .iter()
        .filter(|(k, _)| claimed.contains(k))
        .map(|(_, j)| (j.id as i64, j.body.as_str()))
        .unzip();
    sqlx::query(
        "INSERT INTO effects (job_id, body) SELECT * FROM unnest($1::bigint[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
