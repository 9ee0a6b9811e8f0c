//! Measures `on_outage` (wait, park, stop) against the mock provider while it answers 503 to
//! everything, next to the raw write rate of the same database, for the outage section of
//! docs/guarantees.md. Default settings (64 inputs a request, 4 concurrent requests, 5
//! attempts, the breaker opening after 20 consecutive failures and probing at 2 s doubling to 60 s).
//!
//! ```sh
//! eval "$(scripts/services.sh up)"     # sets DATABASE_URL
//! OUTAGE_CHUNKS=20000 OUTAGE_WAIT_SECS=45 cargo run --release --example outage_modes
//! ```
//!
//! Per mode, on a fresh database: wall time, where the chunks went, provider calls (canary
//! probes among them), and for `park` the rate after the breaker opened (from the last work
//! request the mock saw to the end of the run). `no breaker` is the way the demo parks an
//! outage (one attempt, a breaker that never opens): the rate parking can reach.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::embed::gate::{BreakerConfig, OnOutage, ProviderGate};
use embed_dlq::ingest::{IngestError, IngestSummary};
use embed_dlq::testkit::TestDb;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider, vector_for};
use pgvector::Vector;
use tokio_util::sync::CancellationToken;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let chunks = env_u64("OUTAGE_CHUNKS", 20_000) as usize;
    let wait_secs = env_u64("OUTAGE_WAIT_SECS", 45);
    let corpus: Vec<u8> = (0..chunks)
        .map(|i| {
            let text = format!("outage chunk {i} with a few words of text to embed");
            format!(
                "{}\n",
                serde_json::json!({"doc_id": format!("o-{}", i / 8), "chunk_index": i % 8, "text": text})
            )
        })
        .collect::<String>()
        .into_bytes();

    let db = TestDb::new().await;
    let raw = raw_write_rate(&db, chunks).await;
    println!("{chunks} chunks; raw write rate {raw:.0} rows/s (768-dim vectors, UNNEST, 500 a statement)");
    drop(db);

    for (label, mode) in [
        ("no breaker", None),
        ("park", Some(OnOutage::Park)),
        ("stop", Some(OnOutage::Stop)),
        ("wait", Some(OnOutage::Wait)),
    ] {
        let db = TestDb::new().await;
        let mock = MockProvider::start(
            MockConfig::default(),
            SocketAddr::from(([127, 0, 0, 1], 0)),
            CancellationToken::new(),
        )
        .await
        .unwrap();
        mock.control.set_outage(true);
        let settings = IngestSettings::resolve(
            ServiceArgs { database_url: Some(db.url.clone()), redis_url: None, ..Default::default() },
            ProviderArgs {
                base_url: Some(mock.base_url()),
                model: Some("outage".into()),
                ..Default::default()
            },
            IngestArgs { on_outage: mode, ..Default::default() },
            RetryArgs { max_outage_secs: Some(wait_secs), ..Default::default() },
            None,
        )
        .unwrap();
        let mut pipeline = settings.pipeline().await.unwrap();
        if mode.is_none() {
            pipeline.embedder.policy.max_attempts = 1;
            pipeline.embedder.gate = Arc::new(ProviderGate::new(BreakerConfig {
                failure_threshold: u32::MAX,
                ..Default::default()
            }));
        }
        // When the mock last saw a work request (canaries are the breaker's probes).
        let last_work = Arc::new(Mutex::new(Instant::now()));
        let watch = CancellationToken::new();
        let watcher = tokio::spawn({
            let (control, last_work, watch) = (mock.control.clone(), last_work.clone(), watch.clone());
            async move {
                let mut seen = 0;
                while !watch.is_cancelled() {
                    let st = control.stats();
                    if st.requests - st.canaries != seen {
                        seen = st.requests - st.canaries;
                        *last_work.lock().unwrap() = Instant::now();
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        });
        let start = Instant::now();
        let result = pipeline.run(std::io::Cursor::new(corpus.clone()), CancellationToken::new()).await;
        let end = Instant::now();
        watch.cancel();
        watcher.await.unwrap();
        let (summary, ending) = match result {
            Ok(s) => (s, "finished (exit 0)".to_string()),
            Err(IngestError::Provider { stop, summary }) => (*summary, format!("stopped (exit 4): {stop}")),
            Err(e) => panic!("{label}: {e}"),
        };
        report(label, &summary, &ending, end - start, end - *last_work.lock().unwrap(), &mock, raw);
    }
}

fn report(
    label: &str,
    s: &IngestSummary,
    ending: &str,
    elapsed: Duration,
    after_last_work: Duration,
    mock: &MockProvider,
    raw: f64,
) {
    let st = mock.control.stats();
    println!("\n== {label}: {ending}");
    println!(
        "   {:.2} s; of {} claimed: {} parked, {} not attempted; breaker opened {}",
        elapsed.as_secs_f64(),
        s.records,
        s.parked_total(),
        s.not_attempted,
        s.breaker_opened
    );
    println!(
        "   provider calls {} ({} canary probes), {} inputs; last work request {:.2} s before the end",
        st.requests,
        st.canaries,
        st.inputs,
        after_last_work.as_secs_f64()
    );
    let parked = s.parked_total() as f64;
    let whole = parked / elapsed.as_secs_f64();
    println!("   parked {whole:.0} chunks/s over the run ({:.2} of raw)", whole / raw);
    if label == "park" {
        let after = parked / after_last_work.as_secs_f64();
        println!(
            "   after the breaker opened: {after:.0} chunks/s ({:.2} of raw, counting every park in that window)",
            after / raw
        );
    }
}

/// Rows per second written straight into a table shaped like `doc_embeddings` with the
/// fastest plain method (as the ingest benchmark's raw baseline).
async fn raw_write_rate(db: &TestDb, rows: usize) -> f64 {
    sqlx::raw_sql("CREATE TABLE raw_embeddings (LIKE doc_embeddings INCLUDING ALL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let vectors: Vec<Vector> =
        (0..rows).map(|i| Vector::from(vector_for(&format!("raw {i}"), 768))).collect();
    let mut conn = db.pool.acquire().await.unwrap();
    let start = Instant::now();
    for (n, batch) in vectors.chunks(500).enumerate() {
        let rows: Vec<(usize, &Vector)> = batch.iter().enumerate().map(|(i, v)| (n * 500 + i, v)).collect();
        embed_dlq::testkit::db::insert_raw_rows(&mut conn, "raw", &rows).await.unwrap();
    }
    rows as f64 / start.elapsed().as_secs_f64()
}
