//! The handler contract: what `#[handler]` generates and what a handler receives.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;

use crate::delivery::Delivery;
use crate::inbox::{Backend, TableNames};
use crate::outbox::OutboxMessage;
use crate::{Error, HandlerError};

/// The id of the `n`th message (from 0) that the run of (`handler`, `key`) writes to the
/// outbox, unless it names its own: the same on every attempt and redelivery.
fn outbox_message_id(handler: &str, key: &str, n: u32) -> String {
    crate::key::idempotency_key(handler, key, &format!("outbox/{n}"))
}

/// What to do when a key arrives again with a different payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConflictPolicy {
    /// Dead-letter it with reason `key_conflict` (the default): a human should look.
    #[default]
    DeadLetter,
    /// Ack it without running the handler, logging a warning and counting it.
    Skip,
}

/// A handler's identity and retry settings. Built by `#[handler]`; validated when the worker
/// starts (a bad value fails there, naming the option).
#[derive(Debug, Clone)]
pub struct HandlerOptions {
    pub(crate) name: Cow<'static, str>,
    pub(crate) key: Option<Cow<'static, str>>,
    pub(crate) payload_hash: bool,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: (Duration, Duration),
    pub(crate) retention: Duration,
    pub(crate) timeout: Duration,
    pub(crate) on_conflict: ConflictPolicy,
    pub(crate) aliases: Vec<Cow<'static, str>>,
}

impl HandlerOptions {
    /// Defaults: no key template, no payload hashing, 5 attempts, backoff 500ms doubling to
    /// 60s, 7 days of retention, a 30s timeout, conflicts dead-lettered.
    ///
    /// `name` is the stable identity stored in the inbox: renaming it makes every message
    /// new, unless the old name is kept as an alias ([`HandlerOptions::alias`]).
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        HandlerOptions {
            name: name.into(),
            key: None,
            payload_hash: false,
            max_attempts: 5,
            backoff: (Duration::from_millis(500), Duration::from_secs(60)),
            retention: Duration::from_secs(7 * 24 * 3600),
            timeout: Duration::from_secs(30),
            on_conflict: ConflictPolicy::DeadLetter,
            aliases: Vec::new(),
        }
    }

    /// A key template over the message's fields, e.g. `invoice-{order_id}`. It takes
    /// precedence over the message id: a handler that names its key has said what makes two
    /// messages the same job.
    pub fn key(mut self, template: impl Into<Cow<'static, str>>) -> Self {
        self.key = Some(template.into());
        self
    }

    /// Allow a SHA-256 of the canonical payload as the key when there is neither a template
    /// nor a message id.
    pub fn payload_hash(mut self, allow: bool) -> Self {
        self.payload_hash = allow;
        self
    }

    /// Attempts before the message is dead-lettered (at least 1). Crashed attempts count.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Exponential backoff from `base`, doubling, capped at `cap`; each delay is jittered
    /// between half its value and its value (see [`crate::ExponentialBackoff`]).
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff = (base, cap);
        self
    }

    /// How long a completed key is remembered (duplicates within it are skipped).
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Longest a handler may run; past it the attempt fails (transiently) and rolls back.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// What to do on a key conflict.
    pub fn on_conflict(mut self, policy: ConflictPolicy) -> Self {
        self.on_conflict = policy;
        self
    }

    /// A name the handler had before, whose inbox keys it takes over: a key completed (or
    /// dead-lettered, or pending) under `old_name` counts as this handler's, so renaming a
    /// handler does not run its keys again. May be called several times.
    ///
    /// Keep an alias while the old name's keys can still be redelivered (the handler's
    /// retention). Stop the workers running under the old name before starting the renamed
    /// ones: a key delivered to both at once is checked by each under its own name only.
    pub fn alias(mut self, old_name: impl Into<Cow<'static, str>>) -> Self {
        self.aliases.push(old_name.into());
        self
    }

    /// The handler's stable name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configured attempt limit.
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }
}

