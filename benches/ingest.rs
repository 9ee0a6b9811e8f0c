//! End-to-end ingest throughput against the raw write limit, measured side by side.
//!
//! ```text
//! scripts/bench.sh            # = services up + cargo bench --bench ingest
//! BENCH_CHUNKS=100000 BENCH_ROUNDS=3 BENCH_MEMORY_CHUNKS=10000,100000,1000000 scripts/bench.sh
//! ```
//!
//! - **raw**: the same number of 768-dim rows written straight into a table of the same shape
//!   with the fastest plain method measured here (binary binds, `UNNEST($::vector[])`, 500
//!   rows a statement), once over each connection count of `BENCH_RAW_CONNECTIONS` (default
//!   `1,2,4`: each connection writes its own contiguous share at the same time). Vectors are
//!   precomputed; the fastest of these writes in a round is that round's raw write limit, so a
//!   pipeline with several writers is not measured against a baseline held to one.
//! - **pipeline**: `Pipeline::run` over an in-memory JSONL corpus, against the mock provider
//!   (zero latency, no faults) over real HTTP, default settings.
//! - **unchanged rerun**: the same corpus again right after, every chunk skipped as unchanged;
//!   its rate against the fresh run just before it.
//!
//! - **floor** (with `BENCH_INGEST_FLOOR` set): the work no ingest can skip, and nothing else:
//!   the round's corpus texts embedded through the same client and mock provider (same batch
//!   size and requests in flight), their vectors written as the raw writer writes them, over
//!   as many connections as the pipeline has writers, the two overlapped. No JSONL, hashing,
//!   manifest, fencing or DLQ: the best a pipeline could do on this machine.
//!   With `BENCH_INGEST_FLOOR=manifest`, each round also times the **floor with the
//!   manifest**: the same, each write statement also inserting the batch's manifest rows
//!   (status `stored`) into a copy of `ingest_manifest` with its indexes, as a plain insert.
//!   That is the work invariant 1 adds to every chunk (a manifest row beside its vector, so
//!   that the two can be reconciled); what the pipeline does beyond it is ours.
//!
//! Rounds alternate raw and pipeline so both see the same machine noise, and each phase starts
//! from empty tables and a clean buffer pool (`TRUNCATE` + `CHECKPOINT`): neither pays for
//! writing out the other's rows. The ratio of the medians is what BENCHMARKS.md records. With `BENCH_MEMORY_CHUNKS`, the release binary also
//! ingests generated corpora of those sizes while its peak RSS (VmHWM) is sampled.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::{CpuSampler, CpuSnapshot, env_usize, median, with_database};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::db::insert_raw_rows;
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
    sqlx::raw_sql(
        "CREATE TABLE raw_embeddings (LIKE doc_embeddings INCLUDING ALL);
         CREATE TABLE raw_manifest (LIKE ingest_manifest INCLUDING ALL)",
    )
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

    // Precomputed input for the raw writers: same ids and vector size.
    let vectors: Arc<[Vector]> = (0..chunks)
        .map(|i| Vector::from(embed_dlq::testkit::mock_provider::vector_for(&format!("raw {i}"), 768)))
        .collect();
    let raw_connections: Vec<usize> = std::env::var("BENCH_RAW_CONNECTIONS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .filter(|&c| c > 0)
        .collect();
    assert!(!raw_connections.is_empty(), "BENCH_RAW_CONNECTIONS names no connection count");

    // BENCH_ONLY=streams: only the relay/replay/latency part (needs REDIS_URL).
    let only_streams = std::env::var("BENCH_ONLY").is_ok_and(|o| o == "streams");
    let rounds = if only_streams { 0 } else { rounds };
    println!("ingest benchmark: {chunks} chunks x 768 dims, {rounds} rounds (raw and pipeline alternate)");
    let (mut raw_rates, mut pipe_rates, mut single_rates) = (vec![], vec![], vec![]);
    let with_floor = std::env::var("BENCH_INGEST_FLOOR").is_ok();
    let with_manifest_floor = std::env::var("BENCH_INGEST_FLOOR").is_ok_and(|f| f == "manifest");
    let (mut floor_rates, mut manifest_floor_ratios) = (vec![], vec![]);
    let mut rerun_ratios = vec![];
    // CPU-seconds per tier of each phase: where a chunk's cost goes, beside the rates.
    let cpu = CpuSampler::start(&pool, &db_name).await;
    let per_chunk = |from: CpuSnapshot| {
        let d = cpu.snapshot().since(&from);
        format!(
            "client {:.1} + pg {:.1} ({:.1} backends) us",
            d.client * 1e6 / chunks as f64,
            (d.pg_own + d.pg_background) * 1e6 / chunks as f64,
            d.pg_own * 1e6 / chunks as f64
        )
    };
    let mut cpu_lines = vec![];
    for round in 0..rounds {
        // Every raw write starts from an empty table and a clean buffer pool; the connection
        // counts take turns going first, so none always writes onto the freshest checkpoint.
        let mut order = raw_connections.clone();
        let turn = round % order.len();
        order.rotate_left(turn);
        let mut raw_by_connections = Vec::new();
        for &connections in &order {
            sqlx::raw_sql(
                "TRUNCATE raw_embeddings, doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox; CHECKPOINT",
            )
            .execute(&pool)
            .await
            .unwrap();
            let before = cpu.snapshot();
            let raw = raw_write(&pool, &vectors, connections).await;
            cpu_lines.push(format!("raw {connections} conn: {}", per_chunk(before)));
            raw_by_connections.push((connections, chunks as f64 / raw.as_secs_f64()));
        }
        raw_by_connections.sort_by_key(|&(connections, _)| connections);
        let (best_connections, raw_rate) =
            raw_by_connections.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        // The pipeline starts from the state the raw writers started from: an empty table and
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
        let texts: Option<Arc<[String]>> = with_floor.then(|| {
            corpus
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| {
                    serde_json::from_slice::<serde_json::Value>(l).unwrap()["text"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
                .collect()
        });
        let mut floor = None;
        let mut manifest_floor = None;
        if let Some(texts) = &texts {
            let before = cpu.snapshot();
            let took = floor_write(&pool, &pipeline, texts.clone(), false).await;
            cpu_lines.push(format!("floor: {}", per_chunk(before)));
            sqlx::raw_sql("TRUNCATE raw_embeddings; CHECKPOINT").execute(&pool).await.unwrap();
            floor = Some(chunks as f64 / took.as_secs_f64());
            if with_manifest_floor {
                let before = cpu.snapshot();
                let took = floor_write(&pool, &pipeline, texts.clone(), true).await;
                cpu_lines.push(format!("floor with the manifest: {}", per_chunk(before)));
                sqlx::raw_sql("TRUNCATE raw_embeddings, raw_manifest; CHECKPOINT")
                    .execute(&pool)
                    .await
                    .unwrap();
                manifest_floor = Some(chunks as f64 / took.as_secs_f64());
            }
        }
        let (start, before) = (Instant::now(), cpu.snapshot());
        let summary =
            pipeline.run(std::io::Cursor::new(corpus.clone()), CancellationToken::new()).await.unwrap();
        let pipe = start.elapsed();
        cpu_lines.push(format!("pipeline: {}", per_chunk(before)));
        assert_eq!(summary.stored as usize, chunks, "every chunk stored: {summary:?}");
        let pipe_rate = chunks as f64 / pipe.as_secs_f64();
        // The same corpus again, nothing changed: the periodic run's usual case. Measured
        // against the fresh run just before it (same corpus, same machine moment).
        let (start, before) = (Instant::now(), cpu.snapshot());
        let again = pipeline.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
        let rerun = start.elapsed();
        cpu_lines.push(format!("unchanged rerun: {}", per_chunk(before)));
        assert_eq!(again.unchanged as usize, chunks, "every chunk unchanged: {again:?}");
        let rerun_rate = chunks as f64 / rerun.as_secs_f64();
        rerun_ratios.push(rerun_rate / pipe_rate);
        let raws: Vec<String> = raw_by_connections.iter().map(|(c, r)| format!("{c} conn {r:.0}")).collect();
        let floor_line = floor
            .map(|f| {
                format!("   floor (embed + raw write only) {f:>8.0} chunks/s, ratio {:.2}", f / raw_rate)
            })
            .unwrap_or_default();
        println!(
            "round {round}: raw {} rows/s (limit: {best_connections} conn)   pipeline {pipe_rate:>8.0} chunks/s   ratio {:.2}{floor_line}",
            raws.join(", "),
            pipe_rate / raw_rate
        );
        println!(
            "  unchanged rerun {rerun_rate:>8.0} chunks/s, {:.2}x the fresh ingest",
            rerun_rate / pipe_rate
        );
        if let Some(m) = manifest_floor {
            println!(
                "  floor with the manifest {m:>8.0} chunks/s ({:.2} of the floor); pipeline / floor with the manifest {:.2}",
                m / floor.unwrap_or(m),
                pipe_rate / m
            );
            manifest_floor_ratios.push(pipe_rate / m);
        }
        floor_rates.extend(floor);
        println!("  CPU per chunk: {}", cpu_lines.join("; "));
        cpu_lines.clear();
        raw_rates.push(raw_rate);
        pipe_rates.push(pipe_rate);
        if let Some(&(_, single)) = raw_by_connections.iter().find(|&&(c, _)| c == 1) {
            single_rates.push(single);
        }
    }
    if rounds > 0 {
        let ratios: Vec<f64> = raw_rates.iter().zip(&pipe_rates).map(|(r, p)| p / r).collect();
        let single_ratio = (single_rates.len() == rounds)
            .then(|| median(single_rates.iter().zip(&pipe_rates).map(|(r, p)| p / r).collect()));
        let floor_ratio = (floor_rates.len() == rounds)
            .then(|| median(floor_rates.iter().zip(&raw_rates).map(|(f, r)| f / r).collect()));
        let (raw_m, pipe_m, ratio_m) = (median(raw_rates), median(pipe_rates), median(ratios));
        println!(
            "median: raw limit {raw_m:.0} rows/s, pipeline {pipe_m:.0} chunks/s, ratio {ratio_m:.2} (median of the per-round ratios){}",
            single_ratio.map(|r| format!("; against one raw connection {r:.2}")).unwrap_or_default()
        );
        println!(
            "unchanged rerun: {:.2}x the fresh ingest rate (median of the per-round ratios)",
            median(rerun_ratios)
        );
        if let Some(f) = floor_ratio {
            println!(
                "floor (embed + raw write only): ratio {f:.2} of the raw limit (median of the per-round ratios)"
            );
        }
        if manifest_floor_ratios.len() == rounds {
            println!(
                "pipeline / floor with the manifest: {:.2} (median of the per-round ratios)",
                median(manifest_floor_ratios)
            );
        }
    }

    if let Ok(redis_url) = std::env::var("REDIS_URL") {
        streams_bench(&pool, &pipeline, &mock, &redis_url, env_usize("BENCH_STREAM_ROWS", 20_000), &cpu)
            .await;
    }

    if let Ok(sizes) = std::env::var("BENCH_MEMORY_CHUNKS") {
        for size in sizes.split(',').filter_map(|s| s.trim().parse::<usize>().ok()) {
            sqlx::raw_sql(
                "TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox",
            )
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

/// Writes `vectors` into `raw_embeddings` over `connections` connections at once, each its own
/// contiguous share in 500-row statements; returns the time until the last one finished.
async fn raw_write(pool: &sqlx::PgPool, vectors: &Arc<[Vector]>, connections: usize) -> Duration {
    let share = vectors.len().div_ceil(connections);
    let mut conns = Vec::new();
    for _ in 0..connections {
        conns.push(pool.acquire().await.unwrap());
    }
    let start = Instant::now();
    let mut writers = tokio::task::JoinSet::new();
    for (part, mut conn) in conns.into_iter().enumerate() {
        let vectors = vectors.clone();
        writers.spawn(async move {
            let first = (part * share).min(vectors.len());
            let last = ((part + 1) * share).min(vectors.len());
            for (n, batch) in vectors[first..last].chunks(500).enumerate() {
                let base = first + n * 500;
                let rows: Vec<(usize, &Vector)> =
                    batch.iter().enumerate().map(|(i, v)| (base + i, v)).collect();
                insert_raw_rows(&mut conn, "raw", &rows).await.unwrap();
            }
        });
    }
    while let Some(done) = writers.join_next().await {
        done.unwrap();
    }
    start.elapsed()
}

/// The ingest floor (see the module docs): `texts` embedded by `pipeline`'s client in requests
/// of its batch size, `concurrency` at a time, and written as the raw writer writes, 512 rows a
/// statement, by `writers` connections, the two overlapped; returns the time until the last
/// row was written. `with_manifest`: each statement also inserts the rows' manifest rows
/// ([`insert_floor_rows_with_manifest`]).
async fn floor_write(
    pool: &sqlx::PgPool,
    pipeline: &embed_dlq::ingest::Pipeline,
    texts: Arc<[String]>,
    with_manifest: bool,
) -> Duration {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (batch, requests, writers) =
        (pipeline.options.batch_max_inputs, pipeline.options.concurrency, pipeline.options.writers);
    let next = Arc::new(AtomicUsize::new(0));
    let mut conns = Vec::new();
    for _ in 0..writers {
        conns.push(pool.acquire().await.unwrap());
    }
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut senders = Vec::new();
    for (w, mut conn) in conns.into_iter().enumerate() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Vec<Vec<f32>>)>(16);
        senders.push(tx);
        tasks.spawn(async move {
            let mut rows: Vec<(usize, Vector)> = Vec::new();
            let mut open = true;
            while open || !rows.is_empty() {
                match rx.recv().await {
                    Some((first, vectors)) => rows
                        .extend(vectors.into_iter().enumerate().map(|(i, v)| (first + i, Vector::from(v)))),
                    None => open = false,
                }
                if rows.len() >= 512 || (!open && !rows.is_empty()) {
                    let refs: Vec<(usize, &Vector)> = rows.iter().map(|(n, v)| (*n, v)).collect();
                    if with_manifest {
                        insert_floor_rows_with_manifest(&mut conn, &format!("floor-{w}"), &refs).await;
                    } else {
                        insert_raw_rows(&mut conn, &format!("floor-{w}"), &refs).await.unwrap();
                    }
                    rows.clear();
                }
            }
        });
    }
    for _ in 0..requests {
        let (client, texts, next, senders) =
            (pipeline.embedder.client.clone(), texts.clone(), next.clone(), senders.clone());
        tasks.spawn(async move {
            loop {
                let first = next.fetch_add(batch, Ordering::Relaxed);
                if first >= texts.len() {
                    break;
                }
                let inputs: Vec<&str> =
                    texts[first..(first + batch).min(texts.len())].iter().map(String::as_str).collect();
                let response = client.embed(&inputs, 768).await.unwrap();
                let vectors = response.items.into_iter().map(|v| v.unwrap()).collect();
                senders[(first / batch) % senders.len()].send((first, vectors)).await.unwrap();
            }
        });
    }
    drop(senders);
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    start.elapsed()
}

/// [`insert_raw_rows`] with the rows' manifest rows in the same statement: a plain insert into
/// `raw_manifest` (a copy of `ingest_manifest` with its indexes) of what a fresh store writes
/// there (status `stored`, the position), then the vectors, as the raw writer writes them.
async fn insert_floor_rows_with_manifest(conn: &mut PgConnection, prefix: &str, rows: &[(usize, &Vector)]) {
    let docs: Vec<String> = rows.iter().map(|(n, _)| format!("{prefix}-{}", n / 8)).collect();
    let idxs: Vec<i32> = rows.iter().map(|(n, _)| (n % 8) as i32).collect();
    let hashes: Vec<String> = rows.iter().map(|(n, _)| format!("{n:064x}")).collect();
    let seqs: Vec<i64> = rows.iter().map(|(n, _)| *n as i64).collect();
    let vectors: Vec<&Vector> = rows.iter().map(|(_, v)| *v).collect();
    sqlx::query(
        "WITH manifest AS (
             INSERT INTO raw_manifest (target_table, doc_id, chunk_index, content_hash, status, source_seq)
             SELECT 'raw_embeddings', doc_id, chunk_index, content_hash, 'stored', source_seq
               FROM UNNEST($1::text[], $2::int[], $3::text[], $5::bigint[])
                    AS i(doc_id, chunk_index, content_hash, source_seq)
             RETURNING 1
         )
         INSERT INTO raw_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[], $4::vector[])
          WHERE (SELECT count(*) FROM manifest) = cardinality($1::text[])",
    )
    .bind(&docs)
    .bind(&idxs)
    .bind(&hashes)
    .bind(&vectors)
    .bind(&seqs)
    .execute(conn)
    .await
    .unwrap();
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
///
/// With `BENCH_RELAY_CEILING` set, each round also times the floor of any outbox relay: the
/// same rows read from Postgres in batches of the relay's size (by id, no locks, no marks)
/// and appended with plain pipelined `XADD` (no dedup), to a fresh key: what a relay costs
/// when it does nothing but move the rows, whatever its design.
async fn relay_rounds(
    pool: &sqlx::PgPool,
    redis: &mut embed_dlq::streams::RedisConn,
    keys: &embed_dlq::streams::StreamKeys,
    raw_key: &str,
    body: &str,
    rows: usize,
    cpu: &CpuSampler,
) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::streams::StreamKeys;
    // CPU per row of a pass, by tier: where a relay's cost goes next to its floor's.
    let mut info_conn = redis.clone();
    let mut cpu_of = async |since: Option<(CpuSnapshot, f64)>| -> ((CpuSnapshot, f64), String) {
        let now = (cpu.snapshot(), redis_cpu_secs(&mut info_conn).await);
        let line = since.map_or(String::new(), |(before, redis_before)| {
            let d = now.0.since(&before);
            format!(
                "client {:.1} + pg {:.1} + redis {:.1} us",
                d.client * 1e6 / rows as f64,
                (d.pg_own + d.pg_background) * 1e6 / rows as f64,
                (now.1 - redis_before) * 1e6 / rows as f64
            )
        });
        (now, line)
    };
    let rounds = env_usize("BENCH_RELAY_ROUNDS", 1).max(1);
    let per_call = env_usize("BENCH_RELAY_ROWS_PER_CALL", RelayConfig::default().rows_per_call);
    let compare = std::env::var("BENCH_RELAY_COMPARE").is_ok();
    let ceiling = std::env::var("BENCH_RELAY_CEILING").is_ok();
    let (mut raws, mut relays, mut singles, mut ceilings) = (vec![], vec![], vec![], vec![]);
    let mut ceilings_scripted = vec![];
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
            // Every row to be published again (to fresh stream keys: new dedup records).
            sqlx::query("UPDATE relay_position SET lower = '3:3:', upper = NULL, after_id = 0, last_id = 0")
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
            let (before, _) = cpu_of(None).await;
            let start = Instant::now();
            if compare && n == 0 {
                while relay.run_once().await.unwrap().claimed > 0 {}
            } else {
                while relay.drain(&CancellationToken::new()).await.unwrap().claimed > 0 {}
            }
            let rate = rows as f64 / start.elapsed().as_secs_f64();
            println!("  relay CPU per row: {}", cpu_of(Some(before)).await.1);
            if compare && n == 0 {
                singles.push(rate)
            } else {
                relays.push(rate)
            }
            if !last {
                let _: () = redis::cmd("DEL").arg(target.events()).query_async(redis).await.unwrap();
            }
        }
        if ceiling {
            let batch = env_usize("BENCH_RELAY_BATCH", RelayConfig::default().batch);
            for scripted in [false, true] {
                let target = format!("{{bench-{}}}:ceiling", std::process::id());
                let (before, _) = cpu_of(None).await;
                let start = Instant::now();
                ceiling_pass(pool, redis, &target, batch, per_call, scripted).await;
                let rate = rows as f64 / start.elapsed().as_secs_f64();
                let what = if scripted { "floor in a script" } else { "floor" };
                println!("  {what} CPU per row: {}", cpu_of(Some(before)).await.1);
                if scripted {
                    ceilings_scripted.push(rate)
                } else {
                    ceilings.push(rate)
                }
                let _: () = redis::cmd("DEL").arg(&target).query_async(redis).await.unwrap();
            }
        }
        let raw = raws[round];
        let ceiling_line = ceilings
            .get(round)
            .map(|c| {
                let s = ceilings_scripted[round];
                format!(
                    "   read + XADD only {c:>8.0} ({:.2}), in a script {s:>8.0} ({:.2}), relay / read + XADD {:.2}",
                    c / raw,
                    s / raw,
                    relays[round] / c
                )
            })
            .unwrap_or_default();
        let single = if compare {
            format!("   one row a call {:>8.0} ({:.2})", singles[round], singles[round] / raw)
        } else {
            String::new()
        };
        println!(
            "relay round {round}: {:>8.0} outbox rows/s ({per_call} rows a call)   raw pipelined XADD {raw:>8.0} entries/s   ratio {:.2}{single}{ceiling_line}",
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
    let single = match ceilings.is_empty() {
        true => single,
        false => format!(
            "{single}, read + XADD only {:.2}, in a script {:.2}; relay / read + XADD only {:.2}",
            median(ceilings.iter().zip(&raws).map(|(c, x)| c / x).collect()),
            median(ceilings_scripted.iter().zip(&raws).map(|(c, x)| c / x).collect()),
            median(relays.iter().zip(&ceilings).map(|(r, c)| r / c).collect())
        ),
    };
    println!(
        "relay: {:>8.0} outbox rows/s   raw pipelined XADD {:>8.0} entries/s   ratio {ratio:.2}{single} (medians of {rounds} rounds)",
        median(relays),
        median(raws)
    );
}

/// One pass of the relay's floor over every outbox row (see [`relay_rounds`]): batches of
/// `batch` rows read by id without locks or marks, the read of batch N+1 overlapped with
/// the append of batch N, appended to `target` with plain pipelined `XADD` or, when
/// `scripted`, by a script of `per_call` rows that does the `XADD`s and writes one record per
/// call (what a relay that tracks publication per batch would leave to Redis).
async fn ceiling_pass(
    pool: &sqlx::PgPool,
    redis: &mut embed_dlq::streams::RedisConn,
    target: &str,
    batch: usize,
    per_call: usize,
    scripted: bool,
) {
    type Rows = Vec<(i64, String, String, String)>;
    async fn read(pool: &sqlx::PgPool, after: i64, batch: usize) -> Rows {
        sqlx::query_as(
            "SELECT id, event_id::text, event, body::text FROM dlq_outbox WHERE id > $1 ORDER BY id LIMIT $2",
        )
        .bind(after)
        .bind(batch as i64)
        .fetch_all(pool)
        .await
        .unwrap()
    }
    let script = redis::Script::new(
        "for r = 0, (#ARGV / 4) - 1 do
           redis.call('XADD', KEYS[1], '*', 'event_id', ARGV[r*4+1], 'outbox_id', ARGV[r*4+2],
                      'event', ARGV[r*4+3], 'body', ARGV[r*4+4])
         end
         redis.call('SET', KEYS[2], ARGV[#ARGV - 3])
         return 1",
    );
    let record = format!("{target}:record");
    let mut rows = read(pool, 0, batch).await;
    while let Some(last) = rows.last().map(|r| r.0) {
        let mut pipe = redis::pipe();
        if scripted {
            pipe.load_script(&script).ignore();
        }
        for call in rows.chunks(per_call.max(1)) {
            if scripted {
                let mut invocation = script.prepare_invoke();
                invocation.key(target).key(&record);
                for (id, event_id, event, body) in call {
                    invocation.arg(event_id).arg(id).arg(event).arg(body);
                }
                pipe.invoke_script(&invocation).ignore();
            } else {
                for (id, event_id, event, body) in call {
                    pipe.cmd("XADD")
                        .arg(target)
                        .arg("*")
                        .arg("event_id")
                        .arg(event_id)
                        .arg("outbox_id")
                        .arg(id)
                        .arg("event")
                        .arg(event)
                        .arg("body")
                        .arg(body)
                        .ignore();
                }
            }
        }
        let mut conn = redis.clone();
        let (next, appended) = tokio::join!(read(pool, last, batch), pipe.query_async::<()>(&mut conn));
        appended.unwrap();
        rows = next;
    }
}

/// The CPU-seconds (user + system) the Redis server behind `redis` has used, from `INFO cpu`.
async fn redis_cpu_secs(redis: &mut embed_dlq::streams::RedisConn) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(redis).await.unwrap();
    info.lines()
        .filter_map(|l| l.strip_prefix("used_cpu_sys:").or_else(|| l.strip_prefix("used_cpu_user:")))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

/// Relay and replay rates, and park-to-stream latency.
async fn streams_bench(
    pool: &sqlx::PgPool,
    pipeline: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    redis_url: &str,
    rows: usize,
    cpu: &CpuSampler,
) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::streams::{self, StreamKeys};

    sqlx::raw_sql("TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox")
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
    relay_rounds(pool, &mut redis, &keys, &raw_key, &body, rows, cpu).await;

    // Replay against the ingest pipeline, side by side, `BENCH_REPLAY_ROUNDS` rounds.
    replay_bench(pool, pipeline, &parking, mock, &client, &mut redis, &keys, rows, cpu).await;

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

/// Replay rate against the ingest pipeline's, measured side by side: each round ingests
/// `rows` chunks through the pipeline (the baseline), then parks `rows` chunks during an
/// outage and times their replay: schedule (since 2026-12-03 the scheduler appends the work
/// items itself: the relay phase has nothing left to move) + relay + `BENCH_REPLAYERS`
/// replayers (default 2, `serve`'s default) draining them (load rows, re-embed via the mock, fenced commit, `XACK`). Sequential by
/// default (the phases are timed apart); `BENCH_REPLAY_OVERLAP=1` starts the replayers
/// first, as `serve` runs them beside the scheduler and the relay. The ratio recorded in
/// BENCHMARKS.md is the median of the per-round ratios.
///
/// Knobs: `BENCH_REPLAY_ROUNDS` (default 3), `BENCH_REPLAY_BATCH` (entries per read and
/// commit; default `ReplayConfig`'s), `BENCH_REPLAY_IN_FLIGHT` (provider requests of a batch in
/// flight; default the pipeline's `concurrency`), `BENCH_REPLAY_OVERLAP`, `BENCH_REPLAYERS`,
/// `BENCH_REPLAY_PIPELINE` (`0`: each replayer commits a batch before reading the next,
/// instead of preparing the next one during the commit as `serve` does), `BENCH_REPLAY_CAP`
/// (the outstanding cap; default the round's rows), `BENCH_REPLAY_FLOOR` (after each round,
/// [`replay_floor`] over as many fresh parked rows: what any replay must do, nothing else).
#[allow(clippy::too_many_arguments)]
async fn replay_bench(
    pool: &sqlx::PgPool,
    pipeline: &embed_dlq::ingest::Pipeline,
    parking: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    client: &embed_dlq::streams::RedisClient,
    redis: &mut embed_dlq::streams::RedisConn,
    keys: &embed_dlq::streams::StreamKeys,
    rows: usize,
    cpu: &CpuSampler,
) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::replay::{InFlight, ReplayConfig, Replayer, Scheduler};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let rounds = env_usize("BENCH_REPLAY_ROUNDS", 3).max(1);
    let overlap = std::env::var("BENCH_REPLAY_OVERLAP").is_ok_and(|v| v == "1");
    // `serve`'s default (`[serve] replayers`).
    let replayers = env_usize("BENCH_REPLAYERS", 2).max(1);
    // `BENCH_REPLAY_PIPELINE=0`: each replayer commits a batch before it reads the next.
    let pipelined = std::env::var("BENCH_REPLAY_PIPELINE").map_or(true, |v| v != "0");
    let defaults = ReplayConfig::default();
    let config = ReplayConfig {
        batch: env_usize("BENCH_REPLAY_BATCH", defaults.batch),
        request_inputs: pipeline.options.batch_max_inputs,
        request_chars: pipeline.options.batch_max_chars,
        requests_in_flight: env_usize("BENCH_REPLAY_IN_FLIGHT", pipeline.options.concurrency),
        block: Duration::from_millis(100),
        // The whole round outstanding at once, so the schedule and relay phases are timed
        // apart as before the cap (with the default cap the scheduler issues work only as
        // it is settled, which `BENCH_REPLAY_OVERLAP=1` measures). `BENCH_REPLAY_CAP` sets
        // it (e.g. the default, 10,000, below the round's rows: `serve` draining a backlog
        // bigger than its cap, with `BENCH_REPLAY_OVERLAP=1`).
        outstanding_max: env_usize("BENCH_REPLAY_CAP", rows.max(defaults.outstanding_max)),
        ..defaults
    };
    embed_dlq::replay::ensure_group(redis, keys).await.unwrap();
    let relay_config = RelayConfig { replay_maxlen: config.outstanding_max, ..RelayConfig::default() };
    let mut relay = Relay::new(pool.clone(), redis.clone(), keys.clone(), relay_config);
    let (mut ingest_rates, mut replay_rates, mut ratios) = (vec![], vec![], vec![]);
    // `BENCH_REPLAY_FLOOR`: after each round, the replay floor over as many fresh parked rows.
    let with_floor = std::env::var("BENCH_REPLAY_FLOOR").is_ok();
    let (mut floor_ratios, mut floor_to_ingest) = (vec![], vec![]);
    for round in 0..rounds {
        // Baseline: the ingest pipeline over `rows` fresh chunks.
        sqlx::raw_sql(
            "TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox; CHECKPOINT",
        )
        .execute(pool)
        .await
        .unwrap();
        let mut corpus = Vec::new();
        let spec = CorpusSpec { doc_prefix: format!("ib{round}"), chunks: rows, ..CorpusSpec::default() };
        write_corpus(&mut corpus, &spec, 100_000).unwrap();
        let mut info_conn = redis.clone();
        let mut redis_cpu = redis_cpu_secs(&mut info_conn).await;
        let (start, mut phase_cpu) = (Instant::now(), cpu.snapshot());
        let mut cpu_lines = vec![];
        let mut book = async |what: &str| {
            let (now, now_redis) = (cpu.snapshot(), redis_cpu_secs(&mut info_conn).await);
            let d = now.since(&phase_cpu);
            cpu_lines.push(format!(
                "{what} client {:.1} + pg {:.1} (background {:.1}) + redis {:.1} us",
                d.client * 1e6 / rows as f64,
                (d.pg_own + d.pg_background) * 1e6 / rows as f64,
                d.pg_background * 1e6 / rows as f64,
                (now_redis - redis_cpu) * 1e6 / rows as f64
            ));
            (phase_cpu, redis_cpu) = (now, now_redis);
        };
        let summary = pipeline.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
        let ingest_rate = rows as f64 / start.elapsed().as_secs_f64();
        book("ingest").await;
        assert_eq!(summary.stored as usize, rows, "{summary:?}");

        // `rows` parked chunks, their `parked` events relayed, all due now.
        sqlx::raw_sql("TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox")
            .execute(pool)
            .await
            .unwrap();
        let mut corpus = Vec::new();
        let spec = CorpusSpec { doc_prefix: format!("rp{round}"), chunks: rows, ..CorpusSpec::default() };
        write_corpus(&mut corpus, &spec, 100_000).unwrap();
        mock.control.set_outage(true);
        parking.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
        mock.control.set_outage(false);
        while relay.run_once().await.unwrap().claimed > 0 {}
        sqlx::raw_sql("UPDATE embedding_dlq SET next_retry_at = now(); CHECKPOINT")
            .execute(pool)
            .await
            .unwrap();
        book("park (outage) + relay").await;

        // The replay: replayers run until every row is settled.
        let settled = Arc::new(AtomicU64::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let spawn_replayers = || {
            (0..replayers)
                .map(|n| {
                    let mut rep = Replayer {
                        name: format!("bench-{round}-{n}"),
                        store: pipeline.store.clone(),
                        embedder: pipeline.embedder.clone(),
                        client: client.clone(),
                        redis: redis.clone(),
                        keys: keys.clone(),
                        config: config.clone(),
                        paused_until: None,
                    };
                    let (client, settled, done) = (client.clone(), settled.clone(), done.clone());
                    tokio::spawn(async move {
                        let mut conn =
                            embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
                        let (never, mut flight) = (CancellationToken::new(), InFlight::default());
                        loop {
                            // As `serve` runs it (a batch prepared while the one before
                            // commits), or one batch after the other.
                            let c = match pipelined {
                                true => rep.step(&mut conn, &never, &never, &mut flight).await.unwrap(),
                                false => rep.read_once(&mut conn, &never).await.unwrap(),
                            };
                            let n = c.replayed + c.reparked + c.exhausted + c.skipped + c.postponed;
                            if settled.fetch_add(n, Ordering::Relaxed) + n >= rows as u64 {
                                done.notify_one();
                            }
                        }
                    })
                })
                .collect::<Vec<_>>()
        };
        let scheduler = Scheduler::new(pipeline.store.clone(), config.clone(), redis.clone(), keys.clone());
        let for_all = |settled: &AtomicU64| settled.load(Ordering::Relaxed) >= rows as u64;
        let start = Instant::now();
        let (tasks, phases) = if overlap {
            let mut tasks = spawn_replayers();
            // As `serve` runs it: passes whenever the replayers settle work, so a backlog
            // bigger than the cap is issued as the cap frees.
            // Aborted with the replayers at the end.
            tasks.push(tokio::spawn(async move { scheduler.run(CancellationToken::new()).await.unwrap() }));
            while relay.run_once().await.unwrap().claimed > 0 {}
            (tasks, String::new())
        } else {
            scheduler.run_once().await.unwrap();
            let scheduled = start.elapsed();
            book("schedule").await;
            while relay.run_once().await.unwrap().claimed > 0 {}
            let relayed = start.elapsed();
            book("relay").await;
            let tasks = spawn_replayers();
            (
                tasks,
                format!(
                    "schedule {:.2}s, relay {:.2}s, drain ",
                    scheduled.as_secs_f64(),
                    (relayed - scheduled).as_secs_f64()
                ),
            )
        };
        let before_drain = start.elapsed();
        while !for_all(&settled) {
            done.notified().await;
        }
        let elapsed = start.elapsed();
        for t in &tasks {
            t.abort();
        }
        book(if overlap { "replay" } else { "drain" }).await;
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(pool).await.unwrap();
        assert_eq!(left, 0, "every parked row replayed");
        let replay_rate = rows as f64 / elapsed.as_secs_f64();
        let phases = if overlap {
            format!("overlapped, {:.2}s", elapsed.as_secs_f64())
        } else {
            format!("{phases}{:.2}s", (elapsed - before_drain).as_secs_f64())
        };
        println!(
            "replay round {round}: ingest pipeline {ingest_rate:>8.0} chunks/s   replay {replay_rate:>8.0} items/s ({phases})   ratio {:.2}",
            replay_rate / ingest_rate
        );
        println!("  CPU per item: {}", cpu_lines.join("; "));
        ingest_rates.push(ingest_rate);
        replay_rates.push(replay_rate);
        ratios.push(replay_rate / ingest_rate);
        if with_floor {
            sqlx::raw_sql(
                "TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox",
            )
            .execute(pool)
            .await
            .unwrap();
            let mut corpus = Vec::new();
            let spec = CorpusSpec { doc_prefix: format!("rf{round}"), chunks: rows, ..CorpusSpec::default() };
            write_corpus(&mut corpus, &spec, 100_000).unwrap();
            mock.control.set_outage(true);
            parking.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
            mock.control.set_outage(false);
            sqlx::raw_sql("UPDATE embedding_dlq SET next_retry_at = now(); CHECKPOINT")
                .execute(pool)
                .await
                .unwrap();
            let (before, before_redis) = (cpu.snapshot(), redis_cpu_secs(&mut redis.clone()).await);
            let elapsed = replay_floor(pool, pipeline, &config, replayers * 2).await;
            let d = cpu.snapshot().since(&before);
            let redis_us = (redis_cpu_secs(&mut redis.clone()).await - before_redis) * 1e6 / rows as f64;
            let floor_rate = rows as f64 / elapsed.as_secs_f64();
            println!(
                "  replay floor: {floor_rate:>8.0} items/s ({:.2}s; CPU per item client {:.1} + pg {:.1} + redis {redis_us:.1} us)   replay / floor {:.2}   floor / ingest {:.2}",
                elapsed.as_secs_f64(),
                d.client * 1e6 / rows as f64,
                (d.pg_own + d.pg_background) * 1e6 / rows as f64,
                replay_rate / floor_rate,
                floor_rate / ingest_rate
            );
            floor_ratios.push(replay_rate / floor_rate);
            floor_to_ingest.push(floor_rate / ingest_rate);
        }
    }
    println!(
        "replay median: {:.0} items/s (schedule + relay + {replayers} replayers, batch {}{}), ingest pipeline {:.0} chunks/s, ratio {:.2} (median of the per-round ratios)",
        median(replay_rates),
        config.batch,
        if overlap { ", overlapped" } else { "" },
        median(ingest_rates),
        median(ratios)
    );
    if with_floor {
        println!(
            "replay floor medians: replay / floor {:.2}, floor / ingest {:.2} (per-round ratios)",
            median(floor_ratios),
            median(floor_to_ingest)
        );
    }
}

/// The replay floor (`BENCH_REPLAY_FLOOR`): what any replay of the parked rows must do, and
/// nothing else. `tasks` workers (twice the replayers: a replayer prepares a batch while
/// the one before commits) each take the next `config.batch` rows by id, read their texts,
/// embed them through the pipeline's client and mock (requests of `config.request_inputs`,
/// `config.requests_in_flight` at a time) and write the outcome in one statement: the DLQ rows
/// deleted, the vectors inserted, the manifest rows `stored`, one `replayed` event each (the
/// product's tables, with their triggers). No scheduler, lease, stream, lock or fence. Returns
/// the time until the last batch committed.
async fn replay_floor(
    pool: &sqlx::PgPool,
    pipeline: &embed_dlq::ingest::Pipeline,
    config: &embed_dlq::replay::ReplayConfig,
    tasks: usize,
) -> Duration {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ids: Arc<[i64]> =
        sqlx::query_scalar("SELECT id FROM embedding_dlq ORDER BY id").fetch_all(pool).await.unwrap().into();
    let next = Arc::new(AtomicUsize::new(0));
    let (batch, inputs, in_flight) =
        (config.batch, config.request_inputs.max(1), config.requests_in_flight.max(1));
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (pool, client, ids, next) =
            (pool.clone(), pipeline.embedder.client.clone(), ids.clone(), next.clone());
        workers.spawn(async move {
            loop {
                let first = next.fetch_add(batch, Ordering::Relaxed);
                if first >= ids.len() {
                    break;
                }
                let mine = &ids[first..(first + batch).min(ids.len())];
                let loaded: Vec<(i64, String, i32, String, String)> = sqlx::query_as(
                    "SELECT id, doc_id, chunk_index, content_hash, payload->>'text' FROM embedding_dlq WHERE id = ANY($1)",
                )
                .bind(mine)
                .fetch_all(&pool)
                .await
                .unwrap();
                let texts: Vec<&str> = loaded.iter().map(|r| r.4.as_str()).collect();
                let requests: Vec<_> = texts.chunks(inputs).map(|group| client.embed(group, 768)).collect();
                let answers: Vec<_> = futures::stream::iter(requests).buffered(in_flight).collect().await;
                let vectors: Vec<Vector> = answers
                    .into_iter()
                    .flat_map(|a| a.unwrap().items.into_iter().map(|v| Vector::from(v.unwrap())))
                    .collect();
                let ids: Vec<i64> = loaded.iter().map(|r| r.0).collect();
                let docs: Vec<&str> = loaded.iter().map(|r| r.1.as_str()).collect();
                let idxs: Vec<i32> = loaded.iter().map(|r| r.2).collect();
                let hashes: Vec<&str> = loaded.iter().map(|r| r.3.as_str()).collect();
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(REPLAY_FLOOR_SQL)
                    .bind(&ids)
                    .bind(&docs)
                    .bind(&idxs)
                    .bind(&hashes)
                    .bind(&vectors)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        });
    }
    while let Some(done) = workers.join_next().await {
        done.unwrap();
    }
    start.elapsed()
}

/// The replay floor's one statement a batch (see [`replay_floor`]).
const REPLAY_FLOOR_SQL: &str = "WITH gone AS (
         DELETE FROM embedding_dlq WHERE id = ANY($1)
         RETURNING id, target_table, doc_id, chunk_index, generation, error_class, attempts, replays
     ), vectors AS (
         INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::vector[])
     ), manifest AS (
         UPDATE ingest_manifest m SET status = 'stored', updated_at = now()
           FROM gone g
          WHERE m.target_table = g.target_table AND m.doc_id = g.doc_id AND m.chunk_index = g.chunk_index
     ), events AS (
         INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
         SELECT 'replayed', id, target_table, doc_id, chunk_index,
                embed_dlq_event('replayed', id, target_table, doc_id, chunk_index, generation,
                                jsonb_build_object('error_class', error_class, 'attempts', attempts,
                                                   'replays', replays + 1, 'at', now()))
           FROM gone
     )
     SELECT count(*) FROM gone";
