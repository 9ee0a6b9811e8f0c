//! A Redis Stream as the ingest source (`ingest --from-stream`): entries become vectors or DLQ
//! rows, each acknowledged only after its outcome committed; a killed consumer's entries are
//! taken over; malformed and poison entries are parked, never looped on; reads are bounded.
//! The oracle is what the test itself published and the suite's own queries.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::ingest::source::SourceOptions;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use redis::AsyncCommands;
use sqlx::Row;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// A source stream key of the test's own; on a cluster its hash tag keeps it in one slot.
pub(crate) fn fresh_stream() -> String {
    format!("{{it-src-{}-{}}}:chunks", std::process::id(), rand::random::<u32>())
}

/// Publishes `entries` (field lists) to `stream`, pipelined; returns their ids in order.
pub(crate) async fn publish(stream: &str, entries: &[Vec<(String, Vec<u8>)>]) -> Vec<String> {
    let mut redis = redis().await;
    let mut ids = Vec::with_capacity(entries.len());
    for batch in entries.chunks(500) {
        let mut pipe = redis::pipe();
        for fields in batch {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(stream).arg("*");
            for (k, v) in fields {
                cmd.arg(k).arg(v.as_slice());
            }
            pipe.add_command(cmd);
        }
        let got: Vec<String> = pipe.query_async(&mut redis).await.unwrap();
        ids.extend(got);
    }
    ids
}

/// The fields of a well-formed chunk entry.
pub(crate) fn chunk_entry(doc: &str, idx: i32, text: &str) -> Vec<(String, Vec<u8>)> {
    vec![
        ("doc_id".into(), doc.as_bytes().to_vec()),
        ("chunk_index".into(), idx.to_string().into_bytes()),
        ("text".into(), text.as_bytes().to_vec()),
        ("metadata".into(), br#"{"source":"it"}"#.to_vec()),
    ]
}

/// Entries pending in `group` on `stream`, as the test reads it (`XPENDING` summary); 0 before
/// the group exists.
pub(crate) async fn pending(stream: &str, group: &str) -> i64 {
    let mut redis = redis().await;
    let reply: redis::Value =
        match redis::cmd("XPENDING").arg(stream).arg(group).query_async(&mut redis).await {
            Ok(v) => v,
            Err(e) if e.code() == Some("NOGROUP") => return 0,
            Err(e) => panic!("XPENDING: {e}"),
        };
    match reply {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => panic!("unexpected XPENDING reply {parts:?}"),
        },
        other => panic!("unexpected XPENDING reply {other:?}"),
    }
}

fn source_opts(stream: &str, consumer: &str) -> SourceOptions {
    SourceOptions {
        streams: vec![stream.to_string()],
        group: "it-ingest".into(),
        consumer: consumer.into(),
        block: Duration::from_millis(200),
        min_idle: Duration::from_millis(1_000),
        idle_exit: Some(Duration::from_millis(800)),
        ..SourceOptions::default()
    }
}

async fn run_source(
    db: &TestDb,
    mock: &MockProvider,
    opts: SourceOptions,
) -> embed_dlq::ingest::IngestSummary {
    let s = settings(db, mock);
    let p = pipeline(&s).await;
    tokio::time::timeout(
        Duration::from_secs(120),
        p.run_source(&redis_client(), opts, CancellationToken::new()),
    )
    .await
    .expect("the source drains and stops")
    .expect("source run")
}

