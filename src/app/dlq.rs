//! `dlq`: validates the action, asks for confirmation where an action is destructive or sends
//! everything to the provider again, calls [`embed_dlq::dlq`] and renders the outcome (a
//! table or lines, or JSON) on stdout.

use std::io::{IsTerminal, Write};

use embed_dlq::config::{FileConfig, IngestArgs};
use embed_dlq::dlq::Filter;
use embed_dlq::store::Store;

use super::args::{DlqAction, DlqCommand};
use super::{Resolver, exit};

/// Longest `--older-than-secs` (100 years): larger values overflow Postgres intervals.
pub const MAX_OLDER_THAN_SECS: u64 = 100 * 365 * 24 * 3600;

/// Runs `dlq`; returns the exit code.
pub async fn command(resolver: &Resolver, args: DlqCommand) -> i32 {
    let DlqCommand { action, json, table } = args;
    let flags = FileConfig { ingest: IngestArgs { table, ..Default::default() }, ..Default::default() };
    match resolver.with_database(flags) {
        Ok((settings, url)) => run(&url, &settings.table, action, json).await,
        Err(e) => exit::usage(&e),
    }
}

/// Runs a `dlq` action on the DLQ of `url` (target table `table`).
async fn run(url: &str, table: &str, action: DlqAction, json: bool) -> i32 {
    let confirm_requeue_all = match check_action(&action) {
        Ok(confirm) => confirm,
        Err(e) => return exit::fail(exit::USAGE, &e),
    };
    let store = match super::open_store(url, 2, table).await {
        Ok(s) => s,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let mut out = std::io::stdout().lock();
    let result = match action {
        DlqAction::Stats => stats(&store, json, &mut out).await,
        DlqAction::List { filter, limit, after_id } => {
            list(&store, &filter, limit, after_id, json, &mut out).await
        }
        DlqAction::Show { id } => show(&store, id, json, &mut out).await,
        DlqAction::Requeue { filter, dry_run, rate, all: _ } => {
            requeue(&store, &filter, dry_run, rate, confirm_requeue_all, json, &mut out).await
        }
        DlqAction::Purge { filter, dry_run, yes } => {
            purge(&store, &filter, dry_run, yes, json, &mut out).await
        }
    };
    match result {
        Ok(()) => exit::OK,
        Err(Failed::Usage(e)) => exit::fail(exit::USAGE, &e),
        Err(Failed::Failure(e)) => exit::fail(exit::FAILURE, &e),
    }
}

/// Why a `dlq` action did not complete, by the exit code it maps to.
enum Failed {
    /// Refused as given, nothing done: no terminal to confirm on and no `--yes` (like a
    /// requeue of every row without `--all`, refused before the database is opened).
    Usage(String),
    /// The database failed, the row does not exist, or the operator did not confirm.
    Failure(String),
}

fn failure(e: impl std::fmt::Display) -> Failed {
    Failed::Failure(e.to_string())
}

/// `n` rows, in English ("1 row", "2 rows").
fn rows(n: u64) -> String {
    super::render::count(n, "row", "rows")
}

/// `n` DLQ rows, in English.
fn dlq_rows(n: u64) -> String {
    super::render::count(n, "DLQ row", "DLQ rows")
}

/// Checks the filter and the requeue flags; returns whether an unfiltered requeue must be
/// confirmed on the terminal.
fn check_action(action: &DlqAction) -> Result<bool, String> {
    if let DlqAction::List { filter, .. }
    | DlqAction::Requeue { filter, .. }
    | DlqAction::Purge { filter, .. } = action
    {
        check_filter_bounds(filter)?;
    }
    // Requeueing the whole DLQ sends every row to the provider again: it needs `--all`, or a
    // confirmation on a terminal.
    if let DlqAction::Requeue { filter, dry_run, all, .. } = action {
        let unfiltered = filter_is_empty(filter);
        if *all && !unfiltered {
            return Err("--all means every row; drop it or the filter".into());
        }
        if unfiltered && !*all && !*dry_run {
            if !std::io::stdin().is_terminal() {
                return Err("refusing to requeue every DLQ row without --all (stdin is not a terminal); \
                     give a filter (--class, --doc, ...) or --all"
                    .into());
            }
            return Ok(true);
        }
    }
    Ok(false)
}

fn check_filter_bounds(filter: &Filter) -> Result<(), String> {
    match filter.older_than_secs {
        Some(s) if s > MAX_OLDER_THAN_SECS => {
            Err(format!("--older-than-secs {s} is out of range: allowed 0..={MAX_OLDER_THAN_SECS}"))
        }
        _ => Ok(()),
    }
}

/// Whether `filter` selects every row. Destructured exhaustively: a new filter field must be
/// considered here, or an unfiltered requeue could slip past the confirmation.
fn filter_is_empty(filter: &Filter) -> bool {
    // `all_tables` widens rather than narrows: it does not make a filter.
    let Filter { class, doc, doc_prefix, older_than_secs, min_attempts, model, exhausted, all_tables: _ } =
        filter;
    class.is_none()
        && doc.is_none()
        && doc_prefix.is_none()
        && older_than_secs.is_none()
        && min_attempts.is_none()
        && model.is_none()
        && !exhausted
}

/// Asks `question` on the terminal; whether the operator typed `yes`.
fn confirmed(question: &str) -> bool {
    eprint!("{question} type 'yes': ");
    let mut answer = String::new();
    let _ = std::io::stdin().read_line(&mut answer);
    answer.trim() == "yes"
}

async fn stats(store: &Store, json: bool, out: &mut dyn Write) -> Result<(), Failed> {
    let s = embed_dlq::dlq::stats(store).await.map_err(failure)?;
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string(&s).unwrap());
        return Ok(());
    }
    let ts = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_else(|| "-".into())
    };
    let _ = writeln!(
        out,
        "{:<20}{:>8}  {:<21}{:<21}{:>12}",
        "error_class", "parked", "oldest", "newest", "avg_attempts"
    );
    for c in &s.by_class {
        let _ = writeln!(
            out,
            "{:<20}{:>8}  {:<21}{:<21}{:>12.1}",
            c.error_class,
            c.parked,
            ts(c.oldest),
            ts(c.newest),
            c.avg_attempts
        );
    }
    let _ = writeln!(
        out,
        "ready to replay {}  still backing off {}  exhausted {}  next due {}",
        s.ready_to_replay,
        s.still_backing_off,
        s.exhausted,
        ts(s.next_due)
    );
    Ok(())
}

