-- The inbox: one row per (handler, key). `{inbox}` and `{expires_index}` are replaced by
-- validated, quoted identifiers before this runs.
CREATE TABLE IF NOT EXISTS {inbox} (
    handler      TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    payload_hash TEXT        NOT NULL,
    status       TEXT        NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'completed', 'dead')),
    attempts     INTEGER     NOT NULL DEFAULT 0,
    first_seen   TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at TIMESTAMPTZ,
    expires_at   TIMESTAMPTZ,
    last_error   TEXT,
    PRIMARY KEY (handler, key)
);
CREATE INDEX IF NOT EXISTS {expires_index} ON {inbox} (expires_at) WHERE status = 'completed';
