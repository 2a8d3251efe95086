//! The worker's settings ([`WorkerConfig`], [`BatchConfig`]) and the handler's options
//! validated against them ([`Settings`]).

use std::sync::Arc;
use std::time::Duration;

use crate::handler::{ConflictPolicy, HandlerOptions};
use crate::inbox::{Backend, Inbox};
use crate::key::KeyTemplate;
use crate::retry::{ExponentialBackoff, Jitter};
use crate::Error;

/// Runtime settings of a worker (the handler's own settings come from `#[handler]`).
///
/// Start from [`WorkerConfig::default`] and change what you need with the `with_*` methods
/// (or by assigning a field); [`Worker::with_config`](crate::Worker::with_config) rejects an
/// invalid value, naming it. New settings may be added in any release, so the struct cannot
/// be built with a literal.
///
/// ```
/// use std::time::Duration;
/// use consumer_core::{BatchConfig, WorkerConfig};
///
/// let config = WorkerConfig::default()
///     .with_concurrency(16)
///     .with_batch(BatchConfig::new(64, Duration::from_millis(5)));
/// assert_eq!(config.concurrency, 16);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// Deliveries (or batches) worked on at once: prepared, run and committed (default 8). A
    /// delivery whose outcome is committed and only waits for the broker to take its ack
    /// does not count; the transport bounds those (RabbitMQ's prefetch, say).
    pub concurrency: usize,
    /// Overrides the handler's `max_attempts`.
    pub max_attempts: Option<u32>,
    /// Overrides the handler's timeout.
    pub handler_timeout: Option<Duration>,
    /// Overrides the handler's retention of completed keys.
    pub retention: Option<Duration>,
    /// How often expired inbox rows are purged (default 60s; `None` disables the task).
    pub retention_interval: Option<Duration>,
    /// How long a pending key's row is kept once no copy of its message can still arrive
    /// (default 7 days; `None` keeps pending rows until an attempt settles them). The
    /// retention task deletes the handler's pending rows that nothing has updated for this
    /// long and whose newest retry copy, if any, was due longer ago than this plus the
    /// inbox's [`copy_grace`](crate::InboxConfig::copy_grace). A pending row holds no effect
    /// (effects commit with the completion), so a message that still arrives afterwards
    /// runs once, as new, with its attempts counted from one. Must be longer than the
    /// handler's timeout, so that an attempt in flight never loses its row.
    pub pending_retention: Option<Duration>,
    /// Rows deleted per purge statement (default 1000).
    pub retention_batch: u32,
    /// How often the inbox gauges (the handler's rows by status, the stalest pending key's
    /// age) are read from the database (default 30s; `None` disables the task). Each
    /// reading counts the handler's rows, so a very large inbox may want it slower.
    pub inbox_gauge_interval: Option<Duration>,
    /// Lets the worker start although the handler's key template differs from the one the
    /// inbox's keys under its name were made with (default `false`: [`Worker::run`](crate::Worker::run)
    /// refuses, naming both templates). Each key made with the old template then runs again
    /// once, with its new key.
    pub allow_key_template_change: bool,
    /// Dead-letters (`too_old`) a delivery published longer ago than the handler's
    /// retention instead of running it (default `false`: it runs, and is counted in
    /// `consumer_too_old_total`). Its key's row may have been purged, so the inbox may not
    /// know it ran: running it again could repeat its effect. Only deliveries whose
    /// transport knows when they were published
    /// ([`Delivery::published_at`](crate::transport::Delivery::published_at)) can be told.
    pub dead_letter_too_old: bool,
    /// Replaces the backoff's randomness (deterministic tests).
    pub jitter: Option<Arc<dyn Jitter>>,
    /// Payloads larger than this are dead-lettered (`payload_too_large`) without being
    /// decoded (default 1 MiB).
    pub max_payload_bytes: usize,
    /// Batched mode: process up to this many deliveries in one database transaction.
    /// `None` (the default) processes one delivery per transaction.
    pub batch: Option<BatchConfig>,
    /// Fault points (the chaos suite); `None` in production.
    #[cfg(feature = "fault-injection")]
    pub faults: Option<Arc<dyn crate::fault::FaultInjector>>,
    /// DELIBERATELY BROKEN, for proving the chaos suite can fail: ack every delivery before
    /// its handler runs. Never set this outside that test.
    #[cfg(feature = "fault-injection")]
    pub broken_ack_before_commit: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 8,
            max_attempts: None,
            handler_timeout: None,
            retention: None,
            retention_interval: Some(Duration::from_secs(60)),
            pending_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            retention_batch: 1000,
            inbox_gauge_interval: Some(Duration::from_secs(30)),
            allow_key_template_change: false,
            dead_letter_too_old: false,
            jitter: None,
            max_payload_bytes: Self::DEFAULT_MAX_PAYLOAD_BYTES,
            batch: None,
            #[cfg(feature = "fault-injection")]
            faults: None,
            #[cfg(feature = "fault-injection")]
            broken_ack_before_commit: false,
        }
    }
}

