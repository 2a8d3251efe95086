-- The highest attempt number of a retry copy of the message that the broker confirmed
-- (0: none), recorded after the confirm. A pending key's delivery with a
-- lower attempt number is superseded by that copy: it is acked without running and without
-- counting an attempt. `{inbox}` is replaced by a validated, quoted identifier before this
-- runs.
ALTER TABLE {inbox} ADD COLUMN retried_to INTEGER NOT NULL DEFAULT 0;
