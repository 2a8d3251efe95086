//! [`IdempotencyConfig`]: which requests the layer handles and how it waits, stores and
//! forgets; built and validated by [`IdempotencyConfigBuilder`].

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

pub use crate::key_format::KeyFormat;
use crate::Error;

/// The longest `Idempotency-Key` accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// How long a completed record is kept and replayed unless
/// [`IdempotencyConfigBuilder::ttl`] says otherwise: 24 h. Also how long a finished
/// operation is kept unless [`Operations::keep_finished`](crate::Operations::keep_finished)
/// says otherwise, so that a replayed `202 Accepted` points at an operation that still
/// exists: a layer given a longer TTL should have its operations kept as long
/// (`store.operations().keep_finished(ttl)`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The client errors that say "not now, try again": 408 Request Timeout, 409 Conflict, 425
/// Too Early and 429 Too Many Requests. The layer never stores them, whatever
/// [`IdempotencyConfigBuilder::store_client_errors`] says: like a 5xx, such an answer rolls
/// the handler's writes back and frees the key, so the client's retry runs the handler.
pub const TRANSIENT_CLIENT_ERRORS: [StatusCode; 4] = [
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::CONFLICT,
    StatusCode::TOO_EARLY,
    StatusCode::TOO_MANY_REQUESTS,
];

/// How the [`IdempotencyLayer`](crate::IdempotencyLayer) treats requests. Build one with
/// [`IdempotencyConfig::builder`]; [`IdempotencyConfig::default`] is the builder's defaults.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct IdempotencyConfig {
    pub(crate) methods: Vec<Method>,
    pub(crate) key_required: bool,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) wait: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    pub(crate) store_client_errors: bool,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) purge: Purge,
    pub(crate) gauge_interval: Duration,
    pub(crate) key_format: KeyFormat,
    pub(crate) policy_url: Option<String>,
    pub(crate) accepted_while_in_progress: bool,
    pub(crate) echo_key: bool,
    pub(crate) operations_path: String,
}

/// Whether `path` is one the router takes as a static prefix and a `Location` holds as it
/// is: `/` and non-empty segments of unreserved characters.
fn valid_operations_path(path: &str) -> bool {
    path.strip_prefix('/').is_some_and(|rest| {
        rest.split('/').all(|segment| {
            !segment.is_empty()
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.~".contains(&b))
        })
    })
}

/// How often the layer deletes expired records (see
/// [`IdempotencyConfigBuilder::purge_interval`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purge {
    /// Every TTL, at least every second, at most every hour.
    EveryTtl,
    /// Every this long.
    Every(Duration),
    /// Never: the application purges ([`IdempotencyStore::purge_expired`](crate::IdempotencyStore::purge_expired)).
    Off,
}

/// The layer's purge deletes this many expired rows per statement.
pub(crate) const PURGE_BATCH: u32 = 1000;

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            methods: vec![Method::POST, Method::PATCH],
            key_required: true,
            max_body_bytes: 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            wait: Duration::from_secs(5),
            poll_interval: Duration::from_millis(50),
            retry_after: Duration::from_secs(1),
            lease: Duration::from_secs(1),
            ttl: DEFAULT_TTL,
            store_client_errors: true,
            stored_headers: vec![http::header::CONTENT_TYPE, http::header::LOCATION],
            purge: Purge::EveryTtl,
            gauge_interval: Duration::from_secs(30),
            key_format: KeyFormat::any(),
            policy_url: None,
            accepted_while_in_progress: false,
            echo_key: false,
            operations_path: "/operations".to_owned(),
        }
    }
}

impl IdempotencyConfig {
    /// A builder with the defaults: POST and PATCH, key required, 1 MiB request and
    /// response bodies, wait 5 s polling every 50 ms, `Retry-After: 1`, lease 1 s, TTL
    /// 24 h ([`DEFAULT_TTL`]), 4xx answers stored (but 408, 409, 425 and 429, never),
    /// `content-type` and `location` stored, operations' statuses under `/operations`.
    pub fn builder() -> IdempotencyConfigBuilder {
        IdempotencyConfigBuilder {
            config: IdempotencyConfig::default(),
        }
    }

    /// Whether an answer of this status is stored (and its handler's writes committed): a
    /// 2xx or 3xx, and a 4xx if so configured, but never a 1xx, a 5xx, or a 4xx that asks
    /// the client to try again ([`TRANSIENT_CLIENT_ERRORS`]).
    pub(crate) fn stores(&self, status: StatusCode) -> bool {
        if status.is_client_error() {
            return self.store_client_errors && !TRANSIENT_CLIENT_ERRORS.contains(&status);
        }
        status.is_success() || status.is_redirection()
    }

