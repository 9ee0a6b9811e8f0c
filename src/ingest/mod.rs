//! The ingest pipeline: corpus → batches → embed → store or park.
//!
//! ```text
//! reader task ──records──> batcher ──jobs──> N workers ──outcomes──> M writers
//!   (JSONL, charged to       │ manifest lookup + leases: skip unchanged / already    │
//!    the byte budget)        │ parked / leased to a concurrent run                   │
//!                            │ pre-flight: empty, too long, broken record → park     │
//!                                                    Store::store_batch / park_batch ┘
//! ```
//!
//! Every channel is bounded by count, and every record in flight is charged to a byte
//! budget (`budget`) from the reader until its outcome is written, so memory stays flat
//! whatever the corpus size or the size of its lines. Workers and writers take from
//! multi-consumer channels: no task waits for input while holding a lock another one needs,
//! so a writer writes what it gathered once no outcome has come for `batch_linger` (and at
//! most a second after the oldest one, however slowly outcomes trickle in). A chunk's manifest
//! row is written only together with its outcome (vector or DLQ row), so a crash at any
//! point leaves either a finished chunk or no trace of it, and rerunning the same corpus
//! completes the work without duplicates or repeated provider calls.
//!
//! Every task is supervised ([`crate::supervise`]): a panic in the reader, the batcher, a
//! worker or a writer halts the run at once and ends it with [`IngestError::Task`], whose
//! summary accounts for every record (what was neither written nor skipped is "not
//! attempted").
//!
//! Shutdown: cancelling the token stops intake; batches already handed to workers finish,
//! or park if they were mid-retry. A systemic provider error stops the run without parking
//! anything for it.
//!
//! Outage: when the provider's circuit breaker opens, the workers follow
//! [`IngestOptions::on_outage`]: wait for the breaker's probes (and stop after
//! `max_outage`), park the rest as transient without a provider call (the embedder answers
//! every piece at once with a `breaker_open` failure, so parking runs at the writers' pace),
//! or stop the run at once like a systemic error.
//!
//! The files follow the flow: `feed` (the reader side, JSONL via `reader` or a stream via
//! `source`), `batcher` (intake windows, the manifest claim, provider-sized jobs; `seen` is
//! its memory of keys), `worker` (embedding), `writer` (store and park statements), then
//! `cleanup` (deletions once the input is written). This file holds the run itself: its
//! options, its summary and how the tasks are wired and supervised.

mod batcher;
pub mod bounds;
pub(crate) mod budget;
pub mod cleanup;
mod fanout;
mod feed;
pub(crate) mod lease;
pub(crate) mod reader;
mod seen;
pub mod source;
mod split;
pub mod table;
mod worker;
mod writer;

