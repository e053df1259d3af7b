-- fencegate.enforce() in C (filters/postgres/ext), the optional accelerator of fence.sql's
-- plpgsql version: the same contract at a fraction of its cost per transaction
-- (docs/BENCHMARKS.md). Installed by `fencegate postgres install --enforce c` after fence.sql, in
-- the same transaction; needs a superuser (LANGUAGE C) and the library `fencegate_enforce` in
-- the server's dynamic_library_path ($libdir: `make -C filters/postgres/ext install`).
-- CREATE OR REPLACE keeps the function's owner, its grants and the triggers that call it.
CREATE OR REPLACE FUNCTION fencegate.enforce()
RETURNS trigger
LANGUAGE C
VOLATILE
SECURITY DEFINER
AS 'fencegate_enforce', 'fencegate_enforce';
