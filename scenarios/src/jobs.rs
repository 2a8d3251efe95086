//! The scenarios' job and its handlers: one per backend (they differ only in placeholder
//! syntax), each also with a batch function that writes a batch's rows with one statement.

use std::time::Duration;

use consumer_core::inbox::Backend;
use consumer_core::{handler, BatchContext, Context, FlagGuard, HandlerError, Inbox, Transition};
use futures::future::BoxFuture;
use serde::Deserialize;
use sqlx::{Postgres, Sqlite};

/// A test job. Its fields script the handler's behaviour, so handlers stay stateless.
#[derive(Debug, Deserialize)]
pub struct Job {
    id: String,
    /// Fail (transiently) while the attempt number is at most this.
    #[serde(default)]
    fail_times: u32,
    #[serde(default)]
    panic: bool,
    #[serde(default)]
    permanent: bool,
    /// Hold the transaction open this long, so concurrent deliveries overlap.
    #[serde(default)]
    sleep_ms: u64,
    /// Also run the guards for this order.
    #[serde(default)]
    order_id: Option<i64>,
    /// After writing the ledger row, run a statement that fails (a NULL into a NOT NULL
    /// column) and ignore its error, as `let _ = insert(...).await;` does.
    #[serde(default)]
    ignore_failed_statement: bool,
    /// The same, inside a savepoint that it rolls back: the idiom that works on both.
    #[serde(default)]
    failed_statement_in_savepoint: bool,
}

/// A statement that fails on both backends: `ledger.job_id` is NOT NULL.
const FAILING_STATEMENT: &str = "INSERT INTO ledger (job_id, attempt) VALUES (NULL, 0)";

impl Job {
    fn behave(&self, attempt: u32) -> Result<(), HandlerError> {
        if self.panic {
            panic!("job {} always panics", self.id);
        }
        if self.permanent {
            return Err(HandlerError::permanent(format!(
                "job {} is invalid",
                self.id
            )));
        }
        if attempt <= self.fail_times {
            return Err(HandlerError::transient(format!(
                "transient failure on attempt {attempt}"
            )));
        }
        Ok(())
    }
}

/// One handler per backend: identical but for the placeholder syntax.
macro_rules! record_handler {
    ($name:ident, $db:ty, $insert:literal) => {
        /// Records the job's id and attempt in `ledger` after the job's scripted behaviour,
        /// and, for a job with an order, moves the order through its guards.
        #[handler(name = "record", max_attempts = 3, backoff = "5ms..20ms")]
        pub async fn $name(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
            job.behave(ctx.attempt())?;
            tokio::time::sleep(Duration::from_millis(job.sleep_ms)).await;
            let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
            sqlx::query($insert)
                .bind(&job.id)
                .bind(attempt)
                .execute(ctx.db())
                .await?;
            if let Some(order) = job.order_id {
                // Two different jobs for one order: the flag and the transition are won once.
                let moved = Transition::new("orders", "status", "id")?
                    .apply(ctx, order, "created", "invoiced")
                    .await?;
                if FlagGuard::new("orders", "invoice_sent", "id")?
                    .set(ctx, order)
                    .await?
                {
                    assert!(moved, "the flag and the transition are won by the same job");
                    sqlx::query($insert)
                        .bind(format!("email-{order}"))
                        .bind(attempt)
                        .execute(ctx.db())
                        .await?;
                }
            }
            if job.ignore_failed_statement {
                let failed = sqlx::query(FAILING_STATEMENT).execute(ctx.db()).await;
                assert!(failed.is_err(), "the statement fails");
            }
            if job.failed_statement_in_savepoint {
                let mut savepoint = sqlx::Connection::begin(ctx.db()).await?;
                let failed = sqlx::query(FAILING_STATEMENT)
                    .execute(&mut *savepoint)
                    .await;
                assert!(failed.is_err(), "the statement fails");
                savepoint.rollback().await?;
            }
            Ok(())
        }
    };
}

record_handler!(
    record_pg,
    Postgres,
    "INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)"
);
record_handler!(
    record_sqlite,
    Sqlite,
    "INSERT INTO ledger (job_id, attempt) VALUES (?1, ?2)"
);

