-- fencegate.enforce(), fencegate.guard(text) and fencegate.guard_proc(text) in C
-- (filters/postgres/ext), the optional accelerators of fence.sql's plpgsql versions: the same
-- contract at a fraction of their cost per transaction (docs/BENCHMARKS.md). Installed by
-- `fencegate postgres install --enforce c` after fence.sql, in the same transaction; needs a
-- superuser (LANGUAGE C) and the library `fencegate_enforce` in the server's
-- dynamic_library_path ($libdir: `make -C filters/postgres/ext install`). CREATE OR REPLACE
-- keeps each function's owner, its grants and the triggers that call it; it drops the guard's
-- SET clauses (the C guard needs no search_path: it names every relation and function by
-- schema; the install puts the lock_timeout on fencegate.take_fence, where the C guard's waits
-- happen).
CREATE OR REPLACE FUNCTION fencegate.enforce()
RETURNS trigger
LANGUAGE C
VOLATILE
SECURITY DEFINER
AS 'fencegate_enforce', 'fencegate_enforce';

CREATE OR REPLACE FUNCTION fencegate.guard(p_token text)
RETURNS void
LANGUAGE C
VOLATILE
SECURITY DEFINER
AS 'fencegate_enforce', 'fencegate_guard';

-- The same C guard as the procedure the gateway CALLs.
CREATE OR REPLACE PROCEDURE fencegate.guard_proc(p_token text)
LANGUAGE C
SECURITY DEFINER
AS 'fencegate_enforce', 'fencegate_guard';

-- The fence lock's writer side (filters/postgres/ext/fence_lock.c): the C guard and enforce()
-- hold a resource's fence lock instead of its row, so every UPDATE or DELETE of a fence row
-- (a raise, an operator's reset, a hand-written statement) takes it exclusively first. Created
-- only when missing (CREATE TRIGGER locks the table against raises in progress); enabled again
-- if disabled or set to fire for replication sessions only. `install --enforce plpgsql` drops
-- both (install.rs).
CREATE OR REPLACE FUNCTION fencegate.fence_write_lock()
RETURNS trigger
LANGUAGE C
VOLATILE
AS 'fencegate_enforce', 'fencegate_fence_write_lock';

DO $write_lock$
DECLARE
    v_enabled "char";
BEGIN
    -- Owned like the schema's other functions (a first switch to C runs as a superuser), so the
    -- owner's `install --enforce plpgsql` can drop it.
    EXECUTE pg_catalog.format('ALTER FUNCTION fencegate.fence_write_lock() OWNER TO %s',
        (SELECT n.nspowner::pg_catalog.regrole FROM pg_catalog.pg_namespace n WHERE n.nspname = 'fencegate'));
    SELECT t.tgenabled INTO v_enabled FROM pg_catalog.pg_trigger t
     WHERE t.tgrelid = 'fencegate.fences'::pg_catalog.regclass AND t.tgname = 'fence_write_lock';
    IF NOT FOUND THEN
        CREATE TRIGGER fence_write_lock BEFORE UPDATE OR DELETE ON fencegate.fences
            FOR EACH ROW EXECUTE FUNCTION fencegate.fence_write_lock();
    ELSIF v_enabled NOT IN ('O', 'A') THEN
        -- disabled, or firing only for replication sessions
        ALTER TABLE fencegate.fences ENABLE TRIGGER fence_write_lock;
    END IF;
END
$write_lock$;