async fn list(
    store: &Store,
    filter: &Filter,
    limit: i64,
    after_id: i64,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), Failed> {
    let limit = limit.clamp(1, 10_000);
    // One row more than the page: whether a next page exists, without a count.
    let mut rows = embed_dlq::dlq::list(store, filter, limit + 1, after_id).await.map_err(failure)?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string(&rows).unwrap());
        return Ok(());
    }
    for r in &rows {
        let _ = writeln!(
            out,
            "{:>8} {}#{} {} {} attempts={} replays={} first={} next={}{}",
            r.id,
            r.doc_id,
            r.chunk_index,
            r.error_class,
            r.error_reason,
            r.attempts,
            r.replays,
            r.first_failed_at.to_rfc3339(),
            r.next_retry_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "never".into()),
            if r.exhausted { " EXHAUSTED" } else { "" }
        );
    }
    if rows.is_empty() {
        let _ = writeln!(out, "no DLQ rows match");
    }
    if let Some(last) = rows.last().filter(|_| more) {
        let _ = writeln!(out, "next page: --after-id {}", last.id);
    }
    Ok(())
}

async fn show(store: &Store, id: i64, json: bool, out: &mut dyn Write) -> Result<(), Failed> {
    match embed_dlq::dlq::show(store, id).await.map_err(failure)? {
        Some(d) => {
            let _ = writeln!(
                out,
                "{}",
                if json { serde_json::to_string(&d) } else { serde_json::to_string_pretty(&d) }.unwrap()
            );
            Ok(())
        }
        None => Err(Failed::Failure(format!("no DLQ row with id {id}"))),
    }
}

async fn requeue(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    rate: u32,
    confirm_all: bool,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), Failed> {
    if confirm_all {
        let n = embed_dlq::dlq::requeue(store, filter, true, rate).await.map_err(failure)?.requeued;
        if n == 0 {
            let _ = if json { writeln!(out, "{{\"requeued\":0}}") } else { writeln!(out, "requeued 0 rows") };
            return Ok(());
        }
        if !confirmed(&format!(
            "requeue all {} for replay (they will be sent to the provider again)?",
            dlq_rows(n)
        )) {
            return Err(Failed::Failure("not confirmed; nothing requeued".into()));
        }
    }
    let o = embed_dlq::dlq::requeue(store, filter, dry_run, rate).await.map_err(failure)?;
    let (n, reingest) = (o.requeued, o.needs_reingest);
    let verb = if dry_run { "would requeue" } else { "requeued" };
    let _ = if json {
        writeln!(out, "{{\"{}\":{n},\"needs_reingest\":{reingest}}}", verb.replace(' ', "_"))
    } else {
        writeln!(out, "{verb} {}", rows(n))
    };
    if reingest > 0 && !json {
        let need = if reingest == 1 { "needs" } else { "need" };
        let _ = writeln!(out, "{} {need} a corrected payload: re-ingest them", rows(reingest));
    }
    Ok(())
}

async fn purge(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    yes: bool,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), Failed> {
    let n = embed_dlq::dlq::purge(store, filter, true).await.map_err(failure)?;
    if dry_run || n == 0 {
        let _ = if json {
            writeln!(out, "{{\"would_purge\":{n}}}")
        } else {
            writeln!(out, "would purge {}", rows(n))
        };
        return Ok(());
    }
    if !yes {
        if !std::io::stdin().is_terminal() {
            return Err(Failed::Usage(format!(
                "refusing to purge {} without --yes (stdin is not a terminal)",
                rows(n)
            )));
        }
        if !confirmed(&format!("purge {} for good?", dlq_rows(n))) {
            return Err(Failed::Failure("not confirmed; nothing purged".into()));
        }
    }
    let n = embed_dlq::dlq::purge(store, filter, false).await.map_err(failure)?;
    let _ = if json { writeln!(out, "{{\"purged\":{n}}}") } else { writeln!(out, "purged {}", rows(n)) };
    Ok(())
}
