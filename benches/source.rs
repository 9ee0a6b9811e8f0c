//! A Redis Stream source against the corpus ingest, side by side in the same run.
//!
//! ```text
//! scripts/services.sh up; eval "$(scripts/services.sh env)"   # DATABASE_URL and REDIS_URL
//! BENCH_CHUNKS=20000 BENCH_ROUNDS=3 cargo bench --bench source
//! ```
//!
//! Each round, on the same database and the same mock provider (zero latency, no faults,
//! real HTTP), default settings:
//!
//! - **corpus**: `Pipeline::run` over an in-memory JSONL corpus of `BENCH_CHUNKS` fresh chunks.
//! - **stream**: the same number of fresh chunks, published to a source stream beforehand
//!   (pipelined `XADD`, not timed), then `Pipeline::run_source` in a consumer group, timed
//!   from its start until every entry is acknowledged (the group has nothing pending and no
//!   lag; polled every 20 ms), then stopped.
//!
//! Both start from empty tables and a clean buffer pool (`TRUNCATE` + `CHECKPOINT`); the two
//! take turns going first. The ratio of the medians (stream / corpus) is what BENCHMARKS.md
//! records.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

mod common;
use common::{BenchDb, env_usize, median};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::ingest::source::SourceOptions;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use tokio_util::sync::CancellationToken;

fn main() {
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

fn line(round: usize, kind: &str, i: usize) -> String {
    format!(
        "{}\n",
        serde_json::json!({"doc_id": format!("{kind}-{round}-{}", i / 8), "chunk_index": i % 8,
            "text": format!("{kind} round {round} chunk {i}: some text of a typical length to embed"),
            "metadata": {"n": i}})
    )
}

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let redis_url = std::env::var("REDIS_URL").expect("REDIS_URL");
    let chunks = env_usize("BENCH_CHUNKS", 20_000);
    let rounds = env_usize("BENCH_ROUNDS", 3);
    let db = BenchDb::create(&admin, &format!("bench_source_{}", std::process::id())).await;
    let mock = MockProvider::start(
        MockConfig::default(),
        SocketAddr::from(([127, 0, 0, 1], 0)),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let settings = IngestSettings::resolve(
        ServiceArgs { database_url: Some(db.url.clone()), redis_url: None, ..Default::default() },
        ProviderArgs { base_url: Some(mock.base_url()), model: Some("bench".into()), ..Default::default() },
        IngestArgs::default(),
        RetryArgs::default(),
        None,
    )
    .unwrap();
    let pipeline = settings.pipeline().await.unwrap();
    let client = embed_dlq::streams::client(&redis_url).unwrap();
    let mut redis = client.managed().await.unwrap();
    println!("source benchmark: {chunks} chunks, {rounds} rounds (corpus and stream alternate)");
    let (mut corpus_rates, mut stream_rates) = (vec![], vec![]);
    for round in 0..rounds {
        let mut phases = ["corpus", "stream"];
        if round % 2 == 1 {
            phases.reverse();
        }
        for phase in phases {
            sqlx::raw_sql("TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox; CHECKPOINT")
                .execute(&db.pool)
                .await
                .unwrap();
            if phase == "corpus" {
                let corpus: Vec<u8> =
                    (0..chunks).flat_map(|i| line(round, "corpus", i).into_bytes()).collect();
                let started = Instant::now();
                let s = pipeline.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
                let secs = started.elapsed().as_secs_f64();
                assert_eq!(s.stored as usize, chunks);
                corpus_rates.push(chunks as f64 / secs);
                println!("round {round} corpus: {:.0} chunks/s", chunks as f64 / secs);
            } else {
                let stream = format!("bench-source-{}-{round}", std::process::id());
                for batch in (0..chunks).collect::<Vec<_>>().chunks(1000) {
                    let mut pipe = redis::pipe();
                    for &i in batch {
                        let v: serde_json::Value = serde_json::from_str(&line(round, "stream", i)).unwrap();
                        pipe.cmd("XADD")
                            .arg(&stream)
                            .arg("*")
                            .arg("doc_id")
                            .arg(v["doc_id"].as_str().unwrap())
                            .arg("chunk_index")
                            .arg(v["chunk_index"].to_string())
                            .arg("text")
                            .arg(v["text"].as_str().unwrap())
                            .arg("metadata")
                            .arg(v["metadata"].to_string())
                            .ignore();
                    }
                    let () = pipe.query_async(&mut redis).await.unwrap();
                }
                let opts = SourceOptions {
                    streams: vec![stream.clone()],
                    group: "bench".into(),
                    consumer: "bench-0".into(),
                    ..SourceOptions::default()
                };
                let cancel = CancellationToken::new();
                let (p, c, stop) = (pipeline.clone(), client.clone(), cancel.clone());
                let started = Instant::now();
                let task = tokio::spawn(async move { p.run_source(&c, opts, stop).await });
                let mut probe = client.managed().await.unwrap();
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let done = drained(&mut probe, &stream).await;
                    if done {
                        break;
                    }
                }
                let secs = started.elapsed().as_secs_f64();
                cancel.cancel();
                let s = task.await.unwrap().unwrap();
                assert_eq!(s.stored as usize, chunks, "{s:?}");
                stream_rates.push(chunks as f64 / secs);
                println!("round {round} stream: {:.0} chunks/s", chunks as f64 / secs);
                let _: i64 = redis::cmd("DEL").arg(&stream).query_async(&mut redis).await.unwrap();
            }
        }
    }
    let (corpus, stream) = (median(corpus_rates), median(stream_rates));
    println!(
        "median: corpus {corpus:.0} chunks/s, stream {stream:.0} chunks/s, ratio stream/corpus {:.2}",
        stream / corpus
    );
    db.drop().await;
}

/// Whether the group `bench` on `stream` has read and acknowledged everything.
async fn drained(redis: &mut embed_dlq::streams::RedisConn, stream: &str) -> bool {
    let reply: redis::Value = match redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await {
        Ok(v) => v,
        Err(_) => return false,
    };
    let redis::Value::Array(groups) = reply else { return false };
    for g in groups {
        let fields: Vec<redis::Value> = match g {
            redis::Value::Array(a) => a,
            redis::Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            _ => continue,
        };
        let get = |name: &str| {
            fields.chunks(2).find_map(|kv| match (&kv[0], kv.get(1)) {
                (redis::Value::BulkString(k), Some(v)) if k == name.as_bytes() => Some(v.clone()),
                _ => None,
            })
        };
        if matches!(get("name"), Some(redis::Value::BulkString(n)) if n == b"bench") {
            return matches!(get("pending"), Some(redis::Value::Int(0)))
                && matches!(get("lag"), Some(redis::Value::Int(0)));
        }
    }
    false
}