use std::collections::{BTreeMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::FutureExt;
use serde::Serialize;
use tokio::io::AsyncBufRead;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::embed::gate::OnOutage;
use crate::embed::retry::DlqSchedule;
use crate::embed::{BatchStats, Embedder, ItemOutcome, Reason, Stop};
use crate::model::{Chunk, ChunkStatus, ErrorClass, HexHash};
use crate::store::delete::DeleteRequest;
use crate::store::park::{OnNewerParked, ParkCounts, ParkedChunk};
use crate::store::position::RunPositions;
use crate::store::{Store, StoreCounts, StoreError, StoredChunk};
use crate::supervise::{Supervisor, TaskFailure};
use crate::telemetry::Escaped;
pub(crate) use batcher::WINDOWS_IN_FLIGHT;
use batcher::*;
pub use batcher::{BAD_LINES_LOG_EVERY, LOGGED_BAD_LINES};
use budget::{ByteBudget, Charge};
pub use cleanup::{CleanupMode, CleanupOptions, CleanupReport};
pub use fanout::{CopyOf, Fanout, RevisionRun, TextHashFill, record_text_hashes};
use feed::*;
use lease::{ALWAYS_LEASED_WINDOWS, LeaseClaims, WindowClaim, WindowKey};
use reader::{LineReader, RawMetadata, Record, parse_line};
use worker::*;
use writer::*;

/// Tuning of one ingest run.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Most inputs in one provider request.
    pub batch_max_inputs: usize,
    /// Most characters (not bytes) of input in one request, counted the same way by ingest
    /// and replay: a proxy for a per-request token limit (~4 characters a token).
    pub batch_max_chars: usize,
    /// Concurrent provider requests.
    pub concurrency: usize,
    /// Records filtered against the manifest in one lookup.
    pub intake_window: usize,
    /// Rows per store/park statement (gathered across provider batches).
    pub write_batch_rows: usize,
    /// Concurrent writers (database connections writing outcomes).
    pub writers: usize,
    /// Longer inputs are parked as `permanent_input/too_long` without a provider call.
    pub max_input_chars: usize,
    /// Longer lines are rejected without being held in memory.
    pub max_line_bytes: usize,
    /// Bytes of input held in flight (read, not yet written): each record is charged its line
    /// plus its parsed form until its outcome is written. Default 64 MiB; clamped to
    /// 1 MiB..=4 GiB-1 (`ByteBudget`). A record larger than the budget runs alone.
    pub max_inflight_bytes: u64,
    /// How long a partly filled batch waits for more records (slow stdin producers).
    pub batch_linger: Duration,
    /// Replay schedule written into the rows this run parks (their first `next_retry_at`).
    pub dlq_schedule: DlqSchedule,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Expected total bytes of input (a file's size), for the progress bar.
    pub total_bytes: Option<u64>,
    /// What the workers do while the provider's circuit breaker is open: wait for the probes,
    /// park the rest as transient for `serve` to replay, or stop the run (see [`OnOutage`]).
    pub on_outage: OnOutage,
    /// Price of a million tokens, for the summary's cost figures (none: no cost shown).
    pub price_per_million_tokens: Option<f64>,
    /// How long a chunk claimed for embedding stays leased to this run (`[ingest]
    /// lease_secs`): long enough for a window's provider calls and retries, short enough that
    /// a hung run's chunks are not held up for long (a killed run's are taken over at once).
    pub lease: Duration,
    /// What a park of a chunk's new text does to the vector of its previous text: withdraw
    /// it in the park's transaction (the default) or keep it until the new text is stored
    /// (`[ingest] on_newer_parked`, see [`OnNewerParked`]). [`IngestSettings::pipeline`]
    /// gives it to the pipeline's store, which applies it: a [`Pipeline`] built by hand
    /// follows its store's policy.
    ///
    /// [`IngestSettings::pipeline`]: crate::config::IngestSettings::pipeline
    pub on_newer_parked: OnNewerParked,
    /// What the run deletes once it has written its input (`--cleanup`, see [`cleanup`]), and
    /// the guards of a full cleanup.
    pub cleanup: CleanupOptions,
    /// Set for a backfill (`revision backfill`): the revision whose records the run copies.
    /// A line is written only where that revision holds the very same text, and at that
    /// record's position, so an older corpus never brings back text the live writes changed
    /// or deleted, and never outranks a live write still in flight ([`CopyOf`]).
    pub copy_of: Option<Arc<CopyOf>>,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            batch_max_inputs: 64,
            batch_max_chars: 200_000,
            concurrency: 4,
            intake_window: 512,
            write_batch_rows: 512,
            writers: 2,
            max_input_chars: 32_000,
            max_line_bytes: 8 * 1024 * 1024,
            max_inflight_bytes: ByteBudget::DEFAULT,
            batch_linger: Duration::from_millis(20),
            dlq_schedule: DlqSchedule::default(),
            progress: false,
            total_bytes: None,
            on_outage: OnOutage::Wait,
            price_per_million_tokens: None,
            lease: Duration::from_secs(120),
            on_newer_parked: OnNewerParked::Withdraw,
            cleanup: CleanupOptions::default(),
            copy_of: None,
        }
    }
}

impl IngestOptions {
    /// These options held to [`bounds`]: what a run actually uses. Settings read by
    /// `config` are checked (and refused) against the same bounds before this; options built
    /// in Rust are clamped here instead, so a zero can't stall a run and a huge value can't
    /// spawn millions of tasks. A price that is not a finite number in range is dropped.
    pub fn within_bounds(&self) -> IngestOptions {
        fn clamp<T: PartialOrd + Copy>(v: T, r: std::ops::RangeInclusive<T>) -> T {
            if v < *r.start() {
                *r.start()
            } else if v > *r.end() {
                *r.end()
            } else {
                v
            }
        }
        let linger_ms = u64::try_from(self.batch_linger.as_millis()).unwrap_or(u64::MAX);
        IngestOptions {
            batch_max_inputs: clamp(self.batch_max_inputs, bounds::BATCH_MAX_INPUTS),
            batch_max_chars: clamp(self.batch_max_chars, bounds::BATCH_MAX_CHARS),
            concurrency: clamp(self.concurrency, bounds::CONCURRENCY),
            intake_window: clamp(self.intake_window, bounds::INTAKE_WINDOW),
            write_batch_rows: clamp(self.write_batch_rows, bounds::WRITE_BATCH_ROWS),
            writers: clamp(self.writers, bounds::WRITERS),
            max_input_chars: clamp(self.max_input_chars, bounds::MAX_INPUT_CHARS),
            max_line_bytes: clamp(self.max_line_bytes, bounds::MAX_LINE_BYTES),
            max_inflight_bytes: clamp(self.max_inflight_bytes, bounds::MAX_INFLIGHT_BYTES),
            batch_linger: Duration::from_millis(clamp(linger_ms, bounds::BATCH_LINGER_MS)),
            lease: Duration::from_secs(clamp(self.lease.as_secs(), bounds::LEASE_SECS)),
            price_per_million_tokens: self
                .price_per_million_tokens
                .filter(|p| bounds::PRICE_PER_MILLION_TOKENS.contains(p)),
            cleanup: CleanupOptions {
                // Not a number: no share at all (a full cleanup needs --yes).
                max_fraction: if self.cleanup.max_fraction.is_nan() {
                    0.0
                } else {
                    clamp(self.cleanup.max_fraction, bounds::CLEANUP_MAX_FRACTION)
                },
                max_rejected_lines: clamp(
                    self.cleanup.max_rejected_lines,
                    bounds::CLEANUP_MAX_REJECTED_LINES,
                ),
                ..self.cleanup.clone()
            },
            ..self.clone()
        }
    }
}