/// A message handler. Write an `async fn` and put `#[handler]` on it rather than
/// implementing this by hand.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a message handler for database `{DB}`",
    note = "put `#[consumer_core::handler]` on an `async fn(ctx: &mut Context<'_, {DB}>, message: M)`"
)]
pub trait Handler<DB: Backend>: Send + Sync + 'static {
    /// The message type, decoded from the payload as JSON.
    type Message: DeserializeOwned + Send + 'static;

    /// Identity and retry settings.
    fn options(&self) -> HandlerOptions;

    /// Runs the handler inside the delivery's transaction.
    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut Context<'c, DB>,
        message: Self::Message,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a;

    /// Whether [`Handler::handle_batch`] is implemented: `#[handler(batch = "fn_name")]`
    /// sets it. Only batched mode ([`BatchConfig`](crate::BatchConfig)) uses it.
    fn handles_batches(&self) -> bool {
        false
    }

    /// Runs a whole batch at once, in the batch's transaction, so its effects can be written
    /// with one statement (say an `INSERT ... SELECT * FROM unnest(...)`) instead of one per
    /// message. Called in batched mode when [`Handler::handles_batches`] is true, with the
    /// batch's runnable messages (distinct keys, claimed, in delivery order; what is known of
    /// each is in `ctx`, by index).
    ///
    /// It must have the effects of calling [`Handler::handle`] for each message: if it fails,
    /// or panics, or times out (the handler's timeout applies to the whole batch), the batch
    /// is rolled back and every message runs again alone through `handle`, in its own
    /// transaction, so each gets its own outcome. The default fails, so that a handler which
    /// claims batches without implementing this still processes every message.
    fn handle_batch<'a, 'c>(
        &'a self,
        ctx: &'a mut BatchContext<'c, DB>,
        messages: Vec<Self::Message>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        let _ = (ctx, messages);
        Box::pin(async { Err(HandlerError::transient("no batch function")) })
    }
}

/// What a batch function receives (see [`Handler::handle_batch`]): the batch's open
/// transaction and, by index in the batch, each message's key, attempt and delivery.
///
/// Everything written through [`BatchContext::db`] commits atomically with the inbox marking
/// every key of the batch completed, and before any of its deliveries is acked.
pub struct BatchContext<'c, DB: Backend> {
    pub(crate) conn: &'c mut DB::Connection,
    pub(crate) handler: &'c str,
    pub(crate) members: &'c [BatchMember<'c>],
    pub(crate) names: &'c TableNames,
    /// What each member has written to the outbox so far, by index (filled on first use).
    pub(crate) written: Vec<Written>,
    /// Set when a message was written: the runtime wakes the relays after the commit.
    pub(crate) wrote: &'c AtomicBool,
}

/// What the runtime knows of one message of a batch.
pub(crate) struct BatchMember<'c> {
    pub(crate) key: &'c str,
    pub(crate) attempt: u32,
    pub(crate) delivery: &'c Delivery,
}

impl<'c, DB: Backend> BatchContext<'c, DB> {
    /// The transaction's connection: use it as the executor for every write.
    pub fn db(&mut self) -> &mut DB::Connection {
        self.conn
    }

    /// The handler's stable name.
    pub fn handler(&self) -> &str {
        self.handler
    }

    /// How many messages the batch holds.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the batch is empty (it never is when the runtime calls the handler).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The idempotency key of message `i`. Panics if `i` is out of range, as indexing does.
    pub fn key(&self, i: usize) -> &str {
        self.members[i].key
    }

    /// The attempt number of message `i`, as counted by the inbox (1 for the first).
    pub fn attempt(&self, i: usize) -> u32 {
        self.members[i].attempt
    }

    /// The delivery of message `i`: message id, headers, source.
    pub fn delivery(&self, i: usize) -> &Delivery {
        self.members[i].delivery
    }

    /// Writes `message` to the outbox in the batch's transaction, on behalf of message `i`
    /// (see [`Context::publish`]: its id, unless it has one, derives from message `i`'s key,
    /// so it is the same whether the message runs in a batch or alone). Returns the id.
    pub async fn publish(&mut self, i: usize, message: OutboxMessage) -> Result<String, Error> {
        self.run_outbox(i).publish(message).await
    }

