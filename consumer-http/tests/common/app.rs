//! The test app: handlers that write their effect through `IdempotentTx`, served behind the
//! layer on `127.0.0.1:0` with a reqwest client, the callers it knows, and a server that can
//! be killed mid-request.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use consumer_http::{IdempotencyConfig, IdempotencyLayer};
use serde_json::{json, Value};
use tokio::sync::Notify;

use super::db::{pg_store, sqlite_store, Db};
use super::{wait_until, Answer};

/// What the handlers share with the test: how often each ran, and switches.
#[derive(Default)]
pub struct Handlers {
    pub runs: AtomicU32,
    /// `/flaky` answers 500 (after its write) while set, and clears it.
    pub fail_next: AtomicBool,
    /// `/panic` panics while set, and clears it.
    pub panic_next: AtomicBool,
    /// `/payments` waits at the gate while set, and clears it: a request in progress.
    pub hold_next: AtomicBool,
    /// What a held `/payments` waits for.
    pub gate: Notify,
    /// How many handlers are waiting at the gate.
    pub held: AtomicU32,
    /// The key `/flaky` got for its effect outside the database
    /// (`IdempotentTx::idempotency_key("charge")`) on each run.
    pub effect_keys: std::sync::Mutex<Vec<String>>,
}

/// The handlers, for one database: each writes through its `IdempotentTx`.
macro_rules! routes {
    ($name:ident, $db:ty, $insert:literal) => {
        mod $name {
            use super::*;
            use consumer_http::IdempotentTx;

            async fn record(tx: &mut IdempotentTx<$db>, route: &str, run: u32) {
                sqlx::query($insert)
                    .bind(route)
                    .bind(i64::from(run))
                    .execute(&mut **tx)
                    .await
                    .expect("insert the effect");
            }

            async fn payments(
                State(h): State<Arc<Handlers>>,
                mut tx: IdempotentTx<$db>,
                Json(body): Json<Value>,
            ) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "payments", run).await;
                if h.hold_next.swap(false, Ordering::SeqCst) {
                    let notified = h.gate.notified();
                    h.held.fetch_add(1, Ordering::SeqCst);
                    notified.await;
                }
                let mut headers = HeaderMap::new();
                headers.insert("location", format!("/payments/{run}").parse().expect("value"));
                headers.insert("x-not-stored", "1".parse().expect("value"));
                let answer = json!({"payment": run, "amount": body["amount"]});
                (StatusCode::CREATED, headers, Json(answer)).into_response()
            }

            async fn flaky(State(h): State<Arc<Handlers>>, mut tx: IdempotentTx<$db>) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "flaky", run).await;
                h.effect_keys
                    .lock()
                    .expect("the effect keys")
                    .push(tx.idempotency_key("charge"));
                if h.fail_next.swap(false, Ordering::SeqCst) {
                    return (StatusCode::BAD_GATEWAY, "provider down").into_response();
                }
                (StatusCode::CREATED, Json(json!({"run": run}))).into_response()
            }

            async fn reject(State(h): State<Arc<Handlers>>) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::NOT_FOUND, Json(json!({"missing": run}))).into_response()
            }

            async fn panics(State(h): State<Arc<Handlers>>, mut tx: IdempotentTx<$db>) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "panic", run).await;
                if h.panic_next.swap(false, Ordering::SeqCst) {
                    panic!("the handler panics on purpose");
                }
                (StatusCode::OK, Json(json!({"run": run}))).into_response()
            }

            /// Writes its effect and answers the status the body names (`{"status": 429}`).
            async fn busy(
                State(h): State<Arc<Handlers>>,
                mut tx: IdempotentTx<$db>,
                Json(body): Json<Value>,
            ) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "busy", run).await;
                let status = body["status"]
                    .as_u64()
                    .and_then(|s| StatusCode::from_u16(u16::try_from(s).ok()?).ok())
                    .expect("a status in the body");
                (status, Json(json!({"busy": run}))).into_response()
            }

            /// Writes its effect, then runs a statement that fails and ignores the error
            /// (which aborts a PostgreSQL transaction), and answers 201.
            async fn ignores(State(h): State<Arc<Handlers>>, mut tx: IdempotentTx<$db>) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "ignores", run).await;
                let failed = sqlx::query("INSERT INTO effects (route, run) VALUES (NULL, 0)")
                    .execute(&mut *tx)
                    .await;
                assert!(failed.is_err(), "the statement fails");
                (StatusCode::CREATED, Json(json!({"run": run}))).into_response()
            }

            /// Starts a `refund` operation on the body and answers 202; with `"fail": true`
            /// in the body, answers 502 after starting it (so it rolls back).
            async fn refunds(
                State(h): State<Arc<Handlers>>,
                mut tx: IdempotentTx<$db>,
                Json(body): Json<Value>,
            ) -> Response {
                h.runs.fetch_add(1, Ordering::SeqCst);
                let started = tx
                    .start_operation("refund", &body)
                    .await
                    .expect("start the operation");
                if body["fail"] == json!(true) {
                    return (StatusCode::BAD_GATEWAY, "provider down").into_response();
                }
                started.accepted()
            }

            async fn big(State(h): State<Arc<Handlers>>, mut tx: IdempotentTx<$db>) -> Response {
                let run = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                record(&mut tx, "big", run).await;
                (StatusCode::OK, "x".repeat(4096)).into_response()
            }

            pub fn router(h: Arc<Handlers>) -> Router {
                Router::new()
                    .route("/payments", post(payments))
                    .route("/flaky", post(flaky))
                    .route("/reject", post(reject))
                    .route("/panic", post(panics))
                    .route("/big", post(big))
                    .route("/busy", post(busy))
                    .route("/ignores", post(ignores))
                    .route("/refunds", post(refunds))
                    .with_state(h)
            }
        }
    };
}

