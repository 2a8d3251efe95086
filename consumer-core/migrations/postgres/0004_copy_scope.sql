-- Where the newest confirmed retry copy went (`retry_scope`: the consumers that will read it)
-- and when it is due. A pending key's delivery with a lower attempt number than `retried_to`
-- is superseded by that copy only if it comes through the same scope and before the copy is
-- overdue by the inbox's grace period; otherwise the copy may never be read, and the delivery
-- runs. Both columns are nullable with no default: no table rewrite.
--
-- Dead rows now expire after the handler's retention, like completed ones: the purge finds
-- them through their own partial index. (Built once, without CONCURRENTLY: on a large inbox
-- the first start of this version holds writes to the table while it is built.)
-- `{inbox}` and `{dead_expires_index}` are replaced by validated, quoted identifiers before
-- this runs.
ALTER TABLE {inbox} ADD COLUMN IF NOT EXISTS retry_scope TEXT;
ALTER TABLE {inbox} ADD COLUMN IF NOT EXISTS retry_due_at TIMESTAMPTZ;
CREATE INDEX IF NOT EXISTS {dead_expires_index} ON {inbox} (expires_at) WHERE status = 'dead';