    /// Writes `messages` to the outbox in the batch's transaction, each on behalf of the
    /// message of the batch its index names, in one statement on PostgreSQL: the same rows,
    /// ids and order as [`BatchContext::publish`] of each in turn, with one round trip in
    /// all. Returns their ids, in order.
    pub async fn publish_all(
        &mut self,
        messages: impl IntoIterator<Item = (usize, OutboxMessage)>,
    ) -> Result<Vec<String>, Error> {
        if self.written.len() < self.members.len() {
            self.written.resize(self.members.len(), Written::default());
        }
        // Each message's count of messages written, counted on once the rows are in.
        let mut published: Vec<u32> = self.written.iter().map(|w| w.published).collect();
        let mut rows = Vec::new();
        for (i, message) in messages {
            let m = &self.members[i];
            let id = match &message.message_id {
                Some(id) => id.clone(),
                None => outbox_message_id(self.handler, m.key, published[i]),
            };
            published[i] += 1;
            let parent = m.delivery.headers.get(crate::trace::TRACEPARENT);
            rows.push((message, id, parent));
        }
        crate::outbox::insert_all::<DB>(self.conn, self.names, &rows).await?;
        for (written, n) in self.written.iter_mut().zip(published) {
            written.published = n;
        }
        if !rows.is_empty() {
            self.wrote.store(true, Ordering::Relaxed);
        }
        Ok(rows.into_iter().map(|(_, id, _)| id).collect())
    }

    /// [`Context::reply`] to message `i` of the batch.
    pub async fn reply(
        &mut self,
        i: usize,
        body: impl Into<bytes::Bytes>,
    ) -> Result<String, Error> {
        self.run_outbox(i).reply(body.into()).await
    }

    /// The outbox as message `i`'s run writes to it.
    fn run_outbox(&mut self, i: usize) -> RunOutbox<'_, DB> {
        if self.written.len() < self.members.len() {
            self.written.resize(self.members.len(), Written::default());
        }
        let m = &self.members[i];
        RunOutbox {
            conn: &mut *self.conn,
            names: self.names,
            handler: self.handler,
            key: m.key,
            delivery: m.delivery,
            written: &mut self.written[i],
            wrote: self.wrote,
        }
    }

    /// A stable key for an effect of message `i` outside the database: the same as
    /// [`Context::idempotency_key`] gives that message when it runs alone.
    pub fn idempotency_key(&self, i: usize, effect: &str) -> String {
        crate::key::idempotency_key(self.handler, self.members[i].key, effect)
    }
}

/// What a handler receives: the open transaction and facts about the delivery.
///
/// Everything written through [`Context::db`] commits atomically with the inbox marking this
/// key completed, and before the delivery is acked.
pub struct Context<'c, DB: Backend> {
    /// A connection inside the open transaction (owned by the runtime, which commits it).
    pub(crate) conn: &'c mut DB::Connection,
    pub(crate) handler: &'c str,
    pub(crate) key: &'c str,
    pub(crate) attempt: u32,
    pub(crate) delivery: &'c Delivery,
    pub(crate) fresh: bool,
    pub(crate) names: &'c TableNames,
    /// What this attempt has written to the outbox so far.
    pub(crate) written: Written,
    /// Set when a message was written: the runtime wakes the relays after the commit.
    pub(crate) wrote: &'c AtomicBool,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: Option<&'c dyn crate::fault::FaultInjector>,
}

impl<'c, DB: Backend> Context<'c, DB> {
    /// The transaction's connection: use it as the executor for every write.
    pub fn db(&mut self) -> &mut DB::Connection {
        self.conn
    }

    /// The idempotency key of this message.
    pub fn key(&self) -> &str {
        self.key
    }

    /// The handler's stable name.
    pub fn handler(&self) -> &str {
        self.handler
    }

    /// This attempt's number, as counted by the inbox (1 for the first; crashes count).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The delivery: message id, headers, source.
    pub fn delivery(&self) -> &Delivery {
        self.delivery
    }

    /// Whether this attempt took the fresh path: the inbox found the delivery to be
    /// nobody's repeat (see [`Delivery::origin`]), so it counted no attempt ahead and
    /// claims the key in this transaction.
    pub fn fresh(&self) -> bool {
        self.fresh
    }

    /// A named fault point inside the handler, for chaos tests: call it right after an
    /// external effect, before its transaction records it ([`FaultPoint::InEffect`]). Does
    /// nothing unless the worker was configured with a fault injector.
    ///
    /// Only with the `fault-injection` feature.
    ///
    /// [`FaultPoint::InEffect`]: crate::fault::FaultPoint::InEffect
    #[cfg(feature = "fault-injection")]
    pub fn fault_point(&self, point: crate::fault::FaultPoint) -> Result<(), HandlerError> {
        let Some(faults) = self.faults else {
            return Ok(());
        };
        match faults.check(point, self.handler, self.key) {
            None => Ok(()),
            Some(crate::fault::FaultAction::Abort) => {
                tracing::error!(
                    fault_point = point.as_str(),
                    key = self.key,
                    "fault point: aborting the process"
                );
                std::process::abort()
            }
            Some(crate::fault::FaultAction::StopWorker) => Err(HandlerError::crash(point)),
        }
    }

