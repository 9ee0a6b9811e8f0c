//! Every page's HTML, as `maud` templates: checked at compile time, and every `(value)` is
//! escaped, so a doc id, a text, metadata or an error message that holds markup is shown as
//! text. Nothing here writes raw HTML from data (`PreEscaped` is used for nothing but the
//! doctype). The pages link one stylesheet and, on the live tail page, one script, both
//! served by the console itself.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::charts;
use super::events::ShownEvent;
use super::filter::{AGES, ListFilter, ListQuery, PAGE_SIZES, query_string};
use super::overview::Overview;
pub use super::state::Ctx;
use crate::model::ErrorClass;
use crate::reconcile::Report;
use crate::store::console::{AuditEntry, Excerpt, Page, ReconcileRun, RowView, SortKey};
use crate::store::dlq::Listed;

/// A time as `2026-11-30 12:00:01`.
pub fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// A duration in seconds as `3 d 4 h`, `2 h 5 min`, `4 min 2 s` or `12 s`.
pub fn age(secs: f64) -> String {
    let s = secs.clamp(0.0, 1e12) as u64;
    let (d, h, m, sec) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec} s"),
        (0, 0, _) => format!("{m} min {sec} s"),
        (0, _, _) => format!("{h} h {m} min"),
        _ => format!("{d} d {h} h"),
    }
}

