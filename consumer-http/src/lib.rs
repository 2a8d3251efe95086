//! Exactly-once effects for HTTP: an `Idempotency-Key` layer for tower and axum, and a
//! webhook ingress.
//!
//! Clients retry: a payment POST times out and is sent again, a mobile app resends on a
//! flaky network. [`IdempotencyLayer`] makes a retried request answer what the first one
//! answered, without running the handler again, and lets the handler's database writes
//! commit in the same transaction as the stored answer ([`IdempotentTx`]), as the
//! consumer's handlers commit with their inbox key.
//!
//! Providers resend too: a webhook whose 2xx never arrived comes again. [`WebhookIngress`]
//! verifies their signed events and hands them to a [`consumer_core::Worker`] as
//! deliveries, so a `#[handler]` runs each event once through the inbox (see
//! [Webhook ingress](#webhook-ingress)).
//!
//! # What the layer answers
//!
//! For the configured methods (default POST and PATCH; others pass through), with
//! [`IdempotencyConfig`]:
//!
//! - no `Idempotency-Key` → 400 (or pass through, if the key is optional); a key that is
//!   empty, repeated, over [`MAX_IDEMPOTENCY_KEY_BYTES`] or not printable ASCII → 400; a body
//!   over the limit → 413. The layer's own answers are `application/problem+json`. The key
//!   is a Structured Field string as the IETF draft writes it (`Idempotency-Key: "8e03"`:
//!   the key is what the quotes hold; parameters after it are ignored) or, as many clients
//!   send it, bare (`Idempotency-Key: 8e03`): the two forms are one key. A value that opens
//!   with a double quote and is not a string → 400. A key not of the format the service declares
//!   ([`IdempotencyConfigBuilder::key_format`], e.g. [`KeyFormat::uuid`]) → 400.
//! - The service's idempotency policy, as the draft asks a server to publish it:
//!   [`IdempotencyLayer::policy_document`] writes the one the configuration keeps, to serve
//!   at [`IdempotencyConfigBuilder::policy_url`]; the answers about a key (400 for the key,
//!   409, 422) then link to it (`Link: <url>; rel="describedby"`, problem type
//!   `url#invalid-key`, `#in-progress`, `#key-reused`).
//! - The record's **scope** is the caller and the route (method and path): what one caller
//!   stored, another cannot read. The layer's builder requires a function naming the
//!   authenticated caller of a request ([`IdempotencyLayerBuilder::caller`]; the layer keeps
//!   only a SHA-256 of the name), or the explicit opt-out
//!   [`shared_across_callers`](IdempotencyLayerBuilder::shared_across_callers) for keys that
//!   are global by design; without either, `build` does not compile. Two callers, or two
//!   routes, never share a record: another caller's request with the same key and body runs
//!   as its own, and is never a replay of, or a 422 against, someone else's record. A
//!   request the function names no caller for → 401, before anything runs.
//! - The request's **fingerprint** is its method, path and query, and body: a JSON body by
//!   its canonical form (object keys sorted, [`consumer_core::key::canonical_hash`], the one the
//!   inbox hashes message payloads with), any other body by its bytes.
//! - First request: the key is claimed (in progress), the handler runs, its status, selected
//!   headers (`content-type` and a configured list) and body are stored, and it is answered.
//! - Same key and fingerprint, completed: the stored answer, byte for byte, with
//!   `Idempotent-Replayed: true`.
//! - Same key, other fingerprint: 422, on every path that reads a record (a claim that lost
//!   a race, a wait, a replay, an in-progress claim).
//! - Same key while the first is in progress: the request waits up to the configured wait
//!   and answers the stored answer, or 409 with `Retry-After`.
//! - The handler answered 5xx, panicked or failed: its transaction rolls back and the key is
//!   free; a retry runs again. A 4xx is stored (configurable), except 408, 409, 425
//!   and 429 ([`TRANSIENT_CLIENT_ERRORS`]), which ask the client to try again: they roll
//!   back and free the key like a 5xx, so the retry runs the handler.
//! - A completed record lives for its TTL (default 24 h, [`DEFAULT_TTL`]), then the key
//!   runs again; [`IdempotencyStore::purge_expired`] deletes expired rows.
//! - A handler whose work finishes later starts a long operation in the request's
//!   transaction ([`IdempotentTx::start_operation`]) and answers 202 with where its status
//!   is ([`operations`]).
//!
//! # The claim and the transaction
//!
//! A request first holds its key in this process (a duplicate in the same process waits
//! there, holding no database connection, or is 422 at once if its fingerprint differs
//! from the running request's), then reads the key's record: a live record of another
//! fingerprint is 422, a completed one is replayed, so a replay writes nothing. A request
//! that finds no live record runs, in **one transaction**:
//!
//! 1. **Claim**: insert (scope, key) as `in_progress` with the fingerprint and a claim
//!    token unique to this request. The statement takes over a row that expired, and
//!    nothing else of another fingerprint. The row is not committed: the open transaction
//!    holds the key, and a request of another process that claims it waits on the row
//!    (PostgreSQL's primary key makes a second insert of a key wait for the first
//!    transaction's end), up to the configured wait, then 409.
//! 2. **Run**: the handler runs in the same transaction ([`IdempotentTx`]); the layer then
//!    stores the answer in it — `UPDATE ... SET status = 'completed' ... WHERE claim = <this
//!    request's token>` — and commits. The claim, the handler's rows and the stored answer
//!    commit together, in one commit, or not at all. A 5xx, a panic, an error or a failure
//!    to store rolls the transaction back, which takes the claim with it: the key is free.
//!    A call outside the database (a payment provider) cannot roll back: the handler hands
//!    it [`IdempotentTx::idempotency_key`], the same on every run of the request's key, so
//!    the provider sees a run that rolled back and its retry as one request.
//!
//! What follows:
//!
//! - **Crash between effect and store** (the process is killed after the handler's
//!   `INSERT`, before the commit): the transaction never commits, so neither the effect nor
//!   the claim is there; the database rolls it back as the process's connections close, and
//!   the client's retry runs at once, once.
//! - **A client that hangs up** while its request runs: the server drops the request, and
//!   with it the transaction, which rolls back: the key is free for the retry at once (an
//!   effect *outside* the transaction, a call to a provider, may have happened: hand the
//!   provider a key of its own).
//! - **Two concurrent requests**, in one process or two: one holds the key; the other waits
//!   (in the process, or on the row) until the first completes (a replay), rolls back (it
//!   runs) or its wait ends (409 with `Retry-After`). A concurrent request of another
//!   fingerprint is 422 in the same process at once; from another process, the database
//!   cannot see an uncommitted claim's fingerprint, so it waits like a duplicate and is 422
//!   once the first has completed (409 if its wait ends first).
//! - **A handler that runs long** holds its key for as long as it runs: no lease runs out
//!   under it, so no second run of the key starts meanwhile. Bound handlers with a timeout
//!   (a tower timeout outside the layer drops the request, which rolls it back).
//! - **Clocks**: TTLs are measured by the database's clock, so processes with skewed clocks
//!   agree.
//! - **The store fails** (a read, the claim, the commit): 503 with `Retry-After`; a commit
//!   whose outcome is unknown either stored the answer (the retry is a replay) or nothing
//!   (the retry runs).
//!
//! Every running request holds a database connection and its transaction while its handler
//! runs, and so does a request of another process waiting on its key (one per waiting
//! request: the Redis fast path below keeps them off the database). On SQLite the request's
//! transaction begins `IMMEDIATE`, so idempotent requests' transactions run one at a time
//! (SQLite has one writer): a request of another key waits for the running handler's commit
//! (the pool's busy timeout), and a database file must not be shared by two processes, nor
//! by two layers (each holds its keys in its own process table).
//!
//! A claim committed `in_progress` by an earlier version of the layer (which committed the
//! claim before running the handler) is waited for, and taken over by a request of its
//! fingerprint once the lease it was given runs out.
//!
//! # Long operations
//!
//! A handler whose work takes longer than a request should record the work in its
//! transaction (say, an `operations` row) and answer `202 Accepted` with the operation's id
//! (and a `Location` of its status, listed in
//! [`IdempotencyConfigBuilder::stored_headers`]). The 202 is stored like any 2xx: a retry
//! with the key gets the same 202 and id and starts nothing, and the client polls the status
//! endpoint, a `GET` the layer lets through. `examples/payments` does this for `POST
//! /refunds`.
//!
//! # Redis fast path
//!
//! With the `redis` feature (on by default), [`IdempotencyLayerBuilder::redis`] puts a
//! [`RedisFastPath`] in front of the store. The database stays the source of truth: its
//! claim decides who runs, its fingerprint check decides 422, and the stored answer commits
//! with the handler's writes, exactly as above. Redis holds two things per record, under
//! keys scoped like the record (the key prefix, the store's table, the scope and the key):
//!
//! - **The answer**, written after the request's transaction committed (never before, never
//!   for a run that rolled back or lost its claim), with the fingerprint it answers, for
//!   what is left of the record's TTL (measured from before the completion statement, so
//!   the copy never outlives the record). A request first looks there: an answer of its
//!   fingerprint is replayed, one of another fingerprint is 422, without a database round
//!   trip. A replay that had to read the database (Redis lost the answer, or was down when
//!   it was written) writes it to Redis for the next.
//! - **A lease**, `SET NX PX` ([`IdempotencyConfigBuilder::lease`], default 1 s, renewed
//!   every third of it while the request runs), taken in the same round trip when there
//!   is no answer, before the database's claim. A request that finds the lease held by a
//!   request of its fingerprint waits in Redis, polling every `poll_interval`, for the
//!   answer: concurrent duplicates in any number of processes then cost the database
//!   nothing. When the lease is released (a 5xx, a panic, a failure, a client that hung
//!   up: the holder deletes it if it is still its own) or runs out (its process died), the
//!   next request takes it. At the end of the
//!   wait, and whenever the lease is held by a request of *another* fingerprint (Redis
//!   cannot tell which of the two owns the key), the request goes on to the database,
//!   which decides as without Redis. The lease is a way to wait, never a permission.
//!
//! **Redis down or slow** changes no answer: every Redis call is bounded by a timeout
//! (default 100 ms); a failure is logged at warn, counted in
//! `consumer_http_redis_failures_total{op}` (`op`: `lookup`, `publish`, `renew`, `release`), and
//! Redis is skipped for a pause (default 1 s) during which the layer runs on the database
//! alone. A lease that could not be released runs out; an answer that could not be cached
//! is read from the database. The URL's credentials appear neither in `Debug` output nor in
//! errors or logs.
//!
//! What follows: a record deleted from the database by hand stays replayable from Redis
//! until its cached TTL ends (delete both); several databases sharing one Redis need
//! distinct [key prefixes](RedisFastPathBuilder::key_prefix) unless their tables' names
//! differ; and a request that waited on the lease costs one Redis call per poll instead of
//! one database read.
//!
//! # Webhook ingress
//!
//! [`WebhookIngress::builder`] takes the route, one or more signing secrets (several while
//! a provider rotates), where the event id is (default: the top-level JSON field `id`; or a
//! header) and the limits; [`WebhookIngress::into_parts`] gives an axum [`Router`](axum::Router)
//! with one `POST` route, and a [`WebhookTransport`] for a [`consumer_core::Worker`] running
//! the application's `#[handler]`. There is one delivery pipeline: the handler runs with the
//! same semantics as on a queue. Its writes through `ctx.db()` commit with the event's inbox
//! key, failures are retried or dead-lettered, and the key is the event id (the delivery's
//! message id) unless the handler names a key template. Give each provider its own handler
//! name: the inbox keys are per handler.
//!
//! A request is checked in this order, and every refusal is answered
//! (`application/problem+json`) before anything reaches the worker or the inbox:
//!
//! 1. A body over the limit (default 1 MiB) → 413, by `Content-Length` before reading or
//!    while reading.
//! 2. The signature header (default `Webhook-Signature: t=<unix seconds>,v1=<hex>`, several
//!    `v1` entries allowed, other schemes ignored) missing, repeated or malformed, or no
//!    `v1` entry the HMAC-SHA256 of `<t>.<body>` under a configured secret → 401. Tags are
//!    compared in constant time, every secret against every entry. A valid signature whose
//!    `t` is further than the tolerance (default 5 min) from this server's clock, in the past
//!    or the future → 401.
//! 3. A body that is not JSON, or no usable event id (missing, not a string or integer,
//!    empty, over [`MAX_KEY_BYTES`](consumer_core::key::MAX_KEY_BYTES), holding a control
//!    character) → 400.
//!
//! The event then becomes a [`Delivery`](consumer_core::transport::Delivery): the event id as
//! message id, the body as payload, the headers `content-type`, `user-agent`, `traceparent`,
//! `tracestate` (the trace context joins the delivery's span), the event id header when the
//! id comes from one, and [`webhook-timestamp`](webhook::WEBHOOK_TIMESTAMP); attempt 1,
//! origin [`Unknown`](consumer_core::transport::Origin::Unknown) (any request may be a resend, so
//! every event takes the counted path), source `webhook:<route>`. It waits in a bounded
//! buffer for the worker, and the request waits for its settlement:
//!
//! | the worker settles | answer | what it means |
//! |---|---|---|
//! | ack: committed now, or a duplicate | 200 `{"received": true}` | the effect committed, once; a duplicate is always answered 2xx |
//! | retry: a transient failure, attempts left | 503, `Retry-After` the backoff's delay | rolled back; the inbox counted the attempt. The provider's resend is the retry (its schedule rules; `Retry-After` is a hint), and `max_attempts` counts across resends |
//! | dead letter | 200 `{"received": true, "dead_lettered": "<reason>"}` | a resend cannot fix it (a permanent error, the last attempt failed, a key conflict, a body the handler's type cannot decode, one over the worker's `max_payload_bytes`, a key the inbox cannot hold), so the provider is told to stop. Answered only once the worker kept the whole event (body, headers, event id, route, handler, key, reason, error, attempts) in the inbox's dead-letter table ([`Inbox::dead_letters`](consumer_core::Inbox::dead_letters)); if that write fails, the worker settles a retry instead (503). Logged at warn with the reason. A dead row answers every resend the same, without running, and the resend counts one more delivery on the same letter; [`Inbox::release`](consumer_core::Inbox::release) and a resend (from the provider's dashboard, or `consumer dlq replay --broker inbox`, which posts the kept body) replay it |
//! | nothing: no worker runs the transport, or the event was dropped unsettled with a stopping worker | 503, `Retry-After: 1` | nothing ran; the provider resends |
//! | nothing within `answer_within` (default 10 s) | 503, `Retry-After: 1` | the event may still commit; the resend is then a duplicate |
//!
//! A key conflict, the same event id with another body (by its canonical JSON), leaves the
//! first body's effect and its completed row as they were; the other body is the dead
//! letter (`key_conflict`), answered 200, since resending it cannot change the outcome.
//!
//! What follows:
//!
//! - **Once per event**: concurrent resends of one event wait on its key's lock, and all but
//!   the first are duplicates. A 200 for an ack is sent only after the commit.
//! - **A client that hangs up**, or a provider that stops waiting: an event the worker took
//!   still runs and commits (its settlement finds no request, which is fine); one still in
//!   the buffer is taken and runs too; one not yet buffered was never handed over. Either
//!   way the resend is answered from the inbox.
//! - **Replays**: a captured request passes the signature check only within the tolerance,
//!   and is then a duplicate, provided the handler's inbox retention (default 7 days) is
//!   longer than the tolerance and than the provider's resend window. An event id read from
//!   a header is not covered by the signature: a replay inside the tolerance with another id
//!   runs as a new event, so prefer a field of the signed body.
//! - **Secrets** never appear in `Debug` output, logs or errors; a 401's detail says what was
//!   wrong, never which secret or tag was expected.
//!
//! # Layout
//!
//! - `config`: [`IdempotencyConfig`] and its builder; `request`: the key check, the scope
//!   and the fingerprint; `problem`: the problem+json answers; `stored`: a stored answer
//!   and its replay.
//! - `layer`: [`IdempotencyLayer`], its builder and its service [`Idempotency`]; `caller`:
//!   whose a record is ([`Callers`], the builder's states); `flow`: one request
//!   through them (decide, run, store or roll back); `held`: the keys a layer's requests
//!   are running in this process; `tx`: [`IdempotentTx`]; `policy`: the idempotency
//!   policy a layer keeps, written out to publish; `housekeeping`: the layer's background
//!   task (the purge of expired records, the gauges); [`metrics`]: what the layer counts
//!   (answers by route and outcome, the time to decide on a key, the records by status and
//!   purged, the oldest request in progress); [`operations`]: long operations a request
//!   starts in its transaction ([`StartedOperation`], 202), their status route and the
//!   [`Operations`] a worker finishes them with.
//! - `fast`: the Redis fast path ([`RedisFastPath`], its builder, a request's keys and
//!   lease, the cached answer's encoding).
//! - `store`: [`IdempotencyStore`] on PostgreSQL or SQLite, its configuration
//!   ([`StoreConfig`]), statements and migrations (run by [`IdempotencyStore::new`]).
//! - [`webhook`]: [`WebhookIngress`] and its builder (`webhook::config`), the signature
//!   check (`webhook::signature`), the HTTP side (`webhook::route`: a request to a delivery,
//!   a settlement to an answer) and the worker's side (`webhook::transport`:
//!   [`WebhookTransport`] and the acknowledger that answers the waiting request).
//!
//! The tests (`tests/`) serve an axum app on `127.0.0.1:0` and call it with reqwest, on
//! PostgreSQL (`DATABASE_URL`, a fresh schema per test) and SQLite (a temporary file), and on
//! PostgreSQL with the Redis fast path (`REDIS_URL`, a key prefix per test); the webhook
//! tests run a worker on the ingress's transport, on PostgreSQL.

