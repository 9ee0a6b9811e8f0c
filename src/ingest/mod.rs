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

pub mod bounds;
pub(crate) mod budget;
pub mod cleanup;
pub(crate) mod reader;
pub mod source;

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
use crate::model::{Chunk, ChunkStatus, ErrorClass, content_hash};
use crate::store::delete::DeleteRequest;
use crate::store::lease::{ALWAYS_LEASED_WINDOWS, WindowClaim, WindowKey};
use crate::store::position::RunPositions;
use crate::store::{OnNewerParked, ParkCounts, ParkedChunk, Store, StoreCounts, StoreError, StoredChunk};
use crate::supervise::{Supervisor, TaskFailure};
use crate::telemetry::Escaped;
use budget::{ByteBudget, Charge};
pub use cleanup::{CleanupMode, CleanupOptions, CleanupReport};
use reader::{LineReader, Record, parse_line};

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
/// `already_parked`, `parked`, `superseded`, `rejected_lines`, `not_attempted` or
/// `leased_elsewhere`.
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
            embedding,
            source_seq: self.seq,
            leased: self.leased,
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
    /// Position of the record ([`crate::store::source_seq`]).
    seq: i64,
    /// The window's claim took the chunk's lease for this run
    /// ([`crate::store::lease::WindowClaim::leased`]).
    leased: bool,
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
        acks: Option<Arc<source::Acks>>,
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
        acks: Option<Arc<source::Acks>>,
        read: F,
    ) -> Result<IngestSummary, IngestError>
    where
        F: FnOnce(Feed) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let started = Instant::now();
        let run_id = with_db_retry(|| self.store.next_run_id()).await?;
        // Marks the run alive while it holds leases (see `store::lease`); released below.
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
        let (rec_tx, mut rec_rx) = mpsc::channel::<(Record, Option<i64>, Charge)>(4096);
        let feed = Feed {
            budget: ByteBudget::new(self.options.max_inflight_bytes),
            records: rec_tx,
            halt: run.halt.clone(),
            progress: run.progress.clone(),
            lines_read: Arc::default(),
            error: Arc::default(),
        };
        let (lines_read, input_error) = (feed.lines_read.clone(), feed.error.clone());
        tasks.spawn("ingest reader", read(feed));
        let jobs = self.spawn_workers_and_writers(&mut tasks, &run);
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
    fn spawn_workers_and_writers(&self, tasks: &mut Supervisor, run: &RunState) -> flume::Sender<Job> {
        let opts = &self.options;
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
            };
            tasks.spawn(format!("ingest worker {n}"), worker.run(job_rx.clone()));
        }
        job_tx
    }

    /// Runs the batcher here (it owns the manifest lookups and the order of intake); a panic
    /// in it is caught like one in any task and halts the run.
    async fn batch_intake(
        &self,
        records: &mut mpsc::Receiver<(Record, Option<i64>, Charge)>,
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

/// Most records the batcher takes from the reader's channel at once.
const RECORDS_PER_TAKE: usize = 256;

/// What every task of one run shares.
struct RunState {
    tally: Arc<Mutex<Tally>>,
    /// Shutdown requested by the caller.
    cancel: CancellationToken,
    /// The run is stopping, for whatever reason (a child of `cancel`).
    halt: CancellationToken,
    progress: Progress,
    /// Told of every record whose outcome is settled (a stream source acknowledges it).
    acks: Option<Arc<source::Acks>>,
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
        + s.leased_elsewhere;
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
        records: &mut mpsc::Receiver<(Record, Option<i64>, Charge)>,
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
        let mut taken = Vec::with_capacity(RECORDS_PER_TAKE);
        'intake: loop {
            let n = if batcher.is_idle() {
                tokio::select! {
                    n = records.recv_many(&mut taken, RECORDS_PER_TAKE) => n,
                    _ = halt.cancelled() => 0,
                }
            } else {
                tokio::select! {
                    n = records.recv_many(&mut taken, RECORDS_PER_TAKE) => n,
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
            for (rec, at, charge) in taken.drain(..) {
                // A halt stops intake at the next record, as if it had not been taken.
                if halt.is_cancelled() {
                    break 'intake;
                }
                batcher.push(rec, at, charge, jobs).await?;
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

/// The reader side of a run, whatever its input: records, each charged to the byte budget
/// before it is handed to the batcher. An I/O error ends the input (what was read is still
/// processed) and is reported when the run ends.
struct Feed {
    budget: ByteBudget,
    records: mpsc::Sender<(Record, Option<i64>, Charge)>,
    halt: CancellationToken,
    progress: Progress,
    /// Lines read, or chunks taken.
    lines_read: Arc<AtomicU64>,
    error: Arc<Mutex<Option<std::io::Error>>>,
}

impl Feed {
    /// The reader task of [`Pipeline::run`]: JSONL lines → records.
    async fn read_jsonl<R: AsyncBufRead + Unpin>(self, input: R, max_line_bytes: usize) {
        let mut lines = LineReader::new(input, max_line_bytes);
        loop {
            // A halted run stops reading even if the producer (stdin) has gone quiet.
            let next = tokio::select! {
                biased;
                _ = self.halt.cancelled() => break,
                r = lines.next_line() => r,
            };
            let raw = match next {
                Ok(Some(raw)) => raw,
                Ok(None) => break,
                Err(e) => {
                    *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                    break;
                }
            };
            self.lines_read.fetch_add(1, Ordering::Relaxed);
            self.progress.set_bytes(lines.bytes_read);
            // Charged in two steps, the line before it is parsed and then its parsed form, so
            // the reader waits for room holding a line, not a parsed record that may be many
            // times larger. Together about twice the record: that covers the copy made to
            // park it. At most the whole budget: a huge record runs alone.
            let Some(charge) = self.charge(raw.bytes.len() as u64).await else { break };
            let Some(rec) = parse_line(&raw) else { continue };
            drop(raw);
            if !self.hand_on(rec, charge).await {
                break;
            }
        }
    }

    /// The reader task of [`Pipeline::run_stream`]: chunks → records, through the same checks
    /// as parsed lines ([`Record::from_chunk`]).
    async fn read_chunks<S: futures::Stream<Item = Chunk>>(self, chunks: S) {
        use futures::StreamExt;
        let mut chunks = std::pin::pin!(chunks);
        let mut position = 0u64;
        loop {
            let next = tokio::select! {
                biased;
                _ = self.halt.cancelled() => break,
                c = chunks.next() => c,
            };
            let Some(chunk) = next else { break };
            position += 1;
            self.lines_read.fetch_add(1, Ordering::Relaxed);
            let rec = Record::from_chunk(position, chunk);
            // The record's own size stands in for the line a JSONL record is charged first:
            // together about twice the record, like a parsed line.
            let Some(charge) = self.charge(rec.approx_bytes()).await else { break };
            if !self.hand_on(rec, charge).await {
                break;
            }
        }
    }

    /// Charges `bytes` to the budget, waiting for room; `None` if the run halts meanwhile.
    async fn charge(&self, bytes: u64) -> Option<Charge> {
        tokio::select! {
            biased;
            _ = self.halt.cancelled() => None,
            c = self.budget.charge(bytes) => Some(c),
        }
    }

    /// Adds the parsed record's size to `charge` (at most up to the whole budget) and hands
    /// the record to the batcher; false once the run halts or the batcher is gone.
    async fn hand_on(&self, rec: Record, charge: Charge) -> bool {
        self.hand_on_at(rec, None, charge).await
    }

    /// [`Feed::hand_on`] for a record that brings its position (`at`, a stream entry's; see
    /// `store::position`); without one, the run positions it by its line.
    async fn hand_on_at(&self, rec: Record, at: Option<i64>, mut charge: Charge) -> bool {
        let parsed = rec.approx_bytes().min(self.budget.capacity().saturating_sub(charge.bytes()));
        if parsed > 0 {
            let Some(more) = self.charge(parsed).await else { return false };
            charge.merge(more);
        }
        self.records.send((rec, at, charge)).await.is_ok()
    }
}

/// Groups records into intake windows with unique keys, filters each window against the
/// manifest in one lookup and hands provider-sized batches to the workers.
///
/// Every record carries its position (`store::position`: when it entered): when one key occurs
/// twice, the store keeps the later line whatever order the outcomes are written in. A key seen before
/// in this run is therefore never skipped as "unchanged" or "already parked" (the manifest
/// may still hold what an earlier line of this run is about to replace): it is embedded and
/// written again, and its position decides.
/// Rejected lines, and invalid records, logged one by one (each kind) before the log only
/// counts them: a corpus of a million broken lines must not become a million log lines.
pub const LOGGED_BAD_LINES: u64 = 20;
/// After the first [`LOGGED_BAD_LINES`] of a kind, one line per this many more, with the
/// count so far; the totals come when the input ends.
pub const BAD_LINES_LOG_EVERY: u64 = 10_000;

/// How many rejected lines and invalid records a run met, for its log.
#[derive(Debug, Default)]
struct BadLines {
    rejected: u64,
    invalid: u64,
}

impl BadLines {
    /// Whether the `n`-th line of a kind is logged on its own (else `None`), or `Some(false)`
    /// for a count line.
    fn verdict(n: u64) -> Option<bool> {
        if n <= LOGGED_BAD_LINES {
            Some(true)
        } else if (n - LOGGED_BAD_LINES).is_multiple_of(BAD_LINES_LOG_EVERY) {
            Some(false)
        } else {
            None
        }
    }

    /// The totals, when some were not logged one by one.
    fn log_totals(&self) {
        if self.rejected > LOGGED_BAD_LINES {
            let n = self.rejected;
            tracing::warn!(
                total = n,
                "rejected input lines in total: {n} (the first {LOGGED_BAD_LINES} logged one by one)"
            );
        }
        if self.invalid > LOGGED_BAD_LINES {
            let n = self.invalid;
            tracing::warn!(
                total = n,
                "invalid records in total: {n} (the first {LOGGED_BAD_LINES} logged one by one)"
            );
        }
    }
}

struct Batcher<'a> {
    pipeline: &'a Pipeline,
    /// Broken lines met so far (their log is bounded).
    bad: BadLines,
    tally: Arc<Mutex<Tally>>,
    run_id: i64,
    /// The positions of the run's lines (records without their own).
    positions: RunPositions,
    chunks: Vec<(Chunk, String, i64)>,
    invalid: Vec<ParkedChunk>,
    keys: HashSet<(String, i32)>,
    /// Every key of this run so far, to recognise a key that occurs twice.
    seen_in_run: SeenKeys,
    /// Keys of the current window seen earlier in this run: never skipped.
    repeated: HashSet<(String, i32)>,
    /// The byte charges of the records in the window; shared by the window's jobs.
    charge: Charge,
    /// Windows sent on so far (the first ones always claim leases, see `store::lease`).
    windows: u64,
    /// The window's delete records (their keys are in `keys`: a whole document as index -1).
    deletes: Vec<DeleteRequest>,
    /// A whole document was deleted earlier in this run: a later chunk of any document is
    /// looked up in `seen_in_run` under the document's key too.
    doc_deletes: bool,
    /// The run cleans up: every window's keys are recorded (`ingest_seen`).
    record_seen: bool,
    /// A dry run: windows are recorded and their deletes listed, nothing else.
    dry_run: bool,
    /// Told of the records skipped as already stored or parked (settled, never written).
    acks: Option<Arc<source::Acks>>,
    /// The previous window, whose claim statement is in flight while this one fills up: the
    /// round trip overlaps with reading and hashing the next records. At most one; it is
    /// finished (skips counted, jobs sent) before the next window touches the database.
    pending: Option<PendingWindow>,
}

/// A window's keys and what [`Store::claim_window`] answered for them.
type ClaimedKeys = (Vec<WindowKey>, Result<Vec<WindowClaim>, StoreError>);

/// A window sent to [`Store::claim_window`] and not yet finished ([`Batcher::finish_pending`]).
struct PendingWindow {
    /// The window's keys and, once the task ends, their claims.
    claim: tokio_util::task::AbortOnDropHandle<ClaimedKeys>,
    chunks: Vec<(Chunk, String, i64)>,
    invalid: Vec<ParkedChunk>,
    charge: Arc<Charge>,
}

fn key_hash(doc_id: &str, chunk_index: i32) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one((doc_id, chunk_index))
}

/// The keys an ingest run has met, in bounded memory: exact 64-bit key hashes up to
/// [`SeenKeys::EXACT_MAX`] keys (about 16 MB), then a Bloom filter of [`SeenKeys::BLOOM_BITS`]
/// bits (16 MiB) with 4 probes. A false "seen before" only means one more provider call for
/// an unchanged chunk (about 1 in 10^5 keys at 1M keys, 1 in 100 at 10M), never a wrong
/// outcome; a key really seen before is always recognised.
struct SeenKeys {
    exact: Option<HashSet<u64>>,
    bloom: Vec<u64>,
}

impl SeenKeys {
    const EXACT_MAX: usize = 1 << 20;
    const BLOOM_BITS: usize = 1 << 27;

    fn new() -> Self {
        SeenKeys { exact: Some(HashSet::new()), bloom: Vec::new() }
    }

    /// Whether `h` was (or may have been) recorded.
    fn contains(&self, h: u64) -> bool {
        if let Some(exact) = &self.exact {
            return exact.contains(&h);
        }
        let (a, b) = (h & 0xffff_ffff, (h >> 32) | 1);
        (0..4u64).all(|i| {
            let bit = (a.wrapping_add(i.wrapping_mul(b)) as usize) % Self::BLOOM_BITS;
            self.bloom[bit / 64] & (1u64 << (bit % 64)) != 0
        })
    }

    /// Records `h`; true if it was (or may have been) recorded before.
    fn insert(&mut self, h: u64) -> bool {
        if let Some(exact) = &mut self.exact {
            let seen = !exact.insert(h);
            if exact.len() > Self::EXACT_MAX {
                let all = self.exact.take().expect("exact set");
                self.bloom = vec![0u64; Self::BLOOM_BITS / 64];
                for h in all {
                    self.bloom_insert(h);
                }
            }
            return seen;
        }
        self.bloom_insert(h)
    }

    fn bloom_insert(&mut self, h: u64) -> bool {
        let (a, b) = (h & 0xffff_ffff, (h >> 32) | 1);
        let mut seen = true;
        for i in 0..4u64 {
            let bit = (a.wrapping_add(i.wrapping_mul(b)) as usize) % Self::BLOOM_BITS;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            seen &= self.bloom[word] & mask != 0;
            self.bloom[word] |= mask;
        }
        seen
    }
}

impl<'a> Batcher<'a> {
    fn new(pipeline: &'a Pipeline, tally: Arc<Mutex<Tally>>, run_id: i64, positions: RunPositions) -> Self {
        Batcher {
            pipeline,
            bad: BadLines::default(),
            tally,
            run_id,
            positions,
            chunks: vec![],
            invalid: vec![],
            keys: HashSet::new(),
            seen_in_run: SeenKeys::new(),
            repeated: HashSet::new(),
            charge: Charge::default(),
            windows: 0,
            deletes: vec![],
            doc_deletes: false,
            record_seen: pipeline.options.cleanup.mode != CleanupMode::None,
            dry_run: pipeline.options.cleanup.dry_run,
            acks: None,
            pending: None,
        }
    }

    /// Adds `key` to the window, remembering whether this run met it before (or deleted its
    /// document earlier: the chunk must then be written again, never skipped as unchanged).
    fn claim_key(&mut self, key: (String, i32)) {
        let seen = self.seen_in_run.insert(key_hash(&key.0, key.1));
        if seen || (self.doc_deletes && self.seen_in_run.contains(key_hash(&key.0, -1))) {
            self.repeated.insert(key.clone());
        }
        self.keys.insert(key);
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.invalid.is_empty() && self.deletes.is_empty()
    }

    /// Nothing in the window and no window in flight: nothing a linger would flush.
    fn is_idle(&self) -> bool {
        self.is_empty() && self.pending.is_none()
    }

    async fn push(
        &mut self,
        rec: Record,
        at: Option<i64>,
        charge: Charge,
        jobs: &flume::Sender<Job>,
    ) -> Result<(), IngestError> {
        let position = match at {
            Some(p) => p,
            None => self.position(rec.line()).await?,
        };
        match rec {
            Record::Rejected { line, problem } => {
                self.bad.rejected += 1;
                let n = self.bad.rejected;
                match BadLines::verdict(n) {
                    Some(true) => {
                        tracing::warn!(line, problem = %Escaped(&problem), "rejected input line (no usable identity)")
                    }
                    Some(false) => tracing::warn!(so_far = n, "rejected input lines so far: {n}"),
                    None => {}
                }
                metrics::counter!(crate::metrics::LINES_REJECTED).increment(1);
                let mut t = self.tally.lock().unwrap();
                t.summary.rejected_lines += 1;
                if t.summary.rejected_examples.len() < 20 {
                    t.summary.rejected_examples.push(RejectedLine { line, problem });
                }
                return Ok(());
            }
            Record::Invalid { line, doc_id, chunk_index, problem, payload, raw_hash } => {
                self.bad.invalid += 1;
                let n = self.bad.invalid;
                match BadLines::verdict(n) {
                    Some(true) => tracing::warn!(line, doc_id = %Escaped(&doc_id), chunk_index,
                        problem = %Escaped(&problem), "invalid record (parked unless already in the DLQ)"),
                    Some(false) => tracing::warn!(so_far = n, "invalid records so far: {n}"),
                    None => {}
                }
                self.tally.lock().unwrap().summary.records += 1;
                self.make_room(&(doc_id.clone(), chunk_index), jobs).await?;
                self.claim_key((doc_id.clone(), chunk_index));
                self.invalid.push(ParkedChunk {
                    source_seq: position,
                    doc_id,
                    chunk_index,
                    content_hash: raw_hash,
                    payload,
                    class: ErrorClass::InvalidRecord,
                    reason: Reason::InvalidRecord.as_str().into(),
                    last_error: format!("line {line}: {problem}"),
                    last_status: None,
                    attempts: 0,
                    retry_in: None,
                });
            }
            Record::Delete { doc_id, chunk_index, .. } => {
                self.tally.lock().unwrap().summary.delete_requests += 1;
                let key = (doc_id.clone(), chunk_index.unwrap_or(-1));
                self.make_room(&key, jobs).await?;
                // A later record of the chunk (of the document) is written again, not skipped.
                self.seen_in_run.insert(key_hash(&key.0, key.1));
                self.doc_deletes |= chunk_index.is_none();
                self.keys.insert(key);
                self.deletes.push(DeleteRequest { doc_id, chunk_index, source_seq: position });
            }
            Record::Chunk { chunk, .. } => {
                self.tally.lock().unwrap().summary.records += 1;
                let key = (chunk.doc_id.clone(), chunk.chunk_index);
                self.make_room(&key, jobs).await?;
                let hash = content_hash(
                    self.pipeline.embedder.client.model(),
                    self.pipeline.embedder.dimensions,
                    &chunk.text,
                );
                self.claim_key(key);
                self.chunks.push((chunk, hash, position));
            }
        }
        self.charge.merge(charge);
        if self.keys.len() >= self.pipeline.options.intake_window {
            self.flush(jobs).await?;
        }
        Ok(())
    }

    /// The position of line `line` of a corpus run, reserving the next block when the line is
    /// past the last one (one statement per [`crate::store::position::BLOCK`] lines).
    async fn position(&mut self, line: u64) -> Result<i64, IngestError> {
        if let Some(p) = self.positions.get(line) {
            return Ok(p);
        }
        let store = &self.pipeline.store;
        let base = with_db_retry(|| store.reserve_positions()).await?;
        self.positions.extend(line, base);
        Ok(self.positions.get(line).expect("the block just reserved holds the line"))
    }

    /// Flushes first if `key` is already in the window: a later line for the same chunk must
    /// not share a statement with an earlier one.
    async fn make_room(&mut self, key: &(String, i32), jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        if self.keys.contains(key) {
            self.flush(jobs).await?;
        }
        Ok(())
    }

    /// Sends the window on: skips what the manifest already holds, parks what cannot be
    /// embedded and hands the rest to the workers in provider-sized batches.
    async fn flush(&mut self, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        self.finish_pending(jobs).await?;
        if self.is_empty() {
            return Ok(());
        }
        // Released when the last job of this window has been written (or dropped).
        let charge = Arc::new(std::mem::take(&mut self.charge));
        let chunks = std::mem::take(&mut self.chunks);
        let invalid = std::mem::take(&mut self.invalid);
        let repeated = std::mem::take(&mut self.repeated);
        let deletes = std::mem::take(&mut self.deletes);
        self.keys.clear();
        self.apply_deletes(&deletes).await?;
        if self.record_seen {
            self.note_seen(&chunks, &invalid).await?;
        }
        if self.dry_run {
            let mut t = self.tally.lock().unwrap();
            t.summary.not_attempted += (chunks.len() + invalid.len()) as u64;
            return Ok(());
        }
        let keys = window_keys(&chunks, &invalid, &repeated);
        let store = self.pipeline.store.clone();
        let (run_id, lease) = (self.run_id, self.pipeline.options.lease);
        let young = self.windows < ALWAYS_LEASED_WINDOWS;
        let stream = self.acks.is_some();
        // The keys travel with the claim and come back with its answer.
        let claim = tokio::spawn(async move {
            let claims = with_db_retry(|| store.claim_window(&keys, run_id, lease, young, stream)).await;
            (keys, claims)
        });
        self.windows += 1;
        let claim = tokio_util::task::AbortOnDropHandle::new(claim);
        self.pending = Some(PendingWindow { claim, chunks, invalid, charge });
        Ok(())
    }

    /// Finishes the window whose claim is in flight, if any: waits for its claim, drops what
    /// the manifest already holds or another run has leased, and sends the rest to the
    /// workers. A panic of the claim's task is the batcher's own.
    async fn finish_pending(&mut self, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        let Some(PendingWindow { claim, mut chunks, mut invalid, charge }) = self.pending.take() else {
            return Ok(());
        };
        let (keys, claims) = match claim.await {
            Ok((keys, claims)) => (keys, claims?),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only dropping the handle aborts the task, and the handle is here.
            Err(e) => {
                let gone = format!("the intake window's claim task ended without an answer: {e}");
                return Err(IngestError::Store(StoreError::Db(sqlx::Error::Protocol(gone))));
            }
        };
        let leased = self.skip_known(&mut chunks, &mut invalid, &keys, &claims);
        let (batches, park) = self.provider_batches(chunks, invalid, &leased);
        self.dispatch(batches, park, charge, jobs).await;
        Ok(())
    }

    /// Applies the window's delete records (in a dry run, lists what they would delete).
    /// Their order against the window's other records does not matter: every record's
    /// position fences every other's (`store::delete`).
    async fn apply_deletes(&self, deletes: &[DeleteRequest]) -> Result<(), IngestError> {
        if deletes.is_empty() {
            return Ok(());
        }
        let store = &self.pipeline.store;
        let gone = if self.dry_run {
            with_db_retry(|| store.delete_requested_plan(deletes)).await?
        } else {
            with_db_retry(|| store.delete_requested(deletes)).await?
        };
        if !self.dry_run {
            metrics::counter!(crate::metrics::CHUNKS_DELETED, "by" => "input").increment(gone.len() as u64);
            // Committed: a stream source may acknowledge the delete entries.
            if let Some(acks) = &self.acks {
                acks.settled(deletes.iter().map(|d| d.source_seq));
            }
        }
        let listed = if self.dry_run { cleanup::DRY_RUN_LISTED } else { cleanup::DELETED_EXAMPLES };
        let mut t = self.tally.lock().unwrap();
        t.summary.chunks_deleted += gone.len() as u64;
        for c in gone.iter().take(listed.saturating_sub(t.summary.deleted_examples.len())) {
            t.summary.deleted_examples.push(format!("{}#{}", c.doc_id, c.chunk_index));
        }
        Ok(())
    }

    /// Records the window's keys for the run's cleanup (one statement).
    async fn note_seen(
        &self,
        chunks: &[(Chunk, String, i64)],
        invalid: &[ParkedChunk],
    ) -> Result<(), IngestError> {
        let keys: Vec<(&str, i32)> = chunks
            .iter()
            .map(|(c, _, _)| (c.doc_id.as_str(), c.chunk_index))
            .chain(invalid.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)))
            .collect();
        let store = &self.pipeline.store;
        let n = with_db_retry(|| store.record_seen(self.run_id, &keys)).await?;
        self.tally.lock().unwrap().seen_written += n;
        Ok(())
    }

    /// Drops (and counts) the records whose content the manifest already holds, stored or
    /// parked (replay owns it then), and the chunks another live run holds the lease of (it
    /// embeds them), as the window's claim found them (`claims`, one per key of
    /// [`window_keys`], which also leased the rest to this run); keys `repeated` in this run
    /// are never skipped as done. Returns the keys whose lease this run took (none once a run
    /// alone is past its first windows).
    fn skip_known(
        &self,
        chunks: &mut Vec<(Chunk, String, i64)>,
        invalid: &mut Vec<ParkedChunk>,
        keys: &[WindowKey],
        claims: &[WindowClaim],
    ) -> HashSet<(String, i32)> {
        let leased: HashSet<(String, i32)> = keys
            .iter()
            .zip(claims)
            .filter(|(_, c)| c.leased)
            .map(|(k, _)| (k.doc_id.clone(), k.chunk_index))
            .collect();
        let (mut unchanged, mut already_parked, mut leased_elsewhere) = (0u64, 0u64, 0u64);
        let mut left: Vec<(String, i32)> = Vec::new();
        // Skipped as done: their outcome is already committed, so a source may acknowledge
        // them. What is left to a concurrent run is not settled (it may die before its write).
        let (mut done, mut elsewhere): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
        let skip: Vec<bool> = keys
            .iter()
            .zip(claims)
            .map(|(key, claim)| {
                if claim.leased_elsewhere {
                    leased_elsewhere += 1;
                    elsewhere.push(key.source_seq);
                    if left.len() < MAX_UNFINISHED_EXAMPLES {
                        left.push((key.doc_id.clone(), key.chunk_index));
                    }
                    return true;
                }
                match claim.manifest {
                    _ if key.repeated => false,
                    // Same content, but the manifest's position could not be moved up to this
                    // record's (the row changed meanwhile): written again, its position decides.
                    _ if !claim.confirmed => false,
                    Some((true, ChunkStatus::Stored)) => {
                        unchanged += 1;
                        done.push(key.source_seq);
                        true
                    }
                    Some((true, ChunkStatus::Parked | ChunkStatus::Exhausted)) => {
                        already_parked += 1;
                        done.push(key.source_seq);
                        true
                    }
                    _ => false,
                }
            })
            .collect();
        let (chunk_skips, invalid_skips) = skip.split_at(chunks.len());
        let mut n = 0;
        chunks.retain(|_| {
            n += 1;
            !chunk_skips[n - 1]
        });
        let mut n = 0;
        invalid.retain(|_| {
            n += 1;
            !invalid_skips[n - 1]
        });
        if let Some(acks) = &self.acks {
            acks.settled(done);
            acks.release(elsewhere);
        }
        {
            let mut t = self.tally.lock().unwrap();
            t.summary.unchanged += unchanged;
            t.summary.already_parked += already_parked;
            t.summary.leased_elsewhere += leased_elsewhere;
            t.summary.note_unfinished(left.iter().map(|(d, i)| (d.as_str(), *i)));
        }
        metrics::counter!(crate::metrics::CHUNKS_SKIPPED, "reason" => "unchanged").increment(unchanged);
        metrics::counter!(crate::metrics::CHUNKS_SKIPPED, "reason" => "already_parked")
            .increment(already_parked);
        metrics::counter!(crate::metrics::CHUNKS_SKIPPED, "reason" => "leased_elsewhere")
            .increment(leased_elsewhere);
        leased
    }

    /// Splits the chunks into provider batches (by count and characters); what fails the
    /// pre-flight checks joins `park` instead.
    fn provider_batches(
        &self,
        chunks: Vec<(Chunk, String, i64)>,
        mut park: Vec<ParkedChunk>,
        leased: &HashSet<(String, i32)>,
    ) -> (Vec<Vec<Claimed>>, Vec<ParkedChunk>) {
        let opts = &self.pipeline.options;
        let mut batches: Vec<Vec<Claimed>> = Vec::new();
        let (mut current, mut chars) = (Vec::new(), 0usize);
        for (chunk, hash, seq) in chunks {
            if let Some((reason, detail)) = preflight(&chunk, opts.max_input_chars) {
                park.push(ParkedChunk {
                    doc_id: chunk.doc_id.clone(),
                    chunk_index: chunk.chunk_index,
                    content_hash: hash,
                    payload: serde_json::to_value(&chunk).expect("chunk serializes"),
                    class: ErrorClass::PermanentInput,
                    reason: reason.as_str().into(),
                    last_error: detail,
                    last_status: None,
                    attempts: 0,
                    retry_in: None,
                    source_seq: seq,
                });
                continue;
            }
            // Characters, as replay counts them (`request_ranges`), not bytes.
            let len = chunk.text.chars().count();
            if !current.is_empty()
                && (current.len() >= opts.batch_max_inputs || chars + len > opts.batch_max_chars)
            {
                batches.push(std::mem::take(&mut current));
                chars = 0;
            }
            chars += len;
            let leased = !leased.is_empty() && leased.contains(&(chunk.doc_id.clone(), chunk.chunk_index));
            current.push(Claimed { chunk, hash, seq, leased });
        }
        if !current.is_empty() {
            batches.push(current);
        }
        (batches, park)
    }

    /// Hands the window's jobs to the workers; the parks ride with the first one.
    async fn dispatch(
        &self,
        batches: Vec<Vec<Claimed>>,
        park: Vec<ParkedChunk>,
        charge: Arc<Charge>,
        jobs: &flume::Sender<Job>,
    ) {
        let mut jobs_out: Vec<Job> = batches
            .into_iter()
            .map(|embed| Job { embed, park: Vec::new(), charge: charge.clone() })
            .collect();
        if !park.is_empty() {
            match jobs_out.first_mut() {
                Some(first) => first.park = park,
                None => jobs_out.push(Job { embed: Vec::new(), park, charge: charge.clone() }),
            }
        }
        for job in jobs_out {
            // A closed channel means every worker is gone (systemic stop): drop the job
            // unrecorded, a rerun does it.
            if let Err(flume::SendError(job)) = jobs.send_async(job).await {
                job.not_attempted(&mut self.tally.lock().unwrap().summary);
            }
        }
    }
}

/// The keys of a window as [`Store::claim_window`] takes them: the chunks first, then the
/// invalid records (the claims come back in this order).
fn window_keys(
    chunks: &[(Chunk, String, i64)],
    invalid: &[ParkedChunk],
    repeated: &HashSet<(String, i32)>,
) -> Vec<WindowKey> {
    let is_repeated = |doc_id: &str, chunk_index: i32| {
        !repeated.is_empty() && repeated.contains(&(doc_id.to_owned(), chunk_index))
    };
    let window_key = |doc_id: &str, chunk_index: i32, hash: &str, seq: i64, embeds: bool| WindowKey {
        doc_id: doc_id.to_owned(),
        chunk_index,
        content_hash: hash.to_owned(),
        source_seq: seq,
        embeds,
        repeated: is_repeated(doc_id, chunk_index),
    };
    chunks
        .iter()
        .map(|(c, hash, seq)| window_key(&c.doc_id, c.chunk_index, hash, *seq, true))
        .chain(
            invalid
                .iter()
                .map(|p| window_key(&p.doc_id, p.chunk_index, &p.content_hash, p.source_seq, false)),
        )
        .collect()
}

/// Client-side checks that save a provider call: empty input (some servers answer it with a
/// real-looking vector) and inputs beyond the configured length.
fn preflight(chunk: &Chunk, max_chars: usize) -> Option<(Reason, String)> {
    if chunk.text.trim().is_empty() {
        return Some((Reason::EmptyText, "text is empty or whitespace only".into()));
    }
    let chars = chunk.text.chars().count();
    if chars > max_chars {
        return Some((Reason::TooLong, format!("text has {chars} characters, the limit is {max_chars}")));
    }
    None
}

/// Outcomes of one job, on their way to the writer.
struct Outcomes {
    store: Vec<StoredChunk>,
    park: Vec<ParkedChunk>,
    /// The job's byte charge, released once these are written.
    charge: Arc<Charge>,
}

struct Worker {
    embedder: Embedder,
    schedule: DlqSchedule,
    tally: Arc<Mutex<Tally>>,
    cancel: CancellationToken,
    halt: CancellationToken,
    writer: flume::Sender<Outcomes>,
}

impl Worker {
    async fn run(self, jobs: flume::Receiver<Job>) {
        while let Ok(job) = jobs.recv_async().await {
            // After a systemic stop or a write failure, queued jobs are dropped unrecorded;
            // after a shutdown request they still run (they were claimed) but retry waits
            // are cut short.
            if self.halt.is_cancelled() && !self.cancel.is_cancelled() {
                job.not_attempted(&mut self.tally.lock().unwrap().summary);
                continue;
            }
            if let Some(out) = self.process(job).await
                && self.writer.send_async(out).await.is_err()
            {
                break;
            }
        }
    }

    async fn process(&self, job: Job) -> Option<Outcomes> {
        crate::failpoint::hit!("ingest_worker");
        let mut stats = BatchStats::default();
        let mut out =
            Outcomes { store: Vec::with_capacity(job.embed.len()), park: job.park, charge: job.charge };
        let mut not_attempted: Vec<(String, i32)> = Vec::new();
        if !job.embed.is_empty() {
            let texts: Vec<&str> = job.embed.iter().map(|c| c.chunk.text.as_str()).collect();
            let (outcomes, stop) =
                self.embedder.embed_batch_until_stop(&texts, &self.cancel, &mut stats).await;
            if let Some(stop) = stop {
                // Nothing is parked for a stop; what the provider embedded before it was paid
                // for and is stored, the rest is left for the rerun.
                tracing::error!(error = %stop, "provider refused the run; stopping without parking");
                let (mut store, mut left) = (Vec::new(), Vec::new());
                for (claimed, outcome) in job.embed.into_iter().zip(outcomes) {
                    match outcome {
                        ItemOutcome::Embedded(embedding) => store.push(claimed.stored(embedding)),
                        _ => left.push((claimed.chunk.doc_id, claimed.chunk.chunk_index)),
                    }
                }
                let mut t = self.tally.lock().unwrap();
                merge_stats(&mut t.summary, &stats);
                t.summary.not_attempted += (left.len() + out.park.len()) as u64;
                t.summary.note_unfinished(left.iter().map(|(d, i)| (d.as_str(), *i)));
                t.summary.note_unfinished(out.park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                if t.stop.is_none() {
                    t.stop = Some(stop);
                }
                drop(t);
                self.halt.cancel();
                return (!store.is_empty()).then(|| Outcomes { store, park: Vec::new(), charge: out.charge });
            }
            for (claimed, outcome) in job.embed.into_iter().zip(outcomes) {
                match outcome {
                    ItemOutcome::Embedded(embedding) => out.store.push(claimed.stored(embedding)),
                    ItemOutcome::Failed(f) => out.park.push(ParkedChunk {
                        payload: serde_json::to_value(&claimed.chunk).expect("chunk serializes"),
                        doc_id: claimed.chunk.doc_id,
                        chunk_index: claimed.chunk.chunk_index,
                        content_hash: claimed.hash,
                        retry_in: f.class.is_replayable().then(|| self.schedule.delay(0)),
                        source_seq: claimed.seq,
                        class: f.class,
                        reason: f.reason.as_str().into(),
                        last_error: f.detail,
                        last_status: f.status,
                        attempts: f.attempts,
                    }),
                    ItemOutcome::NotAttempted => {
                        not_attempted.push((claimed.chunk.doc_id, claimed.chunk.chunk_index));
                    }
                }
            }
        }
        let mut t = self.tally.lock().unwrap();
        merge_stats(&mut t.summary, &stats);
        t.summary.not_attempted += not_attempted.len() as u64;
        t.summary.note_unfinished(not_attempted.iter().map(|(d, i)| (d.as_str(), *i)));
        Some(out)
    }
}

/// A writer: gathers the workers' outcomes into large statements (the provider's batch size
/// is not the database's), one store and one park statement per flush. A couple of writers
/// keep the database busy while the other one is between statements.
struct Writer {
    store: Store,
    tally: Arc<Mutex<Tally>>,
    halt: CancellationToken,
    progress: Progress,
    rows: usize,
    linger: Duration,
    /// Told of every outcome once its write committed (a stream source acknowledges it).
    acks: Option<Arc<source::Acks>>,
}

/// The longest a finished outcome waits in a writer for its statement to fill up, when a
/// slow trickle keeps the writer from ever being idle for `linger`.
const MAX_GATHER: Duration = Duration::from_secs(1);

/// What a writer has gathered and not yet written.
#[derive(Default)]
struct Gathered {
    store: Vec<StoredChunk>,
    park: Vec<ParkedChunk>,
    keys: HashSet<(String, i32)>,
    /// Byte charges of the gathered outcomes, released once they are written.
    charges: Vec<Arc<Charge>>,
    /// When the gathered outcomes are written if no more arrive: `linger` after the latest
    /// one, but never later than [`MAX_GATHER`] after the oldest one.
    deadline: Option<tokio::time::Instant>,
    /// Arrival of the oldest gathered outcome.
    oldest: Option<tokio::time::Instant>,
}

impl Gathered {
    fn len(&self) -> usize {
        self.store.len() + self.park.len()
    }
}

impl Writer {
    async fn run(self, rx: flume::Receiver<Outcomes>) {
        let mut g = Gathered::default();
        let mut failed = false;
        loop {
            // Waiting on the channel holds no lock, so every writer's deadline fires on time.
            let next = match g.deadline {
                None => rx.recv_async().await.ok(),
                Some(at) => tokio::select! {
                    r = rx.recv_async() => r.ok(),
                    _ = tokio::time::sleep_until(at) => {
                        failed |= !self.flush(&mut g).await;
                        continue;
                    }
                },
            };
            let Some(out) = next else { break };
            if failed {
                // The run is stopping after a write failure: what is left stays unwritten and
                // a rerun does it.
                let mut t = self.tally.lock().unwrap();
                t.summary.not_attempted += (out.store.len() + out.park.len()) as u64;
                t.summary.note_unfinished(out.store.iter().map(|c| (c.doc_id.as_str(), c.chunk_index)));
                t.summary.note_unfinished(out.park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                continue;
            }
            let clash = out
                .store
                .iter()
                .map(|s| (&s.doc_id, s.chunk_index))
                .chain(out.park.iter().map(|p| (&p.doc_id, p.chunk_index)))
                .any(|(d, i)| g.keys.contains(&(d.clone(), i)));
            if clash {
                failed |= !self.flush(&mut g).await;
            }
            g.keys.extend(out.store.iter().map(|s| (s.doc_id.clone(), s.chunk_index)));
            g.keys.extend(out.park.iter().map(|p| (p.doc_id.clone(), p.chunk_index)));
            g.store.extend(out.store);
            g.park.extend(out.park);
            g.charges.push(out.charge);
            let now = tokio::time::Instant::now();
            let oldest = *g.oldest.get_or_insert(now);
            g.deadline = Some((now + self.linger).min(oldest + MAX_GATHER.max(self.linger)));
            if g.len() >= self.rows {
                failed |= !self.flush(&mut g).await;
            }
        }
        if !failed {
            self.flush(&mut g).await;
        }
    }

    /// Writes what is gathered; false (and the run halted) if the database refused.
    async fn flush(&self, g: &mut Gathered) -> bool {
        g.keys.clear();
        g.deadline = None;
        g.oldest = None;
        let (to_store, to_park) = (std::mem::take(&mut g.store), std::mem::take(&mut g.park));
        // Released at the end of this call, written or not.
        let _charges = std::mem::take(&mut g.charges);
        if to_store.is_empty() && to_park.is_empty() {
            return true;
        }
        crate::failpoint::hit!("ingest_writer");
        let result = async {
            let counts = with_db_retry(|| self.store.store_batch(&to_store)).await?;
            let parked = with_db_retry(|| self.store.park_batch(&to_park)).await?;
            Ok::<_, StoreError>((counts, parked))
        }
        .await;
        let mut t = self.tally.lock().unwrap();
        match result {
            Ok((counts, parked)) => {
                self.count_written(&mut t.summary, to_store.len(), counts, &to_park, &parked);
                drop(t);
                // Committed (stored, parked, or superseded by a newer record already written):
                // only now may a source acknowledge them.
                if let Some(acks) = &self.acks {
                    acks.settled(
                        to_store.iter().map(|c| c.source_seq).chain(to_park.iter().map(|p| p.source_seq)),
                    );
                }
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "database write failed; stopping the run");
                t.summary.not_attempted += (to_store.len() + to_park.len()) as u64;
                t.summary.note_unfinished(to_store.iter().map(|c| (c.doc_id.as_str(), c.chunk_index)));
                t.summary.note_unfinished(to_park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                if t.fatal.is_none() {
                    t.fatal = Some(e);
                }
                self.halt.cancel();
                false
            }
        }
    }
}

impl Writer {
    /// Adds what one flush wrote to the summary, the metrics, the log and the progress bar.
    fn count_written(
        &self,
        s: &mut IngestSummary,
        stored_rows: usize,
        counts: StoreCounts,
        to_park: &[ParkedChunk],
        parked: &ParkCounts,
    ) {
        let superseded: HashSet<usize> = parked.superseded.iter().copied().collect();
        let to_park: Vec<&ParkedChunk> =
            to_park.iter().enumerate().filter(|(n, _)| !superseded.contains(n)).map(|(_, p)| p).collect();
        for p in &to_park {
            tracing::debug!(doc_id = %Escaped(&p.doc_id), chunk_index = p.chunk_index, class = %p.class,
                reason = %p.reason, attempts = p.attempts, "parked");
        }
        let stored = stored_rows as u64 - counts.superseded;
        metrics::counter!(crate::metrics::CHUNKS_STORED).increment(stored);
        for p in &to_park {
            crate::metrics::parked(p.class, 1);
        }
        s.stored += stored;
        s.superseded += counts.superseded + superseded.len() as u64;
        s.vectors_written += counts.vectors_written;
        s.dlq_resolved += counts.dlq_resolved;
        s.vectors_withdrawn += parked.withdrawn;
        for p in &to_park {
            *s.parked.entry(p.class).or_default() += 1;
        }
        self.progress.set_counts(s.stored + s.unchanged, s.parked_total());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_keys_never_forget_a_key_even_past_the_exact_limit() {
        let mut seen = SeenKeys::new();
        assert!(!seen.contains(key_hash("a", 0)));
        assert!(!seen.insert(key_hash("a", 0)));
        assert!(seen.contains(key_hash("a", 0)));
        assert!(seen.insert(key_hash("a", 0)));
        assert!(!seen.insert(key_hash("a", 1)));
        for i in 0..(SeenKeys::EXACT_MAX as i32 + 10) {
            seen.insert(key_hash("bulk", i));
        }
        assert!(seen.exact.is_none(), "switched to the bounded filter");
        assert!(seen.insert(key_hash("a", 0)) && seen.insert(key_hash("bulk", 7)));
        // A deleted document's key (index -1) is found again past the limit too.
        assert!(seen.contains(key_hash("a", 0)) && !seen.contains(key_hash("deleted-doc", -1)));
        let fresh = (0..1000).filter(|i| !seen.insert(key_hash("new", *i))).count();
        assert!(fresh > 990, "false positives stay rare: {fresh} of 1000 new keys recognised as new");
    }
}
