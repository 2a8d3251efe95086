-- One row per (scope, key): the claim while the request runs, then its stored answer.
-- `{table}` and `{expires_index}` are replaced by validated, quoted identifiers. Times are
-- Unix milliseconds.
CREATE TABLE IF NOT EXISTS {table} (
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      TEXT    NOT NULL,
    claim            TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('in_progress', 'completed')),
    lease_until_ms   INTEGER NOT NULL,
    expires_at_ms    INTEGER NOT NULL,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at_ms);
