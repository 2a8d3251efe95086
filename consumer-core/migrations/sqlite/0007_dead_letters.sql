-- The dead letters of transports that have no dead-letter destination of their own (the
-- webhook ingress, the in-memory broker): the whole message (message id, headers as a JSON
-- object, body bytes), where it came from (`transport`, `location`: the route or queue), the
-- handler, key, reason, error and attempts. `fingerprint` identifies the message (handler,
-- transport, location, message id, body): a resend of a letter already kept counts one more
-- `deliveries` on its row instead of adding one. Times are Unix milliseconds.
-- `{dead_letters}` is replaced by a validated, quoted identifier before this runs.
CREATE TABLE IF NOT EXISTS {dead_letters} (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint TEXT    NOT NULL UNIQUE,
    handler     TEXT    NOT NULL,
    transport   TEXT    NOT NULL,
    location    TEXT    NOT NULL,
    message_id  TEXT,
    key         TEXT,
    reason      TEXT    NOT NULL,
    error       TEXT    NOT NULL,
    attempts    INTEGER NOT NULL,
    headers     TEXT    NOT NULL,
    payload     BLOB    NOT NULL,
    deliveries  INTEGER NOT NULL DEFAULT 1,
    first_at    INTEGER NOT NULL,
    last_at     INTEGER NOT NULL
);