/// A line that could not become a record, as reported to the user.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RejectedLine {
    /// 1-based line number in the input.
    pub line: u64,
    /// Why the line has no usable identity (bad JSON, missing or oversized `doc_id`, ...).
    pub problem: String,
}

/// What a run did. Every record read is accounted for exactly once in `stored`, `unchanged`,
/// `already_parked`, `parked`, `superseded`, `rejected_lines`, `not_attempted`,
/// `leased_elsewhere` or `differs_from_active`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IngestSummary {
    /// Lines read from the input ([`Pipeline::run`], blank and rejected ones included), or
    /// chunks taken ([`Pipeline::run_chunks`]).
    pub lines_read: u64,
    /// Records with a usable identity: the total that the outcome counters below account for.
    pub records: u64,
    /// Chunks stored in this run (including ones whose identical vector was already there).
    pub stored: u64,
    /// Vector rows actually inserted or changed.
    pub vectors_written: u64,
    /// Skipped: the same content is already stored.
    pub unchanged: u64,
    /// Skipped: the same content is already parked (replay owns it now).
    pub already_parked: u64,
    /// Parked in this run, by error class.
    pub parked: BTreeMap<ErrorClass, u64>,
    /// Old DLQ rows superseded by a newly stored vector.
    pub dlq_resolved: u64,
    /// Vectors of a chunk's previous text deleted because its new text was parked
    /// ([`OnNewerParked::Withdraw`]): not an outcome of a record, a side effect of a park.
    pub vectors_withdrawn: u64,
    /// Outcomes not written because a newer record of the same chunk (a later line of this
    /// corpus, or a later run) was written first: the last line wins.
    pub superseded: u64,
    /// Lines without a usable identity: reported, not stored anywhere.
    pub rejected_lines: u64,
    /// The first rejected lines, for the report (the log has the first [`LOGGED_BAD_LINES`]
    /// one by one, then counts).
    pub rejected_examples: Vec<RejectedLine>,
    /// Claimed by the run but left untouched by a shutdown or stop: a rerun does them.
    pub not_attempted: u64,
    /// In-process retries, by reason.
    pub retries: BTreeMap<String, u64>,
    /// Provider requests sent, retries and canaries included.
    pub provider_calls: u64,
    /// Inputs sent over all requests (what the provider bills).
    pub provider_inputs: u64,
    /// Tokens as the provider reported them (some count characters).
    pub reported_tokens: u64,
    /// Rejected batches split in two to find the input at fault.
    pub batch_splits: u64,
    /// Times the circuit breaker opened during the run.
    pub breaker_opened: u64,
    /// Wall-clock duration of the run.
    pub elapsed_secs: f64,
    /// Set when the run ended early: shutdown requested or provider refused the run.
    pub stopped: Option<String>,
    /// Tokens of the inputs whose vector came back usable (estimated from characters, or the
    /// provider's usage when plausible).
    pub tokens_stored: u64,
    /// Tokens sent for nothing: failed requests, unusable vectors, canaries, and so every
    /// input sent again.
    pub tokens_wasted: u64,
    /// Estimated cost of every token sent, at `price_per_million_tokens` (none without it).
    pub estimated_cost: Option<f64>,
    /// The part of `estimated_cost` spent on wasted tokens.
    pub wasted_cost: Option<f64>,
    /// Left to another run that holds the chunk's lease (a concurrent ingest of the same
    /// content): that run stores or parks it; if it dies first, a rerun finishes it.
    pub leased_elsewhere: u64,
    /// A backfill's lines left out because the revision it copies holds other text for
    /// their chunk, or no row at all (changed or deleted since the corpus was written): the
    /// live writes bring the current text to the shadow, or its coverage shows it missing.
    pub differs_from_active: u64,
    /// The first [`MAX_UNFINISHED_EXAMPLES`] chunks counted in `differs_from_active`.
    pub differs_examples: Vec<String>,
    /// The first [`MAX_UNFINISHED_EXAMPLES`] chunks (`doc_id#chunk_index`) counted in
    /// `not_attempted` or `leased_elsewhere`, so the report can say which ones a rerun must
    /// finish (they have no manifest row, nothing else will find them).
    pub unfinished_examples: Vec<String>,
    /// Delete records read (`{"op": "delete"}`): not counted in `records`.
    pub delete_requests: u64,
    /// Chunks the input's delete records deleted (vector, manifest row, any DLQ row; a
    /// `deleted` event each). In a dry run: would delete.
    pub chunks_deleted: u64,
    /// The first deleted chunks (`doc_id#chunk_index`), by the input's deletes and the
    /// cleanup: [`cleanup::DELETED_EXAMPLES`], or in a dry run [`cleanup::DRY_RUN_LISTED`].
    pub deleted_examples: Vec<String>,
    /// What the run's cleanup did (none without `--cleanup`).
    pub cleanup: Option<CleanupReport>,
    /// A dry run: nothing was embedded or written; the records count as not attempted.
    pub dry_run: bool,
    /// What a stream source did with its entries ([`Pipeline::run_source`]); none for a
    /// corpus.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<source::SourceCounts>,
}

