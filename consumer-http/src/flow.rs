//! One request through the layer: check the key, read the body, decide (run, replay, 422,
//! 409), and for a run: the handler in the request's transaction, which holds the claim, then
//! the answer stored in it and committed, or all of it rolled back, which frees the key.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::response::Response;
use bytes::Bytes;
use futures::FutureExt;
use http::request::Parts;
use http::Request;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;
use tower::Service;

use crate::caller::{Callers, NoCaller};
use crate::config::IdempotencyConfig;
use crate::fast::{FastRequest, Settled};
use crate::held::{HeldKey, HeldKeys, Hold};
use crate::metrics::{Counting, Outcome};
use crate::operations::Starter;
use crate::problem;
use crate::request;
use crate::store::{Claim, ClaimRequest, IdempotencyStore, StoreBackend};
use crate::stored::StoredResponse;
use crate::tx::TxSlot;

/// What every clone of the layer and its services share.
pub(crate) struct Shared<DB: StoreBackend> {
    pub(crate) store: IdempotencyStore<DB>,
    pub(crate) config: IdempotencyConfig,
    pub(crate) callers: Callers,
    /// The keys this layer's requests are running.
    pub(crate) held: Arc<HeldKeys>,
    #[cfg(feature = "redis")]
    pub(crate) fast: Option<crate::fast::RedisFastPath>,
    /// What the layer's requests start long operations with.
    pub(crate) starter: Starter<DB>,
    /// Whether the layer's background task has been started (see `housekeeping`).
    pub(crate) housekeeping: Arc<std::sync::atomic::AtomicBool>,
}

impl<DB: StoreBackend> Clone for Shared<DB> {
    fn clone(&self) -> Self {
        Shared {
            store: self.store.clone(),
            config: self.config.clone(),
            callers: self.callers.clone(),
            held: self.held.clone(),
            #[cfg(feature = "redis")]
            fast: self.fast.clone(),
            starter: self.starter.clone(),
            housekeeping: self.housekeeping.clone(),
        }
    }
}

impl<DB: StoreBackend> Shared<DB> {
    /// The request's keys and lease in Redis, if the layer has a fast path.
    fn fast_request(&self, claim: &ClaimRequest<'_>) -> Option<FastRequest> {
        #[cfg(feature = "redis")]
        {
            self.fast.as_ref().map(|fast| {
                fast.request(
                    self.store.table(),
                    claim.scope,
                    claim.key,
                    claim.fingerprint,
                    claim.claim,
                    self.config.lease,
                )
            })
        }
        #[cfg(not(feature = "redis"))]
        {
            let _ = claim;
            None
        }
    }
}

/// What a request with a key gets, once its record has been read or claimed.
enum Decision<DB: StoreBackend> {
    /// This request holds the key, in this process and in this transaction: run the
    /// handler in it.
    Run(sqlx::Transaction<'static, DB>, HeldKey),
    /// The key completed with this request's fingerprint: its answer; read from the
    /// database, it is cached in Redis until `cache_until` (the record's expiry or before).
    Replay {
        stored: StoredResponse,
        cache_until: Option<Instant>,
    },
    /// The key belongs to another request (method, path or body): 422.
    Mismatch,
    /// The key's request was still in progress at the deadline: 409.
    InProgress,
}

pub(crate) async fn handle<S, DB, ResBody>(
    shared: Arc<Shared<DB>>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response, S::Error>
where
    DB: StoreBackend,
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let config = &shared.config;
    if !config.handles(request.method()) {
        return Ok(inner.call(request).await?.map(Body::new));
    }
    let (parts, body) = request.into_parts();
    let count = Counting::of(&parts);
    let echo = config
        .echo_key
        .then(|| parts.headers.get(request::IDEMPOTENCY_KEY).cloned())
        .flatten();
    let answer = answer(&shared, inner, parts, body, &count).await;
    Ok(match (answer?, echo) {
        (mut answer, Some(key)) => {
            answer.headers_mut().insert(request::IDEMPOTENCY_KEY, key);
            answer
        }
        (answer, None) => answer,
    })
}

/// The answer to a request with a key (or without one, where the key is optional): a
/// refusal, a replay, or the inner service's answer stored.
async fn answer<S, DB, ResBody>(
    shared: &Arc<Shared<DB>>,
    mut inner: S,
    parts: Parts,
    body: Body,
    count: &Counting,
) -> Result<Response, S::Error>
where
    DB: StoreBackend,
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let config = &shared.config;
    let policy = config.policy_url.as_deref();
    let key = match request::idempotency_key(&parts, &config.key_format) {
        Ok(Some(key)) => key,
        Ok(None) if config.key_required => {
            count.answered(Outcome::InvalidKey);
            return Ok(problem::bad_key(
                "the request has no Idempotency-Key header",
                policy,
            ));
        }
        Ok(None) => {
            let request = Request::from_parts(parts, body);
            return Ok(inner.call(request).await?.map(Body::new));
        }
        Err(invalid) => {
            count.answered(Outcome::InvalidKey);
            return Ok(problem::bad_key(&invalid.0, policy));
        }
    };
    let caller = match shared.callers.of(&parts) {
        Ok(caller) => caller,
        Err(NoCaller) => {
            count.answered(Outcome::NoCaller);
            return Ok(problem::no_caller());
        }
    };
    let body = match read_body(&parts, body, config.max_body_bytes).await {
        Ok(body) => body,
        Err(answer) => return Ok(answer),
    };
    let scope = request::scope(&parts, caller.as_deref());
    let fingerprint = request::fingerprint(&parts, &body);
    let claim = claim_token();
    let claim = ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        claim: &claim,
        lease_ms: millis(config.lease),
        ttl_ms: millis(config.ttl),
    };
    let fast = shared.fast_request(&claim);
    let fast = fast.as_ref();
    let deciding = Instant::now();
    let decision = decide(shared, &claim, fast).await;
    count.decided(deciding.elapsed());
    let answer = match decision {
        Ok(Decision::Run(tx, held)) => {
            let answer = run(shared, inner, parts, body, tx, &claim, fast).await;
            drop(held);
            answer
        }
        Ok(Decision::Replay {
            stored,
            cache_until,
        }) => {
            if let (Some(fast), Some(until)) = (fast, cache_until) {
                fast.publish(&stored, until).await;
            }
            count.answered(Outcome::Replayed);
            Ok(stored.replay())
        }
        Ok(Decision::Mismatch) => {
            count.answered(Outcome::Mismatch);
            Ok(problem::mismatch(config.policy_url.as_deref()))
        }
        Ok(Decision::InProgress) => {
            count.answered(Outcome::InProgress);
            Ok(problem::in_progress(
                config.retry_after,
                config.policy_url.as_deref(),
                config.accepted_while_in_progress,
            ))
        }
        Err(e) => {
            tracing::warn!(error = %e, "idempotency store failed reading a key");
            count.answered(Outcome::Unavailable);
            Ok(problem::store_unavailable(config.retry_after))
        }
    };
    if let Some(fast) = fast {
        // Every end but a published answer (which dropped it) gives the lease back.
        fast.release().await;
    }
    answer
}

