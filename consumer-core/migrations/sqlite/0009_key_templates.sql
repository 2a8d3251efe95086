-- The key template each handler name last ran with (empty: no template), so that a worker
-- whose template differs from the one the inbox's keys were made with is refused at
-- startup. `{key_templates}` is replaced by a validated, quoted identifier before this runs.
CREATE TABLE IF NOT EXISTS {key_templates} (
    handler  TEXT NOT NULL PRIMARY KEY,
    template TEXT NOT NULL
);
