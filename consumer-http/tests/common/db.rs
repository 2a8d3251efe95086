//! A database for one test: a fresh PostgreSQL schema (optionally with the Redis fast path
//! in front) or a temporary SQLite file, and the layer's store on it.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use consumer_http::{IdempotencyStore, StoreConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, SqlitePool};

#[cfg(feature = "redis")]
use super::redis_url;
use super::{database_url, unique};

/// A database for one test.
pub enum Db {
    Pg {
        pool: PgPool,
        schema: String,
        /// How often a connection was taken from the pool: each store statement, and each
        /// request's transaction, takes one.
        acquires: Arc<AtomicU64>,
        /// The Redis fast path the layer gets in front of this database, if any.
        #[cfg(feature = "redis")]
        redis: Option<consumer_http::RedisFastPath>,
    },
    Sqlite {
        pool: SqlitePool,
        _dir: Arc<tempfile::TempDir>,
    },
}

impl Db {
    /// A fresh PostgreSQL schema with the `effects` table; the pool's `search_path` is it.
    pub async fn postgres() -> Db {
        let schema = unique("http");
        let acquires = Arc::new(AtomicU64::new(0));
        let pool = pg_pool(&schema, &acquires).await;
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\"; \
             CREATE TABLE \"{schema}\".effects (route TEXT NOT NULL, run INTEGER NOT NULL);"
        ))
        .execute(&pool)
        .await
        .expect("create the test schema");
        Db::Pg {
            pool,
            schema,
            acquires,
            #[cfg(feature = "redis")]
            redis: None,
        }
    }

    /// [`Db::postgres`] with the Redis fast path (`REDIS_URL`, a key prefix of its own) in
    /// front of it.
    #[cfg(feature = "redis")]
    pub async fn postgres_redis() -> Db {
        let fast = consumer_http::RedisFastPath::builder(redis_url())
            .key_prefix(unique("http"))
            .build()
            .expect("the Redis fast path");
        Db::postgres().await.with_redis(fast)
    }

    /// The same database with `fast` in front of it.
    #[cfg(feature = "redis")]
    pub fn with_redis(mut self, fast: consumer_http::RedisFastPath) -> Db {
        if let Db::Pg { redis, .. } = &mut self {
            *redis = Some(fast);
        }
        self
    }

    /// The same database as another process sees it: a pool of its own (the same schema
    /// and acquisition count), so that a runtime dropped under it ([`App::serve_killable`])
    /// takes only its own connections along. sqlx registers a connection with the runtime
    /// that opened it: one the killed runtime opened, back in a shared pool, would fail the
    /// next request that takes it.
    pub async fn another_process(&self) -> Db {
        match self {
            Db::Pg {
                schema,
                acquires,
                #[cfg(feature = "redis")]
                redis,
                ..
            } => Db::Pg {
                pool: pg_pool(schema, acquires).await,
                schema: schema.clone(),
                acquires: acquires.clone(),
                #[cfg(feature = "redis")]
                redis: redis.clone(),
            },
            // SQLite's connections run on threads of their own, not on the runtime.
            Db::Sqlite { pool, _dir } => Db::Sqlite {
                pool: pool.clone(),
                _dir: _dir.clone(),
            },
        }
    }

    /// The store's table on PostgreSQL, quoted and qualified as the layer labels its
    /// metrics (`table`).
    pub fn table(&self) -> String {
        match self {
            Db::Pg { schema, .. } => format!("\"{schema}\".\"http_idempotency\""),
            Db::Sqlite { .. } => panic!("labelled on PostgreSQL only"),
        }
    }

    /// How often a connection has been taken from the PostgreSQL pool so far.
    pub fn acquires(&self) -> u64 {
        match self {
            Db::Pg { acquires, .. } => acquires.load(Ordering::SeqCst),
            Db::Sqlite { .. } => panic!("counted on PostgreSQL only"),
        }
    }

    /// A fresh SQLite file with the `effects` table.
    pub async fn sqlite() -> Db {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("http.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .expect("open SQLite");
        sqlx::raw_sql("CREATE TABLE effects (route TEXT NOT NULL, run INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .expect("create the test table");
        Db::Sqlite {
            pool,
            _dir: Arc::new(dir),
        }
    }

    /// How many effect rows have committed.
    pub async fn effects(&self) -> i64 {
        self.count("effects").await
    }

    /// How many idempotency records the store holds.
    pub async fn records(&self) -> i64 {
        self.count("http_idempotency").await
    }

    async fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        match self {
            Db::Pg { pool, .. } => sqlx::query_scalar(&sql).fetch_one(pool).await,
            Db::Sqlite { pool, .. } => sqlx::query_scalar(&sql).fetch_one(pool).await,
        }
        .expect("count rows")
    }

    /// The scope of every record the store holds.
    pub async fn scopes(&self) -> Vec<String> {
        let sql = "SELECT scope FROM http_idempotency";
        match self {
            Db::Pg { pool, .. } => sqlx::query_scalar(sql).fetch_all(pool).await,
            Db::Sqlite { pool, .. } => sqlx::query_scalar(sql).fetch_all(pool).await,
        }
        .expect("read the scopes")
    }

    /// The pending operations of `kind`, through the store's [`consumer_http::Operations`].
    pub async fn pending_operations(&self, kind: &str) -> Vec<consumer_http::Operation> {
        match self {
            Db::Pg { pool, schema, .. } => {
                let ops = pg_store(pool, schema).await.operations();
                ops.pending(kind, 100).await
            }
            Db::Sqlite { pool, .. } => {
                sqlite_store(pool)
                    .await
                    .operations()
                    .pending(kind, 100)
                    .await
            }
        }
        .expect("read the pending operations")
    }

    /// Finishes operation `id` (succeeded with `Ok`'s result, failed with `Err`'s error) in
    /// a transaction of its own, kept `keep`; whether it was pending.
    pub async fn finish_operation(
        &self,
        id: &str,
        outcome: Result<serde_json::Value, serde_json::Value>,
        keep: Duration,
    ) -> bool {
        macro_rules! finish {
            ($store:expr, $pool:expr) => {{
                let ops = $store.operations().keep_finished(keep);
                let mut tx = $pool.begin().await.expect("begin");
                let done = match &outcome {
                    Ok(result) => ops.succeed(&mut tx, id, result).await,
                    Err(error) => ops.fail(&mut tx, id, error).await,
                }
                .expect("finish the operation");
                tx.commit().await.expect("commit");
                done
            }};
        }
        match self {
            Db::Pg { pool, schema, .. } => finish!(pg_store(pool, schema).await, pool),
            Db::Sqlite { pool, .. } => finish!(sqlite_store(pool).await, pool),
        }
    }

    /// How many operations the store holds.
    pub async fn operations(&self) -> i64 {
        self.count("http_idempotency_operations").await
    }

    /// Deletes finished operations past their keep through the store; how many.
    pub async fn purge_finished_operations(&self) -> u64 {
        match self {
            Db::Pg { pool, schema, .. } => {
                pg_store(pool, schema)
                    .await
                    .operations()
                    .purge_finished(100)
                    .await
            }
            Db::Sqlite { pool, .. } => {
                sqlite_store(pool)
                    .await
                    .operations()
                    .purge_finished(100)
                    .await
            }
        }
        .expect("purge")
    }

    /// Deletes expired records through the store; how many.
    pub async fn purge_expired(&self) -> u64 {
        match self {
            Db::Pg { pool, schema, .. } => pg_store(pool, schema).await.purge_expired(100).await,
            Db::Sqlite { pool, .. } => sqlite_store(pool).await.purge_expired(100).await,
        }
        .expect("purge")
    }
}

