//! The outbox's operations on each database (see [`crate::outbox`]), behind one sealed
//! trait that [`Backend`](crate::inbox::Backend) requires; their SQL is in `outbox_sql`. The table
//! is created by the inbox's migrations, beside the inbox. The operations are written once, on each
//! database's statements through [`Execute`]; each database supplies its SQL, how its relay's
//! transaction begins, and how it hears of commits.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use sqlx::{Pool, Postgres, Sqlite, Transaction};

use super::config::{OutboxSql, TableNames};
use super::dialect::{Arg, Clock, Execute, OutboxRaw};
use super::locks::OUTBOX_REST_LOCK as REST_LOCK;
use crate::outbox::message::OutboxMessage;

/// A row the relay took: its id, the message (its id set) and the publishes tried so far.
#[derive(Debug, Clone)]
pub(crate) struct OutboxRow {
    pub(crate) id: i64,
    pub(crate) message: OutboxMessage,
    pub(crate) attempts: u32,
}

/// A message to write to the outbox: its id, and a header it carries beside its own (the
/// trace context).
#[derive(Debug)]
pub struct NewRow<'a> {
    pub(crate) message: &'a OutboxMessage,
    pub(crate) message_id: &'a str,
    pub(crate) extra_header: Option<(&'a str, &'a str)>,
}

/// What a relay's take found.
#[derive(Debug)]
pub struct Taken {
    /// The rows taken, in id order.
    pub(crate) rows: Vec<OutboxRow>,
    /// Whether rows were left behind an earlier row of their key that another relay or
    /// round holds: they are due once it is marked.
    pub(crate) held_back: bool,
}

/// How many rows wait to be published, and for how long the oldest has.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OutboxStats {
    /// Rows not yet published.
    pub pending: u64,
    /// Of those, rows whose last publish failed (held back by a backoff).
    pub failing: u64,
    /// How long ago the oldest unpublished row was written (`None`: none).
    pub oldest_pending: Option<Duration>,
    /// Published rows kept for the retention.
    pub published: u64,
}

/// The outbox operations of a database. Sealed (its supertrait cannot be named outside the
/// crate): part of [`Backend`](crate::inbox::Backend), not a public API.
pub trait OutboxStore: Execute {
    /// The statements on the outbox of the inbox `names` describes.
    #[doc(hidden)]
    fn outbox_sql(names: &TableNames) -> OutboxSql;

    /// Whether the relay's transaction holds the rows it took while it publishes them, until
    /// it marks them (PostgreSQL: row locks, so relays side by side never take one row). Where
    /// it would hold the whole database's write lock instead (SQLite, where one relay runs per
    /// database file), the take commits at once and the marks go in a transaction of their own
    /// after the publish, so no writer waits for the broker.
    #[doc(hidden)]
    const HOLDS_ROWS_WHILE_PUBLISHING: bool;