on_single_and_cluster! {
    /// Every entry ends as a vector or a DLQ row, malformed ones parked with the raw entry,
    /// and the group has nothing pending afterwards; a second pass over the same content
    /// embeds nothing (skipped as unchanged) and still acknowledges everything.
    async fn every_entry_ends_stored_or_parked_and_acknowledged() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let mut entries: Vec<Vec<(String, Vec<u8>)>> =
            (0..300).map(|i| chunk_entry(&format!("doc-{}", i / 3), i % 3, &format!("text {i}"))).collect();
        let malformed = vec![
            // No identity: parked under source:<stream>/<id>.
            vec![("chunk_index".into(), b"1".to_vec()), ("text".into(), b"x".to_vec())],
            vec![("doc_id".into(), b"bad-idx".to_vec()), ("chunk_index".into(), b"-4".to_vec()), ("text".into(), b"x".to_vec())],
            // Identity readable, content broken: parked under it.
            vec![("doc_id".into(), b"bad-meta".to_vec()), ("chunk_index".into(), b"0".to_vec()),
                 ("text".into(), b"x".to_vec()), ("metadata".into(), b"{not json".to_vec())],
            vec![("doc_id".into(), b"bad-utf8".to_vec()), ("chunk_index".into(), b"0".to_vec()),
                 ("text".into(), b"caf\xe9".to_vec())],
            vec![("doc_id".into(), b"bad-op".to_vec()), ("chunk_index".into(), b"0".to_vec()),
                 ("text".into(), b"x".to_vec()), ("op".into(), b"frobnicate".to_vec())],
        ];
        entries.extend(malformed);
        let ids = publish(&stream, &entries).await;
        let mut expected: BTreeSet<(String, i32)> =
            (0..300).map(|i| (format!("doc-{}", i / 3), i % 3)).collect();
        expected.insert((format!("source:{stream}/{}", ids[300]), 0));
        expected.insert((format!("source:{stream}/{}", ids[301]), 0));
        for doc in ["bad-meta", "bad-utf8", "bad-op"] {
            expected.insert((doc.to_string(), 0));
        }

        let summary = run_source(&db, &mock, source_opts(&stream, "c1")).await;
        let counts = summary.source.clone().expect("source counts");
        assert_eq!(counts.entries_read, 305, "{summary:?}");
        assert_eq!(counts.entries_acked, 305, "{summary:?}");
        assert_eq!(counts.left_pending, 0);
        assert_eq!(summary.stored, 300);
        assert_eq!(pending(&stream, "it-ingest").await, 0, "nothing left pending");
        assert_corpus_accounted(&db, &expected).await;
        assert_eq!(db.leaks().await, 0);
        assert_eq!(db.manifest_disagreements().await, 0);
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 300);
        assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'invalid_record'").await, 5);
        // The raw entry is preserved in the payload of a malformed one.
        let row = sqlx::query("SELECT payload, last_error FROM embedding_dlq WHERE doc_id = 'bad-op'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let payload: serde_json::Value = row.get("payload");
        let last_error: String = row.get("last_error");
        assert!(last_error.contains("unknown op"), "{last_error}");
        assert_eq!(payload["raw_entry"][3], serde_json::json!(["op", "frobnicate"]), "{payload}");
        assert_eq!(payload["source_stream"], serde_json::json!(stream));

        // The same content again: nothing embedded, everything acknowledged.
        let inputs = mock.control.stats().inputs;
        publish(&stream, &entries[..300]).await;
        let again = run_source(&db, &mock, source_opts(&stream, "c2")).await;
        assert_eq!(again.unchanged, 300, "{again:?}");
        assert_eq!(mock.control.stats().inputs, inputs, "unchanged entries are not embedded again");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 300);
    }

    /// A slow provider never makes the consumer read the stream into memory: what the group
    /// has delivered and not acknowledged stays within `max_inflight_entries`.
    async fn a_slow_provider_bounds_what_is_read() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig { latency_ms: 150, ..MockConfig::default() }).await;
        let stream = fresh_stream();
        let entries: Vec<_> = (0..1_500).map(|i| chunk_entry(&format!("slow-{i}"), 0, &format!("t{i}"))).collect();
        publish(&stream, &entries).await;
        let mut opts = source_opts(&stream, "slow");
        opts.max_inflight_entries = 64;
        let s = settings(&db, &mock);
        let p = pipeline(&s).await;
        let client = redis_client();
        let run = tokio::spawn(async move { p.run_source(&client, opts, CancellationToken::new()).await });
        let mut max_pending = 0;
        while !run.is_finished() {
            max_pending = max_pending.max(pending(&stream, "it-ingest").await);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let summary = run.await.unwrap().unwrap();
        assert_eq!(summary.stored, 1_500);
        assert!(max_pending > 0, "the test saw work in flight");
        assert!(max_pending <= 64, "at most max_inflight_entries delivered and unacknowledged: {max_pending}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
    }

    /// Redis's delivery count is not proof: an entry delivered past the delivery cap (restarts,
    /// takeovers, outages) is tried alone, one attempt charged in Postgres, and stored when it
    /// is healthy. Only one whose attempts alone never finished (`SOLO_ATTEMPTS` of them, as
    /// consumers it killed leave them) is parked as an invalid record, raw entry kept, and
    /// acknowledged: never taken again.
    async fn an_entry_past_the_delivery_cap_is_tried_alone_and_parked_only_when_it_never_finishes() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let ids = publish(&stream, &[
            chunk_entry("poison", 0, "kills its consumer"),
            chunk_entry("unlucky", 0, "was in flight during many restarts"),
            chunk_entry("fine", 0, "ok"),
        ]).await;
        let mut redis = redis().await;
        let _: () = redis::cmd("XGROUP").arg("CREATE").arg(&stream).arg("it-ingest").arg("0").query_async(&mut redis).await.unwrap();
        // A consumer took both and died, many times over.
        let _: redis::Value = redis::cmd("XREADGROUP").arg("GROUP").arg("it-ingest").arg("dead").arg("COUNT").arg(2)
            .arg("STREAMS").arg(&stream).arg(">").query_async(&mut redis).await.unwrap();
        let _: redis::Value = redis::cmd("XCLAIM").arg(&stream).arg("it-ingest").arg("dead").arg(0).arg(&ids[0]).arg(&ids[1])
            .arg("RETRYCOUNT").arg(20).query_async(&mut redis).await.unwrap();
        // The poison's attempts alone, each charged before the consumer it killed died.
        let solo = embed_dlq::ingest::source::SOLO_ATTEMPTS as i32;
        sqlx::query("INSERT INTO source_suspect (target_table, stream, group_name, entry_id, attempts)
                     VALUES ('public.doc_embeddings', $1, 'it-ingest', $2, $3)")
            .bind(&stream).bind(&ids[0]).bind(solo).execute(&db.pool).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let mut opts = source_opts(&stream, "survivor");
        opts.delivery_cap = 5;
        let summary = run_source(&db, &mock, opts).await;
        assert_eq!(summary.source.as_ref().unwrap().entries_poison, 1, "{summary:?}");
        let rows: Vec<(String, String, String)> =
            sqlx::query_as("SELECT doc_id, error_class, last_error FROM embedding_dlq ORDER BY doc_id")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(rows.len(), 1, "only the poison is parked: {rows:?}");
        assert_eq!((rows[0].0.as_str(), rows[0].1.as_str()), ("poison", "invalid_record"));
        assert!(rows[0].2.contains("delivery cap") && rows[0].2.contains("alone"), "{}", rows[0].2);
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 2, "the unlucky and the healthy entry are stored");
        assert_eq!(db.count("SELECT count(*) FROM source_suspect").await, 0, "suspects with an outcome are forgotten");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        let _: i64 = redis.del(&stream).await.unwrap();
    }

    /// `ingest --from-stream` killed mid-batch (SIGKILL at a writer, nothing written for the
    /// batch) leaves its entries pending; a second consumer takes them over after the
    /// min-idle time; a third run killed after its commit and before its `XACK` leaves
    /// entries whose redelivery is skipped as unchanged. Nothing lost, nothing stored twice,
    /// nothing pending at the end.
    async fn a_killed_consumer_is_taken_over_and_nothing_is_lost_or_doubled() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig { latency_ms: 5, ..MockConfig::default() }).await;
        let stream = fresh_stream();
        let entries: Vec<_> = (0..2_000).map(|i| chunk_entry(&format!("k-{}", i / 4), i % 4, &format!("text {i}"))).collect();
        publish(&stream, &entries).await;
        let expected: BTreeSet<(String, i32)> = (0..2_000).map(|i| (format!("k-{}", i / 4), i % 4)).collect();

        // Killed before its first write.
        let out = source_cmd(&db, &mock, &stream, "victim-1")
            .env("EMBED_DLQ_FAILPOINT", "ingest_writer=abort@2")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("failpoint ingest_writer reached"), "the failpoint killed it: {stderr}");
        let stored_after_kill = db.count("SELECT count(*) FROM doc_embeddings").await;
        let left = pending(&stream, "it-ingest").await;
        assert!(left > 0, "the killed consumer's entries are pending");
        assert!(stored_after_kill < 2_000);

        // Killed after a commit, before its acknowledgement.
        let out = source_cmd(&db, &mock, &stream, "victim-2")
            .env("EMBED_DLQ_FAILPOINT", "source_before_ack=abort@2")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("failpoint source_before_ack reached"), "{stderr}");
        assert!(pending(&stream, "it-ingest").await > 0);

        // A survivor takes everything over.
        let out = source_cmd(&db, &mock, &stream, "survivor").arg("--json").output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(summary["source"]["entries_reclaimed"].as_u64().unwrap() > 0, "{summary}");
        assert!(summary["unchanged"].as_u64().unwrap() > 0, "committed but unacknowledged entries are skipped: {summary}");
        assert_eq!(pending(&stream, "it-ingest").await, 0, "the group's pending count returns to 0");
        assert_corpus_accounted(&db, &expected).await;
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 2_000);
        assert_eq!(db.leaks().await, 0);
        assert_eq!(db.manifest_disagreements().await, 0);
    }
}

