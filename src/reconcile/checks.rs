//! The checks a run makes and one check's result: [`Check`] (their order, names and what
//! repair does) and [`Finding`], with the helpers that build and merge findings.

use serde::Serialize;

use super::sql::CheckRun;

/// The checks, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Manifest rows with neither a vector nor a DLQ row (the seed's query), per target table.
    Leaks,
    /// More than one vector for a (doc_id, chunk_index) in a target table.
    Duplicates,
    /// Manifest says stored, but the vector is missing or has another content hash.
    StoredDrift,
    /// A DLQ row for a chunk whose vector with the same content is stored.
    StaleDlq,
    /// Vectors of the wrong dimension, with NaN, or of zero norm.
    BadVectors,
    /// Vectors of a chunk's previous text while the manifest holds newer content that is
    /// parked or exhausted: search returns text the source no longer holds. A finding under
    /// `[ingest] on_newer_parked = withdraw`; under `keep` they are expected and only counted
    /// in the note. The note also counts (full and deep sweeps) vectors with no manifest row.
    SupersededVectors,
    /// Outbox rows unpublished for longer than the threshold.
    OutboxBacklog,
    /// Events marked published whose entry is not on the events stream, and was not trimmed
    /// by its length cap (e.g. Redis lost its data, or entries were deleted by hand).
    MissingEvents,
    /// DLQ rows handed out as replay work that are in neither the outbox, the replay stream
    /// nor its pending list (e.g. Redis lost its data).
    LostReplayWork,
    /// Replay stream entries still to be processed whose DLQ row is gone or has moved on.
    OrphanStreamEntries,
    /// Rows due for replay for longer than the threshold: the replayers are not draining.
    ReplayStalled,
    /// Capture triggers a table source needs that its table lacks or has disabled: the
    /// table's changes are not reaching the vectors (docs/table-source.md).
    TableSourceTriggers,
}

impl Check {
    /// Every check, in the order a report lists them.
    pub const ALL: [Check; 12] = [
        Check::Leaks,
        Check::Duplicates,
        Check::StoredDrift,
        Check::StaleDlq,
        Check::BadVectors,
        Check::SupersededVectors,
        Check::OutboxBacklog,
        Check::MissingEvents,
        Check::LostReplayWork,
        Check::OrphanStreamEntries,
        Check::ReplayStalled,
        Check::TableSourceTriggers,
    ];

    /// Label value and report name.
    pub fn name(self) -> &'static str {
        match self {
            Check::Leaks => "leaks",
            Check::Duplicates => "duplicates",
            Check::StoredDrift => "stored_drift",
            Check::StaleDlq => "stale_dlq",
            Check::BadVectors => "bad_vectors",
            Check::SupersededVectors => "superseded_vectors",
            Check::OutboxBacklog => "outbox_backlog",
            Check::MissingEvents => "missing_events",
            Check::LostReplayWork => "lost_replay_work",
            Check::OrphanStreamEntries => "orphan_stream_entries",
            Check::ReplayStalled => "replay_stalled",
            Check::TableSourceTriggers => "table_source_triggers",
        }
    }

    /// What repair does, for the report.
    pub fn repair_action(self) -> Option<&'static str> {
        match self {
            Check::Leaks | Check::StoredDrift => Some("mark the chunk for re-ingest"),
            Check::Duplicates => Some("keep the newest vector row"),
            Check::StaleDlq => Some("delete the stale DLQ row, mark stored"),
            Check::BadVectors => Some("delete the vector, mark for re-ingest"),
            Check::SupersededVectors => Some("withdraw the vector (`withdrawn` event)"),
            Check::MissingEvents => Some("re-publish from the outbox"),
            Check::LostReplayWork => Some("release the leases: the scheduler issues the work again"),
            Check::OrphanStreamEntries => Some("acknowledge and delete the entries"),
            Check::TableSourceTriggers => {
                Some("reinstall the triggers and resync the table with a full cleanup at the next follow")
            }
            Check::OutboxBacklog | Check::ReplayStalled => None,
        }
    }
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Which check this is.
    pub check: Check,
    /// Rows or entries in the wrong state when the check ran (0 means the check passed).
    pub found: u64,
    /// A few examples (chunk keys or entry ids).
    pub examples: Vec<String>,
    /// Rows or entries changed by repair (0 in check or dry-run mode).
    pub repaired: u64,
    /// Extra context (e.g. backlog size and age).
    pub note: Option<String>,
}

impl Finding {
    /// Adds examples until the finding holds `limit`.
    pub(super) fn add_examples(&mut self, examples: impl IntoIterator<Item = String>, limit: usize) {
        let room = limit.saturating_sub(self.examples.len());
        self.examples.extend(examples.into_iter().take(room));
    }
}

/// A check's result as the report shows it.
pub(super) fn finding(check: Check, run: CheckRun) -> Finding {
    Finding { check, found: run.found, examples: run.examples, repaired: run.repaired, note: None }
}
