//! What a SQL dialect supplies to the shared inbox operations: how it binds an operation's
//! values ([`Arg`]: the clock, the key locks, the width of an attempt number) and decodes
//! the rows whose types differ; and [`Execute`], the one executor that runs the statements
//! on either database.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use sqlx::{Database, Executor, FromRow, IntoArguments, Transaction};

use super::entry::InboxEntry;

/// The time of one inbox operation, read once so that all its statements agree on it: Unix
/// milliseconds, as SQLite's statements bind it. PostgreSQL's statements read `now()` on
/// the server instead, and bind nothing for it.
#[derive(Debug, Clone, Copy)]
pub struct Clock(i64);

impl Clock {
    /// The current time.
    pub(crate) fn read() -> Self {
        Clock(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                .unwrap_or_default(),
        )
    }

    /// In Unix milliseconds.
    pub(crate) fn unix_ms(self) -> i64 {
        self.0
    }
}

/// One value bound into an inbox statement, in the order of the statement's placeholders.
/// The shared operations list every value either dialect needs; each dialect binds its own
/// and leaves the rest out (see [`Dialect::arguments`]), and its statements are numbered
/// accordingly.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// A handler, key, hash, log name, error or scope.
    Text(&'a str),
    /// A scope that may be absent.
    OptText(Option<&'a str>),
    /// An attempt limit, batch size, log offset or guard id.
    Int(i64),
    /// Whether the key is dead-lettered.
    Bool(bool),
    /// An attempt number, as the `INTEGER` columns hold it.
    Attempt(u32),
    /// The operation's time: SQLite binds it; PostgreSQL binds nothing (its SQL says `now()`).
    Now(Clock),
    /// A time `Duration` after the operation's: SQLite binds the instant; PostgreSQL binds
    /// the duration in milliseconds, which its SQL adds to `now()`.
    After(Clock, Duration),
    /// Key lock ids: PostgreSQL binds them (its statements take or release the advisory
    /// locks); SQLite, which has no database locks, binds nothing.
    Locks(&'a [i64]),
    /// A time `Duration` before the operation's: SQLite binds the instant; PostgreSQL binds
    /// the duration in milliseconds, which its SQL subtracts from `now()`.
    Before(Clock, Duration),
    /// A message body.
    Bytes(&'a [u8]),
    /// A list of row ids: PostgreSQL binds an array (`= ANY($n)`); SQLite a JSON array, which
    /// its SQL reads with `json_each`.
    Ids(&'a [i64]),
    /// A list of texts, bound as [`Arg::Ids`] is.
    Texts(&'a [String]),
    /// A list of texts that may be absent, bound as [`Arg::Ids`] is.
    OptTexts(&'a [Option<String>]),
    /// A list of message bodies, bound as [`Arg::Ids`] is.
    ByteLists(&'a [&'a [u8]]),
}

/// A list as the JSON array SQLite's statements read with `json_each`.
pub(crate) fn json_list<T: serde::Serialize>(items: &[T]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".to_owned())
}

/// An outbox row as the `take` statement returns it: id, message id, destination, ordering
/// key, headers (a JSON object), payload, attempts.
pub(crate) type OutboxRaw = (i64, String, String, Option<String>, String, Vec<u8>, i64);

/// A row of the dead-letter table as its `list` and `fetch` statements return it: id,
/// handler, transport, location, message id, key, reason, error, attempts, headers (a JSON
/// object), payload, deliveries, first and last time (Unix milliseconds).
pub(crate) type DeadLetterRaw = (
    i64,
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    String,
    String,
    i64,
    String,
    Vec<u8>,
    i64,
    i64,
    i64,
);

/// The outbox's `stats` row: pending, failing, age of the oldest pending row in
/// milliseconds, published.
pub(crate) type OutboxStatsRaw = (i64, i64, Option<i64>, i64);

/// What differs between the databases below their SQL text. A supertrait of
/// [`Backend`](crate::inbox::Backend) (through [`Execute`]) that only this crate can name, so it
/// also seals that trait.
pub trait Dialect: Database {
    /// The arguments of a statement, bound in order the database's way (see [`Arg`]).
    fn arguments<'q>(args: &[Arg<'q>]) -> Result<Self::Arguments<'q>, sqlx::Error>;

    /// How many rows a statement changed.
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// The attempt count an attempt-counting statement returned (its first column).
    fn counted(row: &Self::Row) -> Result<u32, sqlx::Error>;

    /// An entry from a row of the entry statements (`fetch_entry`, `select_entries`).
    fn entry_from_row(row: &Self::Row) -> Result<InboxEntry, sqlx::Error>;

    /// Begins the transaction that advances a log mark (see `Backend::advance_log_mark`).
    fn begin_marking(
        conn: &mut Self::Connection,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self>, sqlx::Error>>;
}

/// Runs an inbox statement with its [`Arg`]s and reads its rows: written once, for every
/// [`Dialect`] sqlx can run them on.
pub trait Execute: Dialect {
    /// Runs `sql`; how many rows it changed.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Runs an attempt-counting `sql`: the count, if it returned a row.
    fn fetch_counted<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Option<u32>, sqlx::Error>> + Send + 'a;

    /// Runs an entry statement: the entry, if the key has a row.
    fn fetch_entry<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Option<InboxEntry>, sqlx::Error>> + Send + 'a;

    /// Runs the counts statement: (status, count, idle milliseconds of the stalest row) rows.
    fn fetch_counts<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Vec<(String, i64, Option<i64>)>, sqlx::Error>> + Send + 'a;

    /// Runs the mark statement: `None` without a row, `Some(None)` for a row with no mark.
    fn fetch_mark<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Option<Option<i64>>, sqlx::Error>> + Send + 'a;

    /// Runs the outbox's `take` statement.
    fn fetch_outbox<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Vec<OutboxRaw>, sqlx::Error>> + Send + 'a;

    /// Runs a (text, integer) statement: the outbox's first blocked row of each key.
    fn fetch_pairs<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'a;

    /// Runs the outbox's `stats` statement.
    fn fetch_outbox_stats<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<OutboxStatsRaw, sqlx::Error>> + Send + 'a;

    /// Runs a dead-letter statement that returns letters.
    fn fetch_dead_letters<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> impl Future<Output = Result<Vec<DeadLetterRaw>, sqlx::Error>> + Send + 'a;
}

impl<DB> Execute for DB
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    (String, i64, Option<i64>): for<'r> FromRow<'r, DB::Row>,
    (Option<i64>,): for<'r> FromRow<'r, DB::Row>,
    OutboxRaw: for<'r> FromRow<'r, DB::Row>,
    (String, i64): for<'r> FromRow<'r, DB::Row>,
    OutboxStatsRaw: for<'r> FromRow<'r, DB::Row>,
    DeadLetterRaw: for<'r> FromRow<'r, DB::Row>,
{
    async fn execute<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query_with(sql, DB::arguments(args)?)
            .execute(conn)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn fetch_counted<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Option<u32>, sqlx::Error> {
        let row = sqlx::query_with(sql, DB::arguments(args)?)
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(DB::counted).transpose()
    }

    async fn fetch_entry<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Option<InboxEntry>, sqlx::Error> {
        let row = sqlx::query_with(sql, DB::arguments(args)?)
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(DB::entry_from_row).transpose()
    }

    async fn fetch_counts<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Vec<(String, i64, Option<i64>)>, sqlx::Error> {
        sqlx::query_as_with(sql, DB::arguments(args)?)
            .fetch_all(conn)
            .await
    }

    async fn fetch_mark<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Option<Option<i64>>, sqlx::Error> {
        sqlx::query_scalar_with(sql, DB::arguments(args)?)
            .fetch_optional(conn)
            .await
    }

    async fn fetch_outbox<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Vec<OutboxRaw>, sqlx::Error> {
        sqlx::query_as_with(sql, DB::arguments(args)?)
            .fetch_all(conn)
            .await
    }

    async fn fetch_pairs<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        sqlx::query_as_with(sql, DB::arguments(args)?)
            .fetch_all(conn)
            .await
    }

    async fn fetch_outbox_stats<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<OutboxStatsRaw, sqlx::Error> {
        sqlx::query_as_with(sql, DB::arguments(args)?)
            .fetch_one(conn)
            .await
    }

    async fn fetch_dead_letters<'a>(
        conn: &'a mut DB::Connection,
        sql: &'a str,
        args: &'a [Arg<'a>],
    ) -> Result<Vec<DeadLetterRaw>, sqlx::Error> {
        sqlx::query_as_with(sql, DB::arguments(args)?)
            .fetch_all(conn)
            .await
    }
}
