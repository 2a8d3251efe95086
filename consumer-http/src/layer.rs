//! [`IdempotencyLayer`] and the [`Idempotency`] service it wraps a service in.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, HttpBody};
use axum::response::Response;
use bytes::Bytes;
use futures::future::BoxFuture;
use http::request::Parts;
use http::Request;
use tower::{Layer, Service};

use crate::caller::{CallerNamed, CallerUnnamed, Callers};
use crate::config::IdempotencyConfig;
use crate::flow::{self, Shared};
use crate::operations::Starter;
use crate::store::{IdempotencyStore, StoreBackend};

/// A tower [`Layer`] that makes a service's requests idempotent by their
/// `Idempotency-Key`, recording them in an [`IdempotencyStore`]. See the crate doc for what
/// it answers and guarantees.
///
/// A stored answer belongs to the caller that stored it: the builder asks for a function
/// naming the authenticated caller ([`IdempotencyLayerBuilder::caller`]), or for the
/// explicit [`shared_across_callers`](IdempotencyLayerBuilder::shared_across_callers), and
/// has no `build` before one of them.
///
/// ```no_run
/// # async fn app(pool: sqlx::PgPool) -> Result<(), consumer_http::Error> {
/// use consumer_http::{IdempotencyConfig, IdempotencyLayer, IdempotencyStore, StoreConfig};
///
/// /// What the application's authentication put in the request's extensions.
/// #[derive(Clone)]
/// struct Account(String);
///
/// let store = IdempotencyStore::new(pool, StoreConfig::default()).await?;
/// let layer = IdempotencyLayer::builder(store, IdempotencyConfig::default())
///     .caller(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
///     .build();
/// let app: axum::Router = axum::Router::new()
///     // .route("/payments", axum::routing::post(create_payment))
///     .layer(layer);
///     // .layer(authentication), outside the layer, so it runs first
/// # Ok(()) }
/// ```
///
/// Without the caller, there is nothing to build:
///
/// ```compile_fail
/// # async fn app(store: consumer_http::IdempotencyStore<sqlx::Postgres>) {
/// let layer = consumer_http::IdempotencyLayer::builder(store, Default::default()).build();
/// # }
/// ```
pub struct IdempotencyLayer<DB: StoreBackend> {
    shared: Arc<Shared<DB>>,
}

impl<DB: StoreBackend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<DB: StoreBackend> std::fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.shared.store)
            .field("config", &self.shared.config)
            .field("callers", &self.shared.callers)
            .finish_non_exhaustive()
    }
}

impl<DB: StoreBackend> IdempotencyLayer<DB> {
    /// The idempotency policy this layer keeps, as a Markdown document for the service to
    /// serve at its [`policy_url`](crate::IdempotencyConfigBuilder::policy_url): methods,
    /// key format, scope, fingerprint, expiry, what is stored and replayed, and each answer
    /// about a key, written from the layer's own configuration (so it cannot drift from
    /// it). Its sections carry the anchors the problem types name (`#invalid-key`,
    /// `#in-progress`, `#key-reused`).
    pub fn policy_document(&self) -> String {
        crate::policy::document(&self.shared.config, self.shared.callers.is_shared())
    }

    /// The status route of the long operations this layer's requests start: `GET
    /// <operations_path>/{id}` answers the operation as JSON (`operation_id`, `kind`,
    /// `status`: `pending`, `succeeded` or `failed`, and `result` or `error` once finished,
    /// `created_at_ms`, `updated_at_ms`), with `Retry-After` while pending, to the caller
    /// that started it, named as the layer names callers; any other caller, or an unknown
    /// id, gets 404, and a request without a caller 401. Merge it into the application's
    /// router, outside the layer (it answers GETs) but behind the same authentication.
    pub fn operations_router<S: Clone + Send + Sync + 'static>(&self) -> axum::Router<S> {
        let shared = &self.shared;
        let route = crate::operations::StatusRoute {
            operations: shared.store.operations(),
            callers: shared.callers.clone(),
            retry_after: shared.config.retry_after,
        };
        let path = format!("{}/{{id}}", shared.config.operations_path);
        axum::Router::new()
            .route(&path, axum::routing::get(crate::operations::status::<DB>))
            .with_state(route)
    }

    /// A builder of the layer on `store` with `config`; name the caller
    /// ([`IdempotencyLayerBuilder::caller`] or
    /// [`shared_across_callers`](IdempotencyLayerBuilder::shared_across_callers)), then
    /// [`build`](IdempotencyLayerBuilder::build).
    pub fn builder(
        store: IdempotencyStore<DB>,
        config: IdempotencyConfig,
    ) -> IdempotencyLayerBuilder<DB, CallerUnnamed> {
        IdempotencyLayerBuilder {
            store,
            config,
            callers: CallerUnnamed,
            #[cfg(feature = "redis")]
            fast: None,
        }
    }
}

