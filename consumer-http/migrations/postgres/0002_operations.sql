-- Long operations: one row per operation a request started in its transaction
-- (`IdempotentTx::start_operation`), so it exists exactly when the request's answer does.
-- `owner` is the scope's caller part (the caller's hash, or `-` when records are shared),
-- which the status route matches. `input` and `result` are JSON. A finished operation is
-- kept until `expires_at_ms`, a pending one until it finishes. `{operations}`,
-- `{operations_pending_index}` and `{operations_expires_index}` are replaced by validated,
-- quoted identifiers. Times are Unix milliseconds of the database's clock.
CREATE TABLE IF NOT EXISTS {operations} (
    id            TEXT    PRIMARY KEY,
    owner         TEXT    NOT NULL,
    kind          TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    input         BYTEA   NOT NULL,
    result        BYTEA,
    created_at_ms BIGINT  NOT NULL,
    updated_at_ms BIGINT  NOT NULL,
    expires_at_ms BIGINT
);
CREATE INDEX IF NOT EXISTS {operations_pending_index} ON {operations} (kind, created_at_ms)
    WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS {operations_expires_index} ON {operations} (expires_at_ms)
    WHERE expires_at_ms IS NOT NULL;
