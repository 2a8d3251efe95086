-- The inbox: one row per (handler, key). Times are Unix milliseconds. `{inbox}` and
-- `{expires_index}` are replaced by validated, quoted identifiers before this runs.
CREATE TABLE IF NOT EXISTS {inbox} (
    handler      TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    payload_hash TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'completed', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    first_seen   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at   INTEGER,
    last_error   TEXT,
    PRIMARY KEY (handler, key)
);
CREATE INDEX IF NOT EXISTS {expires_index} ON {inbox} (expires_at) WHERE status = 'completed';
