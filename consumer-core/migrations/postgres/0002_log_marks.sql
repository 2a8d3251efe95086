-- The log marks: per (handler, log), at least the highest offset the handler may ever have
-- been handed in that log (see `LogPosition` in the crate docs). `{log_marks}` is replaced
-- by a validated, quoted identifier before this runs.
CREATE TABLE IF NOT EXISTS {log_marks} (
    handler    TEXT        NOT NULL,
    log        TEXT        NOT NULL,
    mark       BIGINT,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, log)
);
