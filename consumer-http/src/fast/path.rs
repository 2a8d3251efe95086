//! [`RedisFastPath`] and its builder, and [`FastRequest`]: one request's keys and lease in
//! Redis, and the three things the layer asks of them (settle, publish, release).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Client, Script};
use tokio::time::Instant;

use super::entry::{self, CachedAnswer};
use super::settled::Settled;
use crate::stored::StoredResponse;
use crate::Error;

/// Finds the key's answer, or takes its lease, in one round trip. `{1, answer}`: the
/// answer; `{2, ''}`: this request holds the lease now; `{3, holder}`: another request does.
const LOOKUP: &str = r"
local answer = redis.call('GET', KEYS[1])
if answer then return {1, answer} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2, ''} end
return {3, redis.call('GET', KEYS[2]) or ''}
";

/// Caches the answer for `ARGV[2]` ms (none if not above 0) and drops the lease if it is
/// still this request's (`ARGV[3]`).
const PUBLISH: &str = r"
if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
";

/// Extends the lease to `ARGV[2]` ms from now if it is still this request's (`ARGV[1]`).
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
";

/// Drops the lease if it is still this request's (`ARGV[1]`): a lease that ran out and was
/// taken by another request stays.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// The Redis fast path in front of an [`IdempotencyStore`](crate::IdempotencyStore):
/// cached answers for replays and a lease that turns concurrent duplicates away before
/// they reach the database. The database stays the source of truth; see the crate doc's
/// [Redis fast path](crate#redis-fast-path). Give it to the layer's builder,
/// [`IdempotencyLayerBuilder::redis`](crate::IdempotencyLayerBuilder::redis). Cheap to clone.
///
/// ```no_run
/// # async fn app(store: consumer_http::IdempotencyStore<sqlx::Postgres>) -> Result<(), consumer_http::Error> {
/// use consumer_http::{IdempotencyConfig, IdempotencyLayer, RedisFastPath};
///
/// let redis = RedisFastPath::builder("redis://127.0.0.1:6379").build()?;
/// let layer = IdempotencyLayer::builder(store, IdempotencyConfig::default())
///     .caller(|parts| parts.extensions.get::<String>().cloned()) // the authenticated account
///     .redis(redis)
///     .build();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisFastPath {
    inner: Arc<Inner>,
}

struct Inner {
    connection: ConnectionManager,
    /// Redis's address without credentials, for `Debug`.
    address: String,
    prefix: String,
    pause_after_failure: Duration,
    timeout: Duration,
    /// Until when (ms after `epoch`) Redis is skipped after a failure; 0: not paused.
    paused_until_ms: AtomicU64,
    epoch: Instant,
    scripts: Scripts,
}

struct Scripts {
    lookup: Script,
    publish: Script,
    renew: Script,
    release: Script,
}

impl std::fmt::Debug for RedisFastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisFastPath")
            .field("address", &self.inner.address)
            .field("key_prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisFastPath {
    /// A builder for the Redis at `url` (`redis://[user:password@]host[:port][/db]`):
    /// key prefix `consumer-http`, 100 ms per call, Redis skipped for 1 s after a failure.
    pub fn builder(url: impl Into<String>) -> RedisFastPathBuilder {
        RedisFastPathBuilder {
            url: url.into(),
            prefix: "consumer-http".to_owned(),
            timeout: Duration::from_millis(100),
            pause_after_failure: Duration::from_secs(1),
        }
    }

    /// One request's keys: both scoped like its database record, by the store's table,
    /// the record's scope and the key (length-prefixed, so no two records share one).
    pub(crate) fn request(
        &self,
        table: &str,
        scope: &str,
        key: &str,
        fingerprint: &str,
        claim: &str,
        lease: Duration,
    ) -> FastRequest {
        let record = format!("{}:{table}:{}:{scope}:{key}", table.len(), scope.len());
        FastRequest {
            path: self.clone(),
            answer_key: format!("{}:answer:{record}", self.inner.prefix),
            lease_key: format!("{}:lease:{record}", self.inner.prefix),
            lease_value: format!("{fingerprint} {claim}"),
            fingerprint: fingerprint.to_owned(),
            lease_ms: millis(lease),
            leased: AtomicBool::new(false),
        }
    }

    /// Runs one Redis call, bounded by the timeout; `None` if Redis is paused after a
    /// failure, or failed now (logged at warn and counted; Redis is then paused).
    async fn call<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Option<T> {
        let inner = &self.inner;
        let now = inner.epoch.elapsed().as_millis() as u64;
        if now < inner.paused_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        let mut connection = inner.connection.clone();
        let failure = match tokio::time::timeout(
            inner.timeout,
            invocation.invoke_async::<T>(&mut connection),
        )
        .await
        {
            Ok(Ok(value)) => return Some(value),
            Ok(Err(e)) => e.to_string(),
            Err(_elapsed) => format!("no answer within {:?}", inner.timeout),
        };
        metrics::counter!("consumer_http_redis_failures_total", "op" => op).increment(1);
        let until = inner.epoch.elapsed() + inner.pause_after_failure;
        inner
            .paused_until_ms
            .store(until.as_millis() as u64, Ordering::Relaxed);
        tracing::warn!(
            op,
            error = %failure,
            pause = ?inner.pause_after_failure,
            "the Redis fast path failed; the database answers alone meanwhile"
        );
        None
    }
}

