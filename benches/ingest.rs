//! End-to-end ingest throughput against the raw write limit, measured side by side.
//!
//! ```text
//! scripts/bench.sh            # = services up + cargo bench --bench ingest
//! BENCH_CHUNKS=100000 BENCH_ROUNDS=3 BENCH_MEMORY_CHUNKS=10000,100000,1000000 scripts/bench.sh
//! ```
//!
//! - **raw**: the same number of 768-dim rows written straight into a table of the same shape
//!   with the fastest plain method measured here (binary binds, `UNNEST($::vector[])`, 500
//!   rows a statement, one connection). Vectors are precomputed: this is the database's limit.
//! - **pipeline**: `Pipeline::run` over an in-memory JSONL corpus, against the mock provider
//!   (zero latency, no faults) over real HTTP, default settings.
//!
//! Rounds alternate raw and pipeline so both see the same machine noise, and each phase starts
//! from empty tables and a clean buffer pool (`TRUNCATE` + `CHECKPOINT`): neither pays for
//! writing out the other's rows. The ratio of the medians is what BENCHMARKS.md records. With `BENCH_MEMORY_CHUNKS`, the release binary also
//! ingests generated corpora of those sizes while its peak RSS (VmHWM) is sampled.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use pgvector::Vector;
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn with_database(url: &str, db: &str) -> String {
    let base = url.split('?').next().unwrap();
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end).unwrap_or(base.len());
    format!("{}/{db}", &base[..path_start])
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

fn main() {
    // `cargo test --benches` runs benches in test mode: do nothing there.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL (run scripts/bench.sh)");
    let chunks = env_usize("BENCH_CHUNKS", 50_000);
    let rounds = env_usize("BENCH_ROUNDS", 3);
    let db_name = format!("bench_{}", std::process::id());
    let mut conn = PgConnection::connect(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db_name}\"")))
        .execute(&mut conn)
        .await
        .unwrap();
    let url = with_database(&admin, &db_name);
    let pool = embed_dlq::store::connect(&url, 8).await.unwrap();
    embed_dlq::store::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE raw_embeddings (LIKE doc_embeddings INCLUDING ALL)")
        .execute(&pool)
        .await
        .unwrap();

    let mock = MockProvider::start(
        MockConfig::default(),
        SocketAddr::from(([127, 0, 0, 1], 0)),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let settings = IngestSettings::resolve(
        ServiceArgs { database_url: Some(url.clone()), redis_url: None, ..Default::default() },
        ProviderArgs { base_url: Some(mock.base_url()), model: Some("bench".into()), ..Default::default() },
        IngestArgs {
            batch_max_inputs: std::env::var("BENCH_BATCH").ok().and_then(|v| v.parse().ok()),
            concurrency: std::env::var("BENCH_CONCURRENCY").ok().and_then(|v| v.parse().ok()),
            writers: std::env::var("BENCH_WRITERS").ok().and_then(|v| v.parse().ok()),
            ..IngestArgs::default()
        },
        RetryArgs::default(),
        None,
    )
    .unwrap();
    let pipeline = settings.pipeline().await.unwrap();

    // Precomputed input for the raw writer: same ids and vector size.
    let vectors: Vec<Vector> = (0..chunks)
        .map(|i| Vector::from(embed_dlq::testkit::mock_provider::vector_for(&format!("raw {i}"), 768)))
        .collect();

    println!("ingest benchmark: {chunks} chunks x 768 dims, {rounds} rounds (raw and pipeline alternate)");
    let (mut raw_rates, mut pipe_rates) = (vec![], vec![]);
    for round in 0..rounds {
        sqlx::raw_sql(
            "TRUNCATE raw_embeddings, doc_embeddings, ingest_manifest, embedding_dlq, dlq_outbox; CHECKPOINT",
        )
        .execute(&pool)
        .await
        .unwrap();
        let raw = raw_write(&pool, &vectors).await;
        let raw_rate = chunks as f64 / raw.as_secs_f64();
        // The pipeline starts from the state the raw writer started from: an empty table and
        // no dirty buffers. Without this it paid for writing out the raw rows (about 200 MB
        // at 50,000 chunks, most of shared_buffers) while it ran.
        sqlx::raw_sql("TRUNCATE raw_embeddings; CHECKPOINT").execute(&pool).await.unwrap();

        let mut corpus = Vec::new();
        write_corpus(
            &mut corpus,
            &CorpusSpec { doc_prefix: format!("r{round}"), chunks, ..CorpusSpec::default() },
            100_000,
        )
        .unwrap();
        let start = Instant::now();
        let summary = pipeline.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
        let pipe = start.elapsed();
        assert_eq!(summary.stored as usize, chunks, "every chunk stored: {summary:?}");
        let pipe_rate = chunks as f64 / pipe.as_secs_f64();
        println!(
            "round {round}: raw {raw_rate:>8.0} rows/s   pipeline {pipe_rate:>8.0} chunks/s   ratio {:.2}",
            pipe_rate / raw_rate
        );
        raw_rates.push(raw_rate);
        pipe_rates.push(pipe_rate);
    }
    let ratios: Vec<f64> = raw_rates.iter().zip(&pipe_rates).map(|(r, p)| p / r).collect();
    let (raw_m, pipe_m, ratio_m) = (median(raw_rates), median(pipe_rates), median(ratios));
    println!(
        "median: raw {raw_m:.0} rows/s, pipeline {pipe_m:.0} chunks/s, ratio {ratio_m:.2} (median of the per-round ratios)"
    );

    if let Ok(redis_url) = std::env::var("REDIS_URL") {
        streams_bench(&pool, &pipeline, &mock, &redis_url, env_usize("BENCH_STREAM_ROWS", 20_000)).await;
    }

    if let Ok(sizes) = std::env::var("BENCH_MEMORY_CHUNKS") {
        for size in sizes.split(',').filter_map(|s| s.trim().parse::<usize>().ok()) {
            sqlx::raw_sql("TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, dlq_outbox")
                .execute(&pool)
                .await
                .unwrap();
            let (rss_kb, secs) = memory_run(&url, &mock.base_url(), size).await;
            println!(
                "memory: {size:>8} chunks  peak RSS {:>6.1} MB  ({:.0} chunks/s, release binary)",
                rss_kb as f64 / 1024.0,
                size as f64 / secs
            );
        }
    }
    // Reconcile over whatever the last memory run left (1M manifest rows when it was 1M).
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ingest_manifest").fetch_one(&pool).await.unwrap();
    if rows > 0 {
        let mut reconciler = embed_dlq::reconcile::Reconciler {
            store: pipeline.store.clone(),
            redis: None,
            keys: embed_dlq::streams::StreamKeys::default(),
            config: Default::default(),
        };
        let report = reconciler.run_once(embed_dlq::reconcile::Mode::Check).await.unwrap();
        println!(
            "reconcile (all SQL checks) over {rows} manifest rows and {rows} vectors: {:.1}s, {} findings",
            report.duration_secs,
            report.total_found()
        );
    }
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db_name}\" WITH (FORCE)")))
        .execute(&mut conn)
        .await
        .unwrap();
}

