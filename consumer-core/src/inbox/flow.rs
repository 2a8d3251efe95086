//! The inbox operations both dialects run the same way, written once: which statement of
//! the dialect's table ([`Statements`](super::config::Statements)), bound with which values,
//! and what its rows mean. The `Backend` methods of the same names document each.

use std::time::Duration;

use sqlx::Pool;

use super::claim::{AttemptItem, Claim};
use super::config::TableNames;
use super::dialect::{Arg, Clock, Execute};
use super::entry::{InboxCounts, InboxEntry};

/// Counts an attempt of `item` (taking the key's database locks `lock_ids` on PostgreSQL),
/// or says why it is not counted, from the key's row.
pub(super) async fn begin_attempt<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    item: &AttemptItem<'_>,
    max_attempts: u32,
    lock_ids: &[i64],
) -> Result<Claim, sqlx::Error> {
    adopt::<DB>(conn, names, handler, item.key).await?;
    let now = Clock::read();
    // One round trip: see the dialects' `begin_attempt` statement.
    let args = [
        Arg::Text(handler),
        Arg::Text(item.key),
        Arg::Text(item.hash),
        Arg::Int(i64::from(max_attempts)),
        Arg::Locks(lock_ids),
        Arg::Now(now),
        Arg::Attempt(item.attempt),
        Arg::OptText(item.scope),
    ];
    Ok(
        match DB::fetch_counted(&mut *conn, &names.sql.begin_attempt, &args).await? {
            Some(attempt) => Claim::Run { attempt },
            None => match fetch_entry::<DB>(conn, names, handler, item.key).await? {
                Some(entry) => Claim::from_entry(entry, item, names.copy_grace),
                None => return Err(sqlx::Error::RowNotFound),
            },
        },
    )
}

/// Marks the key completed if it is pending at `attempt`; `true` if it was.
pub(super) async fn complete<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
    attempt: u32,
    retention: Duration,
) -> Result<bool, sqlx::Error> {
    let now = Clock::read();
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Now(now),
        Arg::After(now, retention),
        Arg::Attempt(attempt),
    ];
    Ok(DB::execute(conn, &names.sql.complete, &args).await? == 1)
}

/// Inserts a fresh key as completed unless it has a row; `true` if it was inserted.
pub(super) async fn claim_fresh<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
    payload_hash: &str,
    retention: Duration,
) -> Result<bool, sqlx::Error> {
    if !alias_keys::<DB>(conn, names, &[key]).await?.is_empty() {
        // The key has a row under a former name: the counted path adopts it.
        return Ok(false);
    }
    let now = Clock::read();
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Text(payload_hash),
        Arg::Now(now),
        Arg::After(now, retention),
    ];
    Ok(DB::execute(conn, &names.sql.claim_fresh, &args).await? == 1)
}

/// Counts a fresh delivery's failed attempt unless the key has a row by now.
pub(super) async fn count_fresh_failure<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
    payload_hash: &str,
) -> Result<(), sqlx::Error> {
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Text(payload_hash),
        Arg::Now(Clock::read()),
    ];
    DB::execute(conn, &names.sql.count_fresh_failure, &args).await?;
    Ok(())
}

/// Records the newest retry copy's attempt number, scope and due time.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_retry<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
    key: &str,
    attempt: u32,
    scope: &str,
    delay: Duration,
) -> Result<(), sqlx::Error> {
    let now = Clock::read();
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Attempt(attempt),
        Arg::Now(now),
        Arg::Text(scope),
        Arg::After(now, delay),
    ];
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, &names.sql.record_retry, &args).await?;
    Ok(())
}

/// Gives back the attempt counted at `attempt`; `false` if the row has moved on.
pub(super) async fn uncount_attempt<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
    key: &str,
    attempt: u32,
) -> Result<bool, sqlx::Error> {
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Attempt(attempt),
        Arg::Now(Clock::read()),
    ];
    let mut conn = pool.acquire().await?;
    Ok(DB::execute(&mut conn, &names.sql.uncount_attempt, &args).await? == 1)
}

/// Records a failed attempt's error, and dead-letters the key if `dead`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_failure<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
    error: &str,
    dead: bool,
    retention: Duration,
) -> Result<(), sqlx::Error> {
    let now = Clock::read();
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Text(error),
        Arg::Bool(dead),
        Arg::Now(now),
        Arg::After(now, retention),
    ];
    DB::execute(conn, &names.sql.record_failure, &args).await?;
    Ok(())
}

/// Deletes the key's row if it is dead; `true` if it was.
pub(super) async fn release_dead<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<bool, sqlx::Error> {
    let args = [Arg::Text(handler), Arg::Text(key)];
    let mut conn = pool.acquire().await?;
    Ok(DB::execute(&mut conn, &names.sql.release_dead, &args).await? == 1)
}

/// The key's row, if any.
pub(super) async fn fetch_entry<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<Option<InboxEntry>, sqlx::Error> {
    let args = [Arg::Text(handler), Arg::Text(key), Arg::Now(Clock::read())];
    DB::fetch_entry(conn, &names.sql.fetch_entry, &args).await
}

/// [`fetch_entry`] on a pooled connection.
pub(super) async fn entry<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<Option<InboxEntry>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    fetch_entry::<DB>(&mut conn, names, handler, key).await
}

