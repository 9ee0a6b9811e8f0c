//! Embeds chunks that a Rust program already holds: no JSONL, no config file. Failures are
//! classified, retried in process (capped exponential backoff, full jitter) and what still
//! fails is parked in the Postgres DLQ, where `embed-dlq serve` replays it later.
//!
//! Run it against the fault-injecting mock provider:
//!
//! ```sh
//! eval "$(scripts/services.sh up)"      # sets DATABASE_URL
//! cargo run -- mock-provider --listen 127.0.0.1:8089 --settings '{"rate_429":0.1,"rate_5xx":0.1}' &
//! EMBED_DLQ_BASE_URL=http://127.0.0.1:8089/v1 cargo run --example embed_from_rust
//! ```
//!
//! Against a real provider, also set `EMBED_DLQ_MODEL` and `EMBED_DLQ_API_KEY` (and a target
//! table whose vector size is the model's).

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::ingest::IngestSummary;
use embed_dlq::model::Chunk;
use tokio_util::sync::CancellationToken;

/// Where the example sends its chunks.
pub struct Target {
    /// Postgres with pgvector (the schema is migrated on start).
    pub database_url: String,
    /// An OpenAI-compatible API, e.g. `http://127.0.0.1:8089/v1`.
    pub base_url: String,
    /// The embedding model; part of every chunk's content hash.
    pub model: String,
}

/// Settings built in code: the same validation (and defaults) as the command line, without
/// a config file. Fields left `None` keep their defaults.
pub fn settings(target: &Target) -> anyhow::Result<IngestSettings> {
    let settings = IngestSettings::resolve(
        ServiceArgs {
            database_url: Some(target.database_url.clone()),
            redis_url: None,
            ..Default::default()
        },
        ProviderArgs {
            base_url: Some(target.base_url.clone()),
            model: Some(target.model.clone()),
            // The API key is read from EMBED_DLQ_API_KEY (`api_key_env`), never from code.
            request_timeout_ms: Some(5_000),
            ..Default::default()
        },
        IngestArgs { batch_max_inputs: Some(16), concurrency: Some(4), ..Default::default() },
        RetryArgs {
            // In-process attempts per request before a transient failure parks its chunks.
            retry_max_attempts: Some(4),
            retry_base_ms: Some(50),
            retry_cap_ms: Some(1_000),
            // First replay of a parked transient chunk by `serve`.
            dlq_base_secs: Some(30),
            ..Default::default()
        },
        None,
    )?;
    Ok(settings)
}

/// Embeds `chunks` into the default table: stored, parked or rejected, each exactly once.
/// Running it again with the same chunks makes no provider call for what is already done.
pub async fn run(
    target: &Target,
    chunks: Vec<Chunk>,
    cancel: CancellationToken,
) -> anyhow::Result<IngestSummary> {
    let pipeline = settings(target)?.pipeline().await?;
    let summary = pipeline.run_chunks(chunks, cancel).await?;
    Ok(summary)
}

/// A small document split into chunks, plus two that cannot be embedded: one the mock
/// provider rejects (`[[poison:400]]`) and an empty one (parked without a provider call).
pub fn sample_chunks() -> Vec<Chunk> {
    let text = "Postgres is the system of record. A chunk that fails is classified first. Transient \
                failures are retried with capped exponential backoff and full jitter. What still \
                fails is parked in a dead-letter table. Its outbox event is written in the same \
                transaction. The relay publishes it to Redis Streams";
    let mut chunks: Vec<Chunk> = text
        .split(". ")
        .enumerate()
        .map(|(i, sentence)| Chunk {
            doc_id: "example/handbook".into(),
            chunk_index: i as i32,
            text: sentence.into(),
            metadata: Some(serde_json::json!({ "source": "embed_from_rust", "sentence": i })),
        })
        .collect();
    chunks.push(Chunk {
        doc_id: "example/poison".into(),
        chunk_index: 0,
        text: "an input the mock rejects [[poison:400]]".into(),
        metadata: None,
    });
    chunks.push(Chunk { doc_id: "example/empty".into(), chunk_index: 0, text: "  ".into(), metadata: None });
    chunks
}

/// The summary as a few human lines.
pub fn report(s: &IngestSummary) -> String {
    let mut lines = vec![
        format!("records:   {}", s.records),
        format!("stored:    {} ({} vectors written)", s.stored, s.vectors_written),
        format!("unchanged: {} (already stored), {} already parked", s.unchanged, s.already_parked),
        format!("parked:    {}", s.parked_total()),
    ];
    lines.extend(s.parked.iter().map(|(class, n)| format!("  {class}: {n}")));
    lines.push(format!("retries:   {:?}", s.retries));
    lines.push(format!("provider:  {} calls, {} inputs", s.provider_calls, s.provider_inputs));
    if let Some(why) = &s.stopped {
        lines.push(format!("stopped:   {why}"));
    }
    lines.join("\n")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let target = Target {
        database_url: env("DATABASE_URL").ok_or_else(|| anyhow::anyhow!("set DATABASE_URL"))?,
        base_url: env("EMBED_DLQ_BASE_URL").unwrap_or_else(|| "http://127.0.0.1:8089/v1".into()),
        model: env("EMBED_DLQ_MODEL").unwrap_or_else(|| "mock".into()),
    };
    // Ctrl-C stops intake; chunks already handed to the provider finish or park.
    let shutdown = embed_dlq::shutdown::on_signal();
    let summary = run(&target, sample_chunks(), shutdown.graceful).await?;
    println!("{}", report(&summary));
    Ok(())
}
