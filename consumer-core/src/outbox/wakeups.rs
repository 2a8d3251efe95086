//! The relay's wake-ups from the database: its commit notifications (PostgreSQL's
//! `LISTEN`), listened to again, after a wait, when the listening fails or ends; and its
//! rest, the lock that makes writers notify only while the relay waits for them (see
//! [`OutboxStore::outbox_rest`](crate::inbox::OutboxStore::outbox_rest)).

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

/// The notifications a relay listens to, or, while it does not, when it listens again; and
/// whether it rests.
pub(super) struct Wakeups<DB: Backend> {
    /// The notifications (none: not listening).
    stream: Option<BoxStream<'static, ()>>,
    /// When to listen again, while not listening.
    listen_at: Instant,
    /// The wait after the next failure.
    wait: Duration,
    /// The connection that holds the rest lock while the relay rests (kept between rests).
    rest: Option<DB::Connection>,
    /// Whether the rest lock is held.
    resting: bool,
    /// When the relay may try to rest again after a failure to (the database is down).
    rest_at: Instant,
}

/// What an attempt to rest came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rest {
    /// The relay rests: every writer from now on notifies, and every writer that did not has
    /// ended. Rows those committed are due: the relay looks once more.
    Resting,
    /// Writers that did not notify are still in their transactions: the relay looks again,
    /// and tries to rest again.
    Busy,
    /// The relay cannot rest now (it does not listen, or trying failed): it polls.
    NotNow,
}

impl<DB: Backend> Wakeups<DB> {
    /// Not listening yet; [`Wakeups::listen`] listens at once.
    pub(super) fn new() -> Self {
        Wakeups {
            stream: None,
            listen_at: Instant::now(),
            wait: FIRST_WAIT,
            rest: None,
            resting: false,
            rest_at: Instant::now(),
        }
    }

    /// Rests the relay if it listens (a rest unheard would only make writers notify for
    /// nothing) and does not rest yet, waiting at most `wait` for the writers that did not
    /// notify to end. After a failure (logged) it does not try again for [`FIRST_WAIT`]
    /// (see [`Wakeups::rest_retry`]).
    pub(super) async fn rest(&mut self, outbox: &Outbox<DB>, wait: Duration) -> Rest {
        if !DB::RESTS || self.resting || self.stream.is_none() || Instant::now() < self.rest_at {
            return Rest::NotNow;
        }
        match DB::outbox_rest(&outbox.pool, &outbox.names, &mut self.rest, wait).await {
            Ok(taken) => {
                self.resting = taken;
                if taken {
                    Rest::Resting
                } else {
                    Rest::Busy
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "outbox: the relay cannot rest; polling meanwhile");
                self.rest_at = Instant::now() + FIRST_WAIT;
                Rest::NotNow
            }
        }
    }

    /// When the relay tries to rest again after a failure to, while it waits for that.
    pub(super) fn rest_retry(&self) -> Option<Instant> {
        let waiting = DB::RESTS && !self.resting && self.stream.is_some();
        (waiting && Instant::now() < self.rest_at).then_some(self.rest_at)
    }

    /// Ends the relay's rest, if it rests: writers commit without notifying again. When the
    /// lock cannot be released, its connection is closed, which releases it.
    pub(super) async fn unrest(&mut self, outbox: &Outbox<DB>) {
        if !std::mem::take(&mut self.resting) {
            return;
        }
        let Some(conn) = self.rest.as_mut() else {
            return;
        };
        if let Err(e) = DB::outbox_unrest(conn, &outbox.names).await {
            tracing::debug!(error = %e, "outbox: ending the relay's rest failed; reconnecting");
            self.rest = None;
        }
    }

    /// Listens to the outbox's notifications if it does not and its wait is over.
    pub(super) async fn listen(&mut self, outbox: &Outbox<DB>) {
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
