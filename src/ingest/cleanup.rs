//! The cleanup of a corpus run (`--cleanup`, `[ingest] cleanup`): once the run has read its
//! whole input and written every outcome, it deletes the chunks of the target table that the
//! run did not contain, the way LangChain's indexing API cleans up:
//!
//! - `incremental`: for every document the run contained, its chunks the run did not contain
//!   (a document that shrank from 10 chunks to 8 loses chunks 8 and 9);
//! - `full`: every chunk of the table the run did not contain (documents deleted upstream too).
//!
//! What the run contained is every key of every record with an identity (stored, unchanged,
//! parked, superseded, left to a concurrent run: all kept), recorded in the database as the run
//! reads (`store::delete`), so memory stays flat whatever the corpus. A cleanup never runs
//! after a run that did not read its input to the end or failed (a truncated file must never
//! wipe the table): `full` is then refused ([`super::IngestError::CleanupRefused`], exit 2),
//! `incremental` skipped with the reason in the summary. `full` is also refused when it would
//! delete more than `cleanup_max_fraction` of the table's chunks, unless confirmed (`--yes`).
//! Deletions go a page of documents per transaction (`store::delete`): a run killed
//! during its cleanup leaves every document either as it was or cleaned, and a rerun of the
//! same corpus finishes the cleanup.

use serde::Serialize;

use super::{IngestError, IngestSummary, Pipeline, with_db_retry};
use crate::store::delete::CleanupScope;

/// What a run deletes once it has written its input ([module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CleanupMode {
    /// Nothing: a run only adds and updates.
    #[default]
    None,
    /// The chunks of the documents the run contained that the run did not contain.
    Incremental,
    /// Every chunk of the target table that the run did not contain.
    Full,
}

impl CleanupMode {
    /// The setting's spelling in files, flags and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            CleanupMode::None => "none",
            CleanupMode::Incremental => "incremental",
            CleanupMode::Full => "full",
        }
    }
}

/// The cleanup settings of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct CleanupOptions {
    /// What to delete ([`CleanupMode`]).
    pub mode: CleanupMode,
    /// A `full` cleanup that would delete more than this share of the table's chunks is
    /// refused unless `confirmed`. 0..=1; default 0.2.
    pub max_fraction: f64,
    /// A cleanup after a run that rejected more input lines than this is refused (`full`) or
    /// skipped (`incremental`): a rejected line's chunk would be deleted. Default 0.
    pub max_rejected_lines: u64,
    /// `--yes`: a `full` cleanup may delete more than `max_fraction`.
    pub confirmed: bool,
    /// `--dry-run`: read the input and list what the cleanup and the input's deletes would
    /// delete; embed nothing, write nothing.
    pub dry_run: bool,
}

impl Default for CleanupOptions {
    fn default() -> Self {
        CleanupOptions {
            mode: CleanupMode::None,
            max_fraction: 0.2,
            max_rejected_lines: 0,
            confirmed: false,
            dry_run: false,
        }
    }
}

/// What a run's cleanup did.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CleanupReport {
    /// The mode the run was asked for.
    pub mode: CleanupMode,
    /// Nothing was deleted: `deleted` is what would have been.
    pub dry_run: bool,
    /// Chunks deleted (vector, manifest row, any DLQ row), each with a `deleted` event.
    pub deleted: u64,
    /// Documents that lost at least one chunk.
    pub documents: u64,
    /// Why the cleanup did not run (or stopped part way: a rerun of the corpus finishes it).
    pub skipped: Option<String>,
    /// A remark for the operator (a dry run that a real run would refuse).
    pub note: Option<String>,
}

/// Chunks a dry run lists one by one in the summary; the counts hold the rest.
pub const DRY_RUN_LISTED: usize = 1000;
/// Chunks a real run names in the summary's examples of deleted chunks.
pub const DELETED_EXAMPLES: usize = 20;

/// How a run ended, as far as its cleanup cares.
pub(super) struct Ending {
    /// The run failed (a task, the database, the provider): no cleanup, and no refusal
    /// either (the run's own error is reported).
    pub failed: bool,
    /// Reading the input failed before its end.
    pub input_error: Option<String>,
    /// The run was asked to stop.
    pub cancelled: bool,
    /// Keys the run recorded in `ingest_seen`.
    pub seen_written: u64,
}

