-- fencegate's store-side fence for PostgreSQL.
--
-- Installed by `fencegate postgres install --dsn ...` (or at gateway startup when
-- `[postgres] install_on_start = true`). Idempotent: safe to run again after an upgrade. The role
-- that runs it owns the schema and is the only role that can read its secrets: it must not be
-- the application's role (an owner or superuser can drop the triggers).
--
-- The store enforces the fence, not the gateway's SQL parser:
--   fencegate.guard(token) verifies the token here (its signature against fencegate.token_keys
--   when any key is installed, its resource, the fence) and leaves a transaction-local pass,
--   `fencegate.pass = revision:resource:mac`, a MAC over a version tag, backend pid, transaction
--   id, revision and resource keyed with a secret made at install time that application roles cannot read. Statement-level triggers on protected tables (installed by
--   `fencegate postgres protect`) call fencegate.enforce(), which refuses any INSERT, UPDATE,
--   DELETE, TRUNCATE, COPY or MERGE, direct or through a view, rule, function, partition or DO
--   block, in a transaction without a valid pass. A procedure that COMMITs starts a new
--   transaction: its later writes have no pass and are refused.
--
-- The fence itself, checked by the guard:
--   no row yet          -> insert the fence at the token's revision
--   token above fence   -> raise it (UPDATE: waits for the current holder's open transactions,
--                          which hold the row FOR SHARE, up to the guard's lock_timeout; with
--                          the C install they hold the fence lock instead, and the trigger
--                          fence_write_lock makes the UPDATE wait for it: enforce_c.sql)
--   token equal         -> take the row FOR SHARE (the holder's concurrent writers do not
--                          serialize on one row lock, and a raise still waits for them)
--   token below fence   -> SQLSTATE FG001, which aborts the transaction
--
-- SQLSTATEs (class FG, fencegate):
--   FG001 stale token                     (guard, enforce)
--   FG002 missing token / no valid pass   (enforce; the gateway through fencegate.refuse)
--   FG003 malformed token                 (guard; gateway)
--   FG004 forged, unsigned or retired-key token (guard; gateway)
--   FG005 token for another resource      (enforce for a table bound to a resource; gateway)
--   FG006 statement cannot be fenced      (gateway)
--   FG007 fence schema missing            (gateway: run `fencegate postgres install`)
--   55P03 the fence row stayed locked past the guard's lock_timeout (retry)

CREATE SCHEMA IF NOT EXISTS fencegate;

