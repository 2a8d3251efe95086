//! A relay running beside an arm, whose confirmed publishes are counted, so that the arm's
//! clock stops at the last event relayed, not at the last ack; and the end of such an arm.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use consumer_core::{Outbox, OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use futures::future::BoxFuture;
use sqlx::Postgres;
use tokio::sync::{oneshot, watch};

use crate::measure::{Figures, RelayFigures};

/// How long an arm (or a latency sample) waits for its relay before it fails.
const RELAY_DEADLINE: Duration = Duration::from_secs(300);

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
    /// unpublished; returns how many publishes the broker confirmed (a row published twice
    /// counts twice).
    pub(crate) async fn stop(self) -> anyhow::Result<u64> {
        let _ = self.stop.send(());
        self.task.await??;
        let stats = self.outbox.stats().await?;
        anyhow::ensure!(
            stats.pending == 0,
            "the relay left {} rows unpublished",
            stats.pending
        );
        Ok(self.confirmed.borrow().count as u64)
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
        "{n} events written: the broker confirmed {published} publishes, the destination holds {held}"
    );
    Ok(())
}
