//! The `+ outbox` arms' parts: the bench's handler plus one event a message written through
//! the outbox, and a relay running beside the arm whose confirmed publishes are counted, so
//! that the arm's clock stops at the last event relayed, not at the last ack.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use consumer_core::{
    BatchConfig, BatchContext, Context, Handler, HandlerError, HandlerOptions, Inbox, Outbox,
    OutboxMessage, PublishError, Publisher, Relay, RelayConfig,
};
use futures::future::BoxFuture;
use sqlx::Postgres;
use tokio::sync::{oneshot, watch};

use crate::framework::Fw;
use crate::measure::{figures, Clock, Figures, RelayFigures};
use crate::postgres::{record, record_batch, Job};
use crate::Options;

/// How long an arm (or a latency sample) waits for its relay before it fails.
const RELAY_DEADLINE: Duration = Duration::from_secs(300);

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

/// How many of a relay's publishes the broker confirmed, and when the last one was.
#[derive(Debug, Clone, Copy, Default)]
struct Confirmed {
    count: usize,
    last: Option<Instant>,
}

/// A publisher that counts the publishes its broker confirmed.
struct Confirming<P> {
    inner: P,
    confirmed: watch::Sender<Confirmed>,
}

impl<P: Publisher> Publisher for Confirming<P> {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let result = self.inner.publish(message).await;
            if result.is_ok() {
                let at = Instant::now();
                self.confirmed.send_modify(|c| {
                    c.count += 1;
                    c.last = Some(at);
                });
            }
            result
        })
    }
}

/// A relay of the bench's outbox running in a task, its confirmed publishes counted.
pub(crate) struct Relaying {
    confirmed: watch::Receiver<Confirmed>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), consumer_core::Error>>,
    outbox: Outbox<Postgres>,
}

impl Relaying {
    /// Starts `Relay::new(outbox, publisher).with_config(config).run(..)`.
    pub(crate) fn start(
        outbox: Outbox<Postgres>,
        publisher: impl Publisher,
        config: RelayConfig,
    ) -> anyhow::Result<Self> {
        let (confirming, confirmed) = watch::channel(Confirmed::default());
        let publisher = Confirming {
            inner: publisher,
            confirmed: confirming,
        };
        let relay = Relay::new(outbox.clone(), publisher).with_config(config)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async {
            let _ = stopped.await;
        }));
        Ok(Relaying {
            confirmed,
            stop,
            task,
            outbox,
        })
    }

    /// Waits until the broker has confirmed `n` of the relay's publishes in all; when it
    /// confirmed the `n`th.
    pub(crate) async fn confirmed(&self, n: usize) -> anyhow::Result<Instant> {
        let mut confirmed = self.confirmed.clone();
        let c = tokio::time::timeout(RELAY_DEADLINE, confirmed.wait_for(|c| c.count >= n))
            .await
            .with_context(|| {
                format!("the relay did not publish {n} messages in {RELAY_DEADLINE:?}")
            })?
            .context("the relay stopped")?;
        c.last.context("no publish was confirmed")
    }

    /// Stops the relay once its round in progress has ended, and checks that it left no row
    /// unpublished; returns how many rows it published.
    pub(crate) async fn stop(self) -> anyhow::Result<u64> {
        let _ = self.stop.send(());
        self.task.await??;
        let stats = self.outbox.stats().await?;
        anyhow::ensure!(
            stats.pending == 0,
            "the relay left {} rows unpublished",
            stats.pending
        );
        Ok(stats.published)
    }
}

/// When a framework arm's clock stopped: at its last ack or, with a relay, at the later of
/// that and the relay's last confirmed publish.
pub(crate) struct End {
    pub(crate) wall: Duration,
    relay: Option<RelayFigures>,
}

impl End {
    /// Stops the clock started at `start` after the last of `n` messages was acked: at
    /// once, or once `relay` has published `n` events.
    pub(crate) async fn after(
        relay: Option<&Relaying>,
        n: usize,
        start: Instant,
    ) -> anyhow::Result<End> {
        let consumed = start.elapsed();
        let Some(relay) = relay else {
            return Ok(End {
                wall: consumed,
                relay: None,
            });
        };
        let at_ack = relay.confirmed.borrow().count;
        let relayed = relay.confirmed(n).await?.saturating_duration_since(start);
        Ok(End {
            wall: consumed.max(relayed),
            relay: Some(RelayFigures {
                consumed_rate: n as f64 / consumed.as_secs_f64(),
                tail_ms: (relayed.as_secs_f64() - consumed.as_secs_f64()) * 1e3,
                relayed_at_ack: at_ack as f64 / n as f64,
            }),
        })
    }

    /// `f` with the relay's figures.
    pub(crate) fn figures(&self, f: Figures) -> Figures {
        Figures {
            relay: self.relay,
            ..f
        }
    }
}

/// Checks that a `+ outbox` arm's relay published every event once and that the destination
/// holds exactly those (`held`, as the broker counts them).
pub(crate) fn check_events(n: usize, published: u64, held: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        published == n as u64 && held == n as u64,
        "{n} events written: the relay marked {published} published, the destination holds {held}"
    );
    Ok(())
}
