#!/usr/bin/env bash
# The demo: brings up the project's own Postgres+pgvector and Redis (unless DATABASE_URL is
# already set), builds the release binary and runs `embed-dlq demo` end to end against the
# built-in fault-injecting provider. Extra arguments go to `embed-dlq demo`
# (e.g. scripts/demo.sh --chunks 50000).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [[ -z "${DATABASE_URL:-}" ]]; then
  eval "$(scripts/services.sh up)"
fi
cargo build --locked --release --quiet
exec target/release/embed-dlq demo "$@"
