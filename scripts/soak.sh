#!/usr/bin/env bash
# A soak run: one long seeded history (tests/it/history.rs) with production's time settings,
# so every fault lasts as long as it would in production: replay leases of 15 minutes,
# reclaims after 60 s idle, a delivery cap of 5, a Postgres outage longer than
# delivery_cap x min_idle (> 5 minutes), the provider out of quota for longer than a lease,
# Redis data lost with replay in flight, the events stream trimmed past a tailer.
#
# Usage: scripts/soak.sh [MINUTES] [SEED]
#   defaults: 60 minutes of operations, one random seed. The run lasts longer than MINUTES:
#   a fault started before the deadline runs to its end, then the settle and the checks.
# Prints (and writes to target/soak-report.txt): loss, duplicates, stale, exhausted-while-
# healthy, peak replay stream length, peak Redis memory, time to recover from each fault.
# Exit 0 when every invariant held.
#
# Every setting can be overridden from the environment (EMBED_DLQ_HISTORY_*, see the top of
# tests/it/history.rs); SOAK_PROFILE=debug uses the debug build (no release build needed).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
eval "$(scripts/services.sh up)"
minutes="${1:-60}"
export EMBED_DLQ_HISTORY_MINUTES="$minutes"
export EMBED_DLQ_HISTORY_SEEDS="${2:-$RANDOM$RANDOM}"
export EMBED_DLQ_HISTORY_KEYS="${EMBED_DLQ_HISTORY_KEYS:-2000}"
export EMBED_DLQ_HISTORY_MIN_KILLS="${EMBED_DLQ_HISTORY_MIN_KILLS:-5}"
# Production's periods (serve's defaults).
export EMBED_DLQ_HISTORY_MIN_IDLE_MS="${EMBED_DLQ_HISTORY_MIN_IDLE_MS:-60000}"
export EMBED_DLQ_HISTORY_DELIVERY_CAP="${EMBED_DLQ_HISTORY_DELIVERY_CAP:-5}"
export EMBED_DLQ_HISTORY_REPLAY_LEASE_SECS="${EMBED_DLQ_HISTORY_REPLAY_LEASE_SECS:-900}"
export EMBED_DLQ_HISTORY_OUTSTANDING_MAX="${EMBED_DLQ_HISTORY_OUTSTANDING_MAX:-10000}"
# Postgres gone for 6 minutes: longer than delivery_cap x min_idle (5 minutes).
export EMBED_DLQ_HISTORY_DB_OUTAGE_SECS="${EMBED_DLQ_HISTORY_DB_OUTAGE_SECS:-360}"
# The provider refusing for 20 minutes (longer than a lease) in an hour's run; a quarter of
# a shorter run (a 5-minute trial refuses for 75 s, less than a lease: say so if you quote it).
refusal=$(awk -v m="$minutes" 'BEGIN { r = m * 60 / 4; if (r > 1200) r = 1200; printf "%d", r }')
export EMBED_DLQ_HISTORY_REFUSAL_SECS="${EMBED_DLQ_HISTORY_REFUSAL_SECS:-$refusal}"
export EMBED_DLQ_HISTORY_REDIS_RECOVERY_SECS="${EMBED_DLQ_HISTORY_REDIS_RECOVERY_SECS:-60}"
export EMBED_DLQ_HISTORY_REDIS_MEMORY_MB="${EMBED_DLQ_HISTORY_REDIS_MEMORY_MB:-512}"
# Faults at random beside the one of each kind, and time for the last one's work to settle
# (a refused replayer pauses a minute; a row a crash left pending waits min_idle).
export EMBED_DLQ_HISTORY_FAULT_SHARE="${EMBED_DLQ_HISTORY_FAULT_SHARE:-0.02}"
export EMBED_DLQ_HISTORY_RECOVERY_WAIT_SECS="${EMBED_DLQ_HISTORY_RECOVERY_WAIT_SECS:-300}"
export EMBED_DLQ_HISTORY_REPORT="$root/target/soak-report.txt"
profile=(--release)
if [ "${SOAK_PROFILE:-release}" = debug ]; then profile=(); fi
echo "[soak] ${minutes} min, seed ${EMBED_DLQ_HISTORY_SEEDS}, ${EMBED_DLQ_HISTORY_KEYS} keys, db outage ${EMBED_DLQ_HISTORY_DB_OUTAGE_SECS}s, refusal ${EMBED_DLQ_HISTORY_REFUSAL_SECS}s" >&2
status=0
cargo test --locked "${profile[@]}" --features failpoints --test it history::randomized_histories_keep_every_promise -- --ignored --nocapture --test-threads 1 || status=$?
echo "[soak] report: $EMBED_DLQ_HISTORY_REPORT" >&2
exit $status
