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

use crate::config::IdempotencyConfig;
use crate::flow::{self, Shared};
use crate::store::{IdempotencyStore, StoreBackend};

/// A tower [`Layer`] that makes a service's requests idempotent by their
/// `Idempotency-Key`, recording them in an [`IdempotencyStore`]. See the crate doc for what
/// it answers and guarantees.
///
/// ```no_run
/// # async fn app(pool: sqlx::PgPool) -> Result<(), consumer_http::Error> {
/// use consumer_http::{IdempotencyConfig, IdempotencyLayer, IdempotencyStore, StoreConfig};
///
/// let store = IdempotencyStore::new(pool, StoreConfig::default()).await?;
/// let layer = IdempotencyLayer::new(store, IdempotencyConfig::default())
///     .with_tenant(|parts| parts.headers.get("x-account").and_then(|v| v.to_str().ok()).map(str::to_owned));
/// let app: axum::Router = axum::Router::new()
///     // .route("/payments", axum::routing::post(create_payment))
///     .layer(layer);
/// # Ok(()) }
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
            .finish_non_exhaustive()
    }
}

impl<DB: StoreBackend> IdempotencyLayer<DB> {
    /// The layer on `store` with `config`, without tenants.
    pub fn new(store: IdempotencyStore<DB>, config: IdempotencyConfig) -> Self {
        IdempotencyLayer {
            shared: Arc::new(Shared {
                store,
                config,
                tenant: None,
                #[cfg(feature = "redis")]
                fast: None,
            }),
        }
    }

    /// The same layer with a tenant function: its answer is part of every record's scope,
    /// so two tenants' keys never meet. `None` is the scope without a tenant.
    pub fn with_tenant(
        self,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        let mut shared = Shared::clone(&self.shared);
        shared.tenant = Some(Arc::new(tenant));
        IdempotencyLayer {
            shared: Arc::new(shared),
        }
    }

    /// The same layer with the Redis fast path in front of its store: replays answered from
    /// Redis, concurrent duplicates turned away by a lease before they reach the database,
    /// and the database alone when Redis fails. See the crate doc's
    /// [Redis fast path](crate#redis-fast-path).
    #[cfg(feature = "redis")]
    pub fn with_redis(self, fast: crate::RedisFastPath) -> Self {
        let mut shared = Shared::clone(&self.shared);
        shared.fast = Some(fast);
        IdempotencyLayer {
            shared: Arc::new(shared),
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
        Box::pin(flow::handle(self.shared.clone(), inner, request))
    }
}