/// The same handler with a batch function, which writes a batch's ledger rows with one
/// statement. Jobs that use the guards make it fail, so the batch reruns one by one through
/// the handler; a failing, panicking or sleeping job fails, panics or sleeps the batch.
macro_rules! bulk_handler {
    ($name:ident, $single:ident, $batch:literal, $db:ty) => {
        /// The record handler of the same backend, with a batch function that writes a
        /// batch's ledger rows with one statement.
        #[handler(name = "record", max_attempts = 3, backoff = "5ms..20ms", batch = $batch)]
        pub async fn $name(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
            $single::call(ctx, job).await
        }
    };
}

bulk_handler!(bulk_pg, record_pg, "record_pg_batch", Postgres);
bulk_handler!(bulk_sqlite, record_sqlite, "record_sqlite_batch", Sqlite);

/// Batch function calls per queue (the location of the deliveries' source), so a test can
/// tell that its batches went through the batch function.
pub(crate) static BATCH_CALLS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The ledger rows of a batch, after each job's scripted behaviour.
fn ledger_rows<DB: Backend>(
    ctx: &BatchContext<'_, DB>,
    jobs: &[Job],
) -> Result<(Vec<String>, Vec<i32>), HandlerError> {
    if jobs.iter().any(|j| j.order_id.is_some()) {
        return Err(HandlerError::transient("jobs with guards run one by one"));
    }
    let mut rows = (Vec::new(), Vec::new());
    for (i, job) in jobs.iter().enumerate() {
        job.behave(ctx.attempt(i))?;
        rows.0.push(job.id.clone());
        rows.1
            .push(i32::try_from(ctx.attempt(i)).unwrap_or(i32::MAX));
    }
    BATCH_CALLS
        .lock()
        .unwrap()
        .push(ctx.delivery(0).source.location.to_string());
    Ok(rows)
}

async fn sleep_for(jobs: &[Job]) {
    let ms = jobs.iter().map(|j| j.sleep_ms).max().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

async fn record_pg_batch(
    ctx: &mut BatchContext<'_, Postgres>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, attempts) = ledger_rows(ctx, &jobs)?;
    sleep_for(&jobs).await;
    sqlx::query(
        "INSERT INTO ledger (job_id, attempt) SELECT * FROM unnest($1::text[], $2::int4[])",
    )
    .bind(ids)
    .bind(attempts)
    .execute(ctx.db())
    .await?;
    if jobs.iter().any(|j| j.ignore_failed_statement) {
        let failed = sqlx::query(FAILING_STATEMENT).execute(ctx.db()).await;
        assert!(failed.is_err(), "the statement fails");
    }
    Ok(())
}

async fn record_sqlite_batch(
    ctx: &mut BatchContext<'_, Sqlite>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, attempts) = ledger_rows(ctx, &jobs)?;
    sleep_for(&jobs).await;
    let rows: Vec<(String, i32)> = ids.into_iter().zip(attempts).collect();
    sqlx::query(
        "INSERT INTO ledger (job_id, attempt) \
         SELECT value ->> '$[0]', value ->> '$[1]' FROM json_each(?1)",
    )
    .bind(serde_json::to_string(&rows).map_err(HandlerError::permanent)?)
    .execute(ctx.db())
    .await?;
    if jobs.iter().any(|j| j.ignore_failed_statement) {
        let failed = sqlx::query(FAILING_STATEMENT).execute(ctx.db()).await;
        assert!(failed.is_err(), "the statement fails");
    }
    Ok(())
}

/// The number of `ledger` rows of job `id`, on PostgreSQL.
pub fn pg_ledger(inbox: Inbox<Postgres>, id: String) -> BoxFuture<'static, i64> {
    Box::pin(async move {
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = $1")
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .expect("count ledger")
    })
}

/// The number of `ledger` rows of job `id`, on SQLite.
pub fn sqlite_ledger(inbox: Inbox<Sqlite>, id: String) -> BoxFuture<'static, i64> {
    Box::pin(async move {
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = ?1")
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .expect("count ledger")
    })
}