/// Raises the log mark to at least `to` in its own transaction; the mark before.
pub(super) async fn advance_log_mark<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    log: &str,
    to: i64,
) -> Result<Option<i64>, sqlx::Error> {
    let mut tx = DB::begin_marking(conn).await?;
    let now = Clock::read();
    let insert = [Arg::Text(handler), Arg::Text(log), Arg::Now(now)];
    DB::execute(&mut tx, &names.sql.mark_insert, &insert).await?;
    let select = [Arg::Text(handler), Arg::Text(log)];
    let before = DB::fetch_mark(&mut tx, &names.sql.mark_select, &select)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    let update = [
        Arg::Text(handler),
        Arg::Text(log),
        Arg::Int(to),
        Arg::Now(now),
    ];
    DB::execute(&mut tx, &names.sql.mark_update, &update).await?;
    tx.commit().await?;
    Ok(before)
}

/// The log mark, `None` if never set.
pub(super) async fn log_mark<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
    log: &str,
) -> Result<Option<i64>, sqlx::Error> {
    let args = [Arg::Text(handler), Arg::Text(log)];
    let mut conn = pool.acquire().await?;
    let mark = DB::fetch_mark(&mut conn, &names.sql.mark_select, &args).await?;
    Ok(mark.flatten())
}

/// The handler's rows by status.
pub(super) async fn counts<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handler: &str,
) -> Result<InboxCounts, sqlx::Error> {
    let args = [Arg::Text(handler), Arg::Now(Clock::read())];
    let mut conn = pool.acquire().await?;
    let rows = DB::fetch_counts(&mut conn, &names.sql.counts, &args).await?;
    Ok(InboxCounts::from_rows(rows))
}

/// Every handler with rows in the inbox, and how many rows it has, by name.
pub(super) async fn handlers<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
) -> Result<Vec<(String, u64)>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let rows = DB::fetch_counts(&mut conn, &names.sql.handlers, &[]).await?;
    Ok(rows
        .into_iter()
        .map(|(h, n, _)| (h, u64::try_from(n).unwrap_or(0)))
        .collect())
}

/// Deletes (or, with `dry_run`, counts) the rows of `status` not updated for `older_than` or
/// longer.
pub(super) async fn purge_older<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    status: &str,
    older_than: std::time::Duration,
    dry_run: bool,
) -> Result<u64, sqlx::Error> {
    let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    let args = [Arg::Text(status), Arg::Now(Clock::read()), Arg::Int(ms)];
    let mut conn = pool.acquire().await?;
    if dry_run {
        let rows = DB::fetch_counts(&mut conn, &names.sql.count_older, &args).await?;
        Ok(rows
            .first()
            .map_or(0, |(_, n, _)| u64::try_from(*n).unwrap_or(0)))
    } else {
        DB::execute(&mut conn, &names.sql.purge_older, &args).await
    }
}

/// Deletes up to `batch` expired rows; how many it deleted.
pub(super) async fn purge_expired<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let args = [Arg::Now(Clock::read()), Arg::Int(i64::from(batch))];
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, &names.sql.purge_expired, &args).await
}

/// Deletes up to `batch` pending rows of `handlers` that no copy of their message can still
/// reach: idle for `retention`, their newest copy (if any) due longer ago than `retention`
/// plus the copy grace. How many it deleted.
pub(super) async fn purge_stale_pending<DB: Execute>(
    pool: &Pool<DB>,
    names: &TableNames,
    handlers: &[String],
    retention: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let now = Clock::read();
    let args = [
        Arg::Texts(handlers),
        Arg::Before(now, retention),
        Arg::Before(now, retention.saturating_add(names.copy_grace)),
        Arg::Int(i64::from(batch)),
    ];
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, &names.sql.purge_stale_pending, &args).await
}

/// The keys among `keys` that have a row under one of the handler's aliases; none, without
/// a statement, when it has no aliases.
pub(super) async fn alias_keys<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    if names.aliases.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    let args = [Arg::Texts(&names.aliases), Arg::Texts(&keys)];
    let rows = DB::fetch_pairs(conn, &names.sql.alias_keys, &args).await?;
    Ok(rows.into_iter().map(|(key, _)| key).collect())
}

/// Before an attempt on `key` is counted: if the handler has no row for it but one of its
/// aliases has, that row becomes the handler's (renamed, with its status, attempts and
/// retry copy), so a key completed under a former name is a duplicate, a dead one stays
/// dead and a pending one keeps its count. Nothing, without a statement, when the handler
/// has no aliases.
pub(super) async fn adopt<DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<(), sqlx::Error> {
    if names.aliases.is_empty() {
        return Ok(());
    }
    let args = [
        Arg::Text(handler),
        Arg::Text(key),
        Arg::Texts(&names.aliases),
    ];
    DB::execute(conn, &names.sql.adopt, &args).await?;
    Ok(())
}

/// A batch's fresh `items` (key, payload hash) split: those to claim, and the keys with a
/// row under one of the handler's aliases, which the counted path adopts. The items as
/// they are, without a statement, when the handler has no aliases.
pub(super) async fn without_alias_keys<'i, DB: Execute>(
    conn: &mut DB::Connection,
    names: &TableNames,
    items: &'i [(&'i str, &'i str)],
) -> Result<(std::borrow::Cow<'i, [(&'i str, &'i str)]>, Vec<String>), sqlx::Error> {
    if names.aliases.is_empty() {
        return Ok((std::borrow::Cow::Borrowed(items), Vec::new()));
    }
    let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
    let taken = alias_keys::<DB>(conn, names, &keys).await?;
    let rest = items
        .iter()
        .filter(|(k, _)| !taken.iter().any(|t| t == k))
        .copied()
        .collect();
    Ok((std::borrow::Cow::Owned(rest), taken))
}
