//! The documented bound of every ingest option (re-exported in `config::bounds`, with the
//! bounds of the other settings). [`super::IngestOptions::within_bounds`] applies them when
//! a run starts, so options built by hand in Rust, which no config check sees, are held to
//! the same limits as the ones read from flags and files.

use std::ops::RangeInclusive;

/// OpenAI accepts at most 2048 inputs per request.
pub const BATCH_MAX_INPUTS: RangeInclusive<usize> = 1..=2048;
/// `price_per_million_tokens`: the dearest embedding models cost well under 1 a million
/// tokens; 1000 leaves room for any currency while catching a price given per token.
pub const PRICE_PER_MILLION_TOKENS: RangeInclusive<f64> = 0.0..=1000.0;
/// `batch_max_chars`: at most 10 million characters per request.
pub const BATCH_MAX_CHARS: RangeInclusive<usize> = 1..=10_000_000;
/// Each request is a task holding a batch; the pool also grows with it.
pub const CONCURRENCY: RangeInclusive<usize> = 1..=256;
/// Each writer holds a database connection.
pub const WRITERS: RangeInclusive<usize> = 1..=32;
/// `max_input_chars`: longer inputs are parked as too long without a request.
pub const MAX_INPUT_CHARS: RangeInclusive<usize> = 1..=1_000_000;
/// `max_line_bytes`: 64 bytes to 64 MiB per JSONL line.
pub const MAX_LINE_BYTES: RangeInclusive<usize> = 64..=64 * 1024 * 1024;
/// In-flight input bytes of an ingest (the byte budget).
pub const MAX_INFLIGHT_BYTES: RangeInclusive<u64> =
    super::budget::ByteBudget::MIN..=super::budget::ByteBudget::MAX;
/// `lease_secs`: 1 second to 1 hour (longer only delays the takeover of a hung run's work).
pub const LEASE_SECS: RangeInclusive<u64> = 1..=3600;
/// Records filtered against the manifest in one lookup (and claimed in one lease statement).
pub const INTAKE_WINDOW: RangeInclusive<usize> = 1..=8192;
/// Rows per store or park statement: 4096 rows of 16000-dim vectors is 256 MB of binds.
pub const WRITE_BATCH_ROWS: RangeInclusive<usize> = 1..=4096;
/// How long a partly filled batch may wait for more records: 0 to 10 seconds.
pub const BATCH_LINGER_MS: RangeInclusive<u64> = 0..=10_000;
/// `cleanup_max_fraction`: the share of the table's chunks a full cleanup may delete without
/// `--yes`, 0 (any deletion needs it) to 1 (never asks).
pub const CLEANUP_MAX_FRACTION: RangeInclusive<f64> = 0.0..=1.0;
/// `cleanup_max_rejected_lines`: rejected input lines a run may have and still clean up.
pub const CLEANUP_MAX_REJECTED_LINES: RangeInclusive<u64> = 0..=1_000_000_000;
