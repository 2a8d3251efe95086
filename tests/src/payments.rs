//! The payments example (`examples/payments`) as a real process on PostgreSQL, and what its
//! tests share: a fresh schema, one pool and one HTTP client per test, the process started
//! on `127.0.0.1:0` (on PostgreSQL alone, or with the Redis fast path), and the answers read
//! whole.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::{database_url, redis_url, wait_until, PgEnv};
use crate::process::{package_binary, Process};

/// Which store answers the example's `Idempotency-Key` layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// The database alone.
    Postgres,
    /// The Redis fast path (`REDIS_URL`) in front of the database.
    PostgresRedis,
}

/// The API key of the account every request pays as, unless it names another: the example
/// knows it ([`Payments::spawn`] sets `PAYMENTS_API_KEYS`) and [`Payments::client`] sends it.
pub const API_KEY: &str = "sk_test_first";
/// The API key of a second account the example knows.
pub const OTHER_API_KEY: &str = "sk_test_second";

/// One test's payments example: its schema, a pool on it and an HTTP client, shared by every
/// process the test starts and every request it sends. Cheap to clone.
#[derive(Clone)]
pub struct Payments {
    schema: String,
    store: Store,
    pool: PgPool,
    client: reqwest::Client,
}

/// A running example process: dropping it kills it (SIGKILL).
pub struct Server {
    /// The process.
    pub process: Process,
    /// `http://ADDR`, the address it logged.
    pub base: String,
}

pub use consumer_scenarios::http::Answer;

impl Payments {
    /// A fresh schema for the example on the database alone.
    pub async fn new() -> Payments {
        Payments::on(Store::Postgres).await
    }

    /// A fresh schema for the example with `store` behind its layer.
    pub async fn on(store: Store) -> Payments {
        let env = PgEnv::new().await;
        let pool = env.pool(4).await;
        let schema = env.schema;
        // Bounded, so a request to a process that stopped answering fails the test rather
        // than hanging it; far above the layer's 5 s wait for a request in progress.
        let mut headers = reqwest::header::HeaderMap::new();
        let credential = format!("Bearer {API_KEY}");
        headers.insert(
            reqwest::header::AUTHORIZATION,
            credential.parse().expect("a header value"),
        );
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(Duration::from_secs(30))
            .build()
            .expect("an HTTP client");
        Payments {
            schema,
            store,
            pool,
            client,
        }
    }

    /// The test's schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The store behind the layer.
    pub fn store(&self) -> Store {
        self.store
    }

    /// A pool on the test's schema (its `search_path`).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The HTTP client: its requests carry [`API_KEY`] unless they name another.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The example's settings for this test, before the test's own: the schema, a free
    /// port, the API keys [`API_KEY`] and [`OTHER_API_KEY`], and `REDIS_URL`
    /// (empty without the fast path).
    fn settings(&self) -> HashMap<&'static str, String> {
        let mut vars = HashMap::from([
            ("DATABASE_URL", database_url()),
            ("DB_SCHEMA", self.schema.clone()),
            ("PAYMENTS_ADDR", "127.0.0.1:0".to_owned()),
            (
                "PAYMENTS_API_KEYS",
                format!("{API_KEY}=acct_first,{OTHER_API_KEY}=acct_second"),
            ),
        ]);
        // The test command exports `REDIS_URL`, and the process inherits the environment:
        // empty turns the fast path off.
        let redis = match self.store {
            Store::Postgres => String::new(),
            Store::PostgresRedis => redis_url(),
        };
        vars.insert("REDIS_URL", redis);
        vars
    }

    /// Starts the example with `extra` settings, its log in a file named after the schema
    /// and `log`.
    pub fn spawn(&self, extra: &[(&'static str, &str)], log: &str) -> Process {
        let mut vars = self.settings();
        for (k, v) in extra {
            vars.insert(k, (*v).to_owned());
        }
        let log = std::env::temp_dir().join(format!("{}-{log}.log", self.schema));
        Process::spawn_binary(package_binary("payments", "payments"), &vars, log)
    }

    /// [`Payments::spawn`], then waits for the address it listens on.
    pub async fn start(&self, extra: &[(&'static str, &str)], log: &str) -> Server {
        let process = self.spawn(extra, log);
        let mut addr = String::new();
        wait_until("the example listens", || {
            let log = process.log();
            addr = log
                .lines()
                .find_map(|l| l.split("listening on ").nth(1))
                .map(|a| a.trim().to_owned())
                .unwrap_or_default();
            std::future::ready(!addr.is_empty())
        })
        .await;
        Server {
            process,
            base: format!("http://{addr}"),
        }
    }

    /// POSTs `body` to `url` with `Idempotency-Key: key`.
    pub async fn post(&self, url: &str, key: &str, body: &Value) -> reqwest::Result<Answer> {
        let request = self
            .client
            .post(url)
            .header("Idempotency-Key", key)
            .json(body);
        Answer::read(request.send().await?).await
    }

    /// Pays 100 for `order` at `base` with `Idempotency-Key: key`, as the account of
    /// `Authorization: <credential>`.
    pub async fn pay_as(
        &self,
        credential: &str,
        base: &str,
        key: &str,
        order: i64,
    ) -> reqwest::Result<Answer> {
        let request = self
            .client
            .post(format!("{base}/payments"))
            .header("Idempotency-Key", key)
            .header(reqwest::header::AUTHORIZATION, credential)
            .json(&json!({"order_id": order, "amount": 100}));
        Answer::read(request.send().await?).await
    }

    /// Pays 100 for `order` at `base` with `Idempotency-Key: key`.
    pub async fn pay(&self, base: &str, key: &str, order: i64) -> reqwest::Result<Answer> {
        let body = json!({"order_id": order, "amount": 100});
        self.post(&format!("{base}/payments"), key, &body).await
    }

    /// How many charges of `order` have committed.
    pub async fn charges(&self, order: i64) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE order_id = $1")
            .bind(order)
            .fetch_one(&self.pool)
            .await
            .expect("count charges")
    }

    /// `SELECT count(*)` of `table`, in the test's schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count {table}: {e}"))
    }
}
