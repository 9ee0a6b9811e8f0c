#!/usr/bin/env bash
# The demo: brings up the project's own Postgres+pgvector and Redis (unless DATABASE_URL is
# already set), builds the release binary and runs `embed-dlq demo` end to end against the
# built-in fault-injecting provider. Extra arguments go to `embed-dlq demo`
# (e.g. scripts/demo.sh --chunks 50000). It ends with the commands to try next, each ready to
# paste into a fresh shell.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
hint=()
if [[ -z "${DATABASE_URL:-}" ]]; then
  eval "$(scripts/services.sh up)"
  # What a fresh shell needs to reach the same services (up is idempotent and fast).
  hint=(--setup-hint 'eval "$(scripts/services.sh up)"')
fi
cargo build --locked --release --quiet
exec target/release/embed-dlq demo "${hint[@]}" "$@"
