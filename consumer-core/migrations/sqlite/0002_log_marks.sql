-- The log marks: per (handler, log), at least the highest offset the handler may ever have
-- been handed in that log (see `LogPosition` in the crate docs). Times are Unix
-- milliseconds. `{log_marks}` is replaced by a validated, quoted identifier before this runs.
CREATE TABLE IF NOT EXISTS {log_marks} (
    handler    TEXT    NOT NULL,
    log        TEXT    NOT NULL,
    mark       INTEGER,
    updated_at INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (handler, log)
);