/// Builds an [`IdempotencyLayer`]. `C` says whether the caller is named yet: the builder
/// starts [`CallerUnnamed`], and [`caller`](IdempotencyLayerBuilder::caller) or
/// [`shared_across_callers`](IdempotencyLayerBuilder::shared_across_callers) (one of them,
/// once) makes it [`Callers`], which [`build`](IdempotencyLayerBuilder::build) requires.
///
/// Why a state in the type rather than an error from `build`: a layer that forgot the
/// caller would share answers between callers, so it should not compile, rather than fail
/// at the first start or not at all.
pub struct IdempotencyLayerBuilder<DB: StoreBackend, C = CallerUnnamed> {
    store: IdempotencyStore<DB>,
    config: IdempotencyConfig,
    callers: C,
    #[cfg(feature = "redis")]
    fast: Option<crate::RedisFastPath>,
}

impl<DB: StoreBackend, C: std::fmt::Debug> std::fmt::Debug for IdempotencyLayerBuilder<DB, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("store", &self.store)
            .field("config", &self.config)
            .field("callers", &self.callers)
            .finish_non_exhaustive()
    }
}

impl<DB: StoreBackend> IdempotencyLayerBuilder<DB, CallerUnnamed> {
    /// Scopes every stored answer by its caller: `caller` names the authenticated principal
    /// of a request (an account or user id your authentication put in the extensions), and
    /// two callers with the same key have records of their own. What one caller stored is
    /// never answered to another, neither replayed nor refused with 422.
    ///
    /// Return an id, not a credential: two tokens of one account would be two callers. The
    /// layer keeps only a SHA-256 of what it returns (in the record's scope and its Redis
    /// keys) and never logs it. A request for which it returns `None` is answered 401
    /// (`application/problem+json`) and runs nothing: put the layer inside your
    /// authentication, so that unauthenticated requests are refused before it.
    pub fn caller(
        self,
        caller: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> IdempotencyLayerBuilder<DB, Callers> {
        self.with_callers(Callers::each(caller))
    }

    /// One record per key, whoever sends it: any caller that sends a key and body gets the
    /// answer stored for them. Only for services whose keys are global by design (one
    /// caller, or keys no caller can guess and that every caller may read).
    pub fn shared_across_callers(self) -> IdempotencyLayerBuilder<DB, Callers> {
        self.with_callers(Callers::shared())
    }

    fn with_callers(self, callers: Callers) -> IdempotencyLayerBuilder<DB, Callers> {
        IdempotencyLayerBuilder {
            store: self.store,
            config: self.config,
            callers,
            #[cfg(feature = "redis")]
            fast: self.fast,
        }
    }
}

impl<DB: StoreBackend, C> IdempotencyLayerBuilder<DB, C> {
    /// Puts the Redis fast path in front of the store: replays answered from Redis,
    /// concurrent duplicates turned away by a lease before they reach the database, and the
    /// database alone when Redis fails. See the crate doc's
    /// [Redis fast path](crate#redis-fast-path).
    #[cfg(feature = "redis")]
    pub fn redis(mut self, fast: crate::RedisFastPath) -> Self {
        self.fast = Some(fast);
        self
    }

    /// The layer. Requires the caller named, by
    /// [`caller`](IdempotencyLayerBuilder::caller) or
    /// [`shared_across_callers`](IdempotencyLayerBuilder::shared_across_callers).
    pub fn build(self) -> IdempotencyLayer<DB>
    where
        C: CallerNamed,
    {
        let starter = Starter::new(
            self.store.names().clone(),
            &self.config.operations_path,
            self.config.retry_after,
        );
        IdempotencyLayer {
            shared: Arc::new(Shared {
                starter,
                store: self.store,
                config: self.config,
                callers: self.callers.into(),
                held: Default::default(),
                #[cfg(feature = "redis")]
                fast: self.fast,
                housekeeping: Default::default(),
            }),
        }
    }
}

impl<S, DB: StoreBackend> Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotency<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around `S`.
pub struct Idempotency<S, DB: StoreBackend> {
    inner: S,
    shared: Arc<Shared<DB>>,
}

impl<S: Clone, DB: StoreBackend> Clone for Idempotency<S, DB> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S, DB: StoreBackend> std::fmt::Debug for Idempotency<S, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("store", &self.shared.store)
            .finish_non_exhaustive()
    }
}

impl<S, DB, ResBody> Service<Request<Body>> for Idempotency<S, DB>
where
    DB: StoreBackend,
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The service that was polled ready takes the request; a clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        self.shared.start_housekeeping();
        Box::pin(flow::handle(self.shared.clone(), inner, request))
    }
}