    /// Begins a relay's transaction: its take, and its marks.
    #[doc(hidden)]
    fn outbox_begin(
        conn: &mut Self::Connection,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self>, sqlx::Error>>;

    /// A stream that yields when rows may have been committed to the outbox by another
    /// connection (PostgreSQL: `LISTEN`); one that never yields where the database cannot
    /// tell (SQLite: the relay polls).
    #[doc(hidden)]
    fn outbox_wakeups<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<BoxStream<'static, ()>, sqlx::Error>>;

    /// Whether writers notify only while a relay rests ([`OutboxStore::outbox_rest`]):
    /// PostgreSQL; SQLite never notifies (the relay polls).
    #[doc(hidden)]
    const RESTS: bool = false;

    /// Rests the relay: takes the outbox's rest lock in exclusive mode on `conn` (a
    /// connection of the relay's own, opened from `pool` when there is none), waiting at most
    /// `wait` for the writers holding it shared to commit. While it is held, every writer
    /// notifies its commit; a writer that took it shared (and did not notify) has committed
    /// or rolled back once it is taken. `Ok(false)`: not taken within `wait`. Called only
    /// where [`OutboxStore::RESTS`].
    #[doc(hidden)]
    fn outbox_rest<'a>(
        _pool: &'a Pool<Self>,
        _names: &'a TableNames,
        _conn: &'a mut Option<Self::Connection>,
        _wait: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async { Ok(false) })
    }

    /// Releases the rest lock [`OutboxStore::outbox_rest`] took on `conn`: writers commit
    /// without notifying again.
    #[doc(hidden)]
    fn outbox_unrest<'a>(
        _conn: &'a mut Self::Connection,
        _names: &'a TableNames,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async { Ok(()) })
    }

    /// Inserts `message` under `message_id`, with `extra_header` beside its own headers (the
    /// trace context it carries).
    #[doc(hidden)]
    fn outbox_insert<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        message: &'a OutboxMessage,
        message_id: &'a str,
        extra_header: Option<(&'a str, &'a str)>,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let headers = headers_json(&message.headers, extra_header);
            let args = [
                Arg::Text(message_id),
                Arg::Text(&message.destination),
                Arg::OptText(message.key.as_deref()),
                Arg::Text(&headers),
                Arg::Bytes(&message.payload),
                Arg::Now(Clock::read()),
            ];
            Self::execute(conn, &names.outbox_sql.insert, &args).await?;
            Ok(())
        })
    }

    /// Inserts `rows` in their order (so their ids ascend in it): in one statement where the
    /// database binds lists (PostgreSQL), else one statement a row.
    #[doc(hidden)]
    fn outbox_insert_all<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        rows: &'a [NewRow<'a>],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            for row in rows {
                Self::outbox_insert(
                    &mut *conn,
                    names,
                    row.message,
                    row.message_id,
                    row.extra_header,
                )
                .await?;
            }
            Ok(())
        })
    }

    /// Takes up to `limit` due, unpublished rows in id order that no earlier row of their key
    /// held back by its backoff precedes, locking them (PostgreSQL: and skipping the rows
    /// another relay or round holds); then drops every row that an earlier unpublished row
    /// of its key, not taken (another relay's or round's), must precede.
    #[doc(hidden)]
    fn outbox_take<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        limit: u32,
    ) -> BoxFuture<'a, Result<Taken, sqlx::Error>> {
        Box::pin(async move {
            let args = [Arg::Now(Clock::read()), Arg::Int(i64::from(limit))];
            let raw = Self::fetch_outbox(&mut *conn, &names.outbox_sql.take, &args).await?;
            let mut rows = decode(raw)?;
            let (keys, ids, max) = taken(&rows);
            if keys.is_empty() {
                return Ok(Taken {
                    rows,
                    held_back: false,
                });
            }
            let args = [Arg::Texts(&keys), Arg::Int(max), Arg::Ids(&ids)];
            let blocked = Self::fetch_pairs(&mut *conn, &names.outbox_sql.blockers, &args).await?;
            let before = rows.len();
            keep_ordered(&mut rows, &blocked.into_iter().collect());
            Ok(Taken {
                held_back: rows.len() < before,
                rows,
            })
        })
    }

    /// Settles the published rows `ids`: marks them published (kept for the retention), or
    /// deletes them when `kept` is false (no retention: a delete writes no new row version,
    /// where the mark writes one and an entry in each of the table's indexes).
    #[doc(hidden)]
    fn outbox_settle_published<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        ids: &'a [i64],
        kept: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            if kept {
                let args = [Arg::Now(Clock::read()), Arg::Ids(ids)];
                Self::execute(conn, &names.outbox_sql.mark_published, &args).await?;
            } else {
                let args = [Arg::Ids(ids)];
                Self::execute(conn, &names.outbox_sql.delete_published, &args).await?;
            }
            Ok(())
        })
    }

    /// Counts a failed publish of row `id` and holds the row back for `delay`.
    #[doc(hidden)]
    fn outbox_mark_failed<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        id: i64,
        error: &'a str,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let args = [
                Arg::Int(id),
                Arg::Text(error),
                Arg::After(Clock::read(), delay),
            ];
            Self::execute(conn, &names.outbox_sql.mark_failed, &args).await?;
            Ok(())
        })
    }

    /// Deletes up to `limit` rows published more than `older_than` ago; how many.
    #[doc(hidden)]
    fn outbox_purge<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        older_than: Duration,
        limit: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let args = [
                Arg::Before(Clock::read(), older_than),
                Arg::Int(i64::from(limit)),
            ];
            Self::execute(&mut conn, &names.outbox_sql.purge, &args).await
        })
    }

    /// Keeps `reply` (its id set) with the request's row (`handler`, `key`), in the handler's
    /// transaction, so that a duplicate of the request is answered with it again.
    #[doc(hidden)]
    fn outbox_store_reply<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        reply: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let headers = headers_json(&reply.headers, None);
            let args = [
                Arg::Text(handler),
                Arg::Text(key),
                Arg::OptText(reply.message_id.as_deref()),
                Arg::Text(&headers),
                Arg::Bytes(&reply.payload),
            ];
            Self::execute(conn, &names.outbox_sql.store_reply, &args).await?;
            Ok(())
        })
    }

    /// Writes the reply kept with (`handler`, `key`), if any, to the outbox again, for
    /// the duplicate request's `destination` and with its `correlation` id (none: the
    /// reply carries none), in a statement of its own; whether there was one.
    #[doc(hidden)]
    fn outbox_resend_reply<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        destination: &'a str,
        correlation: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let args = [
                Arg::Text(handler),
                Arg::Text(key),
                Arg::Text(destination),
                Arg::OptText(correlation),
                Arg::Now(Clock::read()),
            ];
            Ok(Self::execute(&mut conn, &names.outbox_sql.resend_reply, &args).await? > 0)
        })
    }

    #[doc(hidden)]
    fn outbox_stats<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<OutboxStats, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let args = [Arg::Now(Clock::read())];
            let (pending, failing, oldest_ms, published) =
                Self::fetch_outbox_stats(&mut conn, &names.outbox_sql.stats, &args).await?;
            let count = |n: i64| u64::try_from(n).unwrap_or(0);
            Ok(OutboxStats {
                pending: count(pending),
                failing: count(failing),
                oldest_pending: oldest_ms.map(|ms| Duration::from_millis(count(ms))),
                published: count(published),
            })
        })
    }
}

