//! The two handlers. Both run inside the transaction that marks their key completed in the
//! inbox, so their database writes happen exactly once per job, and so does the event
//! `send_invoice` writes to the outbox for `send_email`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use consumer_core::{handler, Context, FlagGuard, HandlerError, OutboxMessage};
use sqlx::Postgres;

use crate::provider::{Email, EmailProvider};
use crate::{is_slow_order, InvoiceJob, InvoiceReady};

/// The outbox destination of the [`InvoiceReady`] events. The example's publisher
/// ([`crate::transport::EventPublisher`]) sends it to the events exchange or topic
/// (`EVENTS`), so the handler does not depend on where the deployment puts them.
pub const INVOICE_READY: &str = "invoice_ready";

static SIMULATED_WORK_MS: AtomicU64 = AtomicU64::new(0);
static SLOW_JOB_MS: AtomicU64 = AtomicU64::new(0);

/// Makes the handlers sleep `slow` on each slow job ([`InvoiceJob::is_slow`]; the
/// `SLOW_JOB_MS` setting, 0 = off): the chaos suite uses it to outlast the Kafka
/// transport's revoke timeout, so records are in flight across rebalances.
pub fn set_slow_jobs(slow: Duration) {
    let ms = u64::try_from(slow.as_millis()).unwrap_or(u64::MAX);
    SLOW_JOB_MS.store(ms, Ordering::Relaxed);
}

/// Makes every handler run take `work` longer (the `WORK_MS` setting), as a slow provider
/// would: it leaves time to watch a graceful shutdown finish in-flight jobs.
pub fn set_simulated_work(work: Duration) {
    let ms = u64::try_from(work.as_millis()).unwrap_or(u64::MAX);
    SIMULATED_WORK_MS.store(ms, Ordering::Relaxed);
}

async fn simulated_work(order_id: i64) {
    let mut ms = SIMULATED_WORK_MS.load(Ordering::Relaxed);
    if is_slow_order(order_id) {
        ms = ms.saturating_add(SLOW_JOB_MS.load(Ordering::Relaxed));
    }
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The chaos suite's poison jobs fail every attempt, transiently, so they exhaust
/// `max_attempts` and are dead-lettered.
fn refuse_poison(job: &InvoiceJob) -> Result<(), HandlerError> {
    if job.is_poison() {
        return Err(HandlerError::transient(format!(
            "order {} is a poison job (reserved id range): always fails",
            job.order_id
        )));
    }
    Ok(())
}

/// Appends this run's row to `effect_ledger`, in the handler's transaction: it exists iff
/// the run committed, so the chaos suite's oracle can count committed runs per job.
async fn record_effect(ctx: &mut Context<'_, Postgres>, order_id: i64) -> Result<(), HandlerError> {
    let handler = ctx.handler().to_owned();
    let key = ctx.key().to_owned();
    let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
    sqlx::query(
        "INSERT INTO effect_ledger (job_id, handler, key, attempt, pid) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(order_id)
    .bind(handler)
    .bind(key)
    .bind(attempt)
    .bind(i32::try_from(std::process::id()).unwrap_or(i32::MAX))
    .execute(ctx.db())
    .await?;
    Ok(())
}

/// Creates the invoice of an order, sets `orders.invoice_sent` and publishes an
/// [`InvoiceReady`] event through the outbox.
///
/// The guarded update is the first write: whichever attempt commits first sets the flag;
/// any other message for the same order sees it set and creates nothing. A job for an order
/// that does not exist fails permanently (it goes to the dead-letter queue at once). Each
/// committed run appends one row to `effect_ledger`.
///
/// The event is written to the outbox in the handler's transaction, so it exists if and
/// only if the invoice does; the relay publishes it after the commit. Its message id comes
/// from the handler and the key, the same on every attempt, so a re-sent event is a
/// duplicate to the email handler. The Kafka key is the order id (one order's events stay
/// in order).
///
/// Both handlers get 10 attempts. The budget counts attempts that a crash cut short too
/// (the runtime quarantines a message that used them all up without an outcome, a crash
/// loop), and in the chaos suite's per-message runs about one attempt in seven is cut
/// short by a kill or an abort: 10 leave a valid job a chance of about 10^-8 of running
/// out. A poison job spends about 40 s in retries (`1s..5s`) before its dead letter.
#[handler(
    name = "send_invoice",
    key = "invoice-{order_id}",
    max_attempts = 10,
    backoff = "1s..5s"
)]
pub async fn send_invoice(
    ctx: &mut Context<'_, Postgres>,
    job: InvoiceJob,
) -> Result<(), HandlerError> {
    refuse_poison(&job)?;
    simulated_work(job.order_id).await;
    record_effect(ctx, job.order_id).await?;
    let invoice_sent = FlagGuard::new("orders", "invoice_sent", "id")?;
    if !invoice_sent.set(ctx, job.order_id).await? {
        let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM orders WHERE id = $1)")
            .bind(job.order_id)
            .fetch_one(ctx.db())
            .await?;
        if !exists {
            return Err(HandlerError::permanent(format!(
                "order {} does not exist",
                job.order_id
            )));
        }
        tracing::info!(order_id = job.order_id, "invoice already created");
        return Ok(());
    }
    let invoice_id: i64 =
        sqlx::query_scalar("INSERT INTO invoices (order_id, amount) VALUES ($1, $2) RETURNING id")
            .bind(job.order_id)
            .bind(job.amount)
            .fetch_one(ctx.db())
            .await?;
    let ready = InvoiceReady {
        order_id: job.order_id,
        invoice_id,
        email: job.email,
    };
    ctx.publish(OutboxMessage::json(INVOICE_READY, &ready)?.key(job.order_id.to_string()))
        .await?;
    Ok(())
}