/// `ingest --from-stream` as a user runs it, against the test's Redis and database, exiting
/// when the stream is drained.
fn source_cmd(db: &TestDb, mock: &MockProvider, stream: &str, consumer: &str) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY").env_remove("RUST_LOG").env_remove("EMBED_DLQ_FAILPOINT");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    c.arg("ingest")
        .args(["--from-stream", stream, "--group", "it-ingest", "--consumer", consumer])
        .args([
            "--source-min-idle-ms",
            "1000",
            "--idle-exit-ms",
            "1500",
            "--source-max-inflight-entries",
            "300",
        ])
        .args(["--database-url", &db.url, "--redis-url", &redis_url()])
        .args(["--base-url", &mock.base_url(), "--model", "mock"])
        .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress"]);
    c
}

/// The Rust producer example's own code, run against the suite's Redis.
#[path = "../../examples/produce_chunks.rs"]
#[allow(dead_code)] // its `main` is the example binary's, not the suite's
mod produce_chunks;

/// Runs the Python producer example (redis-py) as a user would; a missing `python3` or
/// redis-py fails the test with the reason, it never skips.
async fn publish_from_python(stream: &str, count: usize, prefix: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/produce_chunks.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .args(["--redis-url", &redis_url(), "--stream", stream, "--count", &count.to_string()])
        .args(["--doc-prefix", prefix])
        .output()
        .await
        .expect("python3 must be installed to run the Python producer example");
    assert!(
        out.status.success(),
        "the Python producer failed (redis-py missing? `pip install redis`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["published"][stream], serde_json::json!(count), "{report}");
}

on_single_and_cluster! {
    /// The producer examples, Python (redis-py) and Rust, publish to a source stream; their
    /// chunks end up as vectors.
    async fn the_producer_examples_chunks_end_up_as_vectors() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        publish_from_python(&stream, 120, "py").await;
        let rust_chunks = produce_chunks::sample_chunks("rs", 80);
        let ids = produce_chunks::publish(&mut redis().await, &stream, &rust_chunks).await.unwrap();
        assert_eq!(ids.len(), 80);
        let expected: BTreeSet<(String, i32)> = (0..120)
            .map(|i| (format!("py-{}", i / 4), i % 4))
            .chain(rust_chunks.iter().map(|c| (c.doc_id.clone(), c.chunk_index)))
            .collect();
        let summary = run_source(&db, &mock, source_opts(&stream, "examples")).await;
        assert_eq!(summary.stored, 200, "{summary:?}");
        assert_corpus_accounted(&db, &expected).await;
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 200);
        assert_eq!(pending(&stream, "it-ingest").await, 0);
    }
}