CREATE TABLE IF NOT EXISTS fencegate.fences (
    resource   text PRIMARY KEY,
    revision   bigint NOT NULL CHECK (revision > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- HMAC-SHA256 key pads (RFC 2104): the key padded to 64 bytes, XOR 0x36 (inner) or 0x5c (outer).
-- Stored precomputed, so each HMAC is two calls of the built-in sha256().
CREATE OR REPLACE FUNCTION fencegate.hmac_pad(p_key bytea, p_byte int)
RETURNS bytea
LANGUAGE plpgsql
IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp
AS $pad$
DECLARE
    k bytea := p_key;
    v_out bytea;
BEGIN
    IF length(k) > 64 THEN
        k := sha256(k);
    END IF;
    k := k || decode(repeat('00', 64 - length(k)), 'hex');
    v_out := k;
    FOR i IN 0..63 LOOP
        v_out := set_byte(v_out, i, get_byte(k, i) # p_byte);
    END LOOP;
    RETURN v_out;
END
$pad$;

-- base64url without padding of HMAC-SHA256(key, message), from the key's pads.
-- plpgsql, not SQL: a SQL function called from plpgsql is planned on every call (about
-- 170 us here), a plpgsql one keeps its plan.
CREATE OR REPLACE FUNCTION fencegate.hmac_b64(p_ipad bytea, p_opad bytea, p_message text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp
AS $mac$
BEGIN
    RETURN translate(rtrim(encode(sha256(p_opad || sha256(p_ipad || convert_to(p_message, 'UTF8'))), 'base64'), '='),
                     '+/', '-_');
END
$mac$;

-- The cluster's token keys (written by the gateway node, see install_token_keys in the crate).
-- With any row here, the guard refuses unsigned tokens and tokens of unknown or retired keys.
-- Key id 0 is an operator's own key (authority.token_key_env or token_key_file); 1 and up are
-- the keys the cluster makes and rotates.
CREATE TABLE IF NOT EXISTS fencegate.token_keys (
    kid     bigint PRIMARY KEY CHECK (kid BETWEEN 0 AND 4294967295),
    secret  bytea NOT NULL CHECK (length(secret) >= 32),
    retired boolean NOT NULL DEFAULT false,
    ipad    bytea GENERATED ALWAYS AS (fencegate.hmac_pad(secret, 54)) STORED,
    opad    bytea GENERATED ALWAYS AS (fencegate.hmac_pad(secret, 92)) STORED
);
-- Schemas installed before operator keys were written here checked kid >= 1: widen that check.
-- Only when it is the old one, so a reinstall takes no lock that guards would queue behind.
DO $widen$
DECLARE
    v_name name;
BEGIN
    FOR v_name IN
        SELECT conname FROM pg_catalog.pg_constraint
         WHERE conrelid = 'fencegate.token_keys'::regclass AND contype = 'c'
           AND pg_catalog.pg_get_constraintdef(oid) LIKE '%kid >= 1)%'
    LOOP
        EXECUTE format('ALTER TABLE fencegate.token_keys DROP CONSTRAINT %I', v_name);
        ALTER TABLE fencegate.token_keys ADD CONSTRAINT token_keys_kid_check
            CHECK (kid BETWEEN 0 AND 4294967295);
    END LOOP;
END
$widen$;

-- The pass key, made once at install time from the server's strong random source
-- (gen_random_uuid: 122 random bits each).
CREATE TABLE IF NOT EXISTS fencegate.pass_key (
    id   boolean PRIMARY KEY DEFAULT true CHECK (id),
    ipad bytea NOT NULL,
    opad bytea NOT NULL
);
INSERT INTO fencegate.pass_key (ipad, opad)
SELECT fencegate.hmac_pad(k, 54), fencegate.hmac_pad(k, 92)
  FROM (SELECT decode(replace(gen_random_uuid()::text || gen_random_uuid()::text
                              || gen_random_uuid()::text, '-', ''), 'hex') AS k) s
ON CONFLICT (id) DO NOTHING;

-- Tables whose writes need a pass, and the resource each is bound to (NULL: any resource).
CREATE TABLE IF NOT EXISTS fencegate.protected_tables (
    schema_name text NOT NULL,
    table_name  text NOT NULL,
    resource    text,
    PRIMARY KEY (schema_name, table_name)
);
-- Schemas whose tables created later are protected by the event trigger (when installed).
CREATE TABLE IF NOT EXISTS fencegate.protected_schemas (
    schema_name text PRIMARY KEY,
    resource    text
);

-- The fence check (rules above). Not callable by applications: only through the guard.
CREATE OR REPLACE FUNCTION fencegate.check_fence(p_resource text, p_revision bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $check$
DECLARE
    v_fence bigint;
BEGIN
    -- Hot path without a subtransaction: the current holder's writers share the row lock.
    PERFORM 1 FROM fencegate.fences f
      WHERE f.resource = p_resource AND f.revision = p_revision
        FOR SHARE SKIP LOCKED;
    IF FOUND THEN
        RETURN;
    END IF;
    -- Bounded: each pass either finishes or saw a concurrent change and re-reads it.
    FOR attempt IN 1..10 LOOP
        SELECT f.revision INTO v_fence FROM fencegate.fences f WHERE f.resource = p_resource;
        IF FOUND AND p_revision < v_fence THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FG001',
                MESSAGE = format('fencegate: stale token for resource %s: revision %s is below the fence %s',
                                 p_resource, p_revision, v_fence),
                DETAIL = format('resource=%s revision=%s fence=%s', p_resource, p_revision, v_fence),
                HINT = 'This process lost its lock; stop and discard local state.';
        END IF;
        BEGIN
            IF NOT FOUND THEN
                INSERT INTO fencegate.fences (resource, revision)
                     VALUES (p_resource, p_revision)
                ON CONFLICT (resource) DO NOTHING;
                -- else another first writer inserted it concurrently: compare with theirs
            ELSIF p_revision > v_fence THEN
                UPDATE fencegate.fences f
                   SET revision = p_revision, updated_at = now()
                 WHERE f.resource = p_resource AND f.revision < p_revision;
                -- else someone raised it to >= ours while we waited: compare again
            ELSE
                PERFORM 1 FROM fencegate.fences f
                  WHERE f.resource = p_resource AND f.revision = p_revision
                    FOR SHARE;
                -- else a raise committed between the read and the lock: compare again
            END IF;
            IF FOUND THEN
                RETURN;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION USING
                ERRCODE = '55P03',
                MESSAGE = format('fencegate: the fence for %s is locked by another transaction (lock_timeout %s); retry',
                                 p_resource, current_setting('lock_timeout')),
                HINT = 'A previous holder''s open or prepared (2PC) transaction holds the fence row '
                       '(with the C guard: its fence lock, pg_locks locktype object on fencegate.fences). '
                       'Retry; set idle_in_transaction_session_timeout so abandoned sessions end, '
                       'and check pg_prepared_xacts.';
        END;
    END LOOP;
    RAISE EXCEPTION USING
        ERRCODE = '40001',
        MESSAGE = format('fencegate: the fence for %s kept changing; retry the transaction', p_resource);
END
$check$;

-- The MAC of a pass held as `revision:resource` by this backend's transaction (hex
-- HMAC-SHA256 with the pass key's pads over `pass2:pid:txid:revision:resource`). set_pass and
-- pass_holder share it; fencegate.enforce() computes the same inline (it runs per statement).
CREATE OR REPLACE FUNCTION fencegate.pass_mac(p_ipad bytea, p_opad bytea, p_held text)
RETURNS text
LANGUAGE plpgsql
STABLE STRICT
SET search_path = pg_catalog, pg_temp
AS $passmac$
BEGIN
    RETURN encode(sha256(p_opad || sha256(p_ipad || convert_to(
        format('pass2:%s:%s:', pg_backend_pid(), pg_current_xact_id()) || p_held, 'UTF8'))), 'hex');
END
$passmac$;

-- Records this transaction's pass, `revision:resource:mac`. The MAC (HMAC-SHA256 with the pass
-- key, hex) is over `pass2:pid:txid:revision:resource` (`pass2`: this definition's tag, so a pass
-- made under an earlier one never verifies after a reinstall): the pass verifies only in the backend and
-- transaction that made it, and only SECURITY DEFINER functions of this schema can read the pass
-- key, so no client can forge one. fencegate.enforce() and take_fence's common case compute
-- the same MAC inline: keep the three in step (a mismatch refuses every protected write).
CREATE OR REPLACE FUNCTION fencegate.set_pass(p_resource text, p_revision bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $setpass$
DECLARE
    v_held text := format('%s:%s', p_revision, p_resource);
    k record;
BEGIN
    SELECT ipad, opad INTO STRICT k FROM fencegate.pass_key;
    PERFORM set_config('fencegate.pass', v_held || ':' || fencegate.pass_mac(k.ipad, k.opad, v_held), true);
END
$setpass$;

-- The fence check and the pass, as the guards call them. The common case (the token's revision
-- is the fence's, the row not locked by a raise) is one query: it takes the row FOR SHARE and
-- computes the pass (the same string as set_pass). Anything else goes the long way, through
-- check_fence and set_pass. Issue 18 measured the guard at 46 us per call with both nested
-- calls on every path, 25-30 us with this one.
CREATE OR REPLACE FUNCTION fencegate.take_fence(p_resource text, p_revision bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $take$
DECLARE
    v_pass text;
BEGIN
    SELECT format('%s:%s', f.revision, f.resource) || ':' || encode(sha256(k.opad || sha256(k.ipad || convert_to(
               format('pass2:%s:%s:%s:%s', pg_backend_pid(), pg_current_xact_id(), f.revision, f.resource),
               'UTF8'))), 'hex')
      INTO v_pass
      FROM fencegate.fences f, fencegate.pass_key k
     WHERE f.resource = p_resource AND f.revision = p_revision
       FOR SHARE OF f SKIP LOCKED;
    IF v_pass IS NULL THEN
        PERFORM fencegate.check_fence(p_resource, p_revision);
        PERFORM fencegate.set_pass(p_resource, p_revision);
    ELSE
        PERFORM set_config('fencegate.pass', v_pass, true);
    END IF;
END
$take$;

-- The guard, given the token as presented: `fg1~<revision>~<resource>[~<kid>.<signature>]`. A
-- procedure, for `CALL fencegate.guard_proc('<token>')` (what the gateway sends): a CALL skips
-- the planner and the executor start-up a `SELECT` of a function pays, about 22k instructions per
-- transaction (docs/BENCHMARKS.md). fencegate.guard(text) below is the same check as a function.
CREATE OR REPLACE PROCEDURE fencegate.guard_proc(p_token text)
LANGUAGE plpgsql
-- Runs with its owner's rights: application roles need EXECUTE on it, not access to the keys
-- or write access to fencegate.fences (so no client can lower or delete a fence).
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Never wait forever behind a zombie's open transaction; `install --lock-timeout` changes it.
SET lock_timeout = '5s'
AS $guard$
DECLARE
    m text[];
    v_sig text[];
    v_revision bigint;
    k record;
BEGIN
    -- String functions, not one regular expression: bounded repetitions made a regex cost
    -- about a millisecond per call. m = {fg1, revision, resource, kid, signature}.
    -- Only the fourth field may hold a signature, and `<kid>.<signature>` has one dot: anything
    -- else is malformed (m NULL), as in the C guard (filters/postgres/ext/fencegate_guard.c).
    m := string_to_array(p_token, '~');
    IF cardinality(m) = 4 THEN
        v_sig := CASE WHEN strpos(m[4], '.') > 0 THEN string_to_array(m[4], '.') ELSE ARRAY[NULL, m[4]] END;
        m := CASE WHEN cardinality(v_sig) = 2 THEN ARRAY[m[1], m[2], m[3], v_sig[1], v_sig[2]] END;
    ELSIF cardinality(m) <> 3 THEN
        m := NULL;
    END IF;
    IF m IS NULL OR m[1] <> 'fg1'
       OR length(m[2]) NOT BETWEEN 1 AND 19 OR m[2] ~ '[^0-9]' OR left(m[2], 1) = '0'
       OR length(m[3]) NOT BETWEEN 1 AND 256 OR m[3] ~ '[^!-}]'
       OR (cardinality(m) = 5 AND (
              length(m[5]) IS DISTINCT FROM 43 OR m[5] ~ '[^A-Za-z0-9_-]'
              OR (m[4] IS NOT NULL AND (length(m[4]) NOT BETWEEN 1 AND 10 OR m[4] ~ '[^0-9]'))))
       OR m[2]::numeric > 9223372036854775807 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG003',
            MESSAGE = 'fencegate: malformed token; expected fg1~<revision>~<resource>[~<kid>.<signature>]';
    END IF;
    v_revision := m[2]::bigint;
    -- Without any key installed, a signature (with or without a key id) is not checked here:
    -- the gateway checks it with its own key, as a deployment without keys trusts its clients.
    IF EXISTS (SELECT 1 FROM fencegate.token_keys) THEN
        IF m[4] IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FG004',
                MESSAGE = format('fencegate: token for resource %s refused: this database requires tokens signed as ~<kid>.<signature>', m[3]);
        END IF;
        SELECT t.ipad, t.opad, t.retired INTO k FROM fencegate.token_keys t WHERE t.kid = m[4]::bigint;
        IF NOT FOUND OR k.retired THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FG004',
                MESSAGE = format('fencegate: token for resource %s is signed with key %s, which is %s here',
                                 m[3], m[4], CASE WHEN FOUND THEN 'retired' ELSE 'unknown' END),
                HINT = 'Acquire a new token; if the key is new, install the cluster''s keys in this database.';
        END IF;
        IF fencegate.hmac_b64(k.ipad, k.opad, format('fg1~%s~%s', v_revision, m[3])) <> m[5] THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FG004',
                MESSAGE = format('fencegate: forged token for resource %s: the signature does not verify', m[3]);
        END IF;
    END IF;
    PERFORM fencegate.take_fence(m[3], v_revision);
END
$guard$;

-- The guard as a function, `SELECT fencegate.guard('<token>')`, for callers that add it
-- themselves: the procedure's checks and answers. No SECURITY DEFINER or SET clauses of its own
-- (the procedure has them); it names the procedure by schema, and functions are never looked up
-- in pg_temp.
CREATE OR REPLACE FUNCTION fencegate.guard(p_token text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $guardfn$
BEGIN
    CALL fencegate.guard_proc(p_token);
END
$guardfn$;

-- The guard by resource and revision (unsigned): kept for callers that predate signed tokens.
-- With token keys installed it only confirms a pass this transaction already holds for the same
-- resource and revision (e.g. the gateway guarded the statement with the signed token).
CREATE OR REPLACE FUNCTION fencegate.guard(p_resource text, p_revision bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $guard2$
BEGIN
    IF p_resource IS NULL OR p_revision IS NULL OR p_revision <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG003',
            MESSAGE = 'fencegate: malformed token (no resource or revision)';
    END IF;
    IF EXISTS (SELECT 1 FROM fencegate.token_keys) THEN
        IF fencegate.pass_holder() IS DISTINCT FROM format('%s:%s', p_resource, p_revision) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FG004',
                MESSAGE = format('fencegate: unsigned token for resource %s refused: this database requires signed tokens', p_resource),
                HINT = 'Call fencegate.guard(''<signed token>'') with the token as issued.';
        END IF;
        RETURN;
    END IF;
    PERFORM fencegate.take_fence(p_resource, p_revision);
END
$guard2$;

-- `resource:revision` of this transaction's valid pass, or NULL (no pass, another transaction's,
-- or a forged one). The same check as fencegate.enforce().
CREATE OR REPLACE FUNCTION fencegate.pass_holder()
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $holder$
DECLARE
    v_pass text := current_setting('fencegate.pass', true);
    v_held text := left(v_pass, -65);
    k record;
BEGIN
    IF v_pass IS NULL OR length(v_pass) < 68 THEN
        RETURN NULL;
    END IF;
    SELECT ipad, opad INTO STRICT k FROM fencegate.pass_key;
    IF fencegate.pass_mac(k.ipad, k.opad, v_held) <> right(v_pass, 64) THEN
        RETURN NULL;
    END IF;
    RETURN format('%s:%s', substr(v_held, strpos(v_held, ':') + 1), split_part(v_held, ':', 1));
END
$holder$;

-- The statement-level trigger on protected tables. TG_ARGV[0], when not empty, is the resource
-- the table is bound to. It runs for every protected statement, so it is written to be cheap
-- (issue 12 measured each part):
-- * One query makes every check; plpgsql only raises. Each protected table has its own compiled
--   copy of this function, so every plpgsql expression is set up again on almost every call.
-- * No `SET search_path` clause (it saves and restores the setting on every call). Instead every
--   type, function, operator and relation below is schema-qualified, so nothing in the caller's
--   search_path or pg_temp (searched first for relations and types) can stand in for them while
--   this runs with the owner's rights. Keep it so when editing: `OPERATOR(pg_catalog.=)`, not `=`;
--   no `IN`, `BETWEEN`, `IS DISTINCT FROM` or simple `CASE x WHEN` (they look up `=` by name).
-- * It takes the fence row FOR SHARE itself, at the pass's revision (so VOLATILE: STABLE
--   forbids row locks). The guard's lock is not enough: ROLLBACK TO SAVEPOINT (or an EXCEPTION
--   block) releases it while the client can put the pass string back with set_config. Read
--   committed waits for a concurrent raise and then finds no row at our revision (FG001);
--   repeatable read fails on the raised row with 40001. Either way the write is refused.
--   The lock is in a sub-select the CASE reaches only once the MAC verifies, so a forged pass
--   locks nothing.
-- * `SET plan_cache_mode = force_generic_plan`: the plan cache kept choosing a custom plan for the
--   one query, planning it again on every call (about 250k instructions); the SET clause costs
--   about 13k. Measured with bench/triggers-callgrind.sh: +711k -> +286k per transaction.
-- `fencegate postgres install --enforce c` replaces this function with a C one (enforce_c.sql).
CREATE OR REPLACE FUNCTION fencegate.enforce()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET plan_cache_mode = force_generic_plan
AS $enforce$
DECLARE
    -- The pass is `revision:resource:mac` (see set_pass); v_held and v_resource are trusted only
    -- once the MAC over `pass2:pid:txid:revision:resource` verifies.
    v_pass pg_catalog.text := pg_catalog.current_setting('fencegate.pass', true);
    v_held pg_catalog.text := pg_catalog.left(v_pass, -65);
    v_resource pg_catalog.text := pg_catalog.substr(v_held, pg_catalog.strpos(v_held, ':') OPERATOR(pg_catalog.+) 1);
    v_refusal pg_catalog.text;
    v_fence pg_catalog.int8;
BEGIN
    SELECT CASE
             WHEN v_pass IS NULL OR v_pass OPERATOR(pg_catalog.=) '' THEN 'none'
             WHEN pg_catalog.encode(pg_catalog.sha256(k.opad OPERATOR(pg_catalog.||) pg_catalog.sha256(k.ipad
                      OPERATOR(pg_catalog.||) pg_catalog.convert_to('pass2:' OPERATOR(pg_catalog.||) pg_catalog.pg_backend_pid()::pg_catalog.text
                          OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) pg_catalog.pg_current_xact_id()::pg_catalog.text
                          OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) v_held, 'UTF8'))), 'hex')
                  OPERATOR(pg_catalog.<>) pg_catalog.right(v_pass, 64) THEN 'invalid'
             WHEN TG_ARGV[0] OPERATOR(pg_catalog.<>) '' AND TG_ARGV[0] OPERATOR(pg_catalog.<>) v_resource THEN 'FG005'
             WHEN NOT EXISTS (SELECT 1 FROM fencegate.fences f
                               WHERE f.resource OPERATOR(pg_catalog.=) v_resource
                                 AND f.revision OPERATOR(pg_catalog.=) pg_catalog.split_part(v_held, ':', 1)::pg_catalog.int8
                                 FOR SHARE) THEN 'FG001'
           END
      INTO STRICT v_refusal
      FROM fencegate.pass_key k;
    IF v_refusal IS NULL THEN
        RETURN NULL;
    ELSIF v_refusal OPERATOR(pg_catalog.=) 'none' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG002',
            MESSAGE = pg_catalog.format('fencegate: %s on %I.%I needs a fencing token: no fencegate.guard(token) in this transaction',
                                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME),
            HINT = 'Call SELECT fencegate.guard(''<token>'') first in the same transaction (the gateway does it for you). '
                   'A procedure that COMMITs ends the guarded transaction.';
    ELSIF v_refusal OPERATOR(pg_catalog.=) 'invalid' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG002',
            MESSAGE = pg_catalog.format('fencegate: %s on %I.%I refused: fencegate.pass was not made by fencegate.guard in this transaction',
                                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME),
            HINT = 'Call SELECT fencegate.guard(''<token>'') first in the same transaction (the gateway does it for you). '
                   'A procedure that COMMITs ends the guarded transaction.';
    ELSIF v_refusal OPERATOR(pg_catalog.=) 'FG005' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FG005',
            MESSAGE = pg_catalog.format('fencegate: %s on %I.%I refused: the table belongs to resource %s, the token names %s',
                                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[0], v_resource);
    END IF;
    -- FG001: the fence moved past the pass's revision (or its row is gone). For the message only.
    SELECT f.revision INTO v_fence FROM fencegate.fences f WHERE f.resource OPERATOR(pg_catalog.=) v_resource;
    RAISE EXCEPTION USING
        ERRCODE = 'FG001',
        MESSAGE = pg_catalog.format('fencegate: stale token for resource %s: revision %s is below the fence %s',
                                    v_resource, pg_catalog.split_part(v_held, ':', 1), v_fence),
        DETAIL = pg_catalog.format('resource=%s revision=%s fence=%s',
                                   v_resource, pg_catalog.split_part(v_held, ':', 1), v_fence);
END
$enforce$;

-- Protects one table (and its partitions): run by the installer role (`fencegate postgres
-- protect`). ENABLE ALWAYS: the trigger fires under session_replication_role = replica too.
CREATE OR REPLACE FUNCTION fencegate.protect_table(p_table regclass, p_resource text)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $protect$
DECLARE
    r record;
    n integer := 0;
BEGIN
    FOR r IN SELECT c.oid::regclass AS rel, n.nspname, c.relname
               FROM (SELECT p_table::oid AS relid
                     UNION SELECT t.relid FROM pg_partition_tree(p_table) t) t
               JOIN pg_class c ON c.oid = t.relid
               JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.relkind IN ('r', 'p')
    LOOP
        IF r.nspname = 'fencegate' THEN
            RAISE EXCEPTION 'fencegate: %.% is fencegate''s own table; it is protected by its privileges', r.nspname, r.relname;
        END IF;
        EXECUTE format('DROP TRIGGER IF EXISTS fencegate_enforce ON %s', r.rel);
        EXECUTE format('CREATE TRIGGER fencegate_enforce BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %s '
                       'FOR EACH STATEMENT EXECUTE FUNCTION fencegate.enforce(%L)', r.rel, coalesce(p_resource, ''));
        EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER fencegate_enforce', r.rel);
        INSERT INTO fencegate.protected_tables (schema_name, table_name, resource)
             VALUES (r.nspname, r.relname, p_resource)
        ON CONFLICT (schema_name, table_name) DO UPDATE SET resource = EXCLUDED.resource;
        n := n + 1;
    END LOOP;
    RETURN n;
END
$protect$;

-- Protects every table of a schema now, and records the schema for the event trigger.
CREATE OR REPLACE FUNCTION fencegate.protect_schema(p_schema text, p_resource text)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $protectschema$
DECLARE
    r record;
    n integer := 0;
BEGIN
    IF p_schema = 'fencegate' THEN
        RAISE EXCEPTION 'fencegate: the fencegate schema is protected by its privileges, not by triggers';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = p_schema) THEN
        RAISE EXCEPTION 'fencegate: schema % does not exist', p_schema;
    END IF;
    INSERT INTO fencegate.protected_schemas (schema_name, resource) VALUES (p_schema, p_resource)
    ON CONFLICT (schema_name) DO UPDATE SET resource = EXCLUDED.resource;
    FOR r IN SELECT c.oid::regclass AS rel
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = p_schema AND c.relkind IN ('r', 'p') AND NOT c.relispartition
    LOOP
        n := n + fencegate.protect_table(r.rel, p_resource);
    END LOOP;
    RETURN n;
END
$protectschema$;

-- Event trigger body: protects tables created later in a protected schema. Installed by
-- `protect --schema` only where the installer may create event triggers (a superuser).
CREATE OR REPLACE FUNCTION fencegate.protect_new_tables()
RETURNS event_trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $newtables$
DECLARE
    r record;
    v_resource text;
BEGIN
    FOR r IN SELECT d.objid, d.schema_name FROM pg_event_trigger_ddl_commands() d
              WHERE d.object_type IN ('table', 'table column') AND d.schema_name IS NOT NULL
    LOOP
        SELECT s.resource INTO v_resource FROM fencegate.protected_schemas s WHERE s.schema_name = r.schema_name;
        IF FOUND AND EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = r.objid AND c.relkind IN ('r', 'p')) THEN
            PERFORM fencegate.protect_table(r.objid::regclass, v_resource);
        END IF;
    END LOOP;
END
$newtables$;

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

-- Only the guard writes fences; only this schema's owner reads the keys. Applications may read
-- the fences and the protection lists and call guard and refuse.
REVOKE ALL ON ALL TABLES IN SCHEMA fencegate FROM PUBLIC;
GRANT SELECT ON TABLE fencegate.fences, fencegate.protected_tables, fencegate.protected_schemas TO PUBLIC;
GRANT USAGE ON SCHEMA fencegate TO PUBLIC;
REVOKE ALL ON ALL ROUTINES IN SCHEMA fencegate FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fencegate.guard(text), fencegate.guard(text, bigint),
    fencegate.refuse(text, text), fencegate.pass_holder(), fencegate.enforce() TO PUBLIC;
GRANT EXECUTE ON PROCEDURE fencegate.guard_proc(text) TO PUBLIC;
