//! PostgreSQL: many processes share the table; the clock is the server's.

use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use sqlx::{Pool, Postgres};

use super::backend::{render, store_ops, StoreBackend, CLAIM, EXPIRED};
use super::config::Names;
use crate::Error;

const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        include_str!("../../migrations/postgres/0001_idempotency.sql"),
    ),
    (
        2,
        include_str!("../../migrations/postgres/0002_operations.sql"),
    ),
];

impl StoreBackend for Postgres {
    const BACKEND: &'static str = "PostgreSQL";
    const HAS_SCHEMAS: bool = true;
    // `clock_timestamp()`, not `now()`: a request's transaction lives as long as its
    // handler, and its completion's TTL counts from when it is stored.
    const NOW_MS: &'static str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

    fn begin_claim(wait_ms: i64) -> String {
        // The connection's own lock timeout is kept in a setting of this transaction, for the
        // claim statement to put back: the handler's statements run under it, not the wait.
        // A lock timeout of 0 would wait for ever; above `i32::MAX` ms the setting is refused.
        format!(
            "BEGIN; SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true); \
             SET LOCAL lock_timeout = {}",
            wait_ms.clamp(1, i64::from(i32::MAX))
        )
    }

    fn claim_template() -> String {
        // The lock timeout is put back once the row is this request's (the outer query reads
        // the claim's row only after the insert has waited its turn).
        format!(
            "WITH claimed AS ({CLAIM}) SELECT claim, \
             set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true) \
             FROM claimed"
        )
    }

    fn is_lock_timeout(e: &sqlx::Error) -> bool {
        // `lock_not_available`: the claim waited `lock_timeout` on another request's row.
        e.as_database_error()
            .and_then(|e| e.code())
            .is_some_and(|code| code == "55P03")
    }

    fn placeholders(sql: &str) -> String {
        sql.to_owned()
    }

    fn purge_template() -> String {
        format!(
            "DELETE FROM {{table}} WHERE ctid = ANY(ARRAY(\
             SELECT ctid FROM {{table}} WHERE {EXPIRED} LIMIT $1))"
        )
    }

    fn migrate<'a>(pool: &'a Pool<Self>, names: &'a Names) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(migrate(pool, names))
    }

    store_ops!(Postgres);
}

/// Where a request's transaction keeps its connection's lock timeout while the claim waits.
const SAVED_LOCK_TIMEOUT: &str = "consumer_http.lock_timeout";

/// The migration lock of a table: processes starting together would race on
/// `CREATE ... IF NOT EXISTS`, which is not atomic in PostgreSQL.
fn migration_lock(names: &Names) -> i64 {
    let digest = Sha256::digest(format!("consumer-http migrate {}", names.table));
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(id)
}

async fn migrate(pool: &Pool<Postgres>, names: &Names) -> Result<(), Error> {
    let schema = names.schema.as_ref().map(|s| s.quoted());
    let ledger = consumer_core::migrate::Ledger {
        table: &names.migrations,
        schema: schema.as_deref(),
        lock: migration_lock(names),
    };
    consumer_core::migrate::postgres(pool, ledger, MIGRATIONS, |sql| {
        render::<Postgres>(names, sql)
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait of zero still bounds the claim's wait (0 would be none), and a wait longer
    /// than PostgreSQL's largest lock timeout is clamped to it rather than refused.
    #[test]
    fn the_claims_lock_timeout_is_within_what_postgresql_takes() {
        assert!(Postgres::begin_claim(0).ends_with("lock_timeout = 1"));
        assert!(Postgres::begin_claim(5000).ends_with("lock_timeout = 5000"));
        assert!(Postgres::begin_claim(i64::MAX).ends_with("lock_timeout = 2147483647"));
    }
}
