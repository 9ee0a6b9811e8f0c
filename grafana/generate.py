#!/usr/bin/env python3
"""Writes grafana/embed-dlq.json, the Grafana dashboard of embed-dlq.

One panel per metric family of src/metrics.rs, grouped by stage (ingest, provider, DLQ,
outbox/relay, streams/replay, reconcile), templated on job and shard; every alert of
prometheus/alerts.yml is drawn as a threshold line on the panel of its expression. Edit this
file and run it (python3 grafana/generate.py) rather than editing the JSON by hand; the test
suite (tests/it/dashboard.rs) checks every expression with promtool and every metric name
against a real scrape.

Gauges sampled from the shared database (DLQ, outbox, streams, reconcile) are exported by
every serve/reconcile process alike, so they are combined with max/min, never summed.
`shard=~"$shard"` also matches series without that label, so the variable filters what
carries it and leaves the rest whole. (No metric carries the target table: the DLQ gauges
count every table's rows; `embed-dlq dlq stats --table T` splits them.)
"""

import json
import pathlib

SEL = 'job=~"$job"'
SEL_S = 'job=~"$job", shard=~"$shard"'
RATE = "$__rate_interval"

panels = []
next_id = 1
y = 0


def row(title):
    global next_id, y
    panels.append({"type": "row", "id": next_id, "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    next_id += 1
    y += 1


def stage(title, specs):
    """A row and its panels, three to a line."""
    global next_id, y
    row(title)
    for i, spec in enumerate(specs):
        targets = [{"refId": chr(ord("A") + n), "expr": expr, "legendFormat": legend,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                   for n, (expr, legend) in enumerate(spec["targets"])]
        defaults = {"unit": spec.get("unit", "short"), "min": 0,
                    "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                               "showPoints": "never"}}
        description = spec["description"]
        if "alert" in spec:
            name, value = spec["alert"]
            defaults["thresholds"] = {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": value}]}
            defaults["custom"]["thresholdsStyle"] = {"mode": "line+area"}
            description += f" The red line is alert {name} (prometheus/alerts.yml): {value}."
        else:
            defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
        panels.append({
            "type": "timeseries", "id": next_id, "title": spec["title"], "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": targets,
        })
        next_id += 1
    y += ((len(specs) + 2) // 3) * 8


stage("Ingest", [
    {"title": "Chunks stored / s", "description": "Chunks whose vector was stored, by ingest and by replay.",
     "targets": [(f"sum(rate(embed_dlq_chunks_stored_total{{{SEL}}}[{RATE}]))", "stored")]},
    {"title": "Chunks skipped / s", "description": "Chunks an ingest did not embed: unchanged, already parked, or leased to a concurrent run.",
     "targets": [(f"sum by (reason) (rate(embed_dlq_chunks_skipped_total{{{SEL}}}[{RATE}]))", "{{reason}}")]},
    {"title": "Chunks parked / s", "description": "The park rate, by error class (a retried attempt is never counted here).",
     "targets": [(f"sum by (error_class) (rate(embed_dlq_chunks_parked_total{{{SEL}}}[{RATE}]))", "{{error_class}}")]},
    {"title": "Chunks deleted / s", "description": "Chunks deleted (vector, manifest row, any DLQ row), by a delete record of the input or by a corpus run's cleanup.",
     "targets": [(f"sum by (by) (rate(embed_dlq_chunks_deleted_total{{{SEL}}}[{RATE}]))", "{{by}}")]},
    {"title": "Parked in 5 minutes", "description": "Chunks parked over the last 5 minutes.",
     "alert": ("EmbedDlqParkSpike", 500),
     "targets": [(f"sum(increase(embed_dlq_chunks_parked_total{{{SEL}}}[5m]))", "parked in 5m")]},
    {"title": "Input lines rejected / s", "description": "Input lines without a usable identity (reported with their line numbers, stored nowhere).",
     "targets": [(f"sum(rate(embed_dlq_input_lines_rejected_total{{{SEL}}}[{RATE}]))", "rejected")]},
    {"title": "Tokens / s", "description": "Provider tokens: stored (usable vectors) and wasted (failed requests, unusable vectors, canaries, re-sent inputs).",
     "targets": [(f"sum by (outcome) (rate(embed_dlq_tokens_total{{{SEL}}}[{RATE}]))", "{{outcome}}")]},
])

stage("Provider", [
    {"title": "Provider requests / s", "description": "Requests by outcome: ok, retry, reject, systemic.",
     "targets": [(f"sum by (outcome) (rate(embed_dlq_provider_requests_total{{{SEL}}}[{RATE}]))", "{{outcome}}")]},
    {"title": "Provider latency", "description": "Request latency quantiles from the histogram.", "unit": "s",
     "targets": [(f"histogram_quantile({q}, sum by (le) (rate(embed_dlq_provider_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))", f"p{int(q * 100)}")
                 for q in (0.5, 0.95, 0.99)]},
    {"title": "Retries / s", "description": "In-process retries by reason (timeout, connect, rate_limited, http_5xx codes, ...).",
     "targets": [(f"sum by (reason) (rate(embed_dlq_retries_total{{{SEL}}}[{RATE}]))", "{{reason}}")]},
    {"title": "Breaker state", "description": "0 closed, 1 half-open, 2 open (the worst process).",
     "alert": ("EmbedDlqBreakerOpen", 2),
     "targets": [(f"max(embed_dlq_breaker_state{{{SEL}}})", "state")]},
    {"title": "Breaker openings", "description": "Times the circuit breaker opened.",
     "targets": [(f"sum(increase(embed_dlq_breaker_opened_total{{{SEL}}}[{RATE}]))", "opened")]},
    {"title": "Limiter", "description": "Requests held back by the RPM/TPM budgets or rate-limit headers, the time they waited, and pauses set by headers.",
     "targets": [(f"sum(rate(embed_dlq_limiter_delayed_requests_total{{{SEL}}}[{RATE}]))", "delayed / s"),
                 (f"sum(rate(embed_dlq_limiter_wait_seconds_sum{{{SEL}}}[{RATE}]))", "waiting (s / s)"),
                 (f"histogram_quantile(0.95, sum by (le) (rate(embed_dlq_limiter_wait_seconds_bucket{{{SEL}}}[{RATE}])))", "p95 wait (s)"),
                 (f"sum(rate(embed_dlq_limiter_header_pauses_total{{{SEL}}}[{RATE}]))", "header pauses / s")]},
    {"title": "Limiter AIMD factor", "description": "1 = the configured budget; lower after 429s (the lowest process).",
     "targets": [(f"min(embed_dlq_limiter_factor{{{SEL}}})", "factor")]},
])

stage("DLQ", [
    {"title": "DLQ depth by class", "description": "DLQ rows by error class (sampled from the database by every serve process: max, not sum).",
     "targets": [(f"max by (error_class) (embed_dlq_dlq_depth{{{SEL}}})", "{{error_class}}")]},
    {"title": "Ready to replay", "description": "Transient rows due now (permanent rows never count). Red from 1: the alert fires when it stays above 0 for 15 minutes.",
     "alert": ("EmbedDlqReadyNotDraining", 1),
     "targets": [(f"max(embed_dlq_dlq_ready{{{SEL}}})", "ready")]},
    {"title": "Backing off and exhausted", "description": "Transient rows waiting for their next pass, and rows replay gave up on (only an operator moves them).",
     "targets": [(f"max(embed_dlq_dlq_backing_off{{{SEL}}})", "backing off"),
                 (f"max(embed_dlq_dlq_exhausted{{{SEL}}})", "exhausted")]},
    {"title": "Oldest DLQ row", "description": "Age of the oldest DLQ row.", "unit": "s",
     "targets": [(f"max(embed_dlq_dlq_oldest_age_seconds{{{SEL}}})", "oldest")]},
    {"title": "Next replay due in", "description": "Seconds until the next scheduled replay (0 if one is due).", "unit": "s",
     "targets": [(f"min(embed_dlq_dlq_next_due_seconds{{{SEL}}})", "next due")]},
])

stage("Outbox and relay", [
    {"title": "Outbox backlog", "description": "Outbox rows not yet published to Redis.",
     "targets": [(f"max(embed_dlq_outbox_backlog{{{SEL}}})", "unpublished")]},
    {"title": "Oldest unpublished outbox row", "description": "Age of the oldest unpublished outbox row.", "unit": "s",
     "alert": ("EmbedDlqOutboxStuck", 300),
     "targets": [(f"max(embed_dlq_outbox_oldest_age_seconds{{{SEL}}})", "oldest")]},
    {"title": "Relay / s", "description": "Outbox rows published, and rows recognised as already published (a republish after a crash).",
     "targets": [(f"sum(rate(embed_dlq_relay_published_total{{{SEL}}}[{RATE}]))", "published"),
                 (f"sum(rate(embed_dlq_relay_duplicates_total{{{SEL}}}[{RATE}]))", "duplicates")]},
])

stage("Streams and replay", [
    {"title": "Stream length", "description": "Entries per stream and shard.",
     "targets": [(f"max by (stream, shard) (embed_dlq_stream_length{{{SEL_S}}})", "{{stream}} {{shard}}")]},
    {"title": "Replay pending and lag", "description": "Replay entries delivered and not acknowledged (pending), and not yet delivered (lag), per shard.",
     "targets": [(f"max by (shard) (embed_dlq_stream_pending{{{SEL_S}}})", "pending {{shard}}"),
                 (f"max by (shard) (embed_dlq_stream_lag{{{SEL_S}}})", "lag {{shard}}")]},
    {"title": "Replay outcomes / s", "description": "Replay work items: replayed (stored), reparked, exhausted, skipped.",
     "targets": [(f"sum by (outcome) (rate(embed_dlq_replay_outcomes_total{{{SEL}}}[{RATE}]))", "{{outcome}}")]},
    {"title": "Replay leases released", "description": "Leases of work items lost with a replay stream's data (a consumer group found missing: FLUSHALL, a restart without persistence, an emptied cluster master), released so their work is issued again at once.",
     "targets": [(f"sum(increase(embed_dlq_replay_leases_released_total{{{SEL}}}[{RATE}]))", "released")]},
])

stage("Stream source", [
    {"title": "Source entries / s", "description": "Source stream entries read (new and taken over), acknowledged after their store or park committed, taken over from idle consumers, and parked after the delivery cap (docs/sources.md).",
     "targets": [(f"sum(rate(embed_dlq_source_entries_read_total{{{SEL}}}[{RATE}]))", "read"),
                 (f"sum(rate(embed_dlq_source_entries_acked_total{{{SEL}}}[{RATE}]))", "acknowledged"),
                 (f"sum(rate(embed_dlq_source_entries_reclaimed_total{{{SEL}}}[{RATE}]))", "taken over"),
                 (f"sum(rate(embed_dlq_source_entries_poison_total{{{SEL}}}[{RATE}]))", "poison")]},
    {"title": "Source pending and lag", "description": "Per source stream: entries delivered to the ingest group and not acknowledged (pending), and not yet delivered (lag, XINFO GROUPS).",
     "targets": [(f"max by (stream) (embed_dlq_source_pending{{{SEL}}})", "pending {{stream}}"),
                 (f"max by (stream) (embed_dlq_source_lag{{{SEL}}})", "lag {{stream}}")]},
])

stage("Table sources", [
    {"title": "Table source lag", "description": "Per table source: the age of the oldest change its triggers queued that the follower has not applied (0 when the queue is empty; sampled by serve and by the follower, docs/table-source.md).", "unit": "s",
     "alert": ("EmbedDlqTableSourceBehind", 300),
     "targets": [(f"max by (source) (embed_dlq_table_source_lag_seconds{{{SEL}}})", "{{source}}")]},
    {"title": "Table source changes queued", "description": "Per table source: changes queued and not yet applied (embed_table_changes).",
     "targets": [(f"max by (source) (embed_dlq_table_source_changes{{{SEL}}})", "{{source}}")]},
])

stage("Revisions", [
    {"title": "Revision coverage", "description": "Per revision of each target with revisions: the share of the active revision's chunks it covers (the same text, stored, or parked where the active one has it parked); revision activate switches only at full coverage (or within --allow-missing). Sampled every minute by serve (docs/revisions.md).", "unit": "percentunit",
     "targets": [(f"max by (target, revision) (embed_dlq_revision_covered_ratio{{{SEL}}})", "{{target}} r{{revision}}")]},
    {"title": "Chunks not covered", "description": "Per revision: chunks of the active revision it does not cover (missing, of other text, unresolved, without a vector, or extra): what a backfill has left to do before the switch.",
     "targets": [(f"max by (target, revision) (embed_dlq_revision_uncovered{{{SEL}}})", "{{target}} r{{revision}}")]},
    {"title": "Revision chunks and backlog", "description": "Per revision: the chunks its manifest holds, and its DLQ rows (each revision parks under its own identity); which one the query name answers (1).",
     "targets": [(f"max by (target, revision) (embed_dlq_revision_chunks{{{SEL}}})", "chunks {{target}} r{{revision}}"),
                 (f"max by (target, revision) (embed_dlq_revision_dlq_rows{{{SEL}}})", "DLQ {{target}} r{{revision}}"),
                 (f"max by (target, revision) (embed_dlq_revision_active{{{SEL}}})", "active {{target}} r{{revision}}")]},
    {"title": "Spend and writes by revision", "description": "Per revision number (summed over targets): provider tokens sent (stored and wasted) and vectors stored, by ingest, backfill and replay: what a shadow revision and its backfill cost beside the active one, and how fast the backfill goes.",
     "targets": [(f"sum by (revision) (rate(embed_dlq_tokens_total{{{SEL}}}[{RATE}]))", "tokens r{{revision}}"),
                 (f"sum by (revision) (rate(embed_dlq_chunks_stored_total{{{SEL}}}[{RATE}]))", "stored r{{revision}}")]},
    {"title": "Revisions let go by a stream source", "description": "Times a stream source went on without a revision other than the active one for the rest of a segment, that revision's run having stopped (its provider refused its model, its writes failed): the revision misses what the source wrote meanwhile; its coverage (embed-dlq revision list) shows it, and a backfill writes it (docs/revisions.md).",
     "targets": [(f"sum(increase(embed_dlq_source_revision_dropped_total{{{SEL}}}[{RATE}]))", "let go")]},
])

stage("Reconcile", [
    {"title": "Reconcile findings", "description": "Findings of the last run, by check. Red from 1: the alert fires when findings stay above 0 for 10 minutes.",
     "alert": ("EmbedDlqReconcileFindings", 1),
     "targets": [(f"max by (check) (embed_dlq_reconcile_findings{{{SEL}}})", "{{check}}")]},
    {"title": "Since the last reconcile", "description": "Seconds since the last finished reconcile run (any process).", "unit": "s",
     "alert": ("EmbedDlqReconcileNotRun", 7200),
     "targets": [(f"time() - max(embed_dlq_reconcile_last_success_timestamp_seconds{{{SEL}}})", "since last run")]},
    {"title": "Reconcile duration", "description": "Duration of the last reconcile run.", "unit": "s",
     "targets": [(f"max(embed_dlq_reconcile_duration_seconds{{{SEL}}})", "duration")]},
])


def variable(name, label, query):
    return {"type": "query", "name": name, "label": label,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


dashboard = {
    "title": "embed-dlq",
    "uid": "embed-dlq",
    "description": "Lossless embedding ingestion: ingest, provider, DLQ, outbox/relay, streams/replay, reconcile. Generated by grafana/generate.py.",
    "tags": ["embed-dlq"],
    "timezone": "",
    "editable": True,
    "graphTooltip": 1,
    "schemaVersion": 39,
    "version": 1,
    "refresh": "30s",
    "time": {"from": "now-6h", "to": "now"},
    "annotations": {"list": []},
    "links": [],
    "templating": {"list": [
        {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        variable("job", "job", "label_values(embed_dlq_chunks_stored_total, job)"),
        variable("shard", "shard", "label_values(embed_dlq_stream_length, shard)"),
    ]},
    "panels": panels,
}

out = pathlib.Path(__file__).with_name("embed-dlq.json")
out.write_text(json.dumps(dashboard, indent=2) + "\n")
print(f"wrote {out} ({len([p for p in panels if p['type'] != 'row'])} panels)")
