-- The outbox: messages written in a transaction (a handler's, or the application's own), to be
-- published by a relay once that transaction has committed. `id` orders the rows: a relay
-- publishes one ordering key's rows in `id` order, one at a time. `message_id` is fixed at
-- insert, so a re-send after a relay crash carries the same id and the consumer's inbox
-- deduplicates it. `due_at` holds a row back after a failed publish (backoff); published rows
-- stay until the relay's retention deletes them. Times are Unix milliseconds.
-- `{outbox}`, `{outbox_due_index}`, `{outbox_key_index}` and `{outbox_sent_index}` are replaced
-- by validated, quoted identifiers before this runs.
CREATE TABLE IF NOT EXISTS {outbox} (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id   TEXT    NOT NULL,
    destination  TEXT    NOT NULL,
    ordering_key TEXT,
    headers      TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    created_at   INTEGER NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    due_at       INTEGER,
    last_error   TEXT,
    published_at INTEGER
);
CREATE INDEX IF NOT EXISTS {outbox_due_index} ON {outbox} (id) WHERE published_at IS NULL;
-- A key's unpublished rows in order: what the relay reads to leave a key alone while an
-- earlier row of it is held elsewhere or failing.
CREATE INDEX IF NOT EXISTS {outbox_key_index} ON {outbox} (ordering_key, id)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {outbox_sent_index} ON {outbox} (published_at)
    WHERE published_at IS NOT NULL;