/// Chunks named in [`IngestSummary::unfinished_examples`]; the counts hold the rest.
pub const MAX_UNFINISHED_EXAMPLES: usize = 10;

impl IngestSummary {
    /// Sets the cost figures from the tokens at `per_million` (left empty without a price).
    pub fn price(&mut self, per_million: Option<f64>) {
        let cost = |tokens: u64| per_million.map(|p| tokens as f64 * p / 1e6);
        self.estimated_cost = cost(self.tokens_stored + self.tokens_wasted);
        self.wasted_cost = cost(self.tokens_wasted);
    }

    /// Total parked in this run.
    pub fn parked_total(&self) -> u64 {
        self.parked.values().sum()
    }

    /// Chunks this run neither stored, skipped nor parked: not attempted, or left to another
    /// run's lease. Only a rerun finishes them (they have no manifest row).
    pub fn unfinished(&self) -> u64 {
        self.not_attempted + self.leased_elsewhere
    }

    /// Names unfinished chunks for the report, up to [`MAX_UNFINISHED_EXAMPLES`].
    fn note_unfinished<'a>(&mut self, keys: impl IntoIterator<Item = (&'a str, i32)>) {
        for (doc_id, chunk_index) in keys {
            if self.unfinished_examples.len() >= MAX_UNFINISHED_EXAMPLES {
                return;
            }
            self.unfinished_examples.push(format!("{doc_id}#{chunk_index}"));
        }
    }

    /// Where every record went, in one line (for errors that end a run early).
    pub fn accounting(&self) -> String {
        let leased = if self.leased_elsewhere > 0 {
            format!(", and {} left to a concurrent run that holds them", self.leased_elsewhere)
        } else {
            String::new()
        };
        format!(
            "of {} records, {} stored, {} unchanged, {} already in the DLQ, {} parked, {} superseded by a \
             later line, {} not attempted (rerun the same corpus to finish them){leased}",
            self.records,
            self.stored,
            self.unchanged,
            self.already_parked,
            self.parked_total(),
            self.superseded,
            self.not_attempted
        )
    }
}

