//! One process, many handlers: an [`App`] runs several workers, each on its own transport,
//! and the outbox's relay, under one shutdown future and one health view ([`AppHealth`]).
//!
//! # Layout
//!
//! - this file: [`App`], its builder methods and the supervisor that runs the parts;
//! - `health`: [`AppHealth`], [`HandlerHealth`] and [`PartState`], which the supervisor's
//!   tasks move and anyone holding the view reads.

mod health;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::watch;
use tokio::task::{Id, JoinSet};

pub use health::{AppHealth, HandlerHealth, PartState};

use self::health::{HandlerEntry, StateCell};
use crate::delivery::Transport;
use crate::error::TransportError;
use crate::handler::Handler;
use crate::inbox::{Backend, Inbox};
use crate::outbox::{Publisher, Relay, RelayConfig};
use crate::worker::{Worker, WorkerConfig};
use crate::Error;

/// Starts a part: given the signal that tells it to stop, the future that runs it to its end.
type Start = Box<dyn FnOnce(watch::Receiver<bool>) -> BoxFuture<'static, Result<(), Error>> + Send>;

/// What a part is: the handlers stop first, the relay after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Handler,
    Relay,
}

/// A worker or the relay, not started yet.
struct Part {
    name: String,
    role: Role,
    state: Arc<StateCell>,
    start: Start,
}

/// Several handlers, each on its own queue or topic, and the outbox's relay, in one process
/// under one shutdown future.
///
/// Each [`App::handler`] builds a [`Worker`] on the app's inbox (with its own
/// [`WorkerConfig`] through [`App::handler_with`]: concurrency, batching and the rest are per
/// handler); [`App::relay`] adds a [`Relay`] on the inbox's outbox, which publishes what every
/// handler wrote with [`Context::publish`](crate::Context::publish). [`App::run`] runs them all.
/// The workers are built when their handlers are added: install a metrics recorder before
/// (see the crate doc's "Metrics").
///
/// ```no_run
/// use consumer_core::memory::MemoryBroker;
/// use futures::FutureExt;
/// use consumer_core::{handler, App, Context, HandlerError, Inbox, OutboxMessage, WorkerConfig};
/// use serde_json::Value;
/// use sqlx::Sqlite;
///
/// #[handler(name = "place_order")]
/// async fn place_order(ctx: &mut Context<'_, Sqlite>, order: Value) -> Result<(), HandlerError> {
///     ctx.publish(OutboxMessage::json("order_placed", &order)?).await?;
///     Ok(())
/// }
///
/// #[handler(name = "notify")]
/// async fn notify(_ctx: &mut Context<'_, Sqlite>, _event: Value) -> Result<(), HandlerError> {
///     Ok(())
/// }
///
/// # async fn demo() -> Result<(), consumer_core::Error> {
/// let inbox = Inbox::open_sqlite("app.db").await?;
/// let broker = MemoryBroker::new();
/// let app = App::new(inbox)
///     .handler(place_order, broker.consume("orders"))
///     .handler_with(notify, broker.consume("order_placed"), WorkerConfig::default().with_concurrency(2))
///     .relay(broker.clone());
/// let health = app.health(); // for /readyz
/// app.run(tokio::signal::ctrl_c().map(|_| ())).await?;
/// # Ok(()) }
/// ```
///
/// # Configuration errors
///
/// The builder methods do not fail: the first invalid setting is kept and [`App::run`]
/// returns it before anything starts, so one misconfigured handler starts nothing. It is the
/// [`Error::Config`] the [`Worker`] or [`Relay`] would return, naming the field, with the
/// handler's name added to its reason. Two handlers of one name are refused (`name`): their
/// keys would share the inbox's rows. An app runs one relay (`relay`), and needs at least one
/// handler or a relay (`app`).
///
/// # Running and stopping
///
/// When `shutdown` completes, every worker stops taking deliveries and finishes and settles
/// those in flight, as [`Worker::run`] does; once all have ended, the relay is told to stop,
/// so the messages of their last commits may still go out, and it finishes its round in
/// progress. Rows it has not published stay in the outbox for the next start. `run` returns
/// once every part has ended.
///
/// The parts stand or fall together (one for all): if one ends by itself (its worker or
/// relay returns an error, or its transport ends), the app stops the others as on shutdown
/// and returns that first error; a transport that ends is an [`Error::Transport`] naming the
/// handler. The log names the part that failed, and so does the health view
/// ([`PartState::Failed`]). A part that panics stops the others too, and the panic is resumed
/// once they have ended. Restart the process to recover: a crashed worker's unsettled
/// deliveries are redelivered and the inbox deduplicates them.
///
/// Dropping `run`'s future aborts every part at once, leaving what was in flight unsettled,
/// as a crash would.
pub struct App<DB: Backend> {
    inbox: Inbox<DB>,
    parts: Vec<Part>,
    /// The first invalid setting, returned by `run`.
    invalid: Option<Error>,
    health: AppHealth,
}

