#!/usr/bin/env bash
# Benchmarks (see BENCHMARKS.md): services up, then the ingest benchmark in release mode.
# Knobs: BENCH_CHUNKS, BENCH_ROUNDS, BENCH_MEMORY_CHUNKS (comma-separated corpus sizes).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
eval "$(scripts/services.sh up)"
exec cargo bench --locked --bench ingest "$@"