/// Why a run failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// Bad key, no quota, unknown model, long outage: nothing was parked for it.
    #[error("{stop}")]
    Provider {
        /// Why the provider cannot be used.
        stop: Stop,
        /// Where every record went before the stop (the rest is "not attempted").
        summary: Box<IngestSummary>,
    },
    /// The input could not be read.
    #[error("reading input failed: {0}")]
    Input(#[from] std::io::Error),
    /// A source stream could not be read (bad options, a permanent Redis error): the entries
    /// not yet settled stay pending in its group.
    #[error("{0}")]
    Source(#[from] source::SourceError),
    /// Postgres failed in a way retries did not fix: the outcomes not written are not recorded,
    /// and a rerun of the same corpus does them.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// A table source cannot be followed (unknown, misconfigured, or followed already).
    #[error("{0}")]
    TableSource(#[from] crate::store::table_source::TableSourceError),
    /// A full cleanup was refused (the input was not read to its end, too many rejected lines,
    /// too large a share of the table): the run's writes are done, nothing was deleted.
    #[error("{reason}")]
    CleanupRefused {
        /// Why, for the operator.
        reason: String,
        /// Where every record went.
        summary: Box<IngestSummary>,
    },
    /// A task of the run panicked or failed: the run stopped; `summary` accounts for every
    /// record (whatever was neither written nor skipped is "not attempted").
    #[error("{failure}; the run stopped: {}", .summary.accounting())]
    Task {
        /// The task that stopped the run and how.
        failure: TaskFailure,
        /// Where every record went before the stop.
        summary: Box<IngestSummary>,
    },
}

/// A unit of work for a worker: chunks to embed plus pre-decided failures to park.
struct Job {
    embed: Vec<Claimed>,
    park: Vec<ParkedChunk>,
    /// The byte charge of the job's intake window, held until its outcomes are written.
    charge: Arc<Charge>,
}

impl Claimed {
    /// The chunk's outcome once the provider gave it `embedding`.
    fn stored(self, embedding: Vec<f32>) -> StoredChunk {
        StoredChunk {
            doc_id: self.chunk.doc_id,
            chunk_index: self.chunk.chunk_index,
            content_hash: self.hash,
            text_hash: crate::model::TextHash::of(&self.chunk.text),
            embedding,
            source_seq: self.seq,
            leased: self.leased,
            new_chunk: self.new_chunk,
        }
    }
}

impl Job {
    /// Counts (and names) the job's chunks as not attempted: it is dropped unrecorded.
    fn not_attempted(&self, s: &mut IngestSummary) {
        s.not_attempted += (self.embed.len() + self.park.len()) as u64;
        s.note_unfinished(self.embed.iter().map(|c| (c.chunk.doc_id.as_str(), c.chunk.chunk_index)));
        s.note_unfinished(self.park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
    }
}

struct Claimed {
    chunk: Chunk,
    hash: String,
    /// Position of the record (the `source_seq` column of the manifest).
    seq: i64,
    /// The window's claim took the chunk's lease for this run
    /// ([`lease::WindowClaim::leased`]).
    leased: bool,
    /// The manifest had no row for the chunk when its window was looked up
    /// ([`crate::store::StoredChunk::new_chunk`]).
    new_chunk: bool,
    /// The chunk's metadata as read, for a park's payload ([`RawMetadata::payload`]).
    metadata: Option<RawMetadata>,
}

#[derive(Default)]
struct Tally {
    summary: IngestSummary,
    stop: Option<Stop>,
    fatal: Option<StoreError>,
    /// Keys recorded for the run's cleanup (`ingest_seen`).
    seen_written: u64,
}

/// Everything a run needs besides its input.
#[derive(Clone)]
pub struct Pipeline {
    /// Where outcomes are written (manifest, vectors, DLQ, outbox).
    pub store: Store,
    /// The provider side; its gate is shared with any other pipeline built from the same embedder.
    pub embedder: Embedder,
    /// Batching, concurrency and memory bounds of the run.
    pub options: IngestOptions,
}

impl Pipeline {
    /// Runs one ingest over JSONL `input` until it ends, `cancel` fires, or the provider
    /// refuses the run.
    pub async fn run<R>(&self, input: R, cancel: CancellationToken) -> Result<IngestSummary, IngestError>
    where
        R: AsyncBufRead + Unpin + Send + 'static,
    {
        let max_line_bytes = self.options.within_bounds().max_line_bytes;
        self.execute(cancel, move |feed| feed.read_jsonl(input, max_line_bytes)).await
    }

    /// Ingests chunks a Rust program already holds, with no JSONL in between: the same
    /// checks, batching, manifest filter, byte budget, retries, parking and store as
    /// [`Pipeline::run`], and the same summary. A chunk's 1-based position in `chunks` stands
    /// in for its line number (in rejections, in the payload of a parked broken chunk, and
    /// for "the last one wins" when a key occurs twice).
    pub async fn run_chunks<I>(
        &self,
        chunks: I,
        cancel: CancellationToken,
    ) -> Result<IngestSummary, IngestError>
    where
        I: IntoIterator<Item = Chunk>,
        I::IntoIter: Send + 'static,
    {
        self.run_stream(futures::stream::iter(chunks), cancel).await
    }

    /// Like [`Pipeline::run_chunks`], for chunks produced asynchronously (another pipeline's
    /// output, a database cursor): they are pulled only as the byte budget allows, so memory
    /// stays bounded whatever the stream's length.
    pub async fn run_stream<S>(
        &self,
        chunks: S,
        cancel: CancellationToken,
    ) -> Result<IngestSummary, IngestError>
    where
        S: futures::Stream<Item = Chunk> + Send + 'static,
    {
        self.execute(cancel, move |feed| feed.read_chunks(chunks)).await
    }

    /// One run over records a source made (chunks and deletes, e.g. a table source's): the
    /// same pipeline as [`Pipeline::run_chunks`], a record's position being when the run read it.
    pub(crate) async fn run_records<S>(
        &self,
        records: S,
        cancel: CancellationToken,
    ) -> Result<IngestSummary, IngestError>
    where
        S: futures::Stream<Item = reader::Record> + Send + 'static,
    {
        self.execute(cancel, move |feed| feed.read_records(records)).await
    }

    /// One run whose records come from the task `read` makes of its [`Feed`], with the
    /// options held to their bounds.
    async fn execute<F, Fut>(&self, cancel: CancellationToken, read: F) -> Result<IngestSummary, IngestError>
    where
        F: FnOnce(Feed) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.execute_with(cancel, None, read).await
    }

    /// [`Pipeline::execute`], telling `acks` of every record whose outcome is settled (see
    /// [`source::Acks`]).
    async fn execute_with<F, Fut>(
        &self,
        cancel: CancellationToken,
        acks: Option<Arc<source::AckPart>>,
        read: F,
    ) -> Result<IngestSummary, IngestError>
    where
        F: FnOnce(Feed) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let bounded = Pipeline { options: self.options.within_bounds(), ..self.clone() };
        bounded.execute_bounded(cancel, acks, read).await
    }

    /// [`Pipeline::execute`] once the options are within bounds.
    async fn execute_bounded<F, Fut>(
        &self,
        cancel: CancellationToken,
        acks: Option<Arc<source::AckPart>>,
        read: F,
    ) -> Result<IngestSummary, IngestError>
    where
        F: FnOnce(Feed) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let started = Instant::now();
        let run_id = with_db_retry(|| self.store.next_run_id()).await?;
        // Marks the run alive while it holds leases (see `lease`); released below.
        let run_lease = with_db_retry(|| self.store.hold_run(run_id)).await?;
        // A corpus line's position is when the run read it (`store::position`); a stream
        // entry brings its own.
        let positions = RunPositions::new(with_db_retry(|| self.store.reserve_positions()).await?);
        let oldest = acks.as_ref().map_or(positions.first(), |a| a.floor());
        with_db_retry(|| self.store.record_run_start(run_id, oldest)).await?;
        with_db_retry(|| self.store.sweep_deletion_state(run_id)).await?;
        // `halt` stops intake and queued jobs (shutdown, a systemic stop, a failed task);
        // `cancel` alone (shutdown) also interrupts retry waits so in-flight work parks quickly.
        let run = RunState {
            tally: Arc::default(),
            halt: cancel.child_token(),
            cancel,
            progress: Progress::new(self.options.progress, self.options.total_bytes),
            acks,
        };
        // Every task is joined; a panic in any of them halts the run and is reported.
        let mut tasks = Supervisor::new(run.halt.clone());
        let (rec_tx, mut rec_rx) = mpsc::channel::<Handed>(RECORDS_IN_CHANNEL / RECORDS_PER_HANDOFF);
        let feed = Feed {
            budget: ByteBudget::new(self.options.max_inflight_bytes),
            records: rec_tx,
            halt: run.halt.clone(),
            progress: run.progress.clone(),
            lines_read: Arc::default(),
            error: Arc::default(),
        };
        let (lines_read, input_error) = (feed.lines_read.clone(), feed.error.clone());
        // Beside the batcher, not taking turns with it on one worker (see the method).
        tasks.spawn_on_own_thread("ingest reader", read(feed));
        let jobs = self.spawn_workers_and_writers(&mut tasks, &run, run_id);
        let first_position = positions.first();
        let (intake_error, batcher_failure) =
            self.batch_intake(&mut rec_rx, &jobs, &run, run_id, positions).await;
        drop(jobs);
        drop(rec_rx);
        tasks.wait().await;
        run.progress.finish();

        let mut t = std::mem::take(&mut *run.tally.lock().unwrap_or_else(PoisonError::into_inner));
        t.summary.elapsed_secs = started.elapsed().as_secs_f64();
        t.summary.breaker_opened = self.embedder.gate.times_opened();
        t.summary.lines_read = lines_read.load(Ordering::Relaxed);
        t.summary.dry_run = self.options.cleanup.dry_run;
        t.summary.price(self.options.price_per_million_tokens);
        settle_accounts(&mut t.summary, &run);
        let ending = RunEnding {
            failure: batcher_failure.into_iter().chain(tasks.failures()).next(),
            intake_error,
            input_error: input_error.lock().unwrap_or_else(PoisonError::into_inner).take(),
        };
        let cleanup_ending = cleanup::Ending {
            failed: ending.failure.is_some()
                || ending.intake_error.is_some()
                || t.fatal.is_some()
                || t.stop.is_some(),
            input_error: ending.input_error.as_ref().map(|e| e.to_string()),
            cancelled: run.cancel.is_cancelled(),
            seen_written: t.seen_written,
        };
        // Under the run's lock: a run starting meanwhile sweeps the keys of runs not alive.
        let cleaned = self.cleanup(run_id, first_position, &mut t.summary, cleanup_ending, &run.cancel).await;
        run_lease.release().await;
        cleaned?;
        ending.result(t)
    }

    /// Starts the writers and the workers; returns the workers' job queue.
    fn spawn_workers_and_writers(
        &self,
        tasks: &mut Supervisor,
        run: &RunState,
        run_id: i64,
    ) -> flume::Sender<Job> {
        let opts = &self.options;
        // A corpus run may be alone, building requests without leases; a stream run's
        // skips must be acknowledged to its source and a backfill never leases.
        let late_claims = (run.acks.is_none() && opts.copy_of.is_none())
            .then(|| Arc::new(LateClaims { store: self.store.clone(), run_id, lease: opts.lease }));
        // Multi-consumer channels: an idle writer or worker waits on the channel itself,
        // never on a lock another one needs to make progress.
        let (out_tx, out_rx) = flume::bounded::<Outcomes>(opts.concurrency * 2);
        for n in 0..opts.writers.max(1) {
            let writer = Writer {
                store: self.store.clone(),
                tally: run.tally.clone(),
                halt: run.halt.clone(),
                progress: run.progress.clone(),
                rows: opts.write_batch_rows,
                linger: opts.batch_linger,
                acks: run.acks.clone(),
            };
            tasks.spawn(format!("ingest writer {n}"), writer.run(out_rx.clone()));
        }
        let (job_tx, job_rx) = flume::bounded::<Job>(opts.concurrency * 2);
        for n in 0..opts.concurrency {
            let worker = Worker {
                embedder: Embedder { on_outage: opts.on_outage, ..self.embedder.clone() },
                schedule: opts.dlq_schedule,
                tally: run.tally.clone(),
                cancel: run.cancel.clone(),
                halt: run.halt.clone(),
                writer: out_tx.clone(),
                late_claims: late_claims.clone(),
            };
            tasks.spawn(format!("ingest worker {n}"), worker.run(job_rx.clone()));
        }
        job_tx
    }

    /// Runs the batcher here (it owns the manifest lookups and the order of intake); a panic
    /// in it is caught like one in any task and halts the run.
    async fn batch_intake(
        &self,
        records: &mut mpsc::Receiver<Handed>,
        jobs: &flume::Sender<Job>,
        run: &RunState,
        run_id: i64,
        positions: RunPositions,
    ) -> (Option<IngestError>, Option<TaskFailure>) {
        let intake =
            AssertUnwindSafe(self.intake(records, jobs, run, run_id, positions)).catch_unwind().await;
        match intake {
            Ok(result) => (result.err(), None),
            Err(payload) => {
                let message = crate::supervise::panic_message(payload.as_ref());
                let failure = TaskFailure::Panicked { task: "ingest batcher".into(), message };
                tracing::error!(error = %failure, "task failed; stopping");
                run.halt.cancel();
                (None, Some(failure))
            }
        }
    }
}

