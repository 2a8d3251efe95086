-- The outbox: messages written in a transaction (a handler's, or the application's own), to be
-- published by a relay once that transaction has committed. `id` orders the rows: a relay
-- publishes one ordering key's rows in `id` order, one at a time. `message_id` is fixed at
-- insert, so a re-send after a relay crash carries the same id and the consumer's inbox
-- deduplicates it. `due_at` holds a row back after a failed publish (backoff); published rows
-- stay until the relay's retention deletes them.
--
-- A statement-level trigger notifies the channel `consumer_outbox` with the table's
-- `schema.table` at commit, which wakes the relays listening there.
-- `{outbox}`, `{outbox_due_index}`, `{outbox_key_index}`, `{outbox_sent_index}`,
-- `{outbox_notify}` (the trigger) and `{outbox_notify_fn}` (its function, in the table's
-- schema) are replaced by validated, quoted identifiers before this runs.
CREATE TABLE IF NOT EXISTS {outbox} (
    id           BIGSERIAL   PRIMARY KEY,
    message_id   TEXT        NOT NULL,
    destination  TEXT        NOT NULL,
    ordering_key TEXT,
    headers      TEXT        NOT NULL,
    payload      BYTEA       NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts     INTEGER     NOT NULL DEFAULT 0,
    due_at       TIMESTAMPTZ,
    last_error   TEXT,
    published_at TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS {outbox_due_index} ON {outbox} (id) WHERE published_at IS NULL;
-- A key's unpublished rows in order: what the relay reads to leave a key alone while an
-- earlier row of it is held elsewhere or failing.
CREATE INDEX IF NOT EXISTS {outbox_key_index} ON {outbox} (ordering_key, id)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {outbox_sent_index} ON {outbox} (published_at)
    WHERE published_at IS NOT NULL;
CREATE OR REPLACE FUNCTION {outbox_notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('consumer_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS {outbox_notify} ON {outbox};
CREATE TRIGGER {outbox_notify} AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {outbox_notify_fn}();
