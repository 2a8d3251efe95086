//! The relay's wake-ups from the database: its commit notifications (PostgreSQL's
//! `LISTEN`), listened to again, after a wait, when the listening fails or ends.

use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use tokio::time::Instant;

use super::handle::Outbox;
use crate::inbox::Backend;

/// The wait before listening again after the first failure; it doubles with each failure
/// in a row, up to [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_secs(1);

/// The longest wait before listening again.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// The notifications a relay listens to, or, while it does not, when it listens again.
pub(super) struct Wakeups {
    /// The notifications (none: not listening).
    stream: Option<BoxStream<'static, ()>>,
    /// When to listen again, while not listening.
    listen_at: Instant,
    /// The wait after the next failure.
    wait: Duration,
}

impl Wakeups {
    /// Not listening yet; [`Wakeups::listen`] listens at once.
    pub(super) fn new() -> Self {
        Wakeups {
            stream: None,
            listen_at: Instant::now(),
            wait: FIRST_WAIT,
        }
    }

    /// Listens to the outbox's notifications if it does not and its wait is over.
    pub(super) async fn listen<DB: Backend>(&mut self, outbox: &Outbox<DB>) {
        if self.stream.is_some() || Instant::now() < self.listen_at {
            return;
        }
        match DB::outbox_wakeups(&outbox.pool, &outbox.names).await {
            Ok(stream) => {
                self.stream = Some(stream);
                self.wait = FIRST_WAIT;
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    retry_in = ?self.wait,
                    "outbox: cannot listen for commits; polling meanwhile"
                );
                self.pause();
            }
        }
    }

    /// The next wake-up: a notification, the end of the notifications (the relay looks,
    /// since some may have been lost, and listens again after a wait), or, while not
    /// listening, the end of that wait.
    pub(super) async fn next(&mut self) {
        let Some(stream) = self.stream.as_mut() else {
            tokio::time::sleep_until(self.listen_at).await;
            return;
        };
        if stream.next().await.is_none() {
            tracing::warn!(
                retry_in = ?self.wait,
                "outbox: the database's notifications ended; polling meanwhile"
            );
            self.stream = None;
            self.pause();
        }
    }

    /// Not listening until the wait is over; the next wait twice as long.
    fn pause(&mut self) {
        self.listen_at = Instant::now() + self.wait;
        self.wait = (self.wait * 2).min(MAX_WAIT);
    }
}