/// Most handoffs ([`Handed`]) the batcher takes from the reader's channel at once.
const HANDOFFS_PER_TAKE: usize = 4;

/// Most records waiting in the reader's channel (in handoffs of [`RECORDS_PER_HANDOFF`]).
const RECORDS_IN_CHANNEL: usize = 4096;

/// What every task of one run shares.
struct RunState {
    tally: Arc<Mutex<Tally>>,
    /// Shutdown requested by the caller.
    cancel: CancellationToken,
    /// The run is stopping, for whatever reason (a child of `cancel`).
    halt: CancellationToken,
    progress: Progress,
    /// Told of every record whose outcome is settled (a stream source acknowledges it).
    acks: Option<Arc<source::AckPart>>,
}

/// Whatever a stopped run neither stored, skipped nor parked (records in a dead task's hands,
/// in channels, in the batcher's window) is "not attempted": a rerun does it.
fn settle_accounts(s: &mut IngestSummary, run: &RunState) {
    if run.cancel.is_cancelled() && s.stopped.is_none() {
        s.stopped = Some("shutdown requested".into());
    }
    let accounted = s.stored
        + s.unchanged
        + s.already_parked
        + s.parked_total()
        + s.superseded
        + s.not_attempted
        + s.leased_elsewhere
        + s.differs_from_active;
    if accounted < s.records {
        if !run.halt.is_cancelled() {
            tracing::error!(records = s.records, accounted, "records unaccounted for in a finished run");
        }
        s.not_attempted += s.records - accounted;
    }
}

