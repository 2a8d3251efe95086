-- The reply a handler gave to a request (see `Context::reply`), kept with the request's key
-- so that a duplicate of the request is answered with the same reply again: its message id,
-- headers (a JSON object, with the correlation id) and body. `{inbox}` is replaced by a
-- validated, quoted identifier before this runs.
ALTER TABLE {inbox} ADD COLUMN reply_message_id TEXT;
ALTER TABLE {inbox} ADD COLUMN reply_headers TEXT;
ALTER TABLE {inbox} ADD COLUMN reply_payload BLOB;
