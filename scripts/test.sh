#!/usr/bin/env bash
# The test command: brings up the project's own Postgres+pgvector and Redis (idempotent),
# drops databases left by earlier test runs, makes sure promtool is installed (metrics and
# alert-rule tests), then runs every test against them.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -- fault_mix).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
eval "$(scripts/services.sh up)"
scripts/services.sh drop-test-dbs
scripts/ensure-promtool.sh
exec cargo test --locked --lib --bins --tests "$@"
