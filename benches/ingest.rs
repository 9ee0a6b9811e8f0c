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
//! Rounds alternate raw and pipeline so both see the same machine noise; the ratio of the
//! medians is what BENCHMARKS.md records. With `BENCH_MEMORY_CHUNKS`, the release binary also
//! ingests generated corpora of those sizes while its peak RSS (VmHWM) is sampled.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

mod common;
use common::{env_usize, median, with_database};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use pgvector::Vector;
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

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

    // BENCH_ONLY=streams: only the relay/replay/latency part (needs REDIS_URL).
    let only_streams = std::env::var("BENCH_ONLY").is_ok_and(|o| o == "streams");
    let rounds = if only_streams { 0 } else { rounds };
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
    if rounds > 0 {
        let (raw_m, pipe_m, ratio_m) = (median(raw_rates), median(pipe_rates), median(ratios));
        println!(
            "median: raw {raw_m:.0} rows/s, pipeline {pipe_m:.0} chunks/s, ratio {ratio_m:.2} (median of the per-round ratios)"
        );
    }

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

/// Relay rounds over the `rows` parked outbox rows (`BENCH_RELAY_ROUNDS`, default 1), each
/// after raw pipelined `XADD` of as many entries of the same size (the baseline, 500 a
/// pipeline): the relay as `serve` runs it (`Relay::drain`) with `BENCH_RELAY_ROWS_PER_CALL`
/// (default: the library's) rows per script call and `BENCH_RELAY_BATCH` (default: the
/// library's) rows per pass, and with `BENCH_RELAY_COMPARE` set first the relay of before
/// (`Relay::run_once` pass after pass, one row per script call). Between relays the rows are marked unpublished again and published under
/// fresh stream keys (new markers); the last relay publishes under `keys`.
async fn relay_rounds(
    pool: &sqlx::PgPool,
    redis: &mut embed_dlq::streams::RedisConn,
    keys: &embed_dlq::streams::StreamKeys,
    raw_key: &str,
    body: &str,
    rows: usize,
) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::streams::StreamKeys;
    let rounds = env_usize("BENCH_RELAY_ROUNDS", 1).max(1);
    let per_call = env_usize("BENCH_RELAY_ROWS_PER_CALL", RelayConfig::default().rows_per_call);
    let compare = std::env::var("BENCH_RELAY_COMPARE").is_ok();
    let (mut raws, mut relays, mut singles) = (vec![], vec![], vec![]);
    for round in 0..rounds {
        let _: () = redis::cmd("DEL").arg(raw_key).query_async(redis).await.unwrap();
        let start = Instant::now();
        for chunk in (0..rows).collect::<Vec<_>>().chunks(500) {
            let mut pipe = redis::pipe();
            for i in chunk {
                pipe.cmd("XADD")
                    .arg(raw_key)
                    .arg("*")
                    .arg("outbox_id")
                    .arg(*i)
                    .arg("event")
                    .arg("parked")
                    .arg("body")
                    .arg(body)
                    .ignore();
            }
            let _: () = pipe.query_async(redis).await.unwrap();
        }
        raws.push(rows as f64 / start.elapsed().as_secs_f64());
        let mut variants = vec![per_call];
        if compare {
            variants.insert(0, 1);
        }
        for (n, &per_call) in variants.iter().enumerate() {
            let last = round + 1 == rounds && n + 1 == variants.len();
            let target =
                if last { keys.clone() } else { StreamKeys::new(&format!("{}-r{round}-{n}", keys.prefix())) };
            sqlx::query("UPDATE dlq_outbox SET published_at = NULL, entry_id = NULL")
                .execute(pool)
                .await
                .unwrap();
            sqlx::query("VACUUM ANALYZE dlq_outbox").execute(pool).await.unwrap();
            let batch = if compare && n == 0 {
                500
            } else {
                env_usize("BENCH_RELAY_BATCH", RelayConfig::default().batch)
            };
            let config = RelayConfig { rows_per_call: per_call, batch, ..RelayConfig::default() };
            let mut relay = Relay::new(pool.clone(), redis.clone(), target.clone(), config);
            let start = Instant::now();
            if compare && n == 0 {
                while relay.run_once().await.unwrap().claimed > 0 {}
            } else {
                while relay.drain(&CancellationToken::new()).await.unwrap().claimed > 0 {}
            }
            let rate = rows as f64 / start.elapsed().as_secs_f64();
            if compare && n == 0 {
                singles.push(rate)
            } else {
                relays.push(rate)
            }
            if !last {
                let _: () = redis::cmd("DEL").arg(target.events()).query_async(redis).await.unwrap();
            }
        }
        let raw = raws[round];
        let single = if compare {
            format!("   one row a call {:>8.0} ({:.2})", singles[round], singles[round] / raw)
        } else {
            String::new()
        };
        println!(
            "relay round {round}: {:>8.0} outbox rows/s ({per_call} rows a call)   raw pipelined XADD {raw:>8.0} entries/s   ratio {:.2}{single}",
            relays[round],
            relays[round] / raw
        );
    }
    let ratio = median(relays.iter().zip(&raws).map(|(r, x)| r / x).collect());
    let single = if compare {
        format!(", one row a call {:.2}", median(singles.iter().zip(&raws).map(|(r, x)| r / x).collect()))
    } else {
        String::new()
    };
    println!(
        "relay: {:>8.0} outbox rows/s   raw pipelined XADD {:>8.0} entries/s   ratio {ratio:.2}{single} (medians of {rounds} rounds)",
        median(relays),
        median(raws)
    );
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

    // Relay rounds against raw XADD; the last round leaves every row published under `keys`.
    let body: String =
        sqlx::query_scalar("SELECT body::text FROM dlq_outbox LIMIT 1").fetch_one(pool).await.unwrap();
    let raw_key = format!("{{bench-{}}}:raw", std::process::id());
    relay_rounds(pool, &mut redis, &keys, &raw_key, &body, rows).await;
    let mut relay = Relay::new(pool.clone(), redis.clone(), keys.clone(), RelayConfig::default());

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
