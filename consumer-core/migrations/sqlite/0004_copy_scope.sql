-- Where the newest confirmed retry copy went (`retry_scope`: the consumers that will read it)
-- and when it is due (Unix milliseconds). A pending key's delivery with a lower attempt
-- number than `retried_to` is superseded by that copy only if it comes through the same scope
-- and before the copy is overdue by the inbox's grace period. Dead rows expire after the
-- handler's retention, like completed ones, through their own partial index. `{inbox}` and
-- `{dead_expires_index}` are replaced by validated, quoted identifiers before this runs.
ALTER TABLE {inbox} ADD COLUMN retry_scope TEXT;
ALTER TABLE {inbox} ADD COLUMN retry_due_at INTEGER;
CREATE INDEX IF NOT EXISTS {dead_expires_index} ON {inbox} (expires_at) WHERE status = 'dead';
