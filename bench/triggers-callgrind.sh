#!/usr/bin/env bash
# What the store's enforcement triggers and guard cost, in instructions (issues 12 and 18;
# docs/BENCHMARKS.md, "Store enforcement: the triggers' cost" and "The guard in C"). Instruction
# counts do not depend on the machine's load, unlike throughput on a shared machine.
#
# Replays the benchmark's guarded write transaction (pgbench's simple-update with a guard before
# the UPDATE; 2 protected statements) in a single-user `postgres --single` under callgrind, SHORT
# and LONG times, for each mode:
#   off      the triggers disabled (the guard as fence.sql installs it)
#   plpgsql  fencegate.enforce() and fencegate.guard(text) as fence.sql installs them (the
#            portable default)
#   c        both in C (filters/postgres/ext, `install --enforce c`)
# and prints (Ir(LONG) - Ir(SHORT)) / (LONG - SHORT) per transaction: start-up and first-call
# set-up are in both runs and cancel. Every run starts from the same copy of the database (the
# replays grow pgbench_history, and a later run would pay for it).
#
# Usage: bench/triggers-callgrind.sh [SHORT LONG]   (default 200 600; as root or as postgres)
# Environment:
#   GUARD  pair (default): `SELECT fencegate.guard('bench', 1)`, the unsigned legacy guard, plpgsql
#          in every mode; call: `CALL fencegate.guard_proc('<token>')`, the guard the gateway
#          sends; text: `SELECT fencegate.guard('<token>')`, the same check as a function (what
#          the gateway sent before 2026-12-04); none: no guard (with MODES=off: the plain
#          transaction)
#   KEYS=1 install a token key (id 1) and sign the GUARD=call or text token with it, as a cluster does
#   MODES  the modes to run (default "off plpgsql c")
# Needs valgrind, the PostgreSQL server binaries, postgresql-server-dev (pg_config, headers) and,
# with KEYS=1, openssl.
set -euo pipefail

short=${1:-200}
long=${2:-600}
guard=${GUARD:-pair}
modes=${MODES:-off plpgsql c}
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
work=$(mktemp -d)
# KEEP=1 keeps the work directory (data, callgrind outputs) for callgrind_annotate.
[ -n "${KEEP:-}" ] && echo "work directory: $work" >&2 || trap 'rm -rf "$work"' EXIT
chmod 755 "$work"

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# The C library, built out of tree with PGXS into $work/ext.
mkdir -p "$work/ext"
make -s -C "$work/ext" -f "$repo/filters/postgres/ext/Makefile" VPATH="$repo/filters/postgres/ext" \
  PG_CONFIG="$bin/pg_config" >/dev/null
[ "$(id -u)" = 0 ] && chown -R postgres "$work"

data="$work/data"
as_pg "$bin/initdb" -D "$data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
printf "fsync = off\ndynamic_library_path = '\$libdir:%s'\n" "$work/ext" >>"$data/postgresql.conf"
# Unix socket in the private directory only: no TCP port.
pg_start() {
  as_pg "$bin/pg_ctl" -D "$data" -l "$work/setup.log" -w \
    -o "-c listen_addresses= -k $work" start >/dev/null
}
pg_start
psql_() { as_pg psql -h "$work" -U postgres -d postgres -v ON_ERROR_STOP=1 -Atq "$@"; }
psql_ -f "$repo/filters/postgres/src/fence.sql" >/dev/null
as_pg "$bin/pgbench" -i -s 1 -q -h "$work" -U postgres postgres >/dev/null 2>&1
psql_ -c "SELECT fencegate.protect_schema('public', 'bench')" >/dev/null 2>&1
token="fg1~1~bench"
if [ -n "${KEYS:-}" ]; then
  key=$(printf 'ab%.0s' {1..32})
  psql_ -c "INSERT INTO fencegate.token_keys (kid, secret) VALUES (1, decode('$key', 'hex'))" >/dev/null
  sig=$(printf '%s' "$token" | openssl dgst -sha256 -mac HMAC -macopt "hexkey:$key" -binary \
    | base64 | tr '+/' '-_' | tr -d '=\n')
  token="$token~1.$sig"
