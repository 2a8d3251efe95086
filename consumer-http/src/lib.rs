//! Exactly-once effects for HTTP: an `Idempotency-Key` layer for tower and axum.
//!
//! Clients retry: a payment POST times out and is sent again, a mobile app resends on a
//! flaky network. [`IdempotencyLayer`] makes a retried request answer what the first one
//! answered, without running the handler again, and lets the handler's database writes
//! commit in the same transaction as the stored answer ([`IdempotentTx`]), as the
//! consumer's handlers commit with their inbox key.
//!
//! # What the layer answers
//!
//! For the configured methods (default POST and PATCH; others pass through), with
//! [`IdempotencyConfig`]:
//!
//! - no `Idempotency-Key` → 400 (or pass through, if the key is optional); a key that is
//!   empty, repeated, over [`MAX_IDEMPOTENCY_KEY_BYTES`] or not printable ASCII → 400; a body
//!   over the limit → 413. The layer's own answers are `application/problem+json`.
//! - The record's **scope** is the route (method and path) and the tenant a user-supplied
//!   function reads from the request ([`IdempotencyLayer::with_tenant`]): two tenants, or
//!   two routes, never share a key.
//! - The request's **fingerprint** is its method, path and query, and body: a JSON body by
//!   its canonical form (object keys sorted, [`consumer_core::canonical_hash`], the one the
//!   inbox hashes message payloads with), any other body by its bytes.
//! - First request: the key is claimed (in progress), the handler runs, its status, selected
//!   headers (`content-type` and a configured list) and body are stored, and it is answered.
//! - Same key and fingerprint, completed: the stored answer, byte for byte, with
//!   `Idempotent-Replayed: true`.
//! - Same key, other fingerprint: 422, on every path that reads a record (a claim that lost
//!   a race, a wait, a replay, an in-progress claim).
//! - Same key while the first is in progress: the request polls the record up to the
//!   configured wait and answers the stored answer, or 409 with `Retry-After`.
//! - The handler answered 5xx, panicked or failed: its transaction rolls back and the key is
//!   released; a retry runs again. A 4xx is stored (configurable).
//! - A completed record lives for its TTL (default 24 h), then the key runs again;
//!   [`IdempotencyStore::purge_expired`] deletes expired rows.
//!
//! # The claim and the transaction
//!
//! A request first reads the key's record: a live record of another fingerprint is 422, a
//! completed one is replayed, one in progress is waited for. Only a request that finds no
//! live record (or an in-progress one of its fingerprint whose lease ran out) claims, so a
//! replay or a wait writes nothing. Then:
//!
//! 1. **Claim**, one statement committed on its own: insert (scope, key) as `in_progress`
//!    with the fingerprint, a claim token unique to this request and a lease (default 60 s).
//!    The statement takes over a row that expired, or an in-progress row of the same
//!    fingerprint whose lease ran out, and nothing else. Committing the claim makes it
//!    visible: a second request sees it in progress and polls, holding no lock and no
//!    connection between polls.
//! 2. **Run**, in one transaction: the handler runs with it ([`IdempotentTx`]); the layer
//!    then stores the answer in it — `UPDATE ... SET status = 'completed' ... WHERE claim =
//!    <this request's token> AND status = 'in_progress'` — and commits. The handler's rows
//!    and the stored answer commit together or not at all. 5xx, a panic, an error or a
//!    failure to store rolls the transaction back and deletes the claim (only this
//!    request's, only in progress).
//!
//! Why a committed claim rather than an uncommitted row that a second request blocks on (a
//! unique key held by the running transaction): a waiting request then holds neither a
//! connection nor a lock while it waits, can tell "in progress" from "gone" and compare the
//! fingerprint at once, and SQLite, which has no row locks, works the same way. The price
//! is one more small commit per first request, and a claim left by a killed process that
//! blocks its key until the lease runs out (the transaction's row would have vanished at
//! once).
//!
//! What follows:
//!
//! - **Crash between effect and store** (the process is killed after the handler's
//!   `INSERT`, before the commit): the transaction never commits, so the effect is not
//!   there either. The claim stays in progress until its lease runs out; a retry before
//!   that waits and gets 409, one after it takes the claim over and runs once.
//! - **Two concurrent requests**, in one process or two: one claim statement inserts the
//!   row (PostgreSQL makes a concurrent insert of the same key wait on the primary key for
//!   it, SQLite serialises writers); the other reads the row: 422 if its fingerprint
//!   differs, else it polls until the first completes (replay), is released (it claims and
//!   runs) or its wait ends (409).
//! - **A lease that runs out while its handler still runs** (a handler slower than the
//!   lease, a stalled process): another request takes the claim over and runs. Both
//!   handlers may run, but only the claim's current holder can store its answer, so only
//!   one transaction commits: the other's completion matches no row, and it rolls back
//!   (its client gets 409 and then, on retry, the stored answer). Effects *outside* the
//!   transaction (a call to a provider) may then happen twice: choose the lease above the
//!   slowest handler, and hand the provider a key of its own.
//! - **Clocks**: leases and TTLs are measured by the database's clock, so processes with
//!   skewed clocks agree.
//! - **The store fails** (a read, the claim, the transaction's begin or commit): 503 with
//!   `Retry-After`, and the claim released if this request held it; a commit whose outcome
//!   is unknown leaves a stored answer in place, since the release deletes only a claim
//!   still in progress.
//!
//! Every claimed request holds a database connection while its handler runs, and a waiting
//! request takes one per poll. On SQLite the request's transaction begins `IMMEDIATE`, so
//! idempotent requests' transactions run one at a time (SQLite has one writer): a claim of
//! another key waits for the running handler's commit (the pool's busy timeout), and a
//! database file must not be shared by two processes.
//!
//! # Layout
//!
//! - `config`: [`IdempotencyConfig`] and its builder; `request`: the key check, the scope
//!   and the fingerprint; `problem`: the problem+json answers; `stored`: a stored answer
//!   and its replay.
//! - `layer`: [`IdempotencyLayer`] and its service [`Idempotency`]; `flow`: one request
//!   through them (decide, run, store or release); `tx`: [`IdempotentTx`].
//! - `store`: [`IdempotencyStore`] on PostgreSQL or SQLite, its configuration
//!   ([`StoreConfig`]), statements and migrations (run by [`IdempotencyStore::new`]).
//!
//! The tests (`tests/`) serve an axum app on `127.0.0.1:0` and call it with reqwest, on
//! PostgreSQL (`DATABASE_URL`, a fresh schema per test) and SQLite (a temporary file).

mod config;
mod error;
mod flow;
mod layer;
mod problem;
mod request;
mod store;
mod stored;
mod tx;

pub use config::{IdempotencyConfig, IdempotencyConfigBuilder, MAX_IDEMPOTENCY_KEY_BYTES};
pub use error::Error;
pub use layer::{Idempotency, IdempotencyLayer};
pub use problem::PROBLEM_JSON;
pub use request::IDEMPOTENCY_KEY;
pub use store::{IdempotencyStore, StoreBackend, StoreConfig, StoreConfigBuilder};
pub use stored::IDEMPOTENT_REPLAYED;
pub use tx::IdempotentTx;
