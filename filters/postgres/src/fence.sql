-- fencegate's store-side fence for PostgreSQL.
--
-- Installed by `fencegate postgres install --dsn ...` (or at gateway startup when
-- `[postgres] install_on_start = true`). Idempotent: safe to run again after an upgrade.
--
-- The gateway calls fencegate.guard(resource, revision) in the same transaction as each write,
-- before it. The guard is the check; the gateway never decides from memory:
--   no row yet          -> insert the fence at the token's revision
--   token above fence   -> raise it (UPDATE: waits for the current holder's open transactions,
--                          which hold the row FOR SHARE)
--   token equal         -> take the row FOR SHARE (the holder's concurrent writers do not
--                          serialize on one row lock, and a raise still waits for them)
--   token below fence   -> SQLSTATE FG001, which aborts the transaction
--
-- SQLSTATEs (class FG, fencegate):
--   FG001 stale token (raised here, in the store)
--   FG002 missing token          (raised by the gateway, through fencegate.refuse)
--   FG003 malformed token        (gateway)
--   FG004 forged or unsigned token (gateway)
--   FG005 token for another resource (gateway)
--   FG006 statement cannot be fenced, e.g. a client write to this schema (gateway)

CREATE SCHEMA IF NOT EXISTS fencegate;

CREATE TABLE IF NOT EXISTS fencegate.fences (
    resource   text PRIMARY KEY,
    revision   bigint NOT NULL CHECK (revision > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION fencegate.guard(p_resource text, p_revision bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
-- Runs with its owner's rights: application roles need EXECUTE on it, not write access to
-- fencegate.fences (so no client can lower or delete a fence with a plain UPDATE/DELETE).
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $guard$
DECLARE
    v_fence bigint;
BEGIN
    IF p_resource IS NULL OR p_revision IS NULL OR p_revision <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG003',
            MESSAGE = 'fencegate: malformed token (no resource or revision)';
    END IF;
    -- Bounded: each pass either finishes or saw a concurrent change and re-reads it.
    FOR attempt IN 1..10 LOOP
        SELECT f.revision INTO v_fence FROM fencegate.fences f WHERE f.resource = p_resource;
        IF NOT FOUND THEN
            INSERT INTO fencegate.fences (resource, revision)
                 VALUES (p_resource, p_revision)
            ON CONFLICT (resource) DO NOTHING;
            IF FOUND THEN
                RETURN;
            END IF;
            -- another first writer inserted it concurrently: compare with theirs
        ELSIF p_revision > v_fence THEN
            UPDATE fencegate.fences f
               SET revision = p_revision, updated_at = now()
             WHERE f.resource = p_resource AND f.revision < p_revision;
            IF FOUND THEN
                RETURN;
            END IF;
            -- someone raised it to >= ours while we waited: compare again
        ELSIF p_revision = v_fence THEN
            PERFORM 1 FROM fencegate.fences f
              WHERE f.resource = p_resource AND f.revision = p_revision
                FOR SHARE;
            IF FOUND THEN
                RETURN;
            END IF;
            -- a raise committed between the read and the lock: compare again
        ELSE
            RAISE EXCEPTION USING
                ERRCODE = 'FG001',
                MESSAGE = format('fencegate: stale token for resource %s: revision %s is below the fence %s',
                                 p_resource, p_revision, v_fence),
                DETAIL = format('resource=%s revision=%s fence=%s', p_resource, p_revision, v_fence),
                HINT = 'This process lost its lock; stop and discard local state.';
        END IF;
    END LOOP;
    RAISE EXCEPTION USING
        ERRCODE = '40001',
        MESSAGE = format('fencegate: the fence for %s kept changing; retry the transaction', p_resource);
END
$guard$;

-- Raises a refusal decided by the gateway (missing, malformed, forged token) inside the
-- client's transaction, so an open transaction is aborted exactly as by a server error.
CREATE OR REPLACE FUNCTION fencegate.refuse(p_sqlstate text, p_message text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $refuse$
BEGIN
    IF p_sqlstate !~ '^FG[0-9]{3}$' THEN
        p_sqlstate := 'FG006';
    END IF;
    RAISE EXCEPTION USING ERRCODE = p_sqlstate, MESSAGE = p_message;
END
$refuse$;

-- Only the guard writes fences: applications may read them and call the functions.
REVOKE ALL ON TABLE fencegate.fences FROM PUBLIC;
GRANT SELECT ON TABLE fencegate.fences TO PUBLIC;
GRANT USAGE ON SCHEMA fencegate TO PUBLIC;
REVOKE ALL ON FUNCTION fencegate.guard(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fencegate.guard(text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION fencegate.refuse(text, text) TO PUBLIC;
