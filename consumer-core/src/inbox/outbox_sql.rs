//! The outbox's SQL on each database: the statements [`OutboxStore`](super::OutboxStore)'s
//! operations run, rendered once per table.

use super::config::{OutboxSql, TableNames};

impl OutboxSql {
    pub(crate) fn postgres(names: &TableNames) -> Self {
        let r = |s: &str| names.render(s);
        OutboxSql {
            insert: r(
                "INSERT INTO {outbox} (message_id, destination, ordering_key, headers, payload) \
                       VALUES ($1, $2, $3, $4, $5)",
            ),
            insert_all: r(
                "INSERT INTO {outbox} (message_id, destination, ordering_key, headers, payload) \
                 SELECT m, d, k, h, p FROM unnest($1::text[], $2::text[], $3::text[], \
                 $4::text[], $5::bytea[]) WITH ORDINALITY AS r(m, d, k, h, p, n) ORDER BY n",
            ),
            // A row behind an earlier row of its key that is held back (its backoff) is
            // not taken: however many there are, they never fill a round's batch.
            take: r(
                "SELECT o.id, o.message_id, o.destination, o.ordering_key, o.headers, \
                     o.payload, o.attempts::bigint FROM {outbox} o \
                     WHERE o.published_at IS NULL AND (o.due_at IS NULL OR o.due_at <= now()) \
                     AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {outbox} e \
                       WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                       AND e.published_at IS NULL AND e.due_at > now())) \
                     ORDER BY o.id LIMIT $1 FOR UPDATE OF o SKIP LOCKED",
            ),
            blockers: r("SELECT ordering_key, min(id) FROM {outbox} \
                         WHERE published_at IS NULL AND ordering_key = ANY($1) AND id < $2 \
                         AND NOT (id = ANY($3)) GROUP BY ordering_key"),
            mark_published: r("UPDATE {outbox} SET published_at = now(), due_at = NULL \
                               WHERE id = ANY($1)"),
            delete_published: r("DELETE FROM {outbox} WHERE id = ANY($1)"),
            mark_failed: r(
                "UPDATE {outbox} SET attempts = attempts + 1, last_error = $2, \
                            due_at = now() + $3 * interval '1 millisecond' WHERE id = $1",
            ),
            purge: r("DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                      WHERE published_at < now() - $1 * interval '1 millisecond' LIMIT $2)"),
            stats: r("SELECT count(*) FILTER (WHERE published_at IS NULL), \
                      count(*) FILTER (WHERE published_at IS NULL AND attempts > 0), \
                      (extract(epoch FROM now() - min(created_at) FILTER \
                        (WHERE published_at IS NULL)) * 1000)::bigint, \
                      count(*) FILTER (WHERE published_at IS NOT NULL) FROM {outbox}"),
            store_reply: r(
                "UPDATE {inbox} SET reply_message_id = $3, reply_headers = $4, \
                            reply_payload = $5 WHERE handler = $1 AND key = $2",
            ),
            // The duplicate's correlation id replaces the first request's (header values
            // are strings, so the only null that `jsonb_strip_nulls` drops is a missing one).
            resend_reply: r("INSERT INTO {outbox} \
                             (message_id, destination, ordering_key, headers, payload) \
                             SELECT reply_message_id, $3, NULL, jsonb_strip_nulls(\
                             reply_headers::jsonb || jsonb_build_object('correlation-id', \
                             $4::text))::text, reply_payload \
                             FROM {inbox} WHERE handler = $1 AND key = $2 \
                             AND reply_message_id IS NOT NULL"),
        }
    }

    pub(crate) fn sqlite(names: &TableNames) -> Self {
        let r = |s: &str| names.render(s);
        OutboxSql {
            insert: r("INSERT INTO {outbox} \
                       (message_id, destination, ordering_key, headers, payload, created_at) \
                       VALUES (?1, ?2, ?3, ?4, ?5, ?6)"),
            // Not used: SQLite inserts a list one row at a time.
            insert_all: String::new(),
            take: r(
                "SELECT o.id, o.message_id, o.destination, o.ordering_key, o.headers, \
                     o.payload, o.attempts FROM {outbox} o \
                     WHERE o.published_at IS NULL AND (o.due_at IS NULL OR o.due_at <= ?1) \
                     AND (o.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {outbox} e \
                       WHERE e.ordering_key = o.ordering_key AND e.id < o.id \
                       AND e.published_at IS NULL AND e.due_at > ?1)) \
                     ORDER BY o.id LIMIT ?2",
            ),
            blockers: r("SELECT ordering_key, min(id) FROM {outbox} \
                         WHERE published_at IS NULL \
                         AND ordering_key IN (SELECT value FROM json_each(?1)) AND id < ?2 \
                         AND id NOT IN (SELECT value FROM json_each(?3)) \
                         GROUP BY ordering_key"),
            mark_published: r("UPDATE {outbox} SET published_at = ?1, due_at = NULL \
                               WHERE id IN (SELECT value FROM json_each(?2))"),
            delete_published: r("DELETE FROM {outbox} \
                                 WHERE id IN (SELECT value FROM json_each(?1))"),
            mark_failed: r(
                "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?2, \
                            due_at = ?3 WHERE id = ?1",
            ),
            purge: r("DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                      WHERE published_at IS NOT NULL AND published_at < ?1 LIMIT ?2)"),
            stats: r("SELECT count(*) FILTER (WHERE published_at IS NULL), \
                      count(*) FILTER (WHERE published_at IS NULL AND attempts > 0), \
                      ?1 - min(created_at) FILTER (WHERE published_at IS NULL), \
                      count(*) FILTER (WHERE published_at IS NOT NULL) FROM {outbox}"),
            store_reply: r(
                "UPDATE {inbox} SET reply_message_id = ?3, reply_headers = ?4, \
                            reply_payload = ?5 WHERE handler = ?1 AND key = ?2",
            ),
            // The duplicate's correlation id replaces the first request's.
            resend_reply: r("INSERT INTO {outbox} \
                             (message_id, destination, ordering_key, headers, payload, created_at) \
                             SELECT reply_message_id, ?3, NULL, CASE WHEN ?4 IS NULL \
                             THEN json_remove(reply_headers, '$.\"correlation-id\"') \
                             ELSE json_set(reply_headers, '$.\"correlation-id\"', ?4) END, \
                             reply_payload, ?5 \
                             FROM {inbox} WHERE handler = ?1 AND key = ?2 \
                             AND reply_message_id IS NOT NULL"),
        }
    }
}
