#!/usr/bin/env bash
# Benchmarks (see BENCHMARKS.md): services up, then a benchmark in release mode: `ingest`
# (the default) or `economy` (BENCH=economy).
# Knobs of ingest: BENCH_CHUNKS, BENCH_ROUNDS, BENCH_MEMORY_CHUNKS (comma-separated corpus sizes),
# BENCH_ONLY=streams (only relay/replay/latency), BENCH_STREAM_ROWS, BENCH_RELAY_ROUNDS,
# BENCH_RELAY_COMPARE, BENCH_RELAY_ROWS_PER_CALL, BENCH_RELAY_BATCH, BENCH_REPLAY_ROUNDS,
# BENCH_REPLAYERS, BENCH_REPLAY_OVERLAP, BENCH_REPLAY_CAP, BENCH_REPLAY_FLOOR (see benches/ingest.rs).
# Knobs of economy: ECONOMY_SEEDS (comma-separated fault seeds of the demo mix), ECONOMY_ONLY
# (run only the scenarios whose label contains it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
eval "$(scripts/services.sh up)"
exec cargo bench --locked --bench "${BENCH:-ingest}" "$@"