routes!(
    pg_routes,
    sqlx::Postgres,
    "INSERT INTO effects (route, run) VALUES ($1, $2)"
);
routes!(
    sqlite_routes,
    sqlx::Sqlite,
    "INSERT INTO effects (route, run) VALUES (?1, ?2)"
);

/// The credential of the caller `alice`, which the app's requests carry unless a test names
/// another: the test app knows the callers `alice`, `bob` and `carol`, each by its bearer
/// token `token-<name>`.
pub const ALICE: &str = "Bearer token-alice";
/// The credential of the caller `bob`.
pub const BOB: &str = "Bearer token-bob";
/// The credential of the caller `carol`.
pub const CAROL: &str = "Bearer token-carol";

/// The app on `127.0.0.1:0`.
pub struct App {
    pub base: String,
    pub handlers: Arc<Handlers>,
    pub client: reqwest::Client,
}

impl App {
    /// Serves the routes behind the layer with `config`, each caller's records its own (the
    /// caller named by `Authorization: Bearer token-<name>`).
    pub async fn serve(db: &Db, config: IdempotencyConfig) -> App {
        App::serve_scoped(db, config, Scoping::PerCaller).await
    }

    /// Serves the routes behind the layer with `config`, its records scoped as `scoping`
    /// says.
    pub async fn serve_scoped(db: &Db, config: IdempotencyConfig, scoping: Scoping) -> App {
        let handlers = Arc::new(Handlers::default());
        let router = router(db, config, handlers.clone(), scoping).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, router).await });
        App::at(addr, handlers)
    }

    /// [`App::serve`] on a runtime of its own, which [`Killed::kill`] drops with every
    /// request in flight: what a killed process leaves behind (claims, no commits).
    pub async fn serve_killable(db: &Db, config: IdempotencyConfig) -> (App, Killable) {
        let handlers = Arc::new(Handlers::default());
        // Its own connections, as a process of its own would have.
        let router = router(
            &db.another_process().await,
            config,
            handlers.clone(),
            Scoping::PerCaller,
        )
        .await;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                tokio::select! {
                    _ = axum::serve(listener, router) => {}
                    _ = stopped => {}
                }
            });
            // Dropping the runtime drops every connection task, and the handlers in them.
            drop(runtime);
        });
        (
            App::at(addr, handlers),
            Killable {
                stop,
                thread: Some(thread),
            },
        )
    }

    fn at(addr: std::net::SocketAddr, handlers: Arc<Handlers>) -> App {
        App {
            base: format!("http://{addr}"),
            handlers,
            client: reqwest::Client::new(),
        }
    }

    /// A POST of `body` (JSON) to `path`, with `key` if given.
    pub async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Answer {
        self.send(path, key, body.to_string(), &[]).await
    }

    /// A POST of the JSON text `body` to `path`, with `key` if given and `headers`; as the
    /// caller [`ALICE`] unless `headers` name an `authorization` of their own.
    pub async fn send(
        &self,
        path: &str,
        key: Option<&str>,
        body: String,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if !headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("authorization"))
        {
            request = request.header("authorization", ALICE);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        Answer::read(request.send().await.expect("send"))
            .await
            .expect("body")
    }

    /// A GET of `path` as the caller whose credential is `authorization` (none: no caller).
    pub async fn get(&self, path: &str, authorization: Option<&str>) -> Answer {
        let mut request = self.client.get(format!("{}{path}", self.base));
        if let Some(credential) = authorization {
            request = request.header("authorization", credential);
        }
        Answer::read(request.send().await.expect("send"))
            .await
            .expect("body")
    }

    /// Waits until `n` handlers wait at the gate.
    pub async fn wait_held(&self, n: u32) {
        wait_until("a handler waiting at the gate", || async {
            self.handlers.held.load(Ordering::SeqCst) >= n
        })
        .await;
    }

    /// Lets the handlers waiting at the gate answer.
    pub fn open_gate(&self) {
        self.handlers.gate.notify_waiters();
    }

    /// How often the handlers ran.
    pub fn runs(&self) -> u32 {
        self.handlers.runs.load(Ordering::SeqCst)
    }
}

