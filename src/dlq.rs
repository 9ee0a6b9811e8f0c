//! Operator actions on the DLQ without writing SQL: stats, list, show, requeue, purge.
//! Every action that changes rows supports a dry run, selects rows with the same [`Filter`],
//! and writes its events to the outbox in the same statement as the change. The statements
//! are in `crate::store::dlq`; this module pages, paces and decides.

use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::model::ErrorClass;
use crate::store::dlq::{self as sql, RowFilter};
use crate::store::{Store, StoreError};

pub use crate::store::dlq::{ClassStats, Detail, Listed, Stats};

/// Which DLQ rows an action applies to. Empty filter = every row.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Filter {
    /// Only this error class (transient, permanent_input, invalid_record, dimension_mismatch, invalid_vector).
    // An unknown class is refused when the flag is parsed: a typo would otherwise match
    // nothing, silently.
    #[arg(long)]
    pub class: Option<ErrorClass>,
    /// Only this document.
    #[arg(long)]
    pub doc: Option<String>,
    /// Only documents whose id starts with this (e.g. one source's prefix).
    #[arg(long)]
    pub doc_prefix: Option<String>,
    /// Only rows first parked at least this many seconds ago.
    #[arg(long)]
    pub older_than_secs: Option<u64>,
    /// Only rows with at least this many provider attempts.
    #[arg(long)]
    pub min_attempts: Option<i32>,
    /// Only rows parked under this model (e.g. one the provider has retired since: replay
    /// leaves its rows waiting until they are re-ingested or purged).
    #[arg(long)]
    pub model: Option<String>,
    /// Only rows that automatic replay gave up on.
    #[arg(long)]
    pub exhausted: bool,
    /// Rows of every target table. Without it an action applies to the rows of its store's
    /// table only (`--table`, else the configured one): two tables share one DLQ, and a purge
    /// meant for one must not delete the other's rows.
    #[arg(long)]
    pub all_tables: bool,
}

impl Filter {
    /// The filter as the store's statements take it, for the rows of `store`'s table (or of
    /// every table with `all_tables`).
    fn rows(&self, store: &Store) -> RowFilter {
        let Filter { class, doc, doc_prefix, older_than_secs, min_attempts, model, exhausted, all_tables } =
            self;
        RowFilter {
            table: (!all_tables).then(|| store.table_name().to_string()),
            class: *class,
            doc: doc.clone(),
            doc_prefix: doc_prefix.clone(),
            older_than_secs: *older_than_secs,
            min_attempts: *min_attempts,
            model: model.clone(),
            exhausted: *exhausted,
            ..RowFilter::default()
        }
    }
}

/// The seed's two diagnostic queries in one report, over the rows of `store`'s table.
pub async fn stats(store: &Store) -> Result<Stats, StoreError> {
    sql::stats(store.pool(), Some(store.table_name())).await
}

/// Rows matching `filter`, oldest id first, `limit` at a time after `after_id` (paging).
pub async fn list(
    store: &Store,
    filter: &Filter,
    limit: i64,
    after_id: i64,
) -> Result<Vec<Listed>, StoreError> {
    sql::list(store.pool(), &filter.rows(store), limit, after_id).await
}

/// One row with its payload and error history.
pub async fn show(store: &Store, id: i64) -> Result<Option<Detail>, StoreError> {
    sql::show(store.pool(), id).await
}

/// Rows per `purge` transaction: bounds its locks, its WAL burst and its event batch.
pub const PURGE_BATCH: usize = 1000;

/// Largest batch `purge_in_batches` accepts; larger values are clamped.
pub const MAX_PURGE_BATCH: usize = 10_000;

/// What `requeue` did (or would do, in a dry run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RequeueOutcome {
    /// Rows made due now (the scheduler issues their work within the outstanding cap).
    pub requeued: u64,
    /// Matching rows left alone because replay cannot fix them: `invalid_record` rows and
    /// rows whose payload has no text. Re-ingest their corrected source lines.
    pub needs_reingest: u64,
}

/// Makes matching rows due now (a running `serve`'s scheduler issues their replay work within
/// its outstanding cap), at most `rate_per_sec` rows a second. Permanent classes are requeued
/// too (after their cause was fixed): they become `transient` with reason
/// `requeued:<class>/<reason>`, and a new generation, so outstanding work items for them are
/// void. Rows that replay can never fix
/// (`invalid_record`, no payload text) are never sent to the provider: they are counted in
/// [`RequeueOutcome::needs_reingest`] and left as they are. Rows are read in pages (keyset by
/// id), so memory does not grow with the DLQ.
pub async fn requeue(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    rate_per_sec: u32,
) -> Result<RequeueOutcome, StoreError> {
    let rows_filter = filter.rows(store);
    if dry_run {
        return requeue_dry_run(store, &rows_filter).await;
    }
    requeue_rows(store, &rows_filter, rate_per_sec, &CancellationToken::new(), |_| {}).await
}