/// A pool of up to 16 connections to PostgreSQL whose `search_path` is `schema`, counting
/// every acquisition in `acquires`.
async fn pg_pool(schema: &str, acquires: &Arc<AtomicU64>) -> PgPool {
    let options = PgConnectOptions::from_str(&database_url())
        .expect("DATABASE_URL")
        .options([("search_path", schema)]);
    // A new connection is handed out after `after_connect`, an idle one after
    // `before_acquire`: together, every acquisition.
    let (on_connect, on_acquire) = (acquires.clone(), acquires.clone());
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(30))
        .after_connect(move |_, _| {
            on_connect.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_, _| {
            on_acquire.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(true) })
        })
        .connect_with(options)
        .await
        .expect("connect to PostgreSQL")
}

pub(super) async fn pg_store(pool: &PgPool, schema: &str) -> IdempotencyStore<sqlx::Postgres> {
    let config = StoreConfig::builder()
        .schema(schema)
        .build()
        .expect("store config");
    IdempotencyStore::new(pool.clone(), config)
        .await
        .expect("store")
}

pub(super) async fn sqlite_store(pool: &SqlitePool) -> IdempotencyStore<sqlx::Sqlite> {
    IdempotencyStore::new(pool.clone(), StoreConfig::default())
        .await
        .expect("store")
}
