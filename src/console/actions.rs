//! The console's actions: bulk requeue and purge (dry run → confirmation → run in the
//! background → result page) and reconcile runs. Every one is authorised
//! ([`reply::authorize`](super::reply::authorize): a session, its CSRF token, actions enabled) and written to the
//! audit trail before it changes anything.
//!
//! A bulk action applies to the filter of its dry run and to no row newer than the highest id
//! the dry run counted (`max_id`), so rows parked between the dry run and the confirmation are
//! never swept in. It runs as a tracked background task (at most
//! [`MAX_RUNNING_ACTIONS`](super::MAX_RUNNING_ACTIONS) at once) that records its progress
//! in its audit entry after each page; the browser is sent to that entry's page, which
//! reloads itself until the action is done. A requeue is paced at the console's requeue rate
//! (the same batching and pacing as `dlq requeue --rate`); a purge deletes in transactions of
//! [`PURGE_BATCH`](crate::dlq::PURGE_BATCH) rows, like `dlq purge`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{ConnectInfo, Form, Path, Query, State as AxumState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};

use super::filter::RawQuery;
use super::pages::{self, Preview};
use super::reply::{authorize, db_error, html};
use super::state::{Page, State};
use crate::reconcile::{Mode, Reconciler};
use crate::store::console as sql;

/// The two bulk actions.
fn kind(s: &str) -> Option<&'static str> {
    match s {
        "requeue" => Some("requeue"),
        "purge" => Some("purge"),
        _ => None,
    }
}

/// Rows the dry run shows.
const SAMPLE: i64 = 20;

/// `GET /actions/{kind}?<filter>`: the dry run (count and sample) and, for a logged-in
/// operator, the confirmation form.
pub async fn preview(
    Page { state, ctx }: Page,
    Path(k): Path<String>,
    Query(raw): Query<RawQuery>,
) -> Response {
    let Some(kind) = kind(&k) else {
        return html(StatusCode::NOT_FOUND, pages::message(&ctx, "Not found", "no such action"));
    };
    if ctx.read_only {
        return html(StatusCode::FORBIDDEN, pages::message(&ctx, "Refused", "This console is read-only."));
    }
    let filter = match raw.filter() {
        Ok(f) => f,
        Err(e) => return html(StatusCode::BAD_REQUEST, pages::message(&ctx, "Bad filter", &e)),
    };
    let store = &state.console.store;
    let pool = store.pool();
    let preview = async {
        // The highest id first: the counts below then cover exactly the rows up to it.
        let max_id = sql::max_id(pool, &filter.rows(None)).await?;
        let rows = filter.rows(max_id.or(Some(0)));
        let (count, left_alone) = if kind == "requeue" {
            let o = crate::dlq::requeue_dry_run(store, &rows).await?;
            (o.requeued, o.needs_reingest)
        } else {
            (crate::store::dlq::count(pool, &rows).await?, 0)
        };
        let sample = sql::page(pool, &rows, Default::default(), false, None, SAMPLE).await?.rows;
        Ok::<_, crate::store::StoreError>(Preview {
            kind,
            filter: filter.clone(),
            count,
            left_alone,
            max_id,
            sample,
        })
    };
    match preview.await {
        Ok(p) => html(StatusCode::OK, pages::preview(&ctx, &p)),
        Err(e) => db_error(&ctx, e),
    }
}

/// The confirmation form's fields beside the filter.
fn field<'a>(form: &'a [(String, String)], name: &str) -> Option<&'a str> {
    form.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The filter fields of a form, as a query would carry them.
fn raw_filter(form: &[(String, String)]) -> RawQuery {
    let get = |k: &str| field(form, k).map(str::to_string);
    RawQuery {
        class: get("class"),
        reason: get("reason"),
        doc_prefix: get("doc_prefix"),
        table: get("table"),
        model: get("model"),
        older_than: get("older_than"),
        min_attempts: get("min_attempts"),
        exhausted: get("exhausted"),
        id: get("id"),
        ..Default::default()
    }
}

