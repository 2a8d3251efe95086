//! The health view of an [`App`](crate::App): each part's state, and each handler's counters.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::stats::{Stats, StatsSnapshot};

/// Where a part of an [`App`](crate::App) (a handler's worker, or the relay) is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartState {
    /// Added; [`App::run`](crate::App::run) has not started it yet.
    Idle,
    /// Consuming (a worker) or publishing (the relay).
    Running,
    /// Told to stop: finishing and settling what is in flight (a worker), or the round in
    /// progress (the relay).
    Draining,
    /// Ended after it was told to stop.
    Stopped,
    /// Ended by itself: its worker or relay returned an error, or its transport ended before
    /// the app was told to stop. This ends the whole app.
    Failed,
}

impl PartState {
    fn from_u8(n: u8) -> Self {
        match n {
            0 => PartState::Idle,
            1 => PartState::Running,
            2 => PartState::Draining,
            3 => PartState::Stopped,
            _ => PartState::Failed,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            PartState::Idle => 0,
            PartState::Running => 1,
            PartState::Draining => 2,
            PartState::Stopped => 3,
            PartState::Failed => 4,
        }
    }
}

/// One handler of an [`App`](crate::App) at one moment: its name, its state and a copy of
/// its counters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerHealth {
    /// The handler's stable name.
    pub name: String,
    /// Where its worker is.
    pub state: PartState,
    /// Its counters now (see [`Worker::snapshot`](crate::Worker::snapshot)).
    pub stats: StatsSnapshot,
}

/// A state that the app's tasks move and the health view reads.
#[derive(Debug, Default)]
pub(super) struct StateCell(AtomicU8);

impl StateCell {
    pub(super) fn set(&self, state: PartState) {
        self.0.store(state.as_u8(), Ordering::Relaxed);
    }

    pub(super) fn get(&self) -> PartState {
        PartState::from_u8(self.0.load(Ordering::Relaxed))
    }
}

/// A handler's entry in the health view.
#[derive(Debug)]
pub(super) struct HandlerEntry {
    pub(super) name: String,
    pub(super) state: Arc<StateCell>,
    pub(super) stats: Arc<Stats>,
}

#[derive(Debug, Default)]
struct Parts {
    handlers: Vec<HandlerEntry>,
    relay: Option<Arc<StateCell>>,
}

/// The health view of an [`App`](crate::App): every handler's state and counters, and the
/// relay's state. Get it with [`App::health`](crate::App::health) before calling
/// [`App::run`](crate::App::run); it is cheap to clone and reads without waiting on the
/// app, so an HTTP `/readyz` or a metrics task can hold one.
///
/// ```
/// # async fn demo() -> Result<(), consumer_core::Error> {
/// use consumer_core::{App, Inbox};
///
/// let inbox = Inbox::open_sqlite("inbox.db").await?;
/// let app = App::new(inbox); // .handler(...), .relay(...)
/// let health = app.health();
/// // In the /readyz handler:
/// let status = if health.is_ready() { 200 } else { 503 };
/// # let _ = status;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct AppHealth {
    parts: Arc<Mutex<Parts>>,
}

impl AppHealth {
    fn lock(&self) -> MutexGuard<'_, Parts> {
        self.parts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every handler, in the order they were added.
    pub fn handlers(&self) -> Vec<HandlerHealth> {
        self.lock()
            .handlers
            .iter()
            .map(|h| HandlerHealth {
                name: h.name.clone(),
                state: h.state.get(),
                stats: h.stats.snapshot(),
            })
            .collect()
    }

    /// The handler named `name`, if the app has one.
    pub fn handler(&self, name: &str) -> Option<HandlerHealth> {
        self.handlers().into_iter().find(|h| h.name == name)
    }

    /// The relay's state; `None` if the app has no relay.
    pub fn relay(&self) -> Option<PartState> {
        self.lock().relay.as_ref().map(|s| s.get())
    }

    /// Whether every part is [`PartState::Running`]: false before the app runs, while it
    /// starts, once it drains and after it stopped or failed.
    pub fn is_ready(&self) -> bool {
        let parts = self.lock();
        let states = parts.handlers.iter().map(|h| &h.state).chain(&parts.relay);
        let mut any = false;
        for state in states {
            if state.get() != PartState::Running {
                return false;
            }
            any = true;
        }
        any
    }

    /// Whether a handler of this name is already in the view.
    pub(super) fn has_handler(&self, name: &str) -> bool {
        self.lock().handlers.iter().any(|h| h.name == name)
    }

    pub(super) fn add_handler(&self, entry: HandlerEntry) {
        self.lock().handlers.push(entry);
    }

    pub(super) fn set_relay(&self, state: Arc<StateCell>) {
        self.lock().relay = Some(state);
    }
}
