//! What arrives at a consumer of a latency sample's destination (`--outbox-latency`): the
//! broker modules start one ([`Received::spawn`]), the sampling waits on it.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::mpsc;

/// How long a sample waits for its message at the consumer (a Kafka consumer's first one
/// waits for its group to form).
const ARRIVAL_DEADLINE: Duration = Duration::from_secs(60);

/// A message's payload and the instant it arrived.
pub(crate) type Arrival = (Vec<u8>, Instant);

/// A consumer of a latency destination, running in a task (stopped when this is dropped),
/// handing on what arrives.
pub(crate) struct Received {
    arrivals: mpsc::UnboundedReceiver<Arrival>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Received {
    /// Runs `consume`, which sends every message it receives, in a task.
    pub(crate) fn spawn<F, Fut>(consume: F) -> Received
    where
        F: FnOnce(mpsc::UnboundedSender<Arrival>) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (arrived, arrivals) = mpsc::unbounded_channel();
        Received {
            arrivals,
            task: tokio::spawn(consume(arrived)),
        }
    }

    /// When the message with `payload` arrived (skipping any other).
    pub(crate) async fn arrival(&mut self, payload: &[u8]) -> anyhow::Result<Instant> {
        loop {
            let next = tokio::time::timeout(ARRIVAL_DEADLINE, self.arrivals.recv())
                .await
                .context("no message arrived at the consumer")?;
            match next {
                Some((p, at)) if p == payload => return Ok(at),
                Some(_) => {}
                None => {
                    let ended = (&mut self.task).await?;
                    ended?;
                    anyhow::bail!("the consumer ended");
                }
            }
        }
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        self.task.abort();
    }
}
