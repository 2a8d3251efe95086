-- Pending rows expire too, once no copy of their message can still arrive (see the worker's
-- `pending_retention`): the purge looks for a handler's pending rows by when they were last
-- updated. `{inbox}` and `{pending_index}` are replaced by validated, quoted identifiers
-- before this runs.
CREATE INDEX IF NOT EXISTS {pending_index} ON {inbox} (handler, updated_at) WHERE status = 'pending';