impl<DB: Backend> std::fmt::Debug for App<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field(
                "parts",
                &self.parts.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("invalid", &self.invalid)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> App<DB> {
    /// An app with no handler yet, on `inbox` (and its outbox, for the relay).
    pub fn new(inbox: Inbox<DB>) -> Self {
        App {
            inbox,
            parts: Vec::new(),
            invalid: None,
            health: AppHealth::default(),
        }
    }

    /// Adds `handler`, consuming `transport`, with the default [`WorkerConfig`].
    pub fn handler<H: Handler<DB>, T: Transport>(self, handler: H, transport: T) -> Self {
        self.handler_with(handler, transport, WorkerConfig::default())
    }

    /// Adds `handler`, consuming `transport`, with `config` (its concurrency, batching and
    /// other settings; see [`Worker::with_config`]). An invalid setting is returned by
    /// [`App::run`].
    pub fn handler_with<H: Handler<DB>, T: Transport>(
        mut self,
        handler: H,
        transport: T,
        config: WorkerConfig,
    ) -> Self {
        if self.invalid.is_none() {
            if let Err(e) = self.add_worker(handler, transport, config) {
                self.invalid = Some(e);
            }
        }
        self
    }

    /// Adds the relay of the inbox's outbox, publishing through `publisher`, with the default
    /// [`RelayConfig`].
    pub fn relay(self, publisher: impl Publisher) -> Self {
        self.relay_with(publisher, RelayConfig::default())
    }

    /// Adds the relay of the inbox's outbox, publishing through `publisher`, with `config`.
    /// An invalid setting, or a second relay, is returned by [`App::run`].
    pub fn relay_with(mut self, publisher: impl Publisher, config: RelayConfig) -> Self {
        if self.invalid.is_none() {
            if let Err(e) = self.add_relay(publisher, config) {
                self.invalid = Some(e);
            }
        }
        self
    }

    /// The health view: every handler's state and counters, and the relay's state. Take it
    /// before [`App::run`]; it sees the parts added later too.
    pub fn health(&self) -> AppHealth {
        self.health.clone()
    }

    fn add_worker<H: Handler<DB>, T: Transport>(
        &mut self,
        handler: H,
        transport: T,
        config: WorkerConfig,
    ) -> Result<(), Error> {
        let name = handler.options().name.into_owned();
        let worker = Worker::with_config(self.inbox.clone(), handler, config)
            .map_err(|e| of_handler(e, &name))?;
        if self.health.has_handler(&name) {
            return Err(Error::config(
                "name",
                format!(
                    "two handlers named `{name}` in one App: a handler's keys are kept in the \
                     inbox under its name, so each needs its own"
                ),
            ));
        }
        let state = Arc::new(StateCell::default());
        self.health.add_handler(HandlerEntry {
            name: name.clone(),
            state: state.clone(),
            stats: worker.stats(),
        });
        self.parts.push(Part {
            name,
            role: Role::Handler,
            state,
            start: Box::new(move |told| {
                async move { worker.run(transport, stop_told(told)).await }.boxed()
            }),
        });
        Ok(())
    }

    fn add_relay(&mut self, publisher: impl Publisher, config: RelayConfig) -> Result<(), Error> {
        if self.parts.iter().any(|p| p.role == Role::Relay) {
            return Err(Error::config(
                "relay",
                "an App runs one relay, which publishes the messages of all its handlers",
            ));
        }
        let relay = Relay::new(self.inbox.outbox(), publisher).with_config(config)?;
        let state = Arc::new(StateCell::default());
        self.health.set_relay(state.clone());
        self.parts.push(Part {
            name: "relay".to_owned(),
            role: Role::Relay,
            state,
            start: Box::new(move |told| relay.run(stop_told(told)).boxed()),
        });
        Ok(())
    }

    /// Runs every handler and the relay until `shutdown` completes or one of them ends by
    /// itself, then stops the rest (the handlers, then the relay) and returns once all have
    /// ended: `Ok` after a shutdown, else the first error. See [the type's docs](App) for the
    /// details. A configuration error is returned at once, before anything starts.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        if let Some(e) = self.invalid {
            return Err(e);
        }
        if self.parts.is_empty() {
            return Err(Error::config("app", "has no handler and no relay"));
        }
        let mut supervisor = Supervisor::start(self.parts);
        let shutdown = shutdown.fuse();
        futures::pin_mut!(shutdown);
        loop {
            let ended = tokio::select! {
                () = &mut shutdown, if !supervisor.stopping() => {
                    tracing::info!("shutdown: draining every handler, then the relay");
                    supervisor.stop_handlers();
                    continue;
                }
                ended = supervisor.tasks.join_next_with_id() => ended,
            };
            match ended {
                Some(ended) => supervisor.ended(ended),
                None => break,
            }
        }
        supervisor.finish()
    }
}