impl Pipeline {
    /// Runs the cleanup of run `run_id` once its writes are done, recording what it did in
    /// `summary`. It deletes only what was written before the run's first position (a run
    /// started after it, or a later stream entry, is newer). `Err` for a refused `full` cleanup (or a database failure).
    pub(super) async fn cleanup(
        &self,
        run_id: i64,
        first_position: i64,
        summary: &mut IngestSummary,
        ending: Ending,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> Result<(), IngestError> {
        let opts = &self.options.cleanup;
        if opts.mode == CleanupMode::None {
            return Ok(());
        }
        let store = &self.store;
        let mut report = CleanupReport { mode: opts.mode, dry_run: opts.dry_run, ..Default::default() };
        let refusal = if ending.failed {
            Some("the run failed".to_string())
        } else if let Some(e) = &ending.input_error {
            Some(format!("reading the input failed ({e}), so it was not read to its end"))
        } else if ending.cancelled || summary.stopped.is_some() {
            Some("the run stopped before the end of its input".to_string())
        } else if summary.rejected_lines > opts.max_rejected_lines {
            Some(format!(
                "{} input lines were rejected (cleanup_max_rejected_lines is {}): the chunks they \
                 held would be deleted",
                summary.rejected_lines, opts.max_rejected_lines
            ))
        } else {
            let recorded = with_db_retry(|| store.seen_count(run_id)).await?;
            (recorded != ending.seen_written).then(|| {
                format!(
                    "the run's record of its keys is incomplete ({recorded} of {} in ingest_seen: \
                     did Postgres restart?)",
                    ending.seen_written
                )
            })
        };
        let scope = match opts.mode {
            CleanupMode::Full => CleanupScope::Table,
            _ => CleanupScope::Documents,
        };
        let refusal = match refusal {
            Some(r) => Some(r),
            None if opts.mode == CleanupMode::Full => {
                let (total, doomed) =
                    with_db_retry(|| store.cleanup_count(run_id, first_position, scope)).await?;
                let over = total > 0 && doomed as f64 > opts.max_fraction * total as f64;
                let why = format!(
                    "it would delete {doomed} of the table's {total} chunks, more than \
                     cleanup_max_fraction ({}); check the input, then rerun with --yes",
                    opts.max_fraction
                );
                if over && opts.dry_run {
                    report.note = Some(format!("a real run would refuse: {why}"));
                }
                (over && !opts.confirmed && !opts.dry_run).then_some(why)
            }
            None => None,
        };
        if let Some(reason) = refusal {
            let _ = store.forget_seen(run_id).await;
            tracing::warn!(mode = opts.mode.as_str(), reason = %reason, "cleanup not done");
            report.skipped = Some(reason.clone());
            summary.cleanup = Some(report);
            if opts.mode == CleanupMode::Full && !ending.failed {
                return Err(IngestError::CleanupRefused {
                    reason: format!("full cleanup refused: {reason}; nothing was deleted"),
                    summary: Box::new(summary.clone()),
                });
            }
            return Ok(());
        }
        let listed = if opts.dry_run { DRY_RUN_LISTED } else { DELETED_EXAMPLES };
        let mut after = String::new();
        loop {
            if cancel.is_cancelled() {
                report.skipped =
                    Some("stopped during the cleanup; rerun the same corpus to finish it".into());
                break;
            }
            let docs = with_db_retry(|| store.cleanup_page(run_id, scope, &after)).await?;
            let Some(last) = docs.last() else { break };
            after = last.clone();
            let gone =
                with_db_retry(|| store.cleanup_docs(run_id, first_position, &docs, !opts.dry_run)).await?;
            let mut docs_hit = 0u64;
            for (n, c) in gone.iter().enumerate() {
                if n == 0 || gone[n - 1].doc_id != c.doc_id {
                    docs_hit += 1;
                }
                if summary.deleted_examples.len() < listed {
                    summary.deleted_examples.push(format!("{}#{}", c.doc_id, c.chunk_index));
                }
            }
            report.deleted += gone.len() as u64;
            report.documents += docs_hit;
            if !opts.dry_run {
                metrics::counter!(crate::metrics::CHUNKS_DELETED, "by" => "cleanup")
                    .increment(gone.len() as u64);
            }
        }
        let _ = store.forget_seen(run_id).await;
        tracing::info!(
            mode = opts.mode.as_str(),
            deleted = report.deleted,
            documents = report.documents,
            dry_run = opts.dry_run,
            "cleanup done"
        );
        summary.cleanup = Some(report);
        Ok(())
    }
}