/// `POST /actions/{kind}`: the confirmed action. Checks the session, the CSRF token and (for
/// a purge) the typed word, writes the audit entry, starts the action in the background and
/// sends the browser to the entry's page.
pub async fn confirm(
    AxumState(state): AxumState<State>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(k): Path<String>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let ctx = state.ctx(&headers, "/dlq".into());
    let Some(kind) = kind(&k) else {
        return html(StatusCode::NOT_FOUND, pages::message(&ctx, "Not found", "no such action"));
    };
    let (_, session) = match authorize(&state, &headers, field(&form, "csrf").unwrap_or("")) {
        Ok(s) => s,
        Err(refused) => return refused.page(&ctx),
    };
    if kind == "purge" && field(&form, "confirm").map(str::trim) != Some("purge") {
        return html(
            StatusCode::BAD_REQUEST,
            pages::message(&ctx, "Not confirmed", "Type the word purge to confirm. Nothing was changed."),
        );
    }
    let filter = match raw_filter(&form).filter() {
        Ok(f) => f,
        Err(e) => return html(StatusCode::BAD_REQUEST, pages::message(&ctx, "Bad filter", &e)),
    };
    let Some(max_id) = field(&form, "max_id").and_then(|v| v.parse::<i64>().ok()) else {
        return html(
            StatusCode::BAD_REQUEST,
            pages::message(&ctx, "Nothing to do", "The dry run matched no row."),
        );
    };
    let matched = field(&form, "matched").and_then(|v| v.parse::<i64>().ok());
    let Ok(slot) = state.action_slots.clone().try_acquire_owned() else {
        return html(
            StatusCode::TOO_MANY_REQUESTS,
            pages::message(&ctx, "Busy", "Too many actions are running; try again when one has finished."),
        );
    };
    let pool = state.console.store.pool().clone();
    let audit = sql::audit_start(
        &pool,
        &session.actor,
        Some(&peer.to_string()),
        kind,
        &filter.json(Some(max_id)),
        matched,
        None,
    )
    .await;
    let audit_id = match audit {
        Ok(id) => id,
        Err(e) => return db_error(&ctx, e),
    };
    tracing::info!(actor = %session.actor, action = kind, filter = %filter.describe(), max_id, audit_id,
        "console: action confirmed");
    let rows = filter.rows(Some(max_id));
    let store = state.console.store.clone();
    let rate = state.console.config.requeue_rate;
    let cancel = state.cancel.clone();
    state.tasks.spawn(async move {
        let _slot = slot;
        let (progress_tx, mut progress) = tokio::sync::watch::channel(0i64);
        let work = async {
            if kind == "requeue" {
                crate::dlq::requeue_rows(&store, &rows, rate, &cancel, |o| {
                    let _ = progress_tx.send(o.requeued as i64);
                })
                .await
                .map(|o| {
                    let mut note =
                        format!("requeued {}: due now and published for replay", rows_of(o.requeued as i64));
                    if o.needs_reingest > 0 {
                        note.push_str(&format!(
                            "; {} a corrected payload and were left alone: re-ingest them",
                            match o.needs_reingest {
                                1 => "1 row needs".to_string(),
                                n => format!("{n} rows need"),
                            }
                        ));
                    }
                    (o.requeued as i64, note)
                })
            } else {
                crate::dlq::purge_rows(&store, &rows, crate::dlq::PURGE_BATCH, &cancel, |n| {
                    let _ = progress_tx.send(n as i64);
                })
                .await
                .map(|n| {
                    (
                        n as i64,
                        format!(
                            "purged {} (and their manifest rows); each was announced as purged",
                            rows_of(n as i64)
                        ),
                    )
                })
            }
        };
        tokio::pin!(work);
        let outcome = loop {
            tokio::select! {
                r = &mut work => break r,
                Ok(()) = progress.changed() => {
                    let n = *progress.borrow_and_update();
                    let _ = sql::audit_progress(&pool, audit_id, n).await;
                }
            }
        };
        let stopped = cancel.is_cancelled();
        let done = match outcome {
            Ok((n, mut note)) => {
                if stopped {
                    note.push_str(" before the console stopped; run it again for the rest");
                }
                sql::audit_finish(&pool, audit_id, n, true, &note).await
            }
            Err(e) => {
                tracing::warn!(error = %e, audit_id, "console: action failed");
                let n = *progress.borrow();
                sql::audit_finish(&pool, audit_id, n, false, &format!("failed after {}: {e}", rows_of(n)))
                    .await
            }
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, audit_id, "console: could not finish the audit entry");
        }
    });
    Redirect::to(&format!("/audit/{audit_id}")).into_response()
}