/// The channel the outbox trigger notifies (see the migration `0005_outbox.sql`).
const CHANNEL: &str = "consumer_outbox";

/// The SQLSTATE of a lock not taken within `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// `headers` as a JSON object, with `extra` added (replacing a header of its name) when
/// there is one, so that a header to carry needs no copy of the message.
fn headers_json(headers: &BTreeMap<String, String>, extra: Option<(&str, &str)>) -> String {
    let json = match extra {
        None => serde_json::to_string(headers),
        Some((name, value)) => {
            let mut all: BTreeMap<&str, &str> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            all.insert(name, value);
            serde_json::to_string(&all)
        }
    };
    json.unwrap_or_else(|_| "{}".to_owned())
}

fn decode(rows: Vec<OutboxRaw>) -> Result<Vec<OutboxRow>, sqlx::Error> {
    rows.into_iter()
        .map(
            |(id, message_id, destination, key, headers, payload, attempts)| {
                let headers: BTreeMap<String, String> =
                    serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                Ok(OutboxRow {
                    id,
                    message: OutboxMessage {
                        destination,
                        key,
                        message_id: Some(message_id),
                        headers,
                        payload: payload.into(),
                    },
                    attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
                })
            },
        )
        .collect()
}

/// Drops the rows that an earlier row of their key, not taken, must precede: `first_blocked`
/// maps a key to its earliest unpublished row outside `rows`.
fn keep_ordered(rows: &mut Vec<OutboxRow>, first_blocked: &HashMap<String, i64>) {
    rows.retain(|r| match &r.message.key {
        Some(k) => first_blocked.get(k).is_none_or(|&b| r.id < b),
        None => true,
    });
}

/// The keys of `rows`, the ids taken and the highest id: what the blocker query binds.
fn taken(rows: &[OutboxRow]) -> (Vec<String>, Vec<i64>, i64) {
    let mut keys: Vec<String> = rows.iter().filter_map(|r| r.message.key.clone()).collect();
    keys.sort_unstable();
    keys.dedup();
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let max = ids.iter().copied().max().unwrap_or(0);
    (keys, ids, max)
}

impl OutboxStore for Postgres {
    const HOLDS_ROWS_WHILE_PUBLISHING: bool = true;
    const RESTS: bool = true;