fi
case $guard in
  pair) guard_sql="SELECT fencegate.guard('bench', 1);" ;;
  call) guard_sql="CALL fencegate.guard_proc('$token');" ;;
  text) guard_sql="SELECT fencegate.guard('$token');" ;;
  none) guard_sql="" ;;
  *) echo "GUARD must be pair, call, text or none" >&2; exit 2 ;;
esac
as_pg "$bin/pg_ctl" -D "$data" -w stop >/dev/null
as_pg cp -a "$data" "$work/pristine"

# Switches the enforcement mode through a normal server (psql reads fence.sql's multi-line
# definition; single-user mode would end a command at each newline).
set_mode() {
  local how="ENABLE ALWAYS" sql
  rm -rf "$data"
  as_pg cp -a "$work/pristine" "$data"
  case $1 in
    off) how=DISABLE ;;
    plpgsql)
      # fence.sql's own definition (the file defines it exactly once).
      sed -n '/^CREATE OR REPLACE FUNCTION fencegate.enforce()/,/^\$enforce\$;/p' \
        "$repo/filters/postgres/src/fence.sql" >"$work/enforce.sql" ;;
    c)
      # As `install --enforce c`: enforce_c.sql, then the lock_timeout (on take_fence).
      { cat "$repo/filters/postgres/src/enforce_c.sql"
        echo "ALTER FUNCTION fencegate.take_fence(text, bigint) SET lock_timeout = '5000ms';"; } >"$work/enforce.sql" ;;
  esac
  [ "$1" = off ] && echo "SELECT 1;" >"$work/enforce.sql"
  echo "ALTER TABLE pgbench_accounts $how TRIGGER fencegate_enforce; ALTER TABLE pgbench_history $how TRIGGER fencegate_enforce;" >>"$work/enforce.sql"
  [ "$(id -u)" = 0 ] && chown postgres "$work/enforce.sql"
  pg_start
  psql_ -f "$work/enforce.sql" >/dev/null
  as_pg "$bin/pg_ctl" -D "$data" -w stop >/dev/null
  rm -rf "$work/mode"
  as_pg cp -a "$data" "$work/mode"
}

transactions() {
  local i aid
  for ((i = 0; i < $1; i++)); do
    aid=$(((i * 7919) % 100000 + 1))
    echo "BEGIN; $guard_sql UPDATE pgbench_accounts SET abalance = abalance + $((i % 97 - 48)) WHERE aid = $aid; SELECT abalance FROM pgbench_accounts WHERE aid = $aid; INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES ($((i % 10 + 1)), 1, $aid, $((i % 97 - 48)), CURRENT_TIMESTAMP); END;"
  done
}

instructions() { # mode count
  local input="$work/in.$1.$2" out="$work/cg.$1.$2"
  transactions "$2" >"$input"
  # Both runs from the mode's same database.
  rm -rf "$data"
  as_pg cp -a "$work/mode" "$data"
  as_pg valgrind --tool=callgrind --callgrind-out-file="$out" \
    "$bin/postgres" --single -D "$data" postgres <"$input" >"$work/single.$1.$2.log" 2>&1 || {
    echo "postgres --single failed ($1, $2):" >&2; tail -20 "$work/single.$1.$2.log" >&2; exit 1; }
  if grep -q 'ERROR' "$work/single.$1.$2.log"; then
    echo "errors in the replay ($1, $2):" >&2; grep -m5 ERROR "$work/single.$1.$2.log" >&2; exit 1
  fi
  awk '/^summary:/ { print $2 }' "$out"
}

echo "instructions per guarded write transaction (callgrind, ($long - $short) transactions; GUARD=$guard${KEYS:+, signed})"
declare -A per
for mode in $modes; do
  set_mode "$mode"
  a=$(instructions "$mode" "$short")
  b=$(instructions "$mode" "$long")
  per[$mode]=$(((b - a) / (long - short)))
  printf '%-8s %9d\n' "$mode" "${per[$mode]}"
done
# Only with GUARD=pair is the guard the same in every mode (the C install replaces guard(text)).
for mode in plpgsql c; do
  [ "$guard" = pair ] && [ -n "${per[off]:-}" ] && [ -n "${per[$mode]:-}" ] || continue
  added=$((per[$mode] - per[off]))
  printf 'added by the triggers, %-7s %+8d (%+.1f %%), per enforce() call %d\n' "$mode" "$added" \
    "$(echo "100 * $added / ${per[off]}" | bc -l)" $((added / 2))
done
