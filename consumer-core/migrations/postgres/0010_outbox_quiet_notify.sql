-- The outbox trigger notifies only while a relay rests. A commit that notifies takes
-- PostgreSQL's notification lock, which serializes such commits across the server through
-- their WAL flush (no group commit): at a few hundred commits a second it was the bound of
-- every transaction that wrote an outbox row. Now a resting relay (one waiting for commits)
-- holds the advisory lock ({outbox_rest_lock}, the table's oid) in exclusive mode; a writer takes it
-- shared for its transaction when it can, and notifies only when it cannot. A relay that
-- comes to rest waits for the writers that took it shared (which did not notify) to commit,
-- then looks once more, so that no commit goes unheard.
-- `{outbox_notify_fn}` is replaced by a validated, quoted identifier and `{outbox_rest_lock}`
-- by the lock's first key (a constant of the relay) before this runs.
CREATE OR REPLACE FUNCTION {outbox_notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared({outbox_rest_lock}, TG_RELID::int) THEN
        PERFORM pg_notify('consumer_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    END IF;
    RETURN NULL;
END
$$;