    /// Writes `message` to the outbox in this handler's transaction: it is published (by a
    /// [`Relay`](crate::Relay)) once the transaction commits with the handler's effects and
    /// the key's completion, and never if it rolls back. Returns its message id: the
    /// message's own, or one derived from the handler, the key and how many messages this
    /// run wrote before, so that every attempt and redelivery writes the same ids and the
    /// receiving inbox deduplicates a re-send.
    pub async fn publish(&mut self, message: OutboxMessage) -> Result<String, Error> {
        self.run_outbox().publish(message).await
    }

    /// Replies to this request with `body`, through the outbox in this handler's
    /// transaction: the reply goes to the request's reply address ([`header_names::REPLY_TO`]:
    /// RabbitMQ's `reply_to`, a Kafka header) with the request's correlation id
    /// ([`header_names::CORRELATION_ID`], else its message id), once the transaction commits. It is
    /// also kept with the key: a duplicate of the request is answered with the same reply
    /// again, byte for byte, instead of being acked in silence. Fails if the request names no
    /// reply address, or this run replied already. Returns the reply's message id.
    ///
    /// [`header_names::REPLY_TO`]: crate::header_names::REPLY_TO
    /// [`header_names::CORRELATION_ID`]: crate::header_names::CORRELATION_ID
    pub async fn reply(&mut self, body: impl Into<bytes::Bytes>) -> Result<String, Error> {
        self.run_outbox().reply(body.into()).await
    }

    /// The outbox as this attempt writes to it.
    fn run_outbox(&mut self) -> RunOutbox<'_, DB> {
        RunOutbox {
            conn: &mut *self.conn,
            names: self.names,
            handler: self.handler,
            key: self.key,
            delivery: self.delivery,
            written: &mut self.written,
            wrote: self.wrote,
        }
    }

    /// A stable key for an effect outside the database, e.g. a provider's
    /// `Idempotency-Key` header: the same for every attempt and redelivery of this message.
    pub fn idempotency_key(&self, effect: &str) -> String {
        crate::key::idempotency_key(self.handler, self.key, effect)
    }
}

/// What one message's run has written to the outbox.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Written {
    /// Messages published so far (the next one's id derives from the count).
    published: u32,
    /// Whether it replied (a request gets one reply).
    replied: bool,
}

/// The outbox as one message's run writes to it: what [`Context`] and [`BatchContext`] both
/// write through, so that a message writes the same ids in a batch as alone.
struct RunOutbox<'r, DB: Backend> {
    conn: &'r mut DB::Connection,
    names: &'r TableNames,
    handler: &'r str,
    key: &'r str,
    delivery: &'r Delivery,
    written: &'r mut Written,
    /// Set when a message was written: the runtime wakes the relays after the commit.
    wrote: &'r AtomicBool,
}

impl<DB: Backend> RunOutbox<'_, DB> {
    /// See [`Context::publish`].
    async fn publish(self, message: OutboxMessage) -> Result<String, Error> {
        let id = match &message.message_id {
            Some(id) => id.clone(),
            None => outbox_message_id(self.handler, self.key, self.written.published),
        };
        let parent = self.delivery.headers.get(crate::trace::TRACEPARENT);
        crate::outbox::insert::<DB>(self.conn, self.names, &message, &id, parent).await?;
        self.written.published += 1;
        self.wrote.store(true, Ordering::Relaxed);
        Ok(id)
    }

    /// See [`Context::reply`].
    async fn reply(self, body: bytes::Bytes) -> Result<String, Error> {
        if self.written.replied {
            return Err(Error::Message("a request gets one reply".to_owned()));
        }
        let id = crate::outbox::reply::write::<DB>(
            self.conn,
            self.names,
            self.handler,
            self.key,
            self.delivery,
            body,
        )
        .await?;
        self.written.replied = true;
        self.wrote.store(true, Ordering::Relaxed);
        Ok(id)
    }
}