/// `serve` with a source (`--from-stream`, i.e. `[source] streams`) ingests what is published
/// while it runs, acknowledges it, and says on SIGTERM that it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_ingests_from_its_source_stream() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let stream = fresh_stream();
    let prefix = format!("it-servesrc-{}-{}", std::process::id(), rand::random::<u32>());
    let serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
        .arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--model", "mock", "--stream-prefix", &prefix, "--replayers", "1"])
        .args(["--from-stream", &stream, "--group", "it-ingest", "--consumer", "serve-1"])
        .env_remove("EMBED_DLQ_API_KEY")
        .env_remove("EMBED_DLQ_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let entries: Vec<_> =
        (0..150).map(|i| chunk_entry(&format!("served-{}", i / 5), i % 5, &format!("t{i}"))).collect();
    publish(&stream, &entries).await;
    let mut stored = 0;
    for _ in 0..300 {
        stored = db.count("SELECT count(*) FROM doc_embeddings").await;
        if stored == 150 && pending(&stream, "it-ingest").await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stored, 150, "serve stored what was published");
    assert_eq!(pending(&stream, "it-ingest").await, 0, "and acknowledged it");
    let pid = serve.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), serve.wait_with_output()).await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("stream source stopped"), "{stderr}");
    let expected: BTreeSet<(String, i32)> = (0..150).map(|i| (format!("served-{}", i / 5), i % 5)).collect();
    assert_corpus_accounted(&db, &expected).await;
}

on_single_and_cluster! {
    /// Issue 21: `op: delete` entries delete a chunk or a whole document, like the JSONL
    /// deletes, and are acknowledged once the deletion has committed; a delete carrying text
    /// is parked, not applied.
    async fn delete_entries_delete_and_are_acknowledged() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let entries: Vec<Vec<(String, Vec<u8>)>> =
            (0..12).map(|i| chunk_entry(&format!("doc-{}", i / 4), i % 4, &format!("text {i}"))).collect();
        publish(&stream, &entries).await;
        let first = run_source(&db, &mock, source_opts(&stream, "c1")).await;
        assert_eq!(first.stored, 12, "{first:?}");

        let delete = |doc: &str, idx: Option<i32>| {
            let mut f = vec![("doc_id".to_string(), doc.as_bytes().to_vec()), ("op".into(), b"delete".to_vec())];
            if let Some(i) = idx {
                f.push(("chunk_index".into(), i.to_string().into_bytes()));
            }
            f
        };
        let mut with_text = delete("doc-2", Some(0));
        with_text.push(("text".into(), b"not a delete's".to_vec()));
        publish(&stream, &[delete("doc-0", None), delete("doc-1", Some(3)), with_text]).await;
        let second = run_source(&db, &mock, source_opts(&stream, "c2")).await;
        let counts = second.source.clone().expect("source counts");
        assert_eq!((counts.entries_read, counts.entries_acked), (3, 3), "{second:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0, "every delete entry acknowledged");
        assert_eq!(second.chunks_deleted, 5, "doc-0's four chunks and doc-1#3: {second:?}");

        let mut expected: BTreeSet<(String, i32)> = (4..12)
            .map(|i| (format!("doc-{}", i / 4), i % 4))
            .filter(|k| *k != ("doc-1".to_string(), 3))
            .collect();
        // The delete with text is parked as an invalid record under its identity.
        expected.insert(("doc-2".to_string(), 0));
        assert_corpus_accounted(&db, &expected).await;
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'doc-0'").await, 0);
        // 12 stored, 5 deleted, and doc-2#0's vector withdrawn by the newer (broken) entry
        // parked in its place, as for any broken record of a stored key.
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 6);
        assert_eq!(db.leaks().await, 0);
    }
}

/// The vector stored for `(doc, idx)` compared with the mock's deterministic vector of `text`;
/// `None` without a vector.
async fn vector_is(db: &TestDb, doc: &str, idx: i32, text: &str) -> Option<bool> {
    let row: Option<(pgvector::Vector,)> =
        sqlx::query_as("SELECT embedding FROM doc_embeddings WHERE doc_id = $1 AND chunk_index = $2")
            .bind(doc)
            .bind(idx)
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    let want = embed_dlq::testkit::mock_provider::vector_for(text, 768);
    row.map(|(v,)| v.as_slice().iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4))
}