/// What [`requeue`] would do for `filter`, changing nothing.
pub(crate) async fn requeue_dry_run(store: &Store, filter: &RowFilter) -> Result<RequeueOutcome, StoreError> {
    let (requeued, needs_reingest) = sql::count_requeue(store.pool(), filter).await?;
    Ok(RequeueOutcome { requeued, needs_reingest })
}

/// [`requeue`]'s work for a store filter: pages through the matching rows by id, at most
/// `rate_per_sec` rows a second, handing the running totals to `progress` after each page.
/// Stops between pages once `cancel` is cancelled (every page is complete on its own: its
/// rows are due and published, or due and picked up by the scheduler).
pub(crate) async fn requeue_rows(
    store: &Store,
    rows_filter: &RowFilter,
    rate_per_sec: u32,
    cancel: &CancellationToken,
    mut progress: impl FnMut(&RequeueOutcome),
) -> Result<RequeueOutcome, StoreError> {
    let batch = (rate_per_sec.max(1) as usize).min(1000);
    let mut outcome = RequeueOutcome::default();
    let mut after = 0i64;
    while !cancel.is_cancelled() {
        let started = std::time::Instant::now();
        let rows = sql::requeue_candidates(store.pool(), rows_filter, after, batch).await?;
        let Some(last) = rows.last() else { break };
        after = last.id;
        let mut chunk = Vec::with_capacity(rows.len());
        for r in &rows {
            if r.needs_reingest {
                outcome.needs_reingest += 1;
            } else {
                chunk.push(r.id);
            }
        }
        if !chunk.is_empty() {
            outcome.requeued += sql::mark_requeued(store.pool(), &chunk).await?;
        }
        progress(&outcome);
        if rows.len() < batch {
            break;
        }
        let pace = Duration::from_secs_f64(rows.len() as f64 / rate_per_sec.max(1) as f64);
        if let Some(rest) = pace.checked_sub(started.elapsed()) {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(rest) => {}
            }
        }
    }
    Ok(outcome)
}

/// The rows `filter` selects (what `list` would page through, or `purge` delete).
pub async fn count(store: &Store, filter: &Filter) -> Result<u64, StoreError> {
    sql::count(store.pool(), &filter.rows(store)).await
}

/// Deletes matching rows for good (and their manifest rows, so a later ingest of the same
/// chunk starts fresh), announcing each as `purged`, in transactions of [`PURGE_BATCH`] rows.
/// Returns the rows purged (or that would be, with `dry_run`).
pub async fn purge(store: &Store, filter: &Filter, dry_run: bool) -> Result<u64, StoreError> {
    purge_in_batches(store, filter, dry_run, PURGE_BATCH).await
}

/// [`purge`] with a given batch size (clamped to `1..=`[`MAX_PURGE_BATCH`]): each batch is one
/// statement, so one transaction with its own `purged` events, and a large purge never holds
/// locks on the whole DLQ nor builds one huge transaction. Batches walk the ids upwards, so a
/// purge ends even while new rows keep matching.
pub async fn purge_in_batches(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    batch: usize,
) -> Result<u64, StoreError> {
    let rows_filter = filter.rows(store);
    if dry_run {
        return sql::count(store.pool(), &rows_filter).await;
    }
    purge_rows(store, &rows_filter, batch, &CancellationToken::new(), |_| {}).await
}

/// [`purge_in_batches`]'s work for a store filter, handing the running total to `progress`
/// after each batch and stopping between batches once `cancel` is cancelled.
pub(crate) async fn purge_rows(
    store: &Store,
    rows_filter: &RowFilter,
    batch: usize,
    cancel: &CancellationToken,
    mut progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let batch = batch.clamp(1, MAX_PURGE_BATCH);
    let mut total = 0u64;
    let mut after = 0i64;
    while !cancel.is_cancelled() {
        let done = sql::purge_batch(store.pool(), rows_filter, after, batch).await?;
        total += done.purged;
        progress(total);
        match done.last_id {
            Some(last) if done.selected as usize >= batch => after = last,
            _ => break,
        }
    }
    Ok(total)
}