fn ago(t: DateTime<Utc>) -> String {
    let secs = (Utc::now() - t).num_milliseconds() as f64 / 1000.0;
    if secs >= 0.0 { format!("{} ago", age(secs)) } else { format!("in {}", age(-secs)) }
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// A payload excerpt as shown: a string as is; whole JSON pretty-printed; cut JSON as its
/// compact text (it no longer parses).
fn shown(e: &Excerpt) -> String {
    if e.is_string || e.truncated() {
        return e.head.clone();
    }
    serde_json::from_str::<serde_json::Value>(&e.head).map(|v| pretty(&v)).unwrap_or_else(|_| e.head.clone())
}

/// The frame of every page.
pub fn layout(ctx: &Ctx, title: &str, body: Markup) -> Markup {
    frame(ctx, title, false, body)
}

/// The frame, optionally reloading itself every 2 s (a running action's result page).
fn frame(ctx: &Ctx, title: &str, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if refresh { meta http-equiv="refresh" content="2"; }
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · embed-dlq console" }
                link rel="stylesheet" href="/static/console.css";
            }
            body {
                header.top {
                    span.brand { "embed-dlq" }
                    nav {
                        a href="/" { "Overview" }
                        a href="/dlq" { "DLQ" }
                        a href="/events" { "Live events" }
                        a href="/reconcile" { "Reconcile" }
                        a href="/audit" { "Audit" }
                    }
                    span.who {
                        @if ctx.read_only {
                            span.badge.ro { "read-only" }
                        } @else if let Some((actor, csrf)) = &ctx.session {
                            "signed in as " b { (actor) }
                            form.inline method="post" action="/logout" {
                                input type="hidden" name="csrf" value=(csrf);
                                button.link type="submit" { "log out" }
                            }
                        } @else if ctx.token_set {
                            a #login-link href=(format!("/login?{}", query_string(&[("next", ctx.here.clone())]))) { "log in to act" }
                        } @else {
                            span.badge.ro title="set EMBED_DLQ_CONSOLE_TOKEN to enable actions" { "actions disabled" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A page that only says something (an error, a refusal).
pub fn message(ctx: &Ctx, title: &str, text: &str) -> Markup {
    layout(ctx, title, html! { p #message.message { (text) } })
}

fn class_link(c: ErrorClass) -> String {
    format!("/dlq?{}", query_string(&[("class", c.as_str().to_string())]))
}

/// `/`.
/// The overview's revisions section: each revision of each target that has them, with how
/// much of the active revision it covers (what `revision activate` requires); nothing when
/// no target has revisions.
fn revisions(revisions: &Result<Vec<crate::store::revision::RevisionNumbers>, String>) -> Markup {
    html! {
        @match revisions {
            Ok(rows) if rows.is_empty() => {}
            Ok(rows) => {
                h2 { "Revisions" }
                table #revisions {
                    thead { tr { th { "target" } th.num { "revision" } th { "state" } th { "model" } th.num { "dimensions" } th.num { "chunks" } th.num { "DLQ rows" } th { "covers the active one" } } }
                    tbody {
                        @for n in rows.iter().filter(|n| n.revision.state != "retired") {
                            tr {
                                td { code { (n.revision.target) } }
                                td.num { (n.revision.revision) }
                                td { span class=(format!("badge revision-{}", n.revision.state)) { (n.revision.state) } }
                                td { (n.revision.model.as_deref().unwrap_or("as configured")) }
                                td.num { (n.revision.dimensions) }
                                td.num { (n.chunks) }
                                td.num { (n.dlq_rows) }
                                @match &n.coverage {
                                    Some(c) => td { (c.covered) " of " (c.active_chunks) " (" (format!("{:.1}%", 100.0 * n.covered_ratio())) ")"
                                        @if c.uncovered() > 0 { ": " (c.uncovered()) " not covered" } },
                                    None => td { "-" },
                                }
                            }
                        }
                    }
                }
                p.note { "The target's name answers the active revision; every write reaches each live one. A switch (" code { "embed-dlq revision activate" } ") needs full coverage." }
            }
            Err(e) => { h2 { "Revisions" } p.warn { "Revisions unavailable: " (e) } }
        }
    }
}

/// The overview's table sources section: each source's queue, lag and capture triggers;
/// nothing when none is registered.
fn table_sources(sources: &Result<Vec<super::overview::TableSourceStats>, String>) -> Markup {
    html! {
        @match sources {
            Ok(rows) if rows.is_empty() => {}
            Ok(rows) => {
                h2 { "Table sources" }
                table #table-sources {
                    thead { tr { th { "source" } th { "table" } th { "target" } th { "snapshot" } th.num { "changes queued" } th.num { "lag" } th { "triggers" } } }
                    tbody {
                        @for s in rows {
                            tr {
                                td { code { (s.name) } }
                                td { code { (s.table) } }
                                td { code { (s.target) } }
                                td { @if s.snapshot_done { "done" } @else { span.badge { "pending" } } }
                                td.num { (s.changes) }
                                td.num { (format!("{:.1} s", s.lag_secs)) }
                                @if s.missing_triggers.is_empty() { td { "ok" } }
                                @else { td.warn { "missing: " (s.missing_triggers.join(", ")) } }
                            }
                        }
                    }
                }
                p.note { "Changes are queued by triggers in the writing transaction and deleted once applied; a missing trigger is repaired by " code { "embed-dlq source repair NAME" } " (or " code { "reconcile --repair" } ")." }
            }
            Err(e) => { h2 { "Table sources" } p.warn { "Table sources unavailable: " (e) } }
        }
    }
}

pub fn overview(ctx: &Ctx, o: &Overview) -> Markup {
    let total: i64 = o.stats.by_class.iter().map(|c| c.parked).sum();
    layout(
        ctx,
        "Overview",
        html! {
            section.cards {
                div.card { div.n #dlq-total { (total) } div.l { "DLQ rows" } }
                div.card { div.n #ready { (o.stats.ready_to_replay) } div.l { "ready to replay" } }
                div.card { div.n #backing-off { (o.stats.still_backing_off) } div.l { "backing off" } }
                div.card { div.n #exhausted { (o.stats.exhausted) } div.l { "exhausted" } }
                div.card { div.n { (if total > 0 { age(o.schedule.oldest_secs) } else { "-".into() }) } div.l { "oldest row" } }
                div.card { div.n { (o.stats.next_due.map(ago).unwrap_or_else(|| "-".into())) } div.l { "next replay due" } }
                div.card { div.n #outbox { (o.backlog.unpublished) } div.l { "outbox backlog" @if o.backlog.unpublished > 0 { " (oldest " (age(o.backlog.oldest_secs)) ")" } } }
            }
            section.grid {
                div {
                    h2 { "DLQ depth by class" }
                    table #by-class {
                        thead { tr { th { "class" } th.num { "rows" } th.num { "avg attempts" } th { "oldest" } } }
                        tbody {
                            @for c in &o.stats.by_class {
                                tr {
                                    td { a href=(class_link(c.error_class)) { (c.error_class.as_str()) } }
                                    td.num { (c.parked) }
                                    td.num { (format!("{:.1}", c.avg_attempts)) }
                                    td { (c.oldest.map(time).unwrap_or_default()) }
                                }
                            }
                            @if o.stats.by_class.is_empty() { tr { td colspan="4" { "The DLQ is empty." } } }
                        }
                    }
                    h2 { "…and by reason" }
                    table #by-reason {
                        thead { tr { th { "class" } th { "reason" } th.num { "rows" } } }
                        tbody {
                            @for r in &o.reasons {
                                tr {
                                    td { (r.error_class.as_str()) }
                                    td { a href=(format!("/dlq?{}", query_string(&[("class", r.error_class.as_str().to_string()), ("reason", r.error_reason.clone())]))) { (r.error_reason) } }
                                    td.num { (r.rows) }
                                }
                            }
                        }
                    }
                }
                div {
                    h2 { "Parks and replays" }
                    (charts::activity("Last hour (5-minute bars)", &o.hour, |t| t.format("%H:%M").to_string()))
                    (charts::activity("Last day (hourly bars)", &o.day, |t| t.format("%H:00").to_string()))
                    p.note { "From the outbox's events, which the relay keeps for a day after publishing them." }
                }
            }
            section.grid {
                div {
                    h2 { "Streams" }
                    @match &o.streams {
                        Ok(streams) => {
                            table #streams {
                                thead { tr { th { "shard" } th { "stream" } th { "key" } th.num { "length" } th.num { "pending" } th.num { "lag" } } }
                                tbody {
                                    @for s in streams {
                                        tr {
                                            td { (s.stream.shard) }
                                            td { (s.stream.stream) }
                                            td { code { (s.stream.key) } }
                                            td.num { (s.length) }
                                            td.num { (s.pending.map(|p| p.to_string()).unwrap_or_else(|| "-".into())) }
                                            td.num { (s.lag.map(|p| p.to_string()).unwrap_or_else(|| "-".into())) }
                                        }
                                    }
                                }
                            }
                        }
                        Err(e) => { p.warn { "Streams unavailable: " (e) } }
                    }
                    @match &o.sources {
                        Ok(sources) if sources.is_empty() => {}
                        Ok(sources) => {
                            h2 { "Source streams" }
                            table #sources {
                                thead { tr { th { "stream" } th { "group" } th.num { "length" } th.num { "pending" } th.num { "lag" } } }
                                tbody {
                                    @for s in sources {
                                        tr {
                                            td { code { (s.stream) } }
                                            td { (s.group) }
                                            td.num { (s.length) }
                                            td.num { (s.pending.map(|p| p.to_string()).unwrap_or_else(|| "-".into())) }
                                            td.num { (s.lag.map(|p| p.to_string()).unwrap_or_else(|| "-".into())) }
                                        }
                                    }
                                }
                            }
                            p.note { "Entries are acknowledged once their vector or DLQ row has committed; pending ones are taken over from dead consumers after the min-idle time." }
                        }
                        Err(e) => { h2 { "Source streams" } p.warn { "Source streams unavailable: " (e) } }
                    }
                    (revisions(&o.revisions))
                    (table_sources(&o.table_sources))
                    h2 { "Provider breaker" }
                    @if o.breakers.is_empty() {
                        p.note { "No source: run the console inside " code { "serve --console-addr" } ", or give " code { "--metrics-url" } " of the ingest and serve processes." }
                    } @else {
                        table #breakers {
                            thead { tr { th { "source" } th { "state" } th.num { "opened" } } }
                            tbody {
                                @for b in &o.breakers {
                                    tr {
                                        td { (b.source) }
                                        @match &b.state {
                                            Ok(s) => td { span class=(format!("badge breaker-{s}")) { (s) } },
                                            Err(e) => td.warn { "unknown: " (e) },
                                        }
                                        td.num { (b.opened.map(|n| n.to_string()).unwrap_or_else(|| "-".into())) }
                                    }
                                }
                            }
                        }
                    }
                }
                div {
                    h2 { "Last reconcile" }
                    @match &o.reconcile {
                        Some(run) => { (reconcile_run(run)) }
                        None => { p.warn { "No reconcile run recorded. " a href="/reconcile" { "Run one." } } }
                    }
                }
            }
        },
    )
}

/// The findings of a recorded run, non-zero ones first.
fn reconcile_run(run: &ReconcileRun) -> Markup {
    let findings: Vec<(String, u64, u64)> = run
        .findings
        .as_array()
        .map(|a| {
            a.iter()
                .map(|f| {
                    (
                        f.get("check").and_then(|v| v.as_str()).unwrap_or("?").to_string(),
                        f.get("found").and_then(|v| v.as_u64()).unwrap_or(0),
                        f.get("repaired").and_then(|v| v.as_u64()).unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let found: u64 = findings.iter().map(|f| f.1).sum();
    html! {
        p {
            "Finished " (time(run.finished_at)) " (" (ago(run.finished_at)) "), "
            (if run.repaired { "with repair" } else { "checks only" }) ": "
            @if found == 0 { span.badge.ok { "clean" } } @else { span.badge.bad { (found) " findings" } }
        }
        @if found > 0 {
            table.findings {
                thead { tr { th { "check" } th.num { "found" } th.num { "repaired" } } }
                tbody {
                    @for (check, n, repaired) in findings.iter().filter(|f| f.1 > 0) {
                        tr { td { (check) } td.num { (n) } td.num { (repaired) } }
                    }
                }
            }
        }
    }
}

fn sort_link(q: &ListQuery, key: SortKey, label: &str) -> Markup {
    let active = q.sort == key;
    let desc = active && !q.desc;
    let href = format!("/dlq?{}", query_string(&q.pairs_with(key, desc, None)));
    html! {
        a.sort.active[active] href=(href) {
            (label)
            @if active { (if q.desc { " ▼" } else { " ▲" }) }
        }
    }
}

/// The filter form (also used on the action pages, read-only there).
fn filter_form(f: &ListFilter, q: Option<&ListQuery>, tables: &[String], reasons: &[String]) -> Markup {
    html! {
        form #filter.filter method="get" action="/dlq" {
            label { "class "
                select name="class" {
                    option value="" { "any" }
                    @for c in ErrorClass::ALL {
                        option value=(c.as_str()) selected[f.class == Some(c)] { (c.as_str()) }
                    }
                }
            }
            label { "reason "
                select name="reason" {
                    option value="" { "any" }
                    @for r in reasons {
                        option value=(r) selected[f.reason.as_deref() == Some(r.as_str())] { (r) }
                    }
                    @if let Some(r) = &f.reason {
                        @if !reasons.contains(r) { option value=(r) selected { (r) } }
                    }
                }
            }
            label { "doc prefix " input type="text" name="doc_prefix" value=[f.doc_prefix.as_deref()] size="16"; }
            label { "model " input type="text" name="model" value=[f.model.as_deref()] size="16"; }
            label { "table "
                select name="table" {
                    option value="" { "any" }
                    @for t in tables {
                        option value=(t) selected[f.table.as_deref() == Some(t.as_str())] { (t) }
                    }
                }
            }
            label { "age "
                select name="older_than" {
                    option value="" { "any" }
                    @for (secs, label) in AGES {
                        option value=(secs) selected[f.older_than == Some(secs)] { (label) }
                    }
                }
            }
            label { "min attempts " input type="number" name="min_attempts" min="0" max="1000000" value=[f.min_attempts] size="4"; }
            label { input type="checkbox" name="exhausted" value="1" checked[f.exhausted]; " exhausted only" }
            @if let Some(q) = q {
                @if q.sort != SortKey::Id { input type="hidden" name="sort" value=(q.sort.as_str()); }
                @if q.desc { input type="hidden" name="desc" value="1"; }
                label { "per page "
                    select name="limit" {
                        @for n in PAGE_SIZES { option value=(n) selected[q.limit == n] { (n) } }
                    }
                }
            }
            button #apply type="submit" { "Filter" }
            a href="/dlq" { "clear" }
        }
    }
}

fn rows_table(rows: &[Listed], q: Option<&ListQuery>) -> Markup {
    let head = |key: SortKey, label: &str| match q {
        Some(q) => sort_link(q, key, label),
        None => html! { (label) },
    };
    html! {
        table #rows.rows {
            thead {
                tr {
                    th { (head(SortKey::Id, "id")) }
                    th { "table" }
                    th { (head(SortKey::Doc, "doc")) }
                    th.num { "chunk" }
                    th { "class" }
                    th { "reason" }
                    th.num { (head(SortKey::Attempts, "attempts")) }
                    th.num { "replays" }
                    th { (head(SortKey::FirstFailed, "first failed")) }
                    th { (head(SortKey::LastFailed, "last failed")) }
                    th { (head(SortKey::NextRetry, "next retry")) }
                }
            }
            tbody {
                @for r in rows {
                    tr.exhausted[r.exhausted] {
                        td { a.row-link href=(format!("/dlq/{}", r.id)) { (r.id) } }
                        td { (r.target_table) }
                        td.doc { (r.doc_id) }
                        td.num { (r.chunk_index) }
                        td { (r.error_class.as_str()) }
                        td { (r.error_reason) }
                        td.num { (r.attempts) }
                        td.num { (r.replays) }
                        td.t { (time(r.first_failed_at)) }
                        td.t { (time(r.last_failed_at)) }
                        td.t {
                            @if r.exhausted { span.badge.bad { "exhausted" } }
                            @else { (r.next_retry_at.map(time).unwrap_or_else(|| "never (operator)".into())) }
                        }
                    }
                }
            }
        }
    }
}

/// `/dlq`.
pub fn list(
    ctx: &Ctx,
    q: &ListQuery,
    count: u64,
    page: &Page,
    tables: &[String],
    reasons: &[String],
) -> Markup {
    let filter_qs = query_string(&q.filter.pairs());
    layout(
        ctx,
        "DLQ",
        html! {
            (filter_form(&q.filter, Some(q), tables, reasons))
            p.summary {
                span #match-count { (count) }
                @if q.filter.is_empty() { " rows in the DLQ (no filter)." } @else { " rows match " (q.filter.describe()) "." }
                @if !ctx.read_only && count > 0 {
                    " "
                    a.button #bulk-requeue href=(format!("/actions/requeue?{filter_qs}")) { "Requeue these…" }
                    " "
                    a.button.danger #bulk-purge href=(format!("/actions/purge?{filter_qs}")) { "Purge these…" }
                }
            }
            (rows_table(&page.rows, Some(q)))
            p.pager {
                @if q.after.is_some() { a href=(format!("/dlq?{}", query_string(&q.pairs_with(q.sort, q.desc, None)))) { "« first page" } " " }
                @if let Some(next) = &page.next {
                    a #next-page href=(format!("/dlq?{}", query_string(&q.pairs_with(q.sort, q.desc, Some(next))))) { "next page »" }
                }
            }
        },
    )
}

/// `/dlq/{id}`.
///
/// The payload is shown from the excerpts of [`RowView`]: a text cut at
/// [`crate::store::console::DETAIL_TEXT_CHARS`] says so and links its download.
pub fn detail(ctx: &Ctx, view: &RowView, events: &Result<(Vec<ShownEvent>, usize), String>) -> Markup {
    let d = &view.detail;
    let r = &d.row;
    let history = d.error_history.as_array().cloned().unwrap_or_default();
    let one = query_string(&[("id", r.id.to_string())]);
    layout(
        ctx,
        &format!("DLQ row {}", r.id),
        html! {
            section.grid {
                div {
                    table.kv #row-facts {
                        tr { th { "table" } td { (r.target_table) } }
                        tr { th { "doc" } td #doc-id { (r.doc_id) } }
                        tr { th { "chunk" } td { (r.chunk_index) } }
                        tr { th { "class / reason" } td { (r.error_class.as_str()) " / " (r.error_reason) } }
                        tr { th { "last status" } td { (d.last_status.map(|s| s.to_string()).unwrap_or_else(|| "-".into())) } }
                        tr { th { "attempts / replays" } td { (r.attempts) " / " (r.replays) } }
                        tr { th { "generation" } td { (r.generation) } }
                        tr { th { "first failed" } td { (time(r.first_failed_at)) " (" (ago(r.first_failed_at)) ")" } }
                        tr { th { "last failed" } td { (time(r.last_failed_at)) " (" (ago(r.last_failed_at)) ")" } }
                        tr { th { "next retry" } td #next-retry {
                            @if r.exhausted { span.badge.bad { "exhausted" } " " (d.exhausted_reason.clone().unwrap_or_default()) }
                            @else if let Some(t) = r.next_retry_at { (time(t)) " (" (ago(t)) ")" }
                            @else { "never automatically (" (r.error_class.as_str()) "): requeue after fixing the cause" }
                        } }
                        tr { th { "model" } td { (d.model.clone().unwrap_or_else(|| "-".into())) " · dimensions " (d.dimensions.map(|n| n.to_string()).unwrap_or_else(|| "-".into())) } }
                        tr { th { "content hash" } td { code { (d.content_hash) } } }
                        tr { th { "last error" } td #last-error { (d.last_error.clone().unwrap_or_default()) } }
                    }
                    @if !ctx.read_only {
                        p.actions {
                            a.button #row-requeue href=(format!("/actions/requeue?{one}")) { "Requeue this row…" }
                            " "
                            a.button.danger #row-purge href=(format!("/actions/purge?{one}")) { "Purge this row…" }
                        }
                    }
                }
                div {
                    h2 { "Payload text" }
                    @match &view.text {
                        Some(t) => {
                            pre #payload-text.text { (shown(t)) }
                            @if t.is_string {
                                p.note {
                                    @if t.truncated() {
                                        span #text-truncated { "Showing the first " (t.head.chars().count()) " of " (t.chars) " characters. " }
                                    }
                                    a #text-download href=(format!("/dlq/{}/text", r.id)) { "Download the whole text" }
                                }
                            }
                        }
                        None => { p.warn { "The payload has no text: re-ingest the corrected source line." } }
                    }
                    h2 { "Metadata" }
                    pre #payload-metadata { (view.metadata.as_ref().map(shown).unwrap_or_else(|| "(none)".into())) }
                    @if view.metadata.as_ref().is_some_and(Excerpt::truncated) {
                        p.note #metadata-truncated { "Metadata cut at " (crate::store::console::DETAIL_TEXT_CHARS) " characters (see " code { "dlq show --json" } ")." }
                    }
                    @if let Some(rest) = &view.rest {
                        h2 { "Other payload fields" }
                        pre { (shown(rest)) }
                        @if rest.truncated() { p.note { "Cut at " (crate::store::console::DETAIL_TEXT_CHARS) " characters." } }
                    }
                }
            }
            h2 { "Error history" }
            @if history.is_empty() { p.note { "No history recorded." } }
            ol #timeline.timeline {
                @for h in &history {
                    @let s = |k: &str| h.get(k).map(|v| match v { serde_json::Value::String(s) => s.clone(), serde_json::Value::Null => String::new(), v => v.to_string() }).unwrap_or_default();
                    li {
                        span.when { (s("at")) }
                        " "
                        b { (s("pass")) }
                        " — " (s("error_class")) " / " (s("error_reason"))
                        @if !s("status").is_empty() { " · HTTP " (s("status")) }
                        " · " (s("attempts")) " attempts"
                        @if !s("exhausted_reason").is_empty() { " · exhausted: " (s("exhausted_reason")) }
                        @if !s("error").is_empty() { div.err { (s("error")) } }
                    }
                }
            }
            h2 { "Events" }
            @match events {
                Ok((events, scanned)) => {
                    p.note {
                        "This chunk's events among the newest " (scanned) " of the events stream."
                        @if events.is_empty() { " None there: older ones are beyond this scan (" code { "--events-scan" } ") or trimmed." }
                    }
                    (events_table(events, "row-events"))
                }
                Err(e) => { p.warn { "Events unavailable: " (e) } }
            }
        },
    )
}

fn events_table(events: &[ShownEvent], id: &str) -> Markup {
    html! {
        table.events id=(id) {
            thead { tr { th { "time" } th { "event" } th { "table" } th { "doc" } th.num { "chunk" } th.num { "generation" } th { "details" } } }
            tbody #events-body {
                @for e in events {
                    tr {
                        td.t { (e.at.map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()).unwrap_or_default()) }
                        td {
                            @match e.body.get("dlq_id").and_then(|v| v.as_i64()) {
                                Some(id) => a href=(format!("/dlq/{id}")) { (e.event) },
                                None => (e.event),
                            }
                        }
                        td { (e.field("table")) }
                        td.doc { (e.field("doc_id")) }
                        td.num { (e.field("chunk_index")) }
                        td.num { (e.field("generation")) }
                        td { (e.details()) }
                    }
                }
            }
        }
    }
}

/// `/events`: the newest events, then the live tail (the script appends what arrives).
pub fn events(ctx: &Ctx, recent: &Result<Vec<ShownEvent>, String>) -> Markup {
    let from = match recent {
        Ok(r) => r.first().map(|e| e.id.clone()).unwrap_or_else(|| "$".into()),
        Err(_) => "$".into(),
    };
    layout(
        ctx,
        "Live events",
        html! {
            p { "Status: " span #events-status data-from=(from) { "connecting…" } " — newest first; the page keeps the last 500." }
            @match recent {
                Ok(r) => { (events_table(r, "events")) }
                Err(e) => { p.warn { "Events unavailable: " (e) } (events_table(&[], "events")) }
            }
            script src="/static/console.js" {}
        },
    )
}

/// What a bulk action's dry run found.
#[derive(Debug, Clone)]
pub struct Preview {
    /// `requeue` or `purge`.
    pub kind: &'static str,
    pub filter: ListFilter,
    /// Rows the action would change.
    pub count: u64,
    /// Matching rows it would leave alone (requeue: rows that need a corrected payload).
    pub left_alone: u64,
    /// The highest matching id: the confirmed action stops there.
    pub max_id: Option<i64>,
    pub sample: Vec<Listed>,
}

/// `GET /actions/{kind}`: the dry run and the confirmation form.
pub fn preview(ctx: &Ctx, p: &Preview) -> Markup {
    let verb = if p.kind == "purge" { "Purge" } else { "Requeue" };
    layout(
        ctx,
        &format!("{verb}: dry run"),
        html! {
            @if p.filter.is_empty() {
                p.warn #whole-dlq { "No filter: this applies to every row of the DLQ." }
            }
            p.summary #dry-run {
                "Dry run for " b { (p.filter.describe()) } ": "
                span #would-count { (p.count) }
                @if p.kind == "purge" { " rows would be deleted for good (with their manifest rows; each is announced as " code { "purged" } ")." }
                @else { " rows would become due now and be published for replay (at the console's requeue rate)." }
                @if p.left_alone > 0 { " " span #left-alone { (p.left_alone) } " more need a corrected payload and are left alone: re-ingest them." }
            }
            @if p.count > 0 {
                h2 { "Sample (first " (p.sample.len()) ")" }
                (rows_table(&p.sample, None))
                @if !ctx.actions_enabled() {
                    p.warn { "Actions are disabled here (" (if ctx.read_only { "read-only console" } else { "no EMBED_DLQ_CONSOLE_TOKEN set" }) ")." }
                } @else if let Some(csrf) = ctx.csrf() {
                    form #confirm.confirm method="post" action=(format!("/actions/{}", p.kind)) {
                        @for (k, v) in p.filter.pairs() { input type="hidden" name=(k) value=(v); }
                        input type="hidden" name="max_id" value=[p.max_id];
                        input type="hidden" name="matched" value=(p.count);
                        input type="hidden" name="csrf" value=(csrf);
                        @if p.kind == "purge" {
                            label { "Type " code { "purge" } " to confirm: " input #confirm-word type="text" name="confirm" autocomplete="off" required; }
                            " "
                        }
                        button #confirm-button.danger[p.kind == "purge"] type="submit" { (verb) " " (p.count) " rows" }
                        " "
                        a href=(format!("/dlq?{}", query_string(&p.filter.pairs()))) { "cancel" }
                    }
                } @else {
                    p { a #login-to-act href=(format!("/login?{}", query_string(&[("next", ctx.here.clone())]))) { "Log in" } " to confirm." }
                }
            } @else {
                p { "Nothing to do." }
            }
        },
    )
}

/// `/audit/{id}`: an action's result (refreshes itself while it runs).
pub fn audit_entry(ctx: &Ctx, e: &AuditEntry) -> Markup {
    let running = e.status == "running";
    frame(
        ctx,
        &format!("Action {}: {}", e.id, e.action),
        running,
        html! {
                table.kv #result {
                    tr { th { "status" } td #status { span class=(format!("badge status-{}", e.status)) { (e.status) } } }
                    tr { th { "who" } td { (e.actor) @if let Some(r) = &e.remote { " from " (r) } } }
                    tr { th { "started" } td { (time(e.started_at)) } }
                    tr { th { "finished" } td { (e.finished_at.map(time).unwrap_or_else(|| "-".into())) } }
                    tr { th { "filter" } td { code { (e.filter.to_string()) } } }
                    tr { th { "matched (dry run)" } td { (e.matched.map(|n| n.to_string()).unwrap_or_else(|| "-".into())) } }
                    tr { th { "count" } td #done-count { (e.count.map(|n| n.to_string()).unwrap_or_else(|| "-".into())) } }
                    tr { th { "outcome" } td #outcome { (e.detail.clone().unwrap_or_default()) } }
                }
                p { a href="/dlq" { "back to the DLQ" } " · " a href="/audit" { "audit trail" } }
        },
    )
}

/// `/audit`.
pub fn audit_list(ctx: &Ctx, entries: &[AuditEntry]) -> Markup {
    layout(
        ctx,
        "Audit trail",
        html! {
            table #audit {
                thead { tr { th { "id" } th { "started" } th { "who" } th { "action" } th { "filter" } th.num { "matched" } th.num { "count" } th { "status" } } }
                tbody {
                    @for e in entries {
                        tr {
                            td { a href=(format!("/audit/{}", e.id)) { (e.id) } }
                            td { (time(e.started_at)) }
                            td { (e.actor) }
                            td { (e.action) }
                            td { code { (e.filter.to_string()) } }
                            td.num { (e.matched.map(|n| n.to_string()).unwrap_or_default()) }
                            td.num { (e.count.map(|n| n.to_string()).unwrap_or_default()) }
                            td { (e.status) }
                        }
                    }
                }
            }
        },
    )
}

/// `/reconcile`: the last runs, the forms, and a fresh report when one was just run.
pub fn reconcile(ctx: &Ctx, runs: &[ReconcileRun], report: Option<&Report>) -> Markup {
    layout(
        ctx,
        "Reconcile",
        html! {
            @if let Some(r) = report {
                h2 { "This run: " (match r.mode { crate::reconcile::Mode::Check => "checks", crate::reconcile::Mode::DryRun => "repair dry run", crate::reconcile::Mode::Repair => "repair" }) }
                p #report-summary {
                    @if r.total_found() == 0 { span.badge.ok { "clean" } } @else { span.badge.bad { (r.total_found()) " findings" } }
                    " in " (format!("{:.2}", r.duration_secs)) " s"
                }
                table #report.findings {
                    thead { tr { th { "check" } th.num { "found" } th.num { "repaired" } th { "repair does" } th { "examples" } th { "note" } } }
                    tbody {
                        @for f in &r.findings {
                            tr.bad[f.found > 0] {
                                td { (f.check.name()) }
                                td.num { (f.found) }
                                td.num { (f.repaired) }
                                td { (f.check.repair_action().unwrap_or("-")) }
                                td { @for ex in &f.examples { code { (ex) } " " } }
                                td { (f.note.clone().unwrap_or_default()) }
                            }
                        }
                    }
                }
            }
            @if !ctx.read_only {
                @if let Some(csrf) = ctx.csrf() {
                    form.inline method="post" action="/reconcile" {
                        input type="hidden" name="csrf" value=(csrf);
                        button #run-check type="submit" name="mode" value="check" { "Run the checks" }
                        " "
                        button #run-dry-run type="submit" name="mode" value="dry_run" { "Repair: dry run" }
                        @if report.is_some_and(|r| r.mode == crate::reconcile::Mode::DryRun && r.total_found() > 0) {
                            " "
                            button #run-repair.danger type="submit" name="mode" value="repair" { "Repair now" }
                        }
                    }
                } @else if ctx.token_set {
                    p { a href=(format!("/login?{}", query_string(&[("next", "/reconcile".to_string())]))) { "Log in" } " to run the checks or repair." }
                }
            }
            h2 { "Recorded runs" }
            table #runs {
                thead { tr { th { "run" } th { "finished" } th { "kind" } th.num { "findings" } th { "non-zero checks" } } }
                tbody {
                    @for run in runs {
                        @let checks: Vec<(String, u64)> = run.findings.as_array().map(|a| a.iter().filter_map(|f| {
                            let n = f.get("found").and_then(|v| v.as_u64()).unwrap_or(0);
                            (n > 0).then(|| (f.get("check").and_then(|v| v.as_str()).unwrap_or("?").to_string(), n))
                        }).collect()).unwrap_or_default();
                        tr {
                            td { (run.id) }
                            td { (time(run.finished_at)) }
                            td { (if run.repaired { "repair" } else { "check or dry run" }) }
                            td.num { (checks.iter().map(|c| c.1).sum::<u64>()) }
                            td { @for (c, n) in &checks { (c) " " (n) "; " } }
                        }
                    }
                }
            }
        },
    )
}

/// `/login`.
pub fn login(ctx: &Ctx, next: &str, error: Option<&str>) -> Markup {
    layout(
        ctx,
        "Log in",
        html! {
            @if let Some(e) = error { p.warn #login-error { (e) } }
            @if !ctx.login_offered() {
                p { "Logging in is only needed for actions, and actions are disabled here ("
                    (if ctx.read_only { "read-only console" } else { "no EMBED_DLQ_CONSOLE_TOKEN set" }) ")." }
            } @else {
                form #login.login method="post" action="/login" {
                    input type="hidden" name="next" value=(next);
                    label { "Your name (for the audit trail) " input #login-name type="text" name="name" maxlength="64" autocomplete="username"; }
                    label { "Console token " input #login-token type="password" name="token" autocomplete="current-password" required; }
                    button #login-button type="submit" { "Log in" }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx {
            session: Some(("<b>eve</b>".into(), "c\"srf".into())),
            read_only: false,
            token_set: true,
            here: "/".into(),
            login_for_reads: false,
        }
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(age(12.4), "12 s");
        assert_eq!(age(125.0), "2 min 5 s");
        assert_eq!(age(7500.0), "2 h 5 min");
        assert_eq!(age(90_000.0), "1 d 1 h");
        assert_eq!(age(-5.0), "0 s");
        assert_eq!(age(f64::INFINITY), age(1e12));
    }

    #[test]
    fn values_are_escaped_in_text_and_attributes() {
        let html = message(&ctx(), "<script>alert(1)</script>", "<img src=x onerror=alert(1)>").into_string();
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(!html.contains("<img src=x"), "{html}");
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{html}");
        assert!(html.contains("&lt;b&gt;eve&lt;/b&gt;"), "{html}");
        assert!(html.contains("value=\"c&quot;srf\""), "{html}");
    }
}
