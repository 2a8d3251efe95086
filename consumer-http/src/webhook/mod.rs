//! The webhook ingress: [`WebhookIngress`] and its [builder](WebhookIngressBuilder), the
//! [`WebhookTransport`] a worker runs its events from, [`sign`] for senders and tests, and
//! the names it uses. The crate doc's [Webhook ingress](crate#webhook-ingress) says what it
//! answers and guarantees.

mod config;
mod route;
mod signature;
mod transport;

use std::sync::Arc;

use axum::routing::post;
use axum::Router;
use tokio::sync::mpsc;

pub use config::{WebhookIngressBuilder, DEFAULT_EVENT_ID_FIELD, DEFAULT_SIGNATURE_HEADER};
pub use route::WEBHOOK_TIMESTAMP;
pub use signature::sign;
pub use transport::{WebhookTransport, WEBHOOK_TRANSPORT};

use crate::Error;
use config::Settings;
use route::Shared;

/// A webhook endpoint: an axum [`Router`] with one `POST` route that verifies and answers
/// provider events, and the [`WebhookTransport`] a [`Worker`](consumer_core::Worker) runs
/// them from, with the application's `#[handler]`.
///
/// ```no_run
/// # use consumer_core::{handler, Context, HandlerError, Inbox, InboxConfig, Worker};
/// # use sqlx::Postgres;
/// // The event's key is its id (the delivery's message id): no key template needed.
/// #[handler(name = "provider_events", max_attempts = 5)]
/// async fn on_event(
///     ctx: &mut Context<'_, Postgres>,
///     event: serde_json::Value,
/// ) -> Result<(), HandlerError> {
///     sqlx::query("INSERT INTO events (id, kind) VALUES ($1, $2)")
///         .bind(ctx.key().to_owned())
///         .bind(event["type"].as_str())
///         .execute(ctx.db())
///         .await?;
///     Ok(())
/// }
///
/// # async fn app(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::new(pool, InboxConfig::default()).await?;
/// let (router, transport) = consumer_http::WebhookIngress::builder("/webhooks/provider")
///     .secret(std::env::var("PROVIDER_WEBHOOK_SECRET")?)
///     .build()?
///     .into_parts();
/// let worker = Worker::new(inbox, on_event)?;
/// tokio::spawn(async move { worker.run(transport, std::future::pending()).await });
/// let app: axum::Router = axum::Router::new().merge(router);
/// # Ok(()) }
/// ```
pub struct WebhookIngress {
    router: Router,
    transport: WebhookTransport,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for WebhookIngress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The settings' secrets print redacted.
        f.debug_struct("WebhookIngress")
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl WebhookIngress {
    /// A builder for an ingress at `route`, a literal path (e.g. `/webhooks/provider`),
    /// with the defaults: signature header [`DEFAULT_SIGNATURE_HEADER`], tolerance 5 min,
    /// event id in the JSON field [`DEFAULT_EVENT_ID_FIELD`], bodies up to 1 MiB, 64 events
    /// buffered, answers within 10 s. At least one secret must be added.
    pub fn builder(route: impl Into<String>) -> WebhookIngressBuilder {
        WebhookIngressBuilder::new(route)
    }

    fn from_settings(settings: Settings) -> Self {
        let (events, receiver) = mpsc::channel(settings.buffer);
        let route = settings.route.clone();
        let shared = Arc::new(Shared { settings, events });
        let router = Router::new()
            .route(&route, post(route::receive))
            .with_state(shared.clone());
        WebhookIngress {
            router,
            transport: WebhookTransport { events: receiver },
            shared,
        }
    }

    /// The router to serve (merge it into the application's) and the transport to run a
    /// worker on. The transport ends once every clone of the router is dropped.
    pub fn into_parts(self) -> (Router, WebhookTransport) {
        (self.router, self.transport)
    }
}

impl WebhookIngressBuilder {
    /// Checks the settings and builds the ingress; the error names the field.
    pub fn build(self) -> Result<WebhookIngress, Error> {
        Ok(WebhookIngress::from_settings(self.check()?))
    }
}