/// Builds a [`RedisFastPath`]; [`RedisFastPathBuilder::build`] checks it.
#[derive(Clone)]
pub struct RedisFastPathBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    pause_after_failure: Duration,
}

impl std::fmt::Debug for RedisFastPathBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password: never shown.
        f.debug_struct("RedisFastPathBuilder")
            .field("key_prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("pause_after_failure", &self.pause_after_failure)
            .finish_non_exhaustive()
    }
}

impl RedisFastPathBuilder {
    /// What every key starts with (default `consumer-http`), then `:answer:` or `:lease:`;
    /// give each database its own when several share one Redis (the keys also hold the
    /// store's table name).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest one Redis call may take, connecting included (default 100 ms); a slower
    /// one counts as a failure and the request goes on through the database.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long Redis is skipped after a failure (default 1 s): meanwhile the layer answers
    /// through the database alone, without waiting on Redis's timeout each request.
    pub fn pause_after_failure(mut self, pause: Duration) -> Self {
        self.pause_after_failure = pause;
        self
    }

    /// Checks the configuration; the error names the field (`redis.url`,
    /// `redis.key_prefix`, `redis.timeout`) and never holds the URL. Connects lazily: Redis
    /// need not be up yet. Call it within a Tokio runtime.
    pub fn build(self) -> Result<RedisFastPath, Error> {
        if self.prefix.is_empty() || self.prefix.chars().any(|c| c.is_control()) {
            return Err(Error::config(
                "redis.key_prefix",
                "must be non-empty, without control characters",
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::config("redis.timeout", "must be above 0"));
        }
        let client = Client::open(self.url.as_str()).map_err(|_| {
            Error::config(
                "redis.url",
                "not a Redis URL this build can use (redis://[user:password@]host[:port][/db])",
            )
        })?;
        let address = client.get_connection_info().addr().to_string();
        // Our own timeout bounds every call; the connection's own are the same, and a lost
        // connection is retried once before a call fails, so no call waits on a backoff.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(1);
        let connection = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|_| Error::config("redis.url", "the Redis client could not be set up"))?;
        Ok(RedisFastPath {
            inner: Arc::new(Inner {
                connection,
                address,
                prefix: self.prefix,
                pause_after_failure: self.pause_after_failure,
                timeout: self.timeout,
                paused_until_ms: AtomicU64::new(0),
                epoch: Instant::now(),
                scripts: Scripts {
                    lookup: Script::new(LOOKUP),
                    publish: Script::new(PUBLISH),
                    renew: Script::new(RENEW),
                    release: Script::new(RELEASE),
                },
            }),
        })
    }
}

/// One request's view of Redis: its record's keys, its lease, and whether it holds it.
pub(crate) struct FastRequest {
    path: RedisFastPath,
    answer_key: String,
    lease_key: String,
    /// The fingerprint and the claim token: a holder of another fingerprint is told apart,
    /// and only this request's lease is dropped.
    lease_value: String,
    fingerprint: String,
    lease_ms: i64,
    leased: AtomicBool,
}