async fn raw_write(pool: &sqlx::PgPool, vectors: &[Vector]) -> Duration {
    let mut conn = pool.acquire().await.unwrap();
    let start = Instant::now();
    for (n, batch) in vectors.chunks(500).enumerate() {
        let docs: Vec<String> = (0..batch.len()).map(|i| format!("raw-{}", (n * 500 + i) / 8)).collect();
        let idxs: Vec<i32> = (0..batch.len()).map(|i| ((n * 500 + i) % 8) as i32).collect();
        let hashes: Vec<String> = (0..batch.len()).map(|i| format!("{:064x}", n * 500 + i)).collect();
        sqlx::query(
            "INSERT INTO raw_embeddings (doc_id, chunk_index, content_hash, embedding)
             SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[], $4::vector[])",
        )
        .bind(&docs)
        .bind(&idxs)
        .bind(&hashes)
        .bind(batch)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
    start.elapsed()
}

/// Runs the release binary over a generated corpus file of `size` chunks, sampling VmHWM.
async fn memory_run(url: &str, base_url: &str, size: usize) -> (u64, f64) {
    let dir = std::env::temp_dir().join(format!("embed-dlq-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("corpus-{size}.jsonl"));
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        write_corpus(
            &mut f,
            &CorpusSpec { doc_prefix: format!("mem{size}"), chunks: size, ..CorpusSpec::default() },
            100_000,
        )
        .unwrap();
    }
    let start = Instant::now();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
        .arg("ingest")
        .arg(&path)
        .args(["--database-url", url, "--base-url", base_url, "--model", "bench", "--no-progress", "--json"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut peak_kb = 0u64;
    loop {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kb) = status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        {
            peak_kb = peak_kb.max(kb);
        }
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "memory run failed: {status}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    (peak_kb, secs)
}

/// Relay and replay rates, and park-to-stream latency.
async fn streams_bench(
    pool: &sqlx::PgPool,
    pipeline: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    redis_url: &str,
    rows: usize,
) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
    use embed_dlq::streams::{self, StreamKeys};

    sqlx::raw_sql("TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, dlq_outbox")
        .execute(pool)
        .await
        .unwrap();
    let keys = StreamKeys::new(&format!("bench-{}", std::process::id()));
    let client = streams::client(redis_url).unwrap();
    let mut redis = streams::managed(&client).await.unwrap();

    // Park `rows` chunks during an outage.
    let mut parking = pipeline.clone();
    parking.embedder.policy.max_attempts = 1;
    parking.embedder.gate = std::sync::Arc::new(embed_dlq::embed::gate::ProviderGate::new(
        embed_dlq::embed::gate::BreakerConfig { failure_threshold: u32::MAX, ..Default::default() },
    ));
    let mut corpus = Vec::new();
    write_corpus(
        &mut corpus,
        &CorpusSpec { doc_prefix: "s".into(), chunks: rows, ..CorpusSpec::default() },
        100_000,
    )
    .unwrap();
    mock.control.set_outage(true);
    parking.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
    mock.control.set_outage(false);

    // Baseline: the same number of entries with bodies of the same size, XADD pipelined 500 at a time.
    let body: String =
        sqlx::query_scalar("SELECT body::text FROM dlq_outbox LIMIT 1").fetch_one(pool).await.unwrap();
    let raw_key = format!("{{bench-{}}}:raw", std::process::id());
    let start = Instant::now();
    for chunk in (0..rows).collect::<Vec<_>>().chunks(500) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("XADD")
                .arg(&raw_key)
                .arg("*")
                .arg("outbox_id")
                .arg(*i)
                .arg("event")
                .arg("parked")
                .arg("body")
                .arg(&body)
                .ignore();
        }
        let _: () = pipe.query_async(&mut redis).await.unwrap();
    }
    let raw_rate = rows as f64 / start.elapsed().as_secs_f64();

    let mut relay = Relay::new(pool.clone(), redis.clone(), keys.clone(), RelayConfig::default());
    let start = Instant::now();
    loop {
        if relay.run_once().await.unwrap().claimed == 0 {
            break;
        }
    }
    let relay_rate = rows as f64 / start.elapsed().as_secs_f64();
    println!(
        "relay: {relay_rate:>8.0} outbox rows/s   raw pipelined XADD {raw_rate:>8.0} entries/s   ratio {:.2}",
        relay_rate / raw_rate
    );

    // Replay: schedule everything, relay the work, drain with two replayers.
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(pool).await.unwrap();
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let config = ReplayConfig { batch: 64, block: Duration::from_millis(100), ..Default::default() };
    let start = Instant::now();
    Scheduler { store: pipeline.store.clone(), config: config.clone() }.run_once().await.unwrap();
    while relay.run_once().await.unwrap().claimed > 0 {}
    let mut tasks = Vec::new();
    for n in 0..2 {
        let mut rep = Replayer {
            name: format!("bench-{n}"),
            store: pipeline.store.clone(),
            embedder: pipeline.embedder.clone(),
            client: client.clone(),
            redis: redis.clone(),
            keys: keys.clone(),
            config: config.clone(),
            paused_until: None,
        };
        let client = client.clone();
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
            loop {
                let left: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
                if left == 0 {
                    return;
                }
                rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let replay_rate = rows as f64 / start.elapsed().as_secs_f64();
    println!("replay: {replay_rate:>8.0} items/s (schedule + relay + 2 replayers, re-embed, commit, XACK)");

    // Park-to-stream latency: a relay loop woken by NOTIFY; one park at a time.
    let cancel = CancellationToken::new();
    let relay_task = tokio::spawn(
        Relay::new(pool.clone(), redis.clone(), keys.clone(), RelayConfig::default()).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::new();
    let mut last_len: usize = redis::cmd("XLEN").arg(keys.events()).query_async(&mut redis).await.unwrap();
    mock.control.set_outage(true);
    for i in 0..30 {
        let line = format!("{{\"doc_id\":\"lat\",\"chunk_index\":{i},\"text\":\"latency probe {i}\"}}\n");
        let start = Instant::now();
        parking.run(std::io::Cursor::new(line.into_bytes()), CancellationToken::new()).await.unwrap();
        let committed = start.elapsed();
        loop {
            let len: usize = redis::cmd("XLEN").arg(keys.events()).query_async(&mut redis).await.unwrap();
            if len > last_len {
                last_len = len;
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        latencies.push((start.elapsed() - committed).as_secs_f64() * 1000.0);
    }
    mock.control.set_outage(false);
    cancel.cancel();
    relay_task.await.unwrap().expect("relay stopped on a permanent error");
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "park-to-stream latency (commit to entry visible): median {:.1} ms, p90 {:.1} ms, max {:.1} ms",
        latencies[latencies.len() / 2],
        latencies[latencies.len() * 9 / 10],
        latencies[latencies.len() - 1]
    );
    let _: () = redis::cmd("DEL")
        .arg(&raw_key)
        .arg(keys.events())
        .arg(keys.replay())
        .query_async(&mut redis)
        .await
        .unwrap();
}