/// The body, up to `limit` bytes: 413 above it (by `Content-Length` before reading, or
/// while reading), 400 if it cannot be read. The webhook ingress reads its bodies with it too.
pub(crate) async fn read_body(parts: &Parts, body: Body, limit: usize) -> Result<Bytes, Response> {
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(problem::too_large(limit));
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(problem::too_large(limit)),
        Err(_) => Err(problem::unreadable_body()),
    }
}

/// Asks Redis first, if the layer has it: a cached answer settles the request there (a
/// replay, or 422), and a request of the same fingerprint holding the lease is waited for
/// there. Then holds the key in this process (waiting while a request of this process runs
/// it), reads the key's committed record and decides, or claims the key in the request's
/// transaction, waiting while another process's request holds it; all waits end at the
/// configured wait. The fingerprint is compared on every path that reads a record or a
/// cached answer: a replay, a claim that lost a race, a takeover. The record is read before
/// any claim, so a replay writes nothing (on SQLite it need not wait for the write lock a
/// running handler's transaction holds).
async fn decide<DB: StoreBackend>(
    shared: &Shared<DB>,
    claim: &ClaimRequest<'_>,
    fast: Option<&FastRequest>,
) -> Result<Decision<DB>, sqlx::Error> {
    let store: &IdempotencyStore<DB> = &shared.store;
    let config = &shared.config;
    let deadline = Instant::now() + config.wait;
    if let Some(fast) = fast {
        match fast.settle(deadline, config.poll_interval).await {
            Settled::Replay(stored) => {
                return Ok(Decision::Replay {
                    stored,
                    cache_until: None,
                })
            }
            Settled::Mismatch => return Ok(Decision::Mismatch),
            Settled::ToDatabase => {}
        }
    }
    let name = format!("{}:{}:{}", claim.scope.len(), claim.scope, claim.key);
    let wait = deadline.saturating_duration_since(Instant::now());
    let held = match shared.held.hold(name, claim.fingerprint, wait).await {
        Hold::Held(held) => held,
        Hold::OtherRequest => return Ok(Decision::Mismatch),
        Hold::Busy => return Ok(Decision::InProgress),
    };
    let mut retry_at_once = true;
    loop {
        let mut conn = store.acquire().await?;
        let read_at = Instant::now();
        let claimable = match store.fetch(&mut conn, claim.scope, claim.key).await? {
            Some(record) if !record.expired => {
                if record.fingerprint != claim.fingerprint {
                    return Ok(Decision::Mismatch);
                }
                if let (true, Some(stored)) = (record.completed, record.response) {
                    return Ok(Decision::Replay {
                        stored,
                        cache_until: Some(read_at + record.ttl_left),
                    });
                }
                // A claim committed in progress (by an earlier version of the layer): taken
                // over once its lease ran out, waited for until then.
                record.lease_expired
            }
            // No record, or an expired one, or one whose request still runs (its claim is
            // not committed): claim it, waiting on that request's transaction if there is one.
            _ => true,
        };
        if claimable {
            let wait = deadline.saturating_duration_since(Instant::now());
            match store.claim(conn, claim, wait).await? {
                Claim::Held(tx) => return Ok(Decision::Run(tx, held)),
                Claim::Busy => return Ok(Decision::InProgress),
                // Another request's record committed first: read it, at once the first time.
                Claim::Taken if retry_at_once => {
                    retry_at_once = false;
                    continue;
                }
                Claim::Taken => {}
            }
        } else {
            // Holding no connection while it waits.
            drop(conn);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(Decision::InProgress);
        }
        tokio::time::sleep(config.poll_interval.min(deadline - now)).await;
    }
}