impl FastRequest {
    /// What Redis alone can answer, before the database: the cached answer (a replay, or
    /// 422 if its fingerprint is another), after waiting while a request of the same
    /// fingerprint holds the lease; else the database's turn: with the lease, when a request
    /// of another fingerprint holds it (only the database knows whose the key is), at
    /// `deadline`, or when Redis fails.
    pub(crate) async fn settle(&self, deadline: Instant, poll: Duration) -> Settled {
        let scripts = &self.path.inner.scripts;
        loop {
            let mut invocation = scripts.lookup.key(&self.answer_key);
            invocation
                .key(&self.lease_key)
                .arg(&self.lease_value)
                .arg(self.lease_ms);
            let Some((kind, value)) = self.path.call::<(i64, Vec<u8>)>("lookup", invocation).await
            else {
                return Settled::ToDatabase;
            };
            match kind {
                1 => match entry::decode(&value) {
                    Some(CachedAnswer {
                        fingerprint,
                        stored,
                    }) if fingerprint == self.fingerprint => return Settled::Replay(stored),
                    Some(_) => return Settled::Mismatch,
                    None => {
                        tracing::warn!(
                            "a cached idempotent answer is unreadable; asking the database"
                        );
                        return Settled::ToDatabase;
                    }
                },
                2 => {
                    self.leased.store(true, Ordering::SeqCst);
                    return Settled::ToDatabase;
                }
                _ => {
                    let same =
                        value.split(|b| *b == b' ').next() == Some(self.fingerprint.as_bytes());
                    if !same {
                        return Settled::ToDatabase;
                    }
                }
            }
            let now = Instant::now();
            if now >= deadline {
                // The database has the last word on a 409: the holder may have completed
                // without caching (Redis failed then) or died before its claim.
                return Settled::ToDatabase;
            }
            tokio::time::sleep(poll.min(deadline - now)).await;
        }
    }

    /// Caches the committed answer until `expires` (the database record's expiry, or
    /// earlier) and drops this request's lease.
    pub(crate) async fn publish(&self, stored: &StoredResponse, expires: Instant) {
        let ttl_ms = millis(expires.saturating_duration_since(Instant::now()));
        let mut invocation = self.path.inner.scripts.publish.key(&self.answer_key);
        invocation
            .key(&self.lease_key)
            .arg(entry::encode(&self.fingerprint, stored))
            .arg(ttl_ms)
            .arg(&self.lease_value);
        if self.path.call::<i64>("publish", invocation).await.is_some() {
            self.leased.store(false, Ordering::SeqCst);
        }
    }

    /// Runs `work` (the handler) while keeping this request's lease, if it holds one: the
    /// lease is extended every third of its length, so it outlives a live handler however
    /// long it runs, and a dead process's lease by at most its length.
    pub(crate) async fn hold_while<F: std::future::Future>(&self, work: F) -> F::Output {
        if !self.leased.load(Ordering::SeqCst) {
            return work.await;
        }
        let every = Duration::from_millis(u64::try_from(self.lease_ms / 3).unwrap_or(0))
            .max(Duration::from_millis(10));
        let renewing = async {
            loop {
                tokio::time::sleep(every).await;
                let mut invocation = self.path.inner.scripts.renew.key(&self.lease_key);
                invocation.arg(&self.lease_value).arg(self.lease_ms);
                let _ = self.path.call::<i64>("renew", invocation).await;
            }
        };
        tokio::pin!(work, renewing);
        match futures::future::select(work, renewing).await {
            futures::future::Either::Left((output, _)) => output,
            futures::future::Either::Right(_) => unreachable!("the renewals never end"),
        }
    }

    /// Drops the lease if this request still holds it; if Redis fails, it runs out.
    pub(crate) async fn release(&self) {
        if !self.leased.swap(false, Ordering::SeqCst) {
            return;
        }
        release(&self.path, &self.lease_key, &self.lease_value).await;
    }
}

impl Drop for FastRequest {
    /// A request dropped while it holds the lease (its client hung up, so the server dropped
    /// it): the lease is dropped at once, in a task of its own, as the transaction that held
    /// the key rolls back, so the key's next request does not wait for the lease to run out.
    fn drop(&mut self) {
        if !self.leased.swap(false, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (path, key, value) = (
            self.path.clone(),
            std::mem::take(&mut self.lease_key),
            std::mem::take(&mut self.lease_value),
        );
        runtime.spawn(async move { release(&path, &key, &value).await });
    }
}

/// Drops the lease `key` if it is still `value`'s.
async fn release(path: &RedisFastPath, key: &str, value: &str) {
    let mut invocation = path.inner.scripts.release.key(key);
    invocation.arg(value);
    let _ = path.call::<i64>("release", invocation).await;
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
