//! The bound of every numeric setting (the resolver checks it and writes it down for the help
//! and the generated docs/reference/configuration.md: `super::help_bounds`).
//! Each keeps a value from exhausting memory, connections or time arithmetic: e.g. a huge
//! `concurrency` spawned millions of tasks (14.8 GB RSS), and a huge millisecond value
//! overflowed `Instant + Duration` (a panic).

use std::ops::RangeInclusive;

pub use crate::ingest::bounds::*;

/// pgvector's `vector(N)` holds at most 16000 dimensions.
pub const DIMENSIONS: RangeInclusive<usize> = 1..=16_000;
/// `request_timeout_ms`: 100 ms to 10 minutes.
pub const REQUEST_TIMEOUT_MS: RangeInclusive<u64> = 100..=600_000;
/// `retry_max_attempts`: attempts per input in one pass, the first included.
pub const RETRY_MAX_ATTEMPTS: RangeInclusive<u32> = 1..=20;
/// `retry_base_ms`: 1 ms to 1 minute.
pub const RETRY_BASE_MS: RangeInclusive<u64> = 1..=60_000;
/// Lower end is `retry_base_ms`.
pub const RETRY_CAP_MS: RangeInclusive<u64> = 1..=600_000;
/// `dlq_base_secs`: 1 second to 1 day.
pub const DLQ_BASE_SECS: RangeInclusive<u64> = 1..=86_400;
/// Lower end is `dlq_base_secs`; 30 days.
pub const DLQ_CAP_SECS: RangeInclusive<u64> = 1..=2_592_000;
/// `dlq_max_replays`: replay passes before a row is exhausted.
pub const DLQ_MAX_REPLAYS: RangeInclusive<u32> = 1..=1000;
/// `breaker_failure_threshold`: consecutive transient failures that open the breaker.
pub const BREAKER_FAILURE_THRESHOLD: RangeInclusive<u32> = 1..=10_000;
/// Up to the breaker's longest cooldown (60 s).
pub const BREAKER_COOLDOWN_MS: RangeInclusive<u64> = 10..=60_000;
/// 7 days.
pub const MAX_OUTAGE_SECS: RangeInclusive<u64> = 1..=604_800;
/// `replayers`: 0 runs only the relay and the scheduler.
pub const REPLAYERS: RangeInclusive<usize> = 0..=64;
/// `stream_shards`: each shard is a stream pair, a consumer group and a loop in every
/// replayer, `tail` and gauge sampler ([`crate::streams::MAX_SHARDS`]).
pub const STREAM_SHARDS: RangeInclusive<u16> = 1..=crate::streams::MAX_SHARDS;
/// `replay_batch`: work items per replay stream entry (the scheduler writes one entry per
/// batch of a shard's rows), and so per read, load and commit transaction (the provider
/// requests of a batch are cut by `batch_max_inputs` and `batch_max_chars`).
pub const REPLAY_BATCH: RangeInclusive<usize> = 1..=crate::model::MAX_ITEMS_PER_ENTRY;
/// 100 ms ..= 1 day.
pub const MIN_IDLE_MS: RangeInclusive<u64> = 100..=86_400_000;
/// `delivery_cap`: replays of one work item begun without an outcome before the row is
/// given up on.
pub const DELIVERY_CAP: RangeInclusive<u32> = 1..=1000;
/// `replay_lease_secs`: a second (tests) to a day; a lease must outlast a replay batch,
/// since a load extends it by as much.
pub const REPLAY_LEASE_SECS: RangeInclusive<u64> = 1..=86_400;
/// `replay_outstanding_max`: a million work items is about 300 MB of replay stream.
pub const REPLAY_OUTSTANDING_MAX: RangeInclusive<usize> = 1..=1_000_000;
/// `grace_ms`: up to 10 minutes of drain after the signal.
pub const GRACE_MS: RangeInclusive<u64> = 0..=600_000;
/// `relay_batch`: outbox rows per relay page (one read, one pipeline per shard).
pub const RELAY_BATCH: RangeInclusive<usize> = 1..=10_000;
/// `relay_poll_ms`: 10 ms to 1 minute between passes without a notification.
pub const RELAY_POLL_MS: RangeInclusive<u64> = 10..=60_000;
/// `relay_marker_ttl_secs`: an hour (a relay down longer than the record lives could show
/// a re-published event twice) to 30 days.
pub const RELAY_MARKER_TTL_SECS: RangeInclusive<u64> = 3_600..=2_592_000;
/// `events_maxlen`: at least 1000 entries (a few relay batches: trimming must never eat
/// a batch before a tail that keeps up has read it), at most a billion (hundreds of GB of
/// Redis memory; there is no "unbounded": every stream has a bound).
pub const EVENTS_MAXLEN: RangeInclusive<usize> = 1_000..=1_000_000_000;
/// 0 = never; at most 7 days.
pub const RECONCILE_EVERY_SECS: RangeInclusive<u64> = 0..=604_800;
/// 0 = every run is a full sweep; at most 30 days between full sweeps.
pub const RECONCILE_FULL_EVERY_SECS: RangeInclusive<u64> = 0..=2_592_000;
/// 0 = never a deep sweep unless asked for; at most a year between deep sweeps.
pub const RECONCILE_DEEP_EVERY_SECS: RangeInclusive<u64> = 0..=31_536_000;
/// Characters of a stream prefix or consumer name.
pub const NAME_CHARS: RangeInclusive<usize> = 1..=128;
/// Characters of a source's consumer group or consumer name.
pub const SOURCE_NAME_CHARS: RangeInclusive<usize> = 1..=256;
/// Characters of a model name.
pub const MODEL_CHARS: RangeInclusive<usize> = 1..=256;
/// `max_requests_per_minute`: up to ten million requests a minute.
pub const MAX_REQUESTS_PER_MINUTE: RangeInclusive<u32> = 1..=10_000_000;
/// `max_tokens_per_minute`: up to two billion estimated tokens a minute.
pub const MAX_TOKENS_PER_MINUTE: RangeInclusive<u32> = 1..=2_000_000_000;
/// Extra headers.
pub const MAX_HEADERS: usize = 32;
/// Postgres truncates identifiers longer than 63 bytes; we refuse them instead.
pub const IDENTIFIER_BYTES: usize = 63;
/// Characters of a URL.
pub const URL_CHARS: usize = 2048;
