//! What every framework arm shares, whatever its broker: the worker it runs
//! ([`bench_worker`]), what it is given to run ([`Fw`]: a handler, batched or not, and a relay
//! for an `+ outbox` arm), and its figures at the end ([`framework_figures`]), once the worker
//! is seen to have completed every message ([`ensure_completed`]).

use std::time::Duration;

use consumer_core::{BatchConfig, Handler, Inbox, Worker, WorkerConfig};
use sqlx::Postgres;

use crate::measure::{figures, Baseline, Figures};
use crate::timing::Acks;
use crate::{relay, Options};

/// The framework's worker for the `record` handler, as every framework arm runs it: the
/// bench's concurrency, `batch`, no retention task.
pub(crate) fn bench_worker<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    o: &Options,
    batch: Option<BatchConfig>,
) -> anyhow::Result<Worker<Postgres, H>> {
    Ok(Worker::with_config(
        inbox.clone(),
        handler,
        WorkerConfig::default()
            .with_concurrency(o.concurrency)
            .with_retention_interval(None)
            .with_batch(batch),
    )?)
}

/// A framework arm on a broker: its handler, batched or not, and for an `+ outbox` arm the
/// relay whose last publish stops the arm's clock.
pub(crate) struct Fw<'a, H> {
    /// The handler the worker runs.
    pub(crate) handler: H,
    /// How the worker batches messages (`None`: one a transaction).
    pub(crate) batch: Option<BatchConfig>,
    /// The `+ outbox` arm's relay (`None`: the clock stops at the last ack).
    pub(crate) relay: Option<&'a relay::Relaying>,
}

impl<H> Fw<'static, H> {
    /// The framework without an outbox.
    pub(crate) fn alone(handler: H, batch: Option<BatchConfig>) -> Self {
        Fw {
            handler,
            batch,
            relay: None,
        }
    }
}

/// A framework arm's figures once its clock has stopped at `end`, after `cpu` of this
/// process's CPU: the worker (its counters `s`) must have completed every message.
pub(crate) fn framework_figures(
    o: &Options,
    s: &consumer_core::stats::StatsSnapshot,
    end: &relay::End,
    cpu: Duration,
    acks: &Acks,
    base: Baseline,
) -> anyhow::Result<Figures> {
    ensure_completed(o, s)?;
    Ok(end.figures(figures(
        o.messages,
        end.wall,
        cpu,
        &mut acks.latencies(),
        base,
    )))
}

/// Fails unless the worker (its counters `s`) completed every message of the arm.
pub(crate) fn ensure_completed(
    o: &Options,
    s: &consumer_core::stats::StatsSnapshot,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        s.completed == o.messages as u64,
        "framework arm completed {} of {}: {s:?}",
        s.completed,
        o.messages
    );
    Ok(())
}
