//! The `+ outbox` arms: the bench's handler plus one event a message written through the
//! outbox, and the arm that runs it with a relay beside it (see `relay`), or the relay
//! alone over rows written beforehand.

use consumer_core::{
    BatchConfig, BatchContext, Context, Handler, HandlerError, HandlerOptions, Inbox,
    OutboxMessage, Publisher,
};
use futures::future::BoxFuture;
use sqlx::Postgres;

use crate::framework::Fw;
use crate::measure::{figures, Clock, Figures};
use crate::postgres::{record, record_batch, Job};
use crate::relay::Relaying;
use crate::Options;

/// `record` (the same effect rows; in batched mode the same one statement a batch), and one
/// event a message written to the outbox in the same transaction, for `destination`.
pub(crate) struct RecordAndPublish {
    destination: String,
}

impl RecordAndPublish {
    pub(crate) fn new(destination: &str) -> Self {
        RecordAndPublish {
            destination: destination.to_owned(),
        }
    }

    /// Job `id`'s event: its id as JSON, ordered by a key of its own (one key an entity, as
    /// an `invoice_ready` is keyed by its invoice), so a relay round publishes its rows at
    /// once.
    fn event(&self, id: u64) -> Result<OutboxMessage, consumer_core::Error> {
        Ok(OutboxMessage::json(
            self.destination.as_str(),
            &serde_json::json!({ "job_id": id }),
        )?
        .key(format!("job-{id}")))
    }
}

impl Handler<Postgres> for RecordAndPublish {
    type Message = Job;

    /// `record`'s: the same name, so both arms write the same inbox rows.
    fn options(&self) -> HandlerOptions {
        Handler::<Postgres>::options(&record)
    }

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut Context<'c, Postgres>,
        job: Job,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let event = self.event(job.id)?;
            record::call(ctx, job).await?;
            ctx.publish(event).await?;
            Ok(())
        })
    }

    fn handles_batches(&self) -> bool {
        true
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        ctx: &'a mut BatchContext<'c, Postgres>,
        jobs: Vec<Job>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let events = jobs
                .iter()
                .map(|j| self.event(j.id))
                .collect::<Result<Vec<_>, _>>()?;
            record_batch(ctx, jobs).await?;
            ctx.publish_all(events.into_iter().enumerate()).await?;
            Ok(())
        })
    }
}

/// What an outbox arm runs beside its relay.
#[derive(Debug, Clone, Copy)]
pub(crate) enum OutboxArm {
    /// The framework arm (batched or not) with [`RecordAndPublish`]: `fw ... + outbox`.
    Framework(Option<BatchConfig>),
    /// Nothing: the outbox is filled first, and the relay drains it (`relay alone`).
    RelayAlone,
}

impl OutboxArm {
    /// Runs the arm with a relay publishing through `publisher` to `events`; `framework`
    /// runs a framework arm. Returns its figures and the relay, still running.
    pub(crate) async fn run<P, F>(
        self,
        inbox: &Inbox<Postgres>,
        publisher: P,
        events: &str,
        o: &Options,
        framework: F,
    ) -> anyhow::Result<(Figures, Relaying)>
    where
        P: Publisher,
        F: AsyncFnOnce(Fw<'_, RecordAndPublish>) -> anyhow::Result<Figures>,
    {
        let handler = RecordAndPublish::new(events);
        let OutboxArm::Framework(batch) = self else {
            return relay_alone(inbox, publisher, handler, o).await;
        };
        let relay = Relaying::start(inbox.outbox(), publisher, o.relay_config())?;
        let fw = Fw {
            handler,
            batch,
            relay: Some(&relay),
        };
        let f = framework(fw).await?;
        Ok((f, relay))
    }
}

/// `o.messages` of `handler`'s events written to the outbox (in one transaction, before the
/// clock starts), then the relay started and the clock run to its last confirmed publish.
async fn relay_alone(
    inbox: &Inbox<Postgres>,
    publisher: impl Publisher,
    handler: RecordAndPublish,
    o: &Options,
) -> anyhow::Result<(Figures, Relaying)> {
    let outbox = inbox.outbox();
    let mut tx = inbox.pool().begin().await?;
    for id in 0..o.messages as u64 {
        let event = handler.event(id)?.message_id(format!("e-{id}"));
        outbox.enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;
    let clock = Clock::start();
    let relay = Relaying::start(outbox, publisher, o.relay_config())?;
    let last = relay.confirmed(o.messages).await?;
    let wall = last.saturating_duration_since(clock.start);
    Ok((
        figures(o.messages, wall, clock.cpu(), &mut [], clock.base),
        relay,
    ))
}