    fn outbox_insert_all<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        rows: &'a [NewRow<'a>],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let column = |f: fn(&NewRow<'a>) -> String| rows.iter().map(f).collect::<Vec<_>>();
            let ids = column(|r| r.message_id.to_owned());
            let destinations = column(|r| r.message.destination.clone());
            let headers = column(|r| headers_json(&r.message.headers, r.extra_header));
            let keys: Vec<Option<String>> = rows.iter().map(|r| r.message.key.clone()).collect();
            let bodies: Vec<&[u8]> = rows.iter().map(|r| &r.message.payload[..]).collect();
            let args = [
                Arg::Texts(&ids),
                Arg::Texts(&destinations),
                Arg::OptTexts(&keys),
                Arg::Texts(&headers),
                Arg::ByteLists(&bodies),
            ];
            Self::execute(conn, &names.outbox_sql.insert_all, &args).await?;
            Ok(())
        })
    }

    fn outbox_sql(names: &TableNames) -> OutboxSql {
        OutboxSql::postgres(names)
    }

    fn outbox_begin(
        conn: &mut Self::Connection,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self>, sqlx::Error>> {
        use sqlx::Connection;
        conn.begin()
    }

    fn outbox_wakeups<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<BoxStream<'static, ()>, sqlx::Error>> {
        Box::pin(async move {
            // The trigger names the table as the server resolved it: resolve ours the same
            // way, so that any spelling of the configuration hears its own table.
            let table: Option<String> = sqlx::query_scalar(
                "SELECT n.nspname || '.' || c.relname FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
            )
            .bind(&names.outbox)
            .fetch_one(pool)
            .await?;
            let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
            listener.listen(CHANNEL).await?;
            let stream = listener.into_stream().filter_map(move |n| {
                let wake = match n {
                    Ok(n) => table.as_deref().is_none_or(|t| n.payload() == t),
                    // A lost connection: the listener reconnects on the next poll, and
                    // notifications sent meanwhile are lost; a wake-up makes the relay look.
                    Err(e) => {
                        tracing::debug!(error = %e, "outbox listener interrupted");
                        true
                    }
                };
                std::future::ready(wake.then_some(()))
            });
            Ok(stream.boxed())
        })
    }

    fn outbox_rest<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        conn: &'a mut Option<Self::Connection>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let held = match conn {
                Some(held) => held,
                None => {
                    // A connection of the relay's own, out of the pool: closing it (the
                    // relay ends, or a statement failed) releases the lock.
                    let mut fresh = pool.acquire().await?.detach();
                    let ms = wait.as_millis().max(1);
                    sqlx::query(&format!("SET lock_timeout = {ms}"))
                        .execute(&mut fresh)
                        .await?;
                    conn.insert(fresh)
                }
            };
            let taken = sqlx::query("SELECT pg_advisory_lock($1, to_regclass($2)::oid::int)")
                .bind(REST_LOCK)
                .bind(&names.outbox)
                .execute(&mut *held)
                .await;
            match taken {
                Ok(_) => Ok(true),
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
                {
                    Ok(false)
                }
                Err(e) => {
                    *conn = None;
                    Err(e)
                }
            }
        })
    }

    fn outbox_unrest<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("SELECT pg_advisory_unlock($1, to_regclass($2)::oid::int)")
                .bind(REST_LOCK)
                .bind(&names.outbox)
                .execute(conn)
                .await?;
            Ok(())
        })
    }
}

impl OutboxStore for Sqlite {
    const HOLDS_ROWS_WHILE_PUBLISHING: bool = false;

    fn outbox_sql(names: &TableNames) -> OutboxSql {
        OutboxSql::sqlite(names)
    }

    fn outbox_begin(
        conn: &mut Self::Connection,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self>, sqlx::Error>> {
        use sqlx::Connection;
        // The write lock from the start (a take, or the marks: neither spans a publish), so
        // the marks cannot fail on a snapshot another writer made stale.
        conn.begin_with("BEGIN IMMEDIATE")
    }

    fn outbox_wakeups<'a>(
        _pool: &'a Pool<Self>,
        _names: &'a TableNames,
    ) -> BoxFuture<'a, Result<BoxStream<'static, ()>, sqlx::Error>> {
        Box::pin(async { Ok(futures::stream::pending().boxed()) })
    }
}
