-- fencegate.enforce() and fencegate.guard(text) in C (filters/postgres/ext), the optional
-- accelerators of fence.sql's plpgsql versions: the same contract at a fraction of their cost
-- per transaction (docs/BENCHMARKS.md). Installed by `fencegate postgres install --enforce c`
-- after fence.sql, in the same transaction; needs a superuser (LANGUAGE C) and the library
-- `fencegate_enforce` in the server's dynamic_library_path ($libdir: `make -C
-- filters/postgres/ext install`). CREATE OR REPLACE keeps each function's owner, its grants and
-- the triggers that call it; it drops the guard's SET clauses, so the install sets its
-- lock_timeout afterwards (the C guard needs no search_path: it names every relation and
-- function by schema).
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