/// Adds the handler's name to a configuration error's reason.
fn of_handler(e: Error, name: &str) -> Error {
    match e {
        Error::Config { field, reason } => Error::Config {
            field,
            reason: format!("{reason} (handler `{name}`)"),
        },
        other => other,
    }
}

/// Completes once `told` says stop (or its sender is gone).
async fn stop_told(mut told: watch::Receiver<bool>) {
    let _ = told.wait_for(|stop| *stop).await;
}

/// The running parts, and what the app does when one ends.
struct Supervisor {
    tasks: JoinSet<Result<(), Error>>,
    /// The parts by their task, with their name, role and state.
    parts: HashMap<Id, (String, Role, Arc<StateCell>)>,
    handlers_left: usize,
    stop_handlers: watch::Sender<bool>,
    stop_relay: watch::Sender<bool>,
    first_error: Option<Error>,
    panic: Option<Box<dyn std::any::Any + Send>>,
}

impl Supervisor {
    fn start(parts: Vec<Part>) -> Self {
        let (stop_handlers, handlers_told) = watch::channel(false);
        let (stop_relay, relay_told) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut running = HashMap::with_capacity(parts.len());
        let mut handlers_left = 0;
        for part in parts {
            let told = match part.role {
                Role::Handler => {
                    handlers_left += 1;
                    handlers_told.clone()
                }
                Role::Relay => relay_told.clone(),
            };
            part.state.set(PartState::Running);
            let id = tasks.spawn((part.start)(told)).id();
            running.insert(id, (part.name, part.role, part.state));
        }
        tracing::info!(parts = running.len(), "app started");
        Supervisor {
            tasks,
            parts: running,
            handlers_left,
            stop_handlers,
            stop_relay,
            first_error: None,
            panic: None,
        }
    }

    fn stopping(&self) -> bool {
        *self.stop_handlers.borrow()
    }

    /// Tells the handlers to drain (the relay follows once they have ended).
    fn stop_handlers(&mut self) {
        if self.stopping() {
            return;
        }
        self.stop_handlers.send_replace(true);
        for (_, role, state) in self.parts.values() {
            if *role == Role::Handler && state.get() == PartState::Running {
                state.set(PartState::Draining);
            }
        }
        self.stop_relay_when_handlers_ended();
    }

    fn stop_relay_when_handlers_ended(&mut self) {
        if self.handlers_left > 0 || *self.stop_relay.borrow() {
            return;
        }
        self.stop_relay.send_replace(true);
        for (_, role, state) in self.parts.values() {
            if *role == Role::Relay && state.get() == PartState::Running {
                state.set(PartState::Draining);
            }
        }
    }

    /// A part's task ended: records how, and stops the app if the part ended by itself.
    fn ended(&mut self, ended: Result<(Id, Result<(), Error>), tokio::task::JoinError>) {
        let id = match &ended {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let Some((name, role, state)) = self.parts.remove(&id) else {
            return;
        };
        let told = match role {
            Role::Handler => *self.stop_handlers.borrow(),
            Role::Relay => *self.stop_relay.borrow(),
        };
        let failure = match ended {
            Ok((_, Ok(()))) if told => None,
            Ok((_, Ok(()))) => Some(ended_early(&name, role)),
            Ok((_, Err(e))) => Some(e),
            Err(e) if e.is_panic() => {
                tracing::error!(part = %name, "panicked: stopping the app");
                state.set(PartState::Failed);
                self.panic.get_or_insert(e.into_panic());
                None
            }
            // Cancelled: only when the runtime shuts down.
            Err(_) => None,
        };
        match failure {
            Some(e) => {
                state.set(PartState::Failed);
                if self.first_error.is_none() && self.panic.is_none() {
                    tracing::error!(part = %name, error = %e, "ended by itself: stopping the app");
                    self.first_error = Some(e);
                } else {
                    tracing::warn!(part = %name, error = %e, "failed while the app was stopping");
                }
            }
            None if state.get() != PartState::Failed => state.set(PartState::Stopped),
            None => {}
        }
        if role == Role::Handler {
            self.handlers_left -= 1;
        }
        if state.get() == PartState::Failed {
            self.stop_handlers();
        }
        self.stop_relay_when_handlers_ended();
    }

    /// After every part has ended: the first error, or the first panic resumed.
    fn finish(self) -> Result<(), Error> {
        if let Some(panic) = self.panic {
            std::panic::resume_unwind(panic);
        }
        match self.first_error {
            Some(e) => Err(e),
            None => {
                tracing::info!("app stopped");
                Ok(())
            }
        }
    }
}

/// The error of a part that returned before it was told to stop.
fn ended_early(name: &str, role: Role) -> Error {
    let what = match role {
        Role::Handler => format!("the transport of handler `{name}` ended before shutdown"),
        Role::Relay => "the relay stopped before shutdown".to_owned(),
    };
    Error::Transport(TransportError::msg(what))
}