/// How a run ended besides its tally, for [`RunEnding::result`].
struct RunEnding {
    /// A task (or the batcher) that panicked or failed.
    failure: Option<TaskFailure>,
    /// Why the batcher stopped early (a manifest lookup failed).
    intake_error: Option<IngestError>,
    /// Why reading the input stopped early.
    input_error: Option<std::io::Error>,
}

impl RunEnding {
    /// The run's result: the most serious reason it stopped, if any, else its summary.
    fn result(self, mut t: Tally) -> Result<IngestSummary, IngestError> {
        if let Some(failure) = self.failure {
            t.summary.stopped = Some(failure.to_string());
            return Err(IngestError::Task { failure, summary: Box::new(t.summary) });
        }
        if let Some(e) = self.intake_error {
            return Err(e);
        }
        if let Some(e) = t.fatal {
            return Err(IngestError::Store(e));
        }
        if let Some(stop) = t.stop {
            t.summary.stopped = Some(stop.to_string());
            return Err(IngestError::Provider { stop, summary: Box::new(t.summary) });
        }
        if let Some(e) = self.input_error {
            return Err(IngestError::Input(e));
        }
        Ok(t.summary)
    }
}

impl Pipeline {
    /// The batcher loop: records in, jobs out, until the input ends or the run halts.
    async fn intake(
        &self,
        records: &mut mpsc::Receiver<Handed>,
        jobs: &flume::Sender<Job>,
        run: &RunState,
        run_id: i64,
        positions: RunPositions,
    ) -> Result<(), IngestError> {
        let (halt, cancel) = (&run.halt, &run.cancel);
        let mut batcher = Batcher::new(self, run.tally.clone(), run_id, positions);
        batcher.acks = run.acks.clone();
        // Records are taken many at a time: taken one by one, each freed slot of the channel
        // woke the reader for one more line (thread wake-ups were a seventh of an unchanged
        // rerun's CPU).
        let mut taken = Vec::with_capacity(HANDOFFS_PER_TAKE);
        'intake: loop {
            let n = if batcher.is_idle() {
                tokio::select! {
                    n = records.recv_many(&mut taken, HANDOFFS_PER_TAKE) => n,
                    _ = halt.cancelled() => 0,
                }
            } else {
                tokio::select! {
                    n = records.recv_many(&mut taken, HANDOFFS_PER_TAKE) => n,
                    _ = halt.cancelled() => 0,
                    _ = tokio::time::sleep(self.options.batch_linger) => {
                        batcher.flush(jobs).await?;
                        continue;
                    }
                }
            };
            // 0: the input ended (every sender gone) or the run halted.
            if n == 0 {
                break;
            }
            for Handed { records, charge } in taken.drain(..) {
                for (rec, at) in records {
                    // A halt stops intake at the next record, as if it had not been taken.
                    if halt.is_cancelled() {
                        break 'intake;
                    }
                    batcher.push(rec, at, jobs).await?;
                }
                // With the window of the handoff's last record (see `Handed`).
                batcher.charge.merge(charge);
            }
        }
        // End of input: the last window goes out. Shutdown: records already claimed are
        // finished or parked; anything after them is left for a rerun. Any other halt (a
        // systemic stop, a failed task): the window is left, "not attempted".
        if !halt.is_cancelled() || cancel.is_cancelled() {
            batcher.flush(jobs).await?;
        }
        // The window in flight was claimed before the halt: finished as a flush before it
        // would have finished it.
        batcher.finish_pending(jobs).await?;
        batcher.bad.log_totals();
        Ok(())
    }
}