/// `GET /reconcile`.
pub async fn reconcile_page(Page { state, ctx }: Page) -> Response {
    match sql::reconcile_runs(state.console.store.pool(), 20).await {
        Ok(runs) => html(StatusCode::OK, pages::reconcile(&ctx, &runs, None)),
        Err(e) => db_error(&ctx, e),
    }
}

/// Longest a reconcile run started from the console may take.
const RECONCILE_TIMEOUT: Duration = Duration::from_secs(600);

/// `POST /reconcile` (`mode` = `check`, `dry_run` or `repair`): runs the reconciler once,
/// records it in the audit trail, and shows its report.
pub async fn reconcile_run(
    AxumState(state): AxumState<State>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let ctx = state.ctx(&headers, "/reconcile".into());
    let (_, session) = match authorize(&state, &headers, field(&form, "csrf").unwrap_or("")) {
        Ok(s) => s,
        Err(refused) => return refused.page(&ctx),
    };
    let (mode, action) = match field(&form, "mode") {
        Some("check") => (Mode::Check, "reconcile_check"),
        Some("dry_run") => (Mode::DryRun, "reconcile_dry_run"),
        Some("repair") => (Mode::Repair, "reconcile_repair"),
        _ => {
            return html(
                StatusCode::BAD_REQUEST,
                pages::message(&ctx, "Bad request", "mode is check, dry_run or repair"),
            );
        }
    };
    let Ok(_running) = state.reconcile_lock.try_lock() else {
        return html(
            StatusCode::CONFLICT,
            pages::message(&ctx, "Busy", "A reconcile run is in progress; try again shortly."),
        );
    };
    let pool = state.console.store.pool().clone();
    let audit_id = match sql::audit_start(
        &pool,
        &session.actor,
        Some(&peer.to_string()),
        action,
        &serde_json::json!({}),
        None,
        None,
    )
    .await
    {
        Ok(id) => id,
        Err(e) => return db_error(&ctx, e),
    };
    let mut reconciler = Reconciler {
        store: state.console.store.clone(),
        redis: state.redis().await.ok(),
        keys: state.console.keys.clone(),
        config: Default::default(),
    };
    let outcome = tokio::time::timeout(RECONCILE_TIMEOUT, reconciler.run_once(mode)).await;
    let report = match outcome {
        Ok(Ok(report)) => report,
        Ok(Err(e)) => {
            let _ = sql::audit_finish(&pool, audit_id, 0, false, &format!("reconcile failed: {e}")).await;
            return html(
                StatusCode::SERVICE_UNAVAILABLE,
                pages::message(&ctx, "Reconcile failed", &e.to_string()),
            );
        }
        Err(_) => {
            let _ = sql::audit_finish(&pool, audit_id, 0, false, "reconcile took longer than 600 s").await;
            return html(
                StatusCode::SERVICE_UNAVAILABLE,
                pages::message(&ctx, "Reconcile failed", "it took longer than 600 s"),
            );
        }
    };
    crate::reconcile::publish_report(&report);
    let repaired: u64 = report.findings.iter().map(|f| f.repaired).sum();
    let note = format!(
        "{} findings, {repaired} repaired{}",
        report.total_found(),
        if reconciler.redis.is_none() { " (Redis unavailable: stream checks skipped)" } else { "" }
    );
    if let Err(e) = sql::audit_finish(&pool, audit_id, report.total_found() as i64, true, &note).await {
        tracing::warn!(error = %e, audit_id, "console: could not finish the audit entry");
    }
    match sql::reconcile_runs(&pool, 20).await {
        Ok(runs) => html(StatusCode::OK, pages::reconcile(&ctx, &runs, Some(&report))),
        Err(e) => db_error(&ctx, e),
    }
}

/// `n` rows in English: "1 row", "2 rows".
fn rows_of(n: i64) -> String {
    match n {
        1 => "1 row".to_string(),
        n => format!("{n} rows"),
    }
}