impl WorkerConfig {
    /// The default of [`WorkerConfig::max_payload_bytes`]: 1 MiB. Transports size what they
    /// must be able to copy (a retry or dead-letter copy of any payload the worker runs) from
    /// it.
    pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

    /// Sets [`WorkerConfig::concurrency`].
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Sets [`WorkerConfig::max_attempts`].
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    /// Sets [`WorkerConfig::handler_timeout`].
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// Sets [`WorkerConfig::retention`].
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Sets [`WorkerConfig::retention_interval`] (`None`: no purge task).
    pub fn with_retention_interval(mut self, interval: Option<Duration>) -> Self {
        self.retention_interval = interval;
        self
    }

    /// Sets [`WorkerConfig::pending_retention`] (`None`: pending rows are kept).
    pub fn with_pending_retention(mut self, retention: Option<Duration>) -> Self {
        self.pending_retention = retention;
        self
    }

    /// Sets [`WorkerConfig::inbox_gauge_interval`] (`None`: no gauge task).
    pub fn with_inbox_gauge_interval(mut self, interval: Option<Duration>) -> Self {
        self.inbox_gauge_interval = interval;
        self
    }

    /// Sets [`WorkerConfig::retention_batch`].
    pub fn with_retention_batch(mut self, rows: u32) -> Self {
        self.retention_batch = rows;
        self
    }

    /// Sets [`WorkerConfig::allow_key_template_change`].
    pub fn with_allow_key_template_change(mut self, allow: bool) -> Self {
        self.allow_key_template_change = allow;
        self
    }

    /// Sets [`WorkerConfig::dead_letter_too_old`].
    pub fn with_dead_letter_too_old(mut self, dead_letter: bool) -> Self {
        self.dead_letter_too_old = dead_letter;
        self
    }

    /// Sets [`WorkerConfig::jitter`].
    pub fn with_jitter(mut self, jitter: Arc<dyn Jitter>) -> Self {
        self.jitter = Some(jitter);
        self
    }

    /// Sets [`WorkerConfig::max_payload_bytes`].
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Sets [`WorkerConfig::batch`]: a [`BatchConfig`] for batched mode, `None` for one
    /// delivery per transaction.
    pub fn with_batch(mut self, batch: impl Into<Option<BatchConfig>>) -> Self {
        self.batch = batch.into();
        self
    }

    /// Sets [`WorkerConfig::faults`].
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(mut self, faults: Arc<dyn crate::fault::FaultInjector>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// Sets [`WorkerConfig::broken_ack_before_commit`]: DELIBERATELY BROKEN, for proving
    /// the chaos suite can fail.
    #[cfg(feature = "fault-injection")]
    pub fn with_broken_ack_before_commit(mut self, broken: bool) -> Self {
        self.broken_ack_before_commit = broken;
        self
    }
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("WorkerConfig");
        d.field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("handler_timeout", &self.handler_timeout)
            .field("retention", &self.retention)
            .field("retention_interval", &self.retention_interval)
            .field("pending_retention", &self.pending_retention)
            .field("retention_batch", &self.retention_batch)
            .field("inbox_gauge_interval", &self.inbox_gauge_interval)
            .field("allow_key_template_change", &self.allow_key_template_change)
            .field("dead_letter_too_old", &self.dead_letter_too_old)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("batch", &self.batch);
        #[cfg(feature = "fault-injection")]
        d.field("faults", &self.faults.is_some());
        d.finish_non_exhaustive()
    }
}

/// Batched mode: many deliveries, one transaction, one commit.
///
/// The keys of a batch are claimed with one statement, the handlers run in one shared
/// transaction, and the batch commits once; then every delivery is settled. If any handler
/// fails, that transaction is rolled back and the batch runs again one message per
/// transaction, so one failure never sinks or half-commits the others (and no attempt is
/// counted twice). What changes is the number of fsyncs per message, and one thing more:
///
/// - **Database effects** (written through the context) are exactly once, as in the
///   per-message mode: the rolled-back batch left nothing.
/// - **Effects outside the database** may be made once more, even with no crash: when one
///   member fails, every member that ran before it in the batch (up to `max_messages - 1`)
///   runs again alone, and repeats any external call it made. Such a call must be safe to
///   repeat: hand the provider [`Context::idempotency_key`](crate::Context::idempotency_key)
///   (the same on every run of the key), or ask the provider whether the effect exists
///   before making it. Where neither is possible, use the per-message mode.
///
/// A handler with a batch function (`#[handler(batch = "fn_name")]`, see
/// [`Handler::handle_batch`](crate::Handler::handle_batch)) gets the whole batch in one call
/// and can write its effects with one statement; the one-by-one rerun after a failure uses
/// the per-message handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// The most deliveries in one batch (at least 1).
    pub max_messages: usize,
    /// How long to wait for more deliveries after the first one arrived.
    pub max_wait: Duration,
}