/// Sends the "invoice ready" email of an [`InvoiceReady`] event.
///
/// The event exists only once its invoice is committed (the outbox), so there is nothing to
/// wait for; an event for an order without an invoice is refused permanently (it would be a
/// bug upstream, and lands in the dead-letter queue with the reason).
///
/// The guard `orders.email_sent` is set in the handler's transaction before the provider
/// is called, so among all attempts that commit exactly one calls the
/// provider. An attempt that calls the provider and then fails to commit (a crash at the
/// `in_effect` fault point) is retried; like a client of an idempotent API (Stripe-style),
/// it first asks the provider whether the idempotency key was already accepted and sends
/// only if not, so the provider receives one send per order.
#[handler(
    name = "send_email",
    key = "invoice-email-{order_id}",
    max_attempts = 10,
    backoff = "1s..5s"
)]
pub async fn send_email(
    ctx: &mut Context<'_, Postgres>,
    event: InvoiceReady,
) -> Result<(), HandlerError> {
    simulated_work(event.order_id).await;
    let invoiced: Option<bool> =
        sqlx::query_scalar("SELECT invoice_sent FROM orders WHERE id = $1")
            .bind(event.order_id)
            .fetch_optional(ctx.db())
            .await?;
    if invoiced != Some(true) {
        return Err(HandlerError::permanent(format!(
            "invoice_ready for order {}, which has no invoice",
            event.order_id
        )));
    }
    let email_sent = FlagGuard::new("orders", "email_sent", "id")?;
    if !email_sent.set(ctx, event.order_id).await? {
        tracing::info!(order_id = event.order_id, "email already sent");
        return Ok(());
    }
    let schema: String = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(ctx.db())
        .await?;
    let provider = EmailProvider::for_schema(&schema).ok_or_else(|| {
        HandlerError::transient(format!("no email provider installed for schema {schema:?}"))
    })?;
    record_effect(ctx, event.order_id).await?;
    let email = Email {
        to: event.email,
        subject: format!("Your invoice for order {} is ready", event.order_id),
        idempotency_key: ctx.idempotency_key("invoice-ready-email"),
    };
    if !provider.accepted(&email.idempotency_key).await? {
        provider.send(&email).await?;
    }
    // Chaos tests crash here: the provider has the email, the transaction does not.
    #[cfg(feature = "chaos")]
    ctx.fault_point(consumer_core::fault::FaultPoint::InEffect)?;
    Ok(())
}