fn merge_stats(s: &mut IngestSummary, b: &BatchStats) {
    s.provider_calls += b.provider_calls;
    s.provider_inputs += b.provider_inputs;
    s.reported_tokens += b.reported_tokens;
    s.batch_splits += b.splits;
    s.tokens_stored += b.tokens_stored;
    s.tokens_wasted += b.tokens_wasted;
    for (reason, n) in &b.retries {
        *s.retries.entry(reason.as_str().to_string()).or_default() += n;
    }
}

/// Retries a database step a few times on connection-level errors (restart, failover), then
/// gives up: the run stops with the error and a rerun resumes where it left off.
async fn with_db_retry<T, F, Fut>(mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let policy = crate::embed::retry::RetryPolicy {
        max_attempts: 6,
        base: Duration::from_millis(200),
        factor: 2.0,
        cap: Duration::from_secs(5),
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() && policy.allows_another(attempt) => {
                tracing::warn!(error = %e, attempt, "database step failed, retrying");
                tokio::time::sleep(policy.backoff(attempt)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Progress bar on stderr (bytes of input when the size is known, a spinner otherwise).
#[derive(Clone)]
struct Progress(Option<indicatif::ProgressBar>);

impl Progress {
    fn new(enabled: bool, total_bytes: Option<u64>) -> Self {
        if !enabled {
            return Progress(None);
        }
        let bar = match total_bytes {
            Some(total) => {
                let b = indicatif::ProgressBar::new(total);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({eta}) {msg}",
                    )
                    .expect("valid template"),
                );
                b
            }
            None => indicatif::ProgressBar::new_spinner(),
        };
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress(Some(bar))
    }

    fn set_bytes(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.set_position(n);
        }
    }

    fn set_counts(&self, done: u64, parked: u64) {
        if let Some(b) = &self.0 {
            b.set_message(format!("{done} stored, {parked} parked"));
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