impl BatchConfig {
    /// Up to `max_messages` deliveries a batch, waiting at most `max_wait` after the first.
    pub const fn new(max_messages: usize, max_wait: Duration) -> Self {
        BatchConfig {
            max_messages,
            max_wait,
        }
    }
}

impl Default for BatchConfig {
    /// 64 deliveries, 5 ms.
    fn default() -> Self {
        BatchConfig::new(64, Duration::from_millis(5))
    }
}

/// The handler's options after validation, with the worker's overrides applied.
#[derive(Debug)]
pub(super) struct Settings {
    pub(super) name: String,
    /// The names the handler had before (see [`HandlerOptions::alias`]).
    pub(super) aliases: Vec<String>,
    pub(super) key: Option<KeyTemplate>,
    pub(super) payload_hash: bool,
    pub(super) max_attempts: u32,
    pub(super) backoff: ExponentialBackoff,
    pub(super) retention: Duration,
    pub(super) timeout: Duration,
    pub(super) on_conflict: ConflictPolicy,
    pub(super) max_payload_bytes: usize,
    pub(super) allow_key_template_change: bool,
    pub(super) dead_letter_too_old: bool,
}

impl Settings {
    /// Checks the handler's options and the worker's configuration, naming the first bad
    /// field.
    pub(super) fn validate(o: HandlerOptions, config: &WorkerConfig) -> Result<Self, Error> {
        consumer_options::check_handler_name(&o.name)
            .map_err(|reason| Error::config("name", reason.to_string()))?;
        let mut aliases: Vec<String> = Vec::with_capacity(o.aliases.len());
        for alias in &o.aliases {
            consumer_options::check_handler_name(alias)
                .map_err(|reason| Error::config("aliases", reason.to_string()))?;
            if alias == &o.name || aliases.iter().any(|a| a == alias) {
                return Err(Error::config(
                    "aliases",
                    format!("{alias:?} is listed twice (an alias is not the handler's own name)"),
                ));
            }
            aliases.push(alias.to_string());
        }
        let max_attempts = config.max_attempts.unwrap_or(o.max_attempts);
        if max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        if config.batch.is_some_and(|b| b.max_messages == 0) {
            return Err(Error::config("batch.max_messages", "must be at least 1"));
        }
        if config.concurrency == 0 {
            return Err(Error::config("concurrency", "must be at least 1"));
        }
        // A zero period would make the task's timer panic.
        if config.retention_interval.is_some_and(|d| d.is_zero()) {
            return Err(Error::config(
                "retention_interval",
                "must be greater than zero",
            ));
        }
        if config.inbox_gauge_interval.is_some_and(|d| d.is_zero()) {
            return Err(Error::config(
                "inbox_gauge_interval",
                "must be greater than zero",
            ));
        }
        let timeout = config.handler_timeout.unwrap_or(o.timeout);
        if timeout.is_zero() {
            return Err(Error::config("timeout", "must be greater than zero"));
        }
        if config.pending_retention.is_some_and(|r| r <= timeout) {
            return Err(Error::config(
                "pending_retention",
                format!("must be longer than the handler's timeout ({timeout:?})"),
            ));
        }
        let mut backoff = ExponentialBackoff::new(o.backoff.0, o.backoff.1)?;
        if let Some(j) = &config.jitter {
            backoff = backoff.with_jitter(SharedJitter(j.clone()));
        }
        Ok(Settings {
            key: o.key.as_deref().map(KeyTemplate::parse).transpose()?,
            name: o.name.into_owned(),
            aliases,
            payload_hash: o.payload_hash,
            max_attempts,
            backoff,
            retention: config.retention.unwrap_or(o.retention),
            timeout,
            on_conflict: o.on_conflict,
            max_payload_bytes: config.max_payload_bytes,
            allow_key_template_change: config.allow_key_template_change,
            dead_letter_too_old: config.dead_letter_too_old,
        })
    }
}

impl Settings {
    /// Checks the handler's key template against the one its inbox rows were made with, and
    /// records it (see [`WorkerConfig::allow_key_template_change`]).
    pub(super) async fn check_key_template<DB: Backend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> Result<(), Error> {
        let template = self.key.as_ref().map_or("", KeyTemplate::as_str);
        let allow = self.allow_key_template_change;
        inbox
            .check_key_template(&self.name, &self.aliases, template, allow)
            .await
    }

    /// The handler's name, then its aliases: every name its inbox rows may be under.
    pub(super) fn names(&self) -> Vec<String> {
        std::iter::once(&self.name)
            .chain(&self.aliases)
            .cloned()
            .collect()
    }
}

struct SharedJitter(Arc<dyn Jitter>);

impl Jitter for SharedJitter {
    fn sample(&self) -> f64 {
        self.0.sample()
    }
}