    /// How often the layer deletes expired records; `None`: never.
    pub(crate) fn purge_interval(&self) -> Option<Duration> {
        match self.purge {
            Purge::EveryTtl => Some(
                self.ttl
                    .clamp(Duration::from_secs(1), Duration::from_secs(60 * 60)),
            ),
            Purge::Every(every) => Some(every),
            Purge::Off => None,
        }
    }

    /// Whether the layer handles requests with this method.
    pub(crate) fn handles(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}

/// Builds an [`IdempotencyConfig`]; [`IdempotencyConfigBuilder::build`] checks it.
#[derive(Debug, Clone)]
pub struct IdempotencyConfigBuilder {
    config: IdempotencyConfig,
}

impl IdempotencyConfigBuilder {
    /// The methods whose requests are made idempotent (default POST, PATCH); others pass
    /// through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether a request without `Idempotency-Key` is refused with 400 (default `true`).
    /// When `false` it passes through, without a record and without an
    /// [`IdempotentTx`](crate::IdempotentTx).
    pub fn key_required(mut self, required: bool) -> Self {
        self.config.key_required = required;
        self
    }

    /// The largest request body read for the fingerprint (default 1 MiB); a larger one is
    /// refused with 413.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body_bytes = bytes;
        self
    }

    /// The largest response body stored (default 1 MiB); a larger answer is not stored:
    /// the transaction rolls back, the key is freed and the client gets 500.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.config.max_response_bytes = bytes;
        self
    }

    /// How long a request waits for another one with the same key to finish (default 5 s)
    /// before it is answered 409; `0` answers 409 at once. On PostgreSQL a request of
    /// another process waits on the running one's transaction for it; on SQLite, whose
    /// transactions run one at a time, a request of another key waits for the write lock up
    /// to the pool's busy timeout instead.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// How often a request waiting on the Redis fast path's lease looks for the answer
    /// (default 50 ms), and how often one waiting on a claim an earlier version of the layer
    /// committed reads the record.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// The `Retry-After` of a 409 answer, rounded up to whole seconds (default 1 s).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.config.retry_after = after;
        self
    }

    /// How long the Redis fast path's lease outlives a process that died holding it (default
    /// 1 s): a running request renews its lease every third of this, so the lease lasts as
    /// long as the request runs, and a killed process's lease makes the key's next request
    /// wait at most this long. The database needs no lease: a running request holds its key
    /// by its open transaction, which a dead process or a hung-up client rolls back at once
    /// (see the crate doc). A claim committed by an earlier version of the layer is taken
    /// over once the lease it was given runs out.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long a completed record is kept and replayed (default 24 h, [`DEFAULT_TTL`]);
    /// after it the key runs again, and the layer's purge deletes the row (see
    /// [`purge_interval`](IdempotencyConfigBuilder::purge_interval)). Keep finished
    /// operations at least as long
    /// ([`Operations::keep_finished`](crate::Operations::keep_finished), whose default is
    /// the same [`DEFAULT_TTL`]).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// Whether a 4xx answer is stored and replayed (default `true`); when `false` it
    /// frees the key like a 5xx does. The transient ones ([`TRANSIENT_CLIENT_ERRORS`]:
    /// 408, 409, 425, 429) are never stored: a retry after them must run the handler.
    pub fn store_client_errors(mut self, store: bool) -> Self {
        self.config.store_client_errors = store;
        self
    }

    /// Response headers stored and replayed besides `content-type` and `location` (which
    /// always are: a replayed 201 or 202 points where the first did).
    pub fn stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let mut names = vec![http::header::CONTENT_TYPE, http::header::LOCATION];
        for h in headers {
            if !names.contains(&h) {
                names.push(h);
            }
        }
        self.config.stored_headers = names;
        self
    }

    /// How often the layer deletes expired records (default: every TTL, at least every
    /// second, at most every hour), 1,000 rows per statement, from its first request on,
    /// for as long as the layer lives. An expired record is never replayed even before it is
    /// purged: the purge only reclaims space. Every process purges; their deletes do not
    /// get in each other's way.
    pub fn purge_interval(mut self, every: Duration) -> Self {
        self.config.purge = Purge::Every(every);
        self
    }

    /// How often the layer sets its gauges (default 30 s), first at its first request: the
    /// records by status, counted in the table (`consumer_http_records`: a `count(*)` of the
    /// table each time), and the age of this process's longest-running request
    /// (`consumer_http_oldest_in_progress_seconds`).
    pub fn gauge_interval(mut self, every: Duration) -> Self {
        self.config.gauge_interval = every;
        self
    }

    /// The layer never purges: the application calls
    /// [`IdempotencyStore::purge_expired`](crate::IdempotencyStore::purge_expired) itself
    /// (e.g. from one scheduled job rather than every process).
    pub fn no_purge(mut self) -> Self {
        self.config.purge = Purge::Off;
        self
    }

    /// The format a key must have (default [`KeyFormat::any`]); a key of another format is
    /// answered 400, naming the format.
    pub fn key_format(mut self, format: KeyFormat) -> Self {
        self.config.key_format = format;
        self
    }

    /// Where the service publishes its idempotency policy (key format, expiry, what makes
    /// two requests the same), as the IETF draft asks a server to: an absolute URL or a path,
    /// e.g. `/docs/idempotency`. The layer's answers about a key (400 for the key, 409, 422)
    /// then carry `Link: <url>; rel="describedby"` and a problem `type` of `url#<problem>`
    /// (`#invalid-key`, `#in-progress`, `#key-reused`) instead of `about:blank`.
    /// [`IdempotencyLayer::policy_document`](crate::IdempotencyLayer::policy_document) writes
    /// the policy this configuration keeps, for the service to serve there.
    pub fn policy_url(mut self, url: impl Into<String>) -> Self {
        self.config.policy_url = Some(url.into());
        self
    }

    /// A retry that finds its key's first request still running after the wait is answered
    /// `202 Accepted` with `Retry-After` ("taken, not done yet: ask again") instead of
    /// `409 Conflict` (the default), for clients that treat a 409 as final. The body says
    /// the same either way.
    pub fn accepted_while_in_progress(mut self) -> Self {
        self.config.accepted_while_in_progress = true;
        self
    }

    /// Every answer to a request with a key (the first run's, a replay, the layer's own)
    /// carries the key back in `Idempotency-Key`, as the client sent it (off by default), so
    /// a client or a proxy can match answers to keys.
    pub fn echo_key(mut self) -> Self {
        self.config.echo_key = true;
        self
    }

    /// Where the status route of long operations is (default `/operations`): an operation
    /// a request started ([`IdempotentTx::start_operation`](crate::IdempotentTx::start_operation))
    /// answers `Location: <path>/<id>`, and
    /// [`IdempotencyLayer::operations_router`](crate::IdempotencyLayer::operations_router)
    /// serves `GET <path>/{id}`. A path: `/` and segments, no trailing `/`, no query.
    pub fn operations_path(mut self, path: impl Into<String>) -> Self {
        self.config.operations_path = path.into();
        self
    }

    /// Checks the configuration; the error names the field.
    pub fn build(self) -> Result<IdempotencyConfig, Error> {
        let c = self.config;
        if c.methods.is_empty() {
            return Err(Error::config("methods", "name at least one method"));
        }
        if c.max_body_bytes == 0 {
            return Err(Error::config("max_body_bytes", "must be above 0"));
        }
        if c.max_response_bytes == 0 {
            return Err(Error::config("max_response_bytes", "must be above 0"));
        }
        if c.poll_interval.is_zero() {
            return Err(Error::config("poll_interval", "must be above 0"));
        }
        if let Some(url) = &c.policy_url {
            // In a header (`Link: <url>`) and a JSON string: a URI reference, nothing that
            // could end the header's angle brackets.
            if url.is_empty() || url.parse::<http::Uri>().is_err() || url.contains(['<', '>']) {
                return Err(Error::config(
                    "policy_url",
                    "must be an absolute URL or a path (a URI reference)",
                ));
            }
        }
        if c.gauge_interval.is_zero() {
            return Err(Error::config("gauge_interval", "must be above 0"));
        }
        if !valid_operations_path(&c.operations_path) {
            return Err(Error::config(
                "operations_path",
                "must be a path: `/` and segments of letters, digits, `-`, `_`, `.` or `~`, \
                 no trailing `/`",
            ));
        }
        if c.purge == Purge::Every(Duration::ZERO) {
            return Err(Error::config(
                "purge_interval",
                "must be above 0 (no_purge turns the purge off)",
            ));
        }
        if c.lease < Duration::from_millis(1) {
            return Err(Error::config("lease", "must be at least 1 ms"));
        }
        if c.ttl < c.lease {
            return Err(Error::config(
                "ttl",
                format!(
                    "{:?} is shorter than the lease ({:?}): a record would expire while its claim holds",
                    c.ttl, c.lease
                ),
            ));
        }
        for d in [c.lease, c.ttl] {
            if i64::try_from(d.as_millis()).is_err() {
                return Err(Error::config("ttl", "too long to store in milliseconds"));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_build_and_bad_values_name_the_field() {
        assert!(IdempotencyConfig::builder().build().is_ok());
        let field = |b: IdempotencyConfigBuilder| match b.build() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        };
        assert_eq!(field(IdempotencyConfig::builder().methods([])), "methods");
        assert_eq!(
            field(IdempotencyConfig::builder().poll_interval(Duration::ZERO)),
            "poll_interval"
        );
        assert_eq!(
            field(IdempotencyConfig::builder().lease(Duration::ZERO)),
            "lease"
        );
        assert_eq!(
            field(
                IdempotencyConfig::builder()
                    .lease(Duration::from_secs(10))
                    .ttl(Duration::from_secs(5))
            ),
            "ttl"
        );
        assert_eq!(
            field(IdempotencyConfig::builder().max_body_bytes(0)),
            "max_body_bytes"
        );
        assert_eq!(
            field(IdempotencyConfig::builder().purge_interval(Duration::ZERO)),
            "purge_interval"
        );
        for bad in [
            "",
            "/",
            "operations",
            "/ops/",
            "/ops/{id}",
            "/a b",
            "/ops?x=1",
            "//ops",
        ] {
            assert_eq!(
                field(IdempotencyConfig::builder().operations_path(bad)),
                "operations_path",
                "{bad:?}"
            );
        }
        for good in ["/operations", "/v1/refund-operations", "/a.b_c~d"] {
            assert!(IdempotencyConfig::builder()
                .operations_path(good)
                .build()
                .is_ok());
        }
    }

    #[test]
    fn a_policy_url_must_be_a_uri_reference() {
        let field = |url: &str| match IdempotencyConfig::builder().policy_url(url).build() {
            Err(Error::Config { field, .. }) => Some(field),
            _ => None,
        };
        assert_eq!(field("https://api.example.com/docs/idempotency"), None);
        assert_eq!(field("/docs/idempotency"), None);
        for bad in ["", "a b", "/x>; rel=evil"] {
            assert_eq!(field(bad), Some("policy_url"), "{bad}");
        }
    }

    #[test]
    fn the_purge_runs_every_ttl_within_bounds_unless_told_otherwise() {
        let every = |b: IdempotencyConfigBuilder| b.build().unwrap().purge_interval();
        let hour = Duration::from_secs(3600);
        assert_eq!(every(IdempotencyConfig::builder()), Some(hour));
        let ttl = |ms| {
            IdempotencyConfig::builder()
                .lease(Duration::from_millis(1))
                .ttl(Duration::from_millis(ms))
        };
        assert_eq!(every(ttl(120_000)), Some(Duration::from_secs(120)));
        assert_eq!(every(ttl(10)), Some(Duration::from_secs(1)));
        let explicit = IdempotencyConfig::builder().purge_interval(Duration::from_millis(50));
        assert_eq!(every(explicit), Some(Duration::from_millis(50)));
        assert_eq!(every(IdempotencyConfig::builder().no_purge()), None);
    }

    #[test]
    fn transient_client_errors_and_5xx_are_never_stored() {
        let storing = IdempotencyConfig::builder().build().unwrap();
        let releasing = IdempotencyConfig::builder()
            .store_client_errors(false)
            .build()
            .unwrap();
        for code in [200, 201, 202, 204, 303] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(storing.stores(status) && releasing.stores(status), "{code}");
        }
        for code in [400, 404, 422] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(
                storing.stores(status) && !releasing.stores(status),
                "{code}"
            );
        }
        for code in [100, 408, 409, 425, 429, 500, 502, 503] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(
                !storing.stores(status) && !releasing.stores(status),
                "{code}"
            );
        }
    }

    #[test]
    fn content_type_is_always_stored() {
        let c = IdempotencyConfig::builder()
            .stored_headers([HeaderName::from_static("location")])
            .build()
            .unwrap();
        assert_eq!(c.stored_headers[0], http::header::CONTENT_TYPE);
        assert_eq!(c.stored_headers.len(), 2);
    }
}
