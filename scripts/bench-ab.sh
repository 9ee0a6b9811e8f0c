#!/usr/bin/env bash
# A/B of the ingest benchmark (see BENCHMARKS.md): builds the bench of REF (any commit) beside
# the one of the working tree, then runs the two binaries alternately ALTERNATIONS times on
# the same services (BENCH_ROUNDS rounds of BENCH_CHUNKS chunks each) and prints, per binary,
# the medians over all its rounds: raw rows/s, pipeline chunks/s, and the per-round ratio.
# The raw baseline swings by a third between runs of the same code on a shared machine, so
# compare the pipeline medians as well as the ratios.
#
# Usage: scripts/bench-ab.sh REF [ALTERNATIONS]      e.g. scripts/bench-ab.sh main~5 3
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
ref=${1:?usage: scripts/bench-ab.sh REF [ALTERNATIONS]}
alternations=${2:-3}
eval "$(scripts/services.sh up)"

wt=$(mktemp -d "${TMPDIR:-/tmp}/embed-dlq-ab.XXXXXX")
git worktree add -q --detach "$wt" "$ref"
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT

# The bench executable of the tree in $1, built in its own target dir ($2).
bench_binary() {
    (cd "$1" && CARGO_TARGET_DIR="$2" cargo bench --locked --bench ingest --no-run --message-format=json) |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "ingest":
        print(m["executable"])'
}
echo "building the bench of $ref and of the working tree (release)..." >&2
base_bin=$(bench_binary "$wt" "$root/target/bench-ab")
# The head's build writes the same file name: keep the base's executable aside.
cp "$base_bin" "$wt/ingest-base" && base_bin="$wt/ingest-base"
# The two trees share a target dir, and cargo records the crate's sources by their path in the
# package: a file of the working tree older than the base build would pass for built. Every
# file that differs from REF is made newer than it.
git diff --name-only "$ref" -- . | while read -r f; do [[ -e $f ]] && touch "$f"; done
git ls-files --others --exclude-standard | while read -r f; do touch "$f"; done
head_bin=$(bench_binary "$root" "$root/target/bench-ab")

log=$(mktemp)
for ((i = 1; i <= alternations; i++)); do
    for side in base head; do
        bin=${side}_bin
        echo "== $side $i" | tee -a "$log"
        env -u REDIS_URL BENCH_CHUNKS="${BENCH_CHUNKS:-50000}" BENCH_ROUNDS="${BENCH_ROUNDS:-5}" "${!bin}" |
            grep -E '^round|^  unchanged rerun' | tee -a "$log"
    done
done
python3 - "$log" "$ref" <<'PY'
import re, statistics, sys
rows, reruns, side = {}, {}, None
for line in open(sys.argv[1]):
    m = re.match(r"== (\w+)", line)
    if m:
        side = m.group(1); rows.setdefault(side, []); reruns.setdefault(side, []); continue
    m = re.search(r"unchanged rerun\s+(\d+) chunks/s, ([\d.]+)x", line)
    if m:
        reruns[side].append(tuple(map(float, m.groups())))
        continue
    m = re.search(r"raw\s+(\d+).*pipeline\s+(\d+).*ratio ([\d.]+)", line)
    if m:
        rows[side].append(tuple(map(float, m.groups())))
for side, name in (("base", sys.argv[2]), ("head", "working tree")):
    v = rows.get(side, [])
    if v:
        print(f"{name:>14}: {len(v)} rounds, raw {statistics.median(r[0] for r in v):,.0f} rows/s, "
              f"pipeline {statistics.median(r[1] for r in v):,.0f} chunks/s, "
              f"ratio {statistics.median(r[2] for r in v):.2f} (medians)")
    u = reruns.get(side, [])
    if u:
        print(f"{'':>14}  unchanged rerun {statistics.median(r[0] for r in u):,.0f} chunks/s, "
              f"{statistics.median(r[1] for r in u):.2f}x the fresh ingest (medians)")
PY