/// Runs the handler with the request's transaction (which holds the key), then stores the
/// answer in it and commits; any other end rolls the transaction back, which frees the key.
/// So does dropping this future (the client hung up) or the process dying: the database
/// rolls the transaction back, and the key's next request runs at once.
async fn run<S, DB, ResBody>(
    shared: &Shared<DB>,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    tx: sqlx::Transaction<'static, DB>,
    claim: &ClaimRequest<'_>,
    fast: Option<&FastRequest>,
) -> Result<Response, S::Error>
where
    DB: StoreBackend,
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let store = &shared.store;
    let config = &shared.config;
    let count = Counting::of(&parts);
    let unavailable = || {
        count.answered(Outcome::Unavailable);
        problem::store_unavailable(config.retry_after)
    };
    let starter = shared.starter.clone();
    let slot = TxSlot::new(tx, claim.scope, claim.key, claim.claim, starter);
    parts.extensions.insert(slot.clone());
    let request = Request::from_parts(parts, Body::from(body));
    let mut inner = inner;
    let handling = AssertUnwindSafe(async move { inner.call(request).await }).catch_unwind();
    let called = match fast {
        Some(fast) => fast.hold_while(handling).await,
        None => handling.await,
    };
    let response = match called {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            abandon(&slot).await;
            count.answered(Outcome::Released);
            return Err(e);
        }
        Err(_panic) => {
            abandon(&slot).await;
            count.answered(Outcome::Released);
            return Ok(problem::internal("the handler panicked"));
        }
    };
    let (head, response_body) = response.into_parts();
    let status = head.status;
    if !config.stores(status) {
        abandon(&slot).await;
        count.answered(Outcome::Released);
        return Ok(http::Response::from_parts(head, Body::new(response_body)));
    }
    let response_body = match Limited::new(response_body, config.max_response_bytes)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            abandon(&slot).await;
            count.answered(Outcome::Released);
            return Ok(problem::internal(
                "the answer could not be stored: its body failed or is over the limit",
            ));
        }
    };
    let Some(mut tx) = slot.take() else {
        // The handler kept its `IdempotentTx` (a spawned task): its transaction rolls back,
        // freeing the key, when that ends.
        count.answered(Outcome::Released);
        return Ok(problem::internal(
            "the handler kept its IdempotentTx past its answer",
        ));
    };
    let stored =
        StoredResponse::capture(status, &head.headers, &config.stored_headers, response_body);
    // The record expires `ttl` after its completion statement, which runs after this: a
    // cached copy never outlives it.
    let completing = Instant::now();
    match store.complete(&mut tx, claim, &stored).await {
        Ok(true) => {}
        Ok(false) => {
            // The transaction's own row is gone (deleted by hand?): nothing to store under.
            let _ = tx.rollback().await;
            tracing::warn!("an idempotent request's claim was gone when its answer was stored");
            return Ok(unavailable());
        }
        Err(e) if consumer_core::inbox::is_aborted(&e) => {
            // A statement of the handler's failed and aborted the transaction (PostgreSQL):
            // its writes cannot commit, so its answer must not be given as a success.
            tracing::warn!(error = %e, "the handler's transaction was aborted by an earlier error it ignored");
            let _ = tx.rollback().await;
            count.answered(Outcome::Released);
            return Ok(problem::internal(
                "the handler's transaction was aborted by an earlier error it ignored",
            ));
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not store an idempotent answer");
            let _ = tx.rollback().await;
            return Ok(unavailable());
        }
    }
    if let Err(e) = tx.commit().await {
        // Unknown whether it committed: if it did, the key's next request is a replay; if
        // not, it runs.
        tracing::warn!(error = %e, "could not commit an idempotent request");
        return Ok(unavailable());
    }
    if let Some(fast) = fast {
        fast.publish(&stored, completing + config.ttl).await;
    }
    count.answered(Outcome::Completed);
    Ok(http::Response::from_parts(head, Body::from(stored.body)))
}

/// Rolls the request's transaction back, which frees the key.
async fn abandon<DB: StoreBackend>(slot: &TxSlot<DB>) {
    if let Some(tx) = slot.take() {
        let _ = tx.rollback().await;
    }
}

/// A claim token unique across processes: the process's random hasher keys (seeded from the
/// OS), the time and a counter.
fn claim_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:016x}-{nanos:x}-{n:x}", h.finish())
}

/// A duration in milliseconds, as the store binds it (the config checked the range).
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