mod caller;
mod config;
mod error;
mod fast;
mod flow;
mod held;
mod housekeeping;
mod key_format;
mod layer;
pub mod metrics;
pub mod operations;
mod policy;
mod problem;
mod request;
mod store;
mod stored;
mod tx;
pub mod webhook;

pub use caller::{CallerNamed, CallerUnnamed, Callers};
pub use config::{
    IdempotencyConfig, IdempotencyConfigBuilder, KeyFormat, DEFAULT_TTL, MAX_IDEMPOTENCY_KEY_BYTES,
    TRANSIENT_CLIENT_ERRORS,
};
pub use error::Error;
#[cfg(feature = "redis")]
pub use fast::{RedisFastPath, RedisFastPathBuilder};
pub use layer::{Idempotency, IdempotencyLayer, IdempotencyLayerBuilder};
pub use operations::StartedOperation;
pub use problem::PROBLEM_JSON;
pub use request::IDEMPOTENCY_KEY;
pub use store::{IdempotencyStore, StoreBackend, StoreConfig, StoreConfigBuilder};
pub use store::{Operation, OperationStatus, Operations};
pub use stored::IDEMPOTENT_REPLAYED;
pub use tx::IdempotentTx;
pub use webhook::{WebhookIngress, WebhookIngressBuilder, WebhookTransport};