on_single_and_cluster! {
    /// Invariant 9 with a stream as the source: a record's position is when it entered (its
    /// entry id), not when a consumer got round to it. Three entries are taken by a consumer
    /// that dies; then a newer version of the first chunk and a delete of the second are
    /// published, and a corpus run writes the third. A survivor reads the new entries first
    /// and takes the dead consumer's over only after the min-idle time: none of the older
    /// entries may overwrite, resurrect or replace what came after it.
    async fn an_older_entry_taken_over_late_never_overwrites_what_came_after_it() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        publish(&stream, &[
            chunk_entry("ord-1", 0, "version 1"),
            chunk_entry("ord-2", 0, "version 1"),
            chunk_entry("ord-3", 0, "version 1"),
        ]).await;
        let mut redis = redis().await;
        let _: () = redis::cmd("XGROUP").arg("CREATE").arg(&stream).arg("it-ingest").arg("0").query_async(&mut redis).await.unwrap();
        let _: redis::Value = redis::cmd("XREADGROUP").arg("GROUP").arg("it-ingest").arg("dead").arg("COUNT").arg(3)
            .arg("STREAMS").arg(&stream).arg(">").query_async(&mut redis).await.unwrap();
        assert_eq!(pending(&stream, "it-ingest").await, 3, "the dead consumer holds the three");
        // What came after: a newer version, a delete, and a corpus run of the third chunk.
        publish(&stream, &[
            chunk_entry("ord-1", 0, "version 2"),
            vec![("doc_id".into(), b"ord-2".to_vec()), ("op".into(), b"delete".to_vec())],
        ]).await;
        let s = settings(&db, &mock);
        let corpus = line("ord-3", 0, "corpus version");
        let written = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!(written.stored, 1);

        let mut opts = source_opts(&stream, "survivor");
        opts.min_idle = Duration::from_millis(4_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let summary = run_source(&db, &mock, opts).await;
        let counts = summary.source.clone().expect("source counts");
        assert_eq!(counts.entries_reclaimed, 3, "the survivor took the dead consumer's entries over: {summary:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);

        assert_eq!(vector_is(&db, "ord-1", 0, "version 2").await, Some(true), "the newer version stays: {summary:?}");
        assert_eq!(vector_is(&db, "ord-2", 0, "version 1").await, None, "the delete stays applied: {summary:?}");
        assert_eq!(
            db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'ord-2'").await
                + db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'ord-2'").await,
            0,
            "nothing of the deleted chunk is back"
        );
        assert_eq!(vector_is(&db, "ord-3", 0, "corpus version").await, Some(true), "the corpus run came after: {summary:?}");
        assert_eq!(db.leaks().await, 0);
    }
}

on_single_and_cluster! {
    /// The tombstone sweep keeps what a live stream consumer still needs: an entry of a chunk
    /// is pending (its consumer died), the chunk is then deleted by a corpus run, and the
    /// tombstone is old enough to sweep. While a survivor that will take the entry over is
    /// running, another run starts (and sweeps): the tombstone must stay, so the entry taken
    /// over afterwards is superseded and does not bring the chunk back.
    async fn a_tombstone_is_kept_while_a_consumer_may_still_take_over_an_older_entry() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        publish(&stream, &[chunk_entry("swept", 0, "before the delete")]).await;
        let mut redis = redis().await;
        let _: () = redis::cmd("XGROUP").arg("CREATE").arg(&stream).arg("it-ingest").arg("0").query_async(&mut redis).await.unwrap();
        let _: redis::Value = redis::cmd("XREADGROUP").arg("GROUP").arg("it-ingest").arg("dead").arg("COUNT").arg(1)
            .arg("STREAMS").arg(&stream).arg(">").query_async(&mut redis).await.unwrap();
        let s = settings(&db, &mock);
        let delete = format!("{}\n", serde_json::json!({"doc_id": "swept", "op": "delete"}));
        pipeline(&s).await.run(input(delete.into_bytes()), CancellationToken::new()).await.unwrap();
        // The delete is two hours old.
        let aged = sqlx::query("UPDATE ingest_tombstone SET deleted_at = now() - interval '2 hours' WHERE doc_id = 'swept'")
            .execute(&db.pool).await.unwrap().rows_affected();
        assert_eq!(aged, 1, "the delete left a tombstone");

        let mut opts = source_opts(&stream, "survivor");
        opts.min_idle = Duration::from_millis(5_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let survivor = {
            let p = pipeline(&s).await;
            let client = redis_client();
            tokio::spawn(async move { p.run_source(&client, opts, CancellationToken::new()).await })
        };
        // The survivor is alive and has not taken the entry over yet; another run sweeps.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(!survivor.is_finished());
        pipeline(&s).await.run(input(line("other", 0, "unrelated").into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!(
            db.count("SELECT count(*) FROM ingest_tombstone WHERE doc_id = 'swept'").await,
            1,
            "the sweep kept the tombstone a live consumer may still need"
        );

        let summary = tokio::time::timeout(Duration::from_secs(60), survivor).await.unwrap().unwrap().unwrap();
        assert_eq!(summary.source.as_ref().unwrap().entries_reclaimed, 1, "{summary:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        assert_eq!(vector_is(&db, "swept", 0, "before the delete").await, None, "the deleted chunk stays deleted: {summary:?}");
        assert_eq!(
            db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'swept'").await
                + db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'swept'").await,
            0
        );
    }
}

on_single_and_cluster! {
    /// Invariant 12 for the stream source: Postgres unreachable for several times
    /// `min_idle × delivery_cap` while `serve` ingests a stream. Its source runs fail and
    /// restart, and each restart takes the pending entries over again (a Redis delivery each
    /// time), none of it the entries' fault. Once the database is back every entry is stored;
    /// none is parked as poison.
    async fn a_database_outage_longer_than_the_source_delivery_cap_parks_no_entry() {
        const ENTRIES: usize = 300;
        let db = TestDb::new().await;
        // Slow enough that entries are in flight and pending when the database goes.
        let mock = start_mock(MockConfig { latency_ms: 60, ..MockConfig::default() }).await;
        let stream = fresh_stream();
        let proxy = embed_dlq::testkit::proxy::TcpProxy::start(postgres_addr(&db)).await.unwrap();
        let (min_idle_ms, cap) = (300u64, 2u64);
        let (min_idle, cap_arg) = (min_idle_ms.to_string(), cap.to_string());
        let mut serve = serve_process(&through(&db, proxy.addr), &mock.base_url(), &fresh_keys(), &[
            "--replayers", "1", "--batch-max-inputs", "8",
            "--from-stream", &stream, "--group", "it-ingest", "--consumer", "serve-1",
            "--source-min-idle-ms", &min_idle, "--source-delivery-cap", &cap_arg,
        ])
        .spawn()
        .unwrap();
        let entries: Vec<_> =
            (0..ENTRIES).map(|i| chunk_entry(&format!("out-{}", i / 4), (i % 4) as i32, &format!("t{i}"))).collect();
        publish(&stream, &entries).await;
        let mut first = 0;
        for _ in 0..600 {
            first = db.count("SELECT count(*) FROM doc_embeddings").await;
            if first >= 16 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(first >= 16 && first < ENTRIES as i64, "the outage starts with work in flight: {first}");
        proxy.control.cut();
        // Eight times min-idle × delivery cap: every pending entry is taken over past its cap
        // many times if deliveries during the outage were charged to it.
        let outage = Duration::from_secs(5);
        assert!(outage > Duration::from_millis(min_idle_ms * cap * 4));
        tokio::time::sleep(outage).await;
        assert!(proxy.control.refused() > 0, "serve never tried the database during the outage");
        proxy.control.restore();
        let mut done = 0;
        for _ in 0..1_200 {
            done = db.count("SELECT count(*) FROM ingest_manifest").await;
            if done == ENTRIES as i64 && pending(&stream, "it-ingest").await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = serve.kill().await;
        let poison: Vec<(String, String)> =
            sqlx::query_as("SELECT doc_id || '#' || chunk_index, last_error FROM embedding_dlq ORDER BY 1 LIMIT 5")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert!(poison.is_empty(), "healthy entries parked by a database outage: {poison:?}");
        assert_eq!(done, ENTRIES as i64, "every entry has an outcome");
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, ENTRIES as i64);
        assert_eq!(pending(&stream, "it-ingest").await, 0);
    }
}

on_single_and_cluster! {
    /// A record skipped as unchanged still counts as the newest word on its chunk. The chunk
    /// holds "final" (a corpus run); a draft is published and taken by a consumer that dies;
    /// then "final" is published again. The survivor reads it first and skips it as unchanged,
    /// then takes the draft over: the draft, older than the "final" entry, must not overwrite it.
    async fn a_draft_taken_over_after_its_final_text_was_skipped_as_unchanged_loses() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let s = settings(&db, &mock);
        let stored = pipeline(&s).await.run(input(line("conf", 0, "final").into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!(stored.stored, 1);
        let stream = fresh_stream();
        publish(&stream, &[chunk_entry("conf", 0, "draft")]).await;
        let mut redis = redis().await;
        let _: () = redis::cmd("XGROUP").arg("CREATE").arg(&stream).arg("it-ingest").arg("0").query_async(&mut redis).await.unwrap();
        let _: redis::Value = redis::cmd("XREADGROUP").arg("GROUP").arg("it-ingest").arg("dead").arg("COUNT").arg(1)
            .arg("STREAMS").arg(&stream).arg(">").query_async(&mut redis).await.unwrap();
        publish(&stream, &[chunk_entry("conf", 0, "final")]).await;

        let mut opts = source_opts(&stream, "survivor");
        opts.min_idle = Duration::from_millis(3_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let summary = run_source(&db, &mock, opts).await;
        assert_eq!(summary.unchanged, 1, "the final text was skipped as unchanged: {summary:?}");
        assert_eq!(summary.source.as_ref().unwrap().entries_reclaimed, 1, "{summary:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        assert_eq!(vector_is(&db, "conf", 0, "final").await, Some(true), "the draft overwrote the final text: {summary:?}");
    }
}

on_single_and_cluster! {
    /// A source blocked in `XREADGROUP` when its stream is deleted (an operator's `DEL`, a
    /// `FLUSHALL`) gets `UNBLOCKED the stream key no longer exists` from Redis 7 (or, between
    /// reads, `NOGROUP`): it recreates its group (at `0`, so nothing published meanwhile is
    /// skipped) and reads on; the run neither stops nor loses what comes after.
    async fn a_source_whose_stream_is_deleted_while_it_waits_recreates_its_group_and_reads_on() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let before: Vec<_> = (0..10).map(|i| chunk_entry("before", i, &format!("b{i}"))).collect();
        publish(&stream, &before).await;
        let opts = SourceOptions {
            block: Duration::from_millis(1_000),
            idle_exit: Some(Duration::from_millis(3_000)),
            ..source_opts(&stream, "c1")
        };
        let run = {
            let s = settings(&db, &mock);
            tokio::spawn(async move {
                let p = pipeline(&s).await;
                p.run_source(&redis_client(), opts, CancellationToken::new()).await
            })
        };
        let mut stored = 0;
        for _ in 0..600 {
            stored = db.count("SELECT count(*) FROM doc_embeddings").await;
            if stored == 10 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(stored, 10, "the first entries are stored");
        // Idle now: the source waits in its blocking read most of the time.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut redis = redis().await;
        let deleted: i64 = redis::cmd("DEL").arg(&stream).query_async(&mut redis).await.unwrap();
        assert_eq!(deleted, 1);
        let after: Vec<_> = (0..10).map(|i| chunk_entry("after", i, &format!("a{i}"))).collect();
        publish(&stream, &after).await;

        let summary = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .expect("the source drains and stops")
            .unwrap()
            .expect("the source run ends well");
        assert_eq!(summary.stored, 20, "{summary:?}");
        let expected: BTreeSet<(String, i32)> =
            (0..10).flat_map(|i| [("before".to_string(), i), ("after".to_string(), i)]).collect();
        assert_corpus_accounted(&db, &expected).await;
        assert_eq!(pending(&stream, "it-ingest").await, 0, "nothing left pending");
    }
}

/// Entries of `stream` a consumer named `consumer` reads in the group and never settles (a
/// consumer that died holding them), creating the group at the stream's start if needed.
async fn taken_by_dead_consumer(stream: &str, consumer: &str, count: usize) {
    let mut redis = redis().await;
    let created: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg("it-ingest")
        .arg("0")
        .query_async(&mut redis)
        .await;
    if let Err(e) = created {
        assert_eq!(e.code(), Some("BUSYGROUP"), "XGROUP CREATE: {e}");
    }
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("it-ingest")
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(&mut redis)
        .await
        .unwrap();
}

on_single_and_cluster! {
    /// Issue 44 (the history's stale draft): a record whose content is already stored but
    /// that the run embeds anyway (it met the chunk earlier in the run) and then parks (here:
    /// longer than this run's input limit, which an earlier run's allowed) is not parked, as
    /// the content is stored; but it is still the newest record of the chunk. An older entry
    /// of another content a dead consumer held (a draft), taken over afterwards, must lose to
    /// it: the manifest's position must move up to the refused park's.
    async fn a_park_refused_as_already_stored_still_fences_an_older_entry() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let finals = fresh_stream();
        let drafts = format!("{finals}:drafts");
        let text = format!("the final text {}", "of many words ".repeat(20));
        publish(&finals, &[chunk_entry("fenced", 0, &text)]).await;
        let first = run_source(&db, &mock, source_opts(&finals, "first")).await;
        assert_eq!(first.stored, 1, "{first:?}");
        // The same text again (the survivor meets the chunk), a draft taken by a consumer
        // that dies, then the final text once more, each in a later millisecond.
        publish(&finals, &[chunk_entry("fenced", 0, &text)]).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        publish(&drafts, &[chunk_entry("fenced", 0, "a draft, older than the final text")]).await;
        taken_by_dead_consumer(&drafts, "dead", 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        publish(&finals, &[chunk_entry("fenced", 0, &text)]).await;

        let mut s = settings(&db, &mock);
        s.options.max_input_chars = 100;
        let mut opts = source_opts(&finals, "survivor");
        opts.streams.push(drafts.clone());
        opts.min_idle = Duration::from_millis(3_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let summary = tokio::time::timeout(
            Duration::from_secs(120),
            pipeline(&s).await.run_source(&redis_client(), opts, CancellationToken::new()),
        )
        .await
        .expect("the source drains and stops")
        .expect("source run");
        let counts = summary.source.clone().expect("source counts");
        assert_eq!(counts.entries_reclaimed, 1, "the survivor took the draft over: {summary:?}");
        assert_eq!(pending(&finals, "it-ingest").await + pending(&drafts, "it-ingest").await, 0);
        assert_eq!(
            vector_is(&db, "fenced", 0, &text).await,
            Some(true),
            "the final text's vector stays; the older draft taken over late must not replace it: {summary:?}"
        );
        assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'fenced'").await, 0);
        assert_eq!(db.leaks().await, 0);
    }
}

on_single_and_cluster! {
    /// Issue 44: a corpus run alone that finds a chunk unchanged skips it, but its record is
    /// newer than an entry of another content a dead stream consumer still holds: taken over
    /// afterwards, that entry must lose to the corpus line. It did not: a corpus run alone
    /// skipped an unchanged line without moving the manifest's position (its read-only
    /// lookup), and no trace of the dead consumer's entry is in Postgres. Now a stream
    /// source registers its table before it reads (`ingest_stream_fed`), and a corpus run of
    /// that table fences its unchanged skips.
    async fn an_unchanged_corpus_line_still_fences_an_older_entry_taken_over_later() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let s = settings(&db, &mock);
        let text = "the corpus text of the chunk";
        pipeline(&s).await.run(input(line("fenced", 0, text).into_bytes()), CancellationToken::new()).await.unwrap();
        // The table's stream source has run before (here on an empty stream).
        let mut opts = source_opts(&stream, "survivor");
        opts.idle_exit = Some(Duration::from_millis(200));
        run_source(&db, &mock, opts).await;
        publish(&stream, &[chunk_entry("fenced", 0, "an entry older than the corpus run below")]).await;
        taken_by_dead_consumer(&stream, "dead", 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let rerun =
            pipeline(&s).await.run(input(line("fenced", 0, text).into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!((rerun.unchanged, rerun.stored), (1, 0), "{rerun:?}");

        let mut opts = source_opts(&stream, "survivor");
        opts.min_idle = Duration::from_millis(1_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let summary = run_source(&db, &mock, opts).await;
        assert_eq!(summary.source.as_ref().unwrap().entries_reclaimed, 1, "{summary:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        assert_eq!(
            vector_is(&db, "fenced", 0, text).await,
            Some(true),
            "the corpus line came after the entry: its text stays: {summary:?}"
        );
        assert_eq!(db.leaks().await, 0);
    }

    /// The same corpus rerun of a table no stream source feeds writes nothing: its unchanged
    /// skips leave the manifest rows as they were (the read-only lookup), so the fence above
    /// costs only the tables that need it.
    async fn an_unchanged_rerun_of_a_table_no_stream_feeds_moves_no_position() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let s = settings(&db, &mock);
        let corpus: String = (0..400).map(|i| line("plain", i, &format!("text {i}"))).collect();
        pipeline(&s).await.run(input(corpus.clone().into_bytes()), CancellationToken::new()).await.unwrap();
        let positions = "SELECT sum(source_seq % 1000003)::bigint FROM ingest_manifest";
        let before = db.count(positions).await;
        let rerun = pipeline(&s).await.run(input(corpus.clone().into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!((rerun.unchanged, rerun.stored), (400, 0), "{rerun:?}");
        assert_eq!(db.count(positions).await, before, "an unchanged rerun alone moves no position");
        // Once a stream source has fed the table, the same rerun moves them all.
        sqlx::query("INSERT INTO ingest_stream_fed (target_table, stream, group_name) VALUES ($1, 's', 'g')").bind(&s.table).execute(&db.pool).await.unwrap();
        let fenced = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!((fenced.unchanged, fenced.stored), (400, 0), "{fenced:?}");
        let newest = "SELECT count(*) FROM ingest_manifest WHERE source_seq >= (SELECT max(source_seq) - 400 FROM ingest_manifest)";
        assert_eq!(db.count(newest).await, 400, "every unchanged line of a stream-fed table took its new position");
    }
}

on_single_and_cluster! {
    /// A deletion's tombstone outlives an older entry of its chunk that a dead consumer still
    /// holds: the sweep at each run start drops tombstones older than an hour that no live
    /// run could still need, and a stream's pending entries are held by no live run. Taken
    /// over after the sweep, the entry must still lose to the deletion.
    async fn a_deletion_stays_fenced_against_an_older_entry_pending_past_the_tombstone_sweep() {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let stream = fresh_stream();
        let s = settings(&db, &mock);
        pipeline(&s).await.run(input(line("gone", 0, "the text").into_bytes()), CancellationToken::new()).await.unwrap();
        let mut opts = source_opts(&stream, "survivor");
        opts.idle_exit = Some(Duration::from_millis(200));
        run_source(&db, &mock, opts).await;
        publish(&stream, &[chunk_entry("gone", 0, "an entry older than the deletion")]).await;
        taken_by_dead_consumer(&stream, "dead", 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let delete = format!("{}\n", serde_json::json!({"doc_id": "gone", "op": "delete"}));
        let deleted = pipeline(&s).await.run(input(delete.into_bytes()), CancellationToken::new()).await.unwrap();
        assert_eq!(deleted.delete_requests, 1, "{deleted:?}");
        assert_eq!(vector_is(&db, "gone", 0, "the text").await, None);
        // An hour and more later, another run starts (and sweeps).
        sqlx::query("UPDATE ingest_tombstone SET deleted_at = deleted_at - interval '2 hours'")
            .execute(&db.pool)
            .await
            .unwrap();
        pipeline(&s).await.run(input(line("other", 0, "text").into_bytes()), CancellationToken::new()).await.unwrap();

        let mut opts = source_opts(&stream, "survivor");
        opts.min_idle = Duration::from_millis(1_000);
        opts.idle_exit = Some(Duration::from_millis(500));
        let summary = run_source(&db, &mock, opts).await;
        assert_eq!(summary.source.as_ref().unwrap().entries_reclaimed, 1, "{summary:?}");
        assert_eq!(pending(&stream, "it-ingest").await, 0);
        assert_eq!(
            db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'gone'").await,
            0,
            "the deletion came after the entry: the chunk stays deleted: {summary:?}"
        );
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'gone'").await, 0);
        assert_eq!(db.leaks().await, 0);
    }
}

/// The peak resident memory (`VmHWM`) of `ingest --from-stream` draining `entries` entries of
/// `text_bytes` each (published first) with a byte budget of `budget`, read off
/// `/proc/<pid>/status` until the process exits.
async fn peak_rss_draining(entries: usize, text_bytes: usize, budget: u64) -> u64 {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let stream = fresh_stream();
    let published: Vec<Vec<(String, Vec<u8>)>> = (0..entries)
        .map(|i| {
            let mut text = format!("big entry {i} ");
            text.extend(std::iter::repeat_n('x', text_bytes - text.len()));
            chunk_entry("big", i as i32, &text)
        })
        .collect();
    for part in published.chunks(8) {
        publish(&stream, part).await;
    }
    drop(published);
    let mut child = source_cmd(&db, &mock, &stream, "big-reader")
        .args(["--max-inflight-bytes", &budget.to_string(), "--max-input-chars", "1000000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut peak = 0u64;
    let status = loop {
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kb) = s.lines().find_map(|l| l.strip_prefix("VmHWM:"))
        {
            peak = peak.max(kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024);
        }
        match tokio::time::timeout(Duration::from_millis(10), child.wait()).await {
            Ok(status) => break status.unwrap(),
            Err(_) => continue,
        }
    };
    assert_eq!(status.code(), Some(0));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, entries as i64, "every entry stored");
    let mut redis = redis().await;
    let _: () = redis.del(&stream).await.unwrap();
    peak
}

/// A source stream of big entries is read within the byte budget (issue 50): a reply held
/// every entry it returned before the budget saw them, so 120 entries of 900 KB under a 4 MiB
/// budget took their 108 MB at once. The peak of draining 120 must stay within the peak of
/// draining one plus a few budgets and entries (the records in flight, their request bodies,
/// one read's reply, the entry being parsed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_entries_are_read_within_the_byte_budget() {
    const TEXT: usize = 900_000;
    const BUDGET: u64 = 4 << 20;
    let one = peak_rss_draining(1, TEXT, BUDGET).await;
    let many = peak_rss_draining(120, TEXT, BUDGET).await;
    let allowed = one + 4 * BUDGET + 4 * TEXT as u64;
    eprintln!("peak RSS: {} MB draining one entry, {} MB draining 120", one >> 20, many >> 20);
    assert!(
        many <= allowed,
        "peak RSS draining 120 entries of {TEXT} bytes: {} MB, against {} MB for one (at most {} MB)",
        many >> 20,
        one >> 20,
        allowed >> 20
    );
}