/// A server on a runtime of its own (see [`App::serve_killable`]).
pub struct Killable {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Killable {
    /// Stops the server at once, dropping its requests in flight.
    pub fn kill(mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the server thread");
        }
    }
}

/// The caller of a request, as the test app's authentication names it: `<name>` for
/// `Authorization: Bearer token-<name>`.
fn caller(parts: &axum::http::request::Parts) -> Option<String> {
    let credential = parts.headers.get("authorization")?.to_str().ok()?;
    credential
        .strip_prefix("Bearer token-")
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
}

/// Whose the layer's records are in a test app.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoping {
    /// Each caller's own ([`caller`]).
    PerCaller,
    /// Every caller's (`shared_across_callers`).
    Shared,
}

/// The routes behind the layer with `config`, its records scoped as `scoping` says.
async fn router(
    db: &Db,
    config: IdempotencyConfig,
    handlers: Arc<Handlers>,
    scoping: Scoping,
) -> Router {
    macro_rules! layer {
        ($store:expr) => {{
            let builder = IdempotencyLayer::builder($store, config);
            match scoping {
                Scoping::PerCaller => builder.caller(caller),
                Scoping::Shared => builder.shared_across_callers(),
            }
        }};
    }
    match db {
        Db::Pg {
            pool,
            schema,
            #[cfg(feature = "redis")]
            redis,
            ..
        } => {
            let layer = layer!(pg_store(pool, schema).await);
            #[cfg(feature = "redis")]
            let layer = match redis {
                Some(fast) => layer.redis(fast.clone()),
                None => layer,
            };
            with_policy(pg_routes::router(handlers), layer.build())
        }
        Db::Sqlite { pool, .. } => {
            let layer = layer!(sqlite_store(pool).await).build();
            with_policy(sqlite_routes::router(handlers), layer)
        }
    }
}

/// Where the test app serves the layer's policy document.
pub const POLICY_PATH: &str = "/docs/idempotency";

/// `routes` behind `layer`, `GET` [`POLICY_PATH`] serving the layer's policy document
/// (a GET passes the layer through), as a service publishes it, and the layer's status
/// route of operations.
fn with_policy<DB: consumer_http::StoreBackend>(
    routes: Router,
    layer: IdempotencyLayer<DB>,
) -> Router {
    let policy = layer.policy_document();
    let operations = layer.operations_router();
    routes
        .merge(operations)
        .route(
            POLICY_PATH,
            axum::routing::get(move || async move {
                ([(http::header::CONTENT_TYPE, "text/markdown")], policy)
            }),
        )
        .layer(layer)
}
