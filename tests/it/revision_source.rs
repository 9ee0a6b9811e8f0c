//! A stream source and `serve` write every live revision of a target (issue 46): each entry
//! reaches every revision, each with its own model, and is acknowledged only once each has
//! committed its outcome; a shadow whose provider refuses it never holds the active revision
//! up; a revision made while a source runs is written from the source's next segment; a
//! target whose revision 1 is retired is written as its active revision. The oracles are
//! what the test published, content hashes the test computes, and the relations and the
//! group's pending count read directly.

use std::sync::Arc;
use std::time::Duration;

use embed_dlq::ingest::source::{SourceOptions, run_source_into};
use embed_dlq::model::content_hash;
use embed_dlq::store::revision::{activate, create_shadow, list, retire};
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::revisions::hashes;
use crate::source::{chunk_entry, fresh_stream, pending, publish};
use crate::support::*;

/// The text of chunk `i` of `doc` at version `v` (every 25th one the provider rejects).
fn text(doc: &str, i: i32, v: &str) -> String {
    let poison = if i % 25 == 24 { "[[poison:400]] " } else { "" };
    format!("{poison}{doc} chunk {i} {v}")
}

/// 30 chunks of "a" at v1, through a corpus run into the table (revision 1 to be).
async fn first_corpus(db: &TestDb, mock: &embed_dlq::testkit::mock_provider::MockProvider) {
    let lines: String = (0..30).map(|i| line("a", i, &text("a", i, "v1"))).collect();
    let summary = pipeline(&settings(db, mock))
        .await
        .run(input(lines.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(summary.stored, 29, "{summary:?}");
}

/// A stream entry's fields.
type Entry = Vec<(String, Vec<u8>)>;

/// What each key must hold: key → text.
type Texts = std::collections::BTreeMap<(String, i32), String>;

/// What the test publishes once a shadow exists: a/0..10 at v2, b/0..25 new (b/24 poison),
/// a delete of a/29; returns what every revision must hold after it: key → text.
fn changes() -> (Vec<Entry>, Texts) {
    let mut entries = Vec::new();
    let mut expected = std::collections::BTreeMap::new();
    for i in 0..10 {
        entries.push(chunk_entry("a", i, &text("a", i, "v2")));
        expected.insert(("a".to_string(), i), text("a", i, "v2"));
    }
    for i in 0..25 {
        entries.push(chunk_entry("b", i, &text("b", i, "v1")));
        expected.insert(("b".to_string(), i), text("b", i, "v1"));
    }
    entries.push(vec![
        ("doc_id".into(), b"a".to_vec()),
        ("chunk_index".into(), b"29".to_vec()),
        ("op".into(), b"delete".to_vec()),
    ]);
    (entries, expected)
}

/// Checks that `relation` holds, for each key of `expected` the provider accepts, the vector
/// of its text embedded by `model` at `dims`, and no key the test deleted.
async fn holds(db: &TestDb, relation: &str, model: &str, dims: usize, expected: &Texts) {
    let got = hashes(db, relation).await;
    for ((doc, i), text) in expected {
        if text.contains("[[poison") {
            assert!(!got.contains_key(&(doc.clone(), *i)), "{relation} {doc}#{i} is poison");
            continue;
        }
        assert_eq!(
            got.get(&(doc.clone(), *i)),
            Some(&content_hash(model, dims, text)),
            "{relation} {doc}#{i}: the vector of {text:?} by {model}"
        );
    }
    assert!(!got.contains_key(&("a".to_string(), 29)), "{relation}: a#29 was deleted");
}

fn opts(stream: &str, consumer: &str) -> SourceOptions {
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

/// `ingest --from-stream` with a shadow: every entry reaches both revisions, each with its
/// model (the shadow at 256 dimensions), the deletion both, the poison entry parks under each
/// identity (each event naming the target and revision), and nothing is left pending. Before
/// issue 46's stream fan-out it wrote revision 1 alone and said so in a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_from_a_stream_writes_every_live_revision_each_with_its_model() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let stream = fresh_stream();
    let (entries, expected) = changes();
    publish(&stream, &entries).await;
    let out = drain_stream(&db, &mock, &stream, "c1").await;
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let per_revision: Vec<(i64, i64)> = summary["revisions"]
        .as_array()
        .unwrap_or_else(|| panic!("one summary per revision: {summary}"))
        .iter()
        .map(|r| (r["revision"].as_i64().unwrap(), r["summary"]["stored"].as_i64().unwrap()))
        .collect();
    // Revision 1 stores the 10 changed and 24 new chunks; revision 2 the same 34.
    assert_eq!(per_revision, vec![(1, 34), (2, 34)], "{summary}");
    holds(&db, "doc_embeddings__r1", "mock", 768, &expected).await;
    holds(&db, "doc_embeddings__r2", "mock-next", 256, &expected).await;
    assert_eq!(pending(&stream, "it-ingest").await, 0, "every entry acknowledged");
    let parked: Vec<(String, String)> = sqlx::query_as(
        "SELECT target_table, doc_id || '#' || chunk_index FROM embedding_dlq WHERE doc_id = 'b' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        parked,
        vec![
            ("public.doc_embeddings".to_string(), "b#24".to_string()),
            ("public.doc_embeddings__r2".to_string(), "b#24".to_string())
        ]
    );
    // Each park's event names the target and its revision, and conforms to the contract
    // (relay_all checks every entry it publishes against docs/events.schema.json).
    let named: Vec<(String, Option<String>, Option<i64>)> = sqlx::query_as(
        "SELECT body->>'table', body->>'target', (body->>'revision')::bigint FROM dlq_outbox
          WHERE event = 'parked' AND doc_id = 'b' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let target = Some("public.doc_embeddings".to_string());
    assert_eq!(
        named,
        vec![
            ("public.doc_embeddings".to_string(), target.clone(), Some(1)),
            ("public.doc_embeddings__r2".to_string(), target, Some(2))
        ]
    );
    relay_all(&db, &fresh_keys()).await;
}

on_single_and_cluster! {
/// A shadow whose model the provider refuses (404, systemic) stops its own part only: the
/// active revision gets every entry, every entry is acknowledged, the shadow's run says it
/// stopped, and the shadow's coverage shows what it missed, so a switch to it is refused.
async fn a_shadow_the_provider_refuses_never_holds_the_active_revision_up() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { retired_models: vec!["mock-gone".into()], ..MockConfig::default() }).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-gone", 768, None).await.unwrap();
    let stream = fresh_stream();
    let (entries, expected) = changes();
    publish(&stream, &entries).await;
    let targets = Arc::new(settings(&db, &mock).source_targets());
    let runs = tokio::time::timeout(
        Duration::from_secs(120),
        run_source_into(targets, &redis_client(), opts(&stream, "c1"), CancellationToken::new()),
    )
    .await
    .expect("the source drains and stops")
    .expect("the active revision's run succeeds");
    let parts: Vec<(i32, bool)> =
        runs.iter().map(|r| (r.revision.as_ref().unwrap().revision, r.stopped.is_some())).collect();
    assert_eq!(parts, vec![(1, false), (2, true)], "{runs:?}");
    holds(&db, "doc_embeddings__r1", "mock", 768, &expected).await;
    assert_eq!(pending(&stream, "it-ingest").await, 0, "the active revision's outcomes acknowledge the entries");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings__r2").await, 0);
    let e = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap_err().to_string();
    assert!(e.contains("does not cover"), "{e}");
}

/// A revision made while a stream source runs is written from the source's next segment,
/// which begins within the watch interval: once a marker entry published after the shadow's
/// creation reaches it, every later entry reaches both revisions. (The table is adopted
/// before the source starts, as the guide says: a relation renamed under a running writer
/// refuses its writes.)
async fn a_revision_made_while_the_source_runs_is_written_from_its_next_segment() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    embed_dlq::store::revision::adopt(&db.pool, "doc_embeddings", Some("mock"), None).await.unwrap();
    let stream = fresh_stream();
    let cancel = CancellationToken::new();
    let targets = Arc::new(settings(&db, &mock).source_targets());
    let mut o = opts(&stream, "c1");
    o.idle_exit = None;
    let client = redis_client();
    let source = tokio::spawn({
        let cancel = cancel.clone();
        async move { run_source_into(targets, &client, o, cancel).await }
    });
    publish(&stream, &[chunk_entry("early", 0, "before the shadow")]).await;
    wait_rows(&db, "SELECT count(*) FROM doc_embeddings__r1 WHERE doc_id = 'early'", 1, "the table").await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    // Markers until one reaches the shadow: the source has begun a segment that writes it.
    let mut marker = 0;
    loop {
        publish(&stream, &[chunk_entry("marker", marker, &format!("marker {marker}"))]).await;
        marker += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if db.count("SELECT count(*) FROM doc_embeddings__r2 WHERE doc_id = 'marker'").await > 0 {
            break;
        }
        assert!(marker < 400, "no marker reached the shadow in two minutes");
    }
    let (entries, expected) = changes();
    publish(&stream, &entries).await;
    wait_rows(&db, "SELECT count(*) FROM doc_embeddings__r2 WHERE doc_id = 'b'", 24, "the shadow").await;
    while pending(&stream, "it-ingest").await > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    let runs = source.await.unwrap().unwrap();
    assert!(runs.iter().all(|r| r.stopped.is_none()), "{runs:?}");
    holds(&db, "doc_embeddings__r1", "mock", 768, &expected).await;
    holds(&db, "doc_embeddings__r2", "mock-next", 256, &expected).await;
    let states: Vec<String> = list(&db.pool, Some("doc_embeddings")).await.unwrap().into_iter().map(|r| r.state).collect();
    assert_eq!(states, vec!["active", "shadow"]);
}
}

/// Waits (up to two minutes) until `sql` counts `n`.
async fn wait_rows(db: &TestDb, sql: &'static str, n: i64, what: &str) {
    for _ in 0..1200 {
        if db.count(sql).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what} never held {n} rows for {sql}");
}

/// "B is live, A is retired": an ingest of the target's name writes revision 2, with
/// revision 2's model, and a `serve` with a stream source the same; before, it wrote through
/// the query name (a view) and every write was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_whose_first_revision_is_retired_is_written_as_its_active_one() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let s = settings(&db, &mock);
    let lines: String = (0..30).map(|i| line("a", i, &text("a", i, "v1"))).collect();
    let fanout = s.fanout().await.unwrap().expect("two live revisions");
    let runs = fanout.run(input(lines.into_bytes()), CancellationToken::new()).await;
    assert!(runs.iter().all(|r| r.result.is_ok()), "{runs:?}");
    activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    retire(&db.pool, "doc_embeddings", 1).await.unwrap();

    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-retired-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.jsonl");
    let changed: String = (0..5).map(|i| line("a", i, &text("a", i, "v3"))).collect();
    std::fs::write(&path, changed).unwrap();
    let out = binary()
        .args(["ingest", path.to_str().unwrap(), "--json", "--no-progress"])
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["stored"].as_i64(), Some(5), "{summary}");
    let got = hashes(&db, "doc_embeddings__r2").await;
    for i in 0..5 {
        assert_eq!(
            got.get(&("a".to_string(), i)),
            Some(&content_hash("mock-next", 256, &text("a", i, "v3")))
        );
    }
    let dims: i32 = sqlx::query_scalar(
        "SELECT vector_dims(embedding) FROM doc_embeddings WHERE doc_id = 'a' AND chunk_index = 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(dims, 256, "the query name answers revision 2");

    // serve's stream source writes it too.
    let stream = fresh_stream();
    let keys = fresh_keys();
    let mut serve = binary()
        .arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--model", "mock", "--stream-prefix", keys.prefix(), "--replayers", "1"])
        .args(["--from-stream", &stream, "--group", "it-ingest", "--consumer", "serve-1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    publish(&stream, &[chunk_entry("served", 0, "served text")]).await;
    let mut stored = false;
    for _ in 0..600 {
        if db.count("SELECT count(*) FROM doc_embeddings__r2 WHERE doc_id = 'served'").await == 1 {
            stored = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = serve.start_kill();
    let out = serve.wait_with_output().await.unwrap();
    assert!(stored, "serve never wrote revision 2: {}", String::from_utf8_lossy(&out.stderr));
    let got = hashes(&db, "doc_embeddings__r2").await;
    assert_eq!(got.get(&("served".to_string(), 0)), Some(&content_hash("mock-next", 256, "served text")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The revision gauges `serve` samples, read from a real scrape: a shadow that holds nothing
/// covers 0 of the active revision's 30 chunks, and the active revision is the one marked 1;
/// the oracle is the corpus the test wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exports_each_revisions_coverage_chunks_and_backlog() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let value = |body: &str, name: &str, revision: i32| -> Option<f64> {
        let want = format!("revision=\"{revision}\"");
        body.lines()
            .filter(|l| {
                l.starts_with(name) && l.contains(&want) && l.contains("target=\"public.doc_embeddings\"")
            })
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let body = scrape_serve_until(&db, |b| value(b, "embed_dlq_revision_covered_ratio", 2).is_some()).await;
    let got = |name: &str| (value(&body, name, 1), value(&body, name, 2));
    assert_eq!(got("embed_dlq_revision_active"), (Some(1.0), Some(0.0)), "{body}");
    assert_eq!(got("embed_dlq_revision_chunks"), (Some(30.0), Some(0.0)));
    assert_eq!(got("embed_dlq_revision_dlq_rows"), (Some(1.0), Some(0.0)), "a#24 is parked in revision 1");
    assert_eq!(got("embed_dlq_revision_uncovered"), (Some(0.0), Some(30.0)));
    assert_eq!(got("embed_dlq_revision_covered_ratio"), (Some(1.0), Some(0.0)));
}

on_single_and_cluster! {
/// A switch under a stream source that never stops writing: each revision commits on its own,
/// so some chunks are always in one and not yet in the other; `activate` with a wait pauses
/// the source's intake, the work in flight commits in both, and the switch goes through. The
/// source then reads on, into both, and nothing published is missing from either revision.
async fn a_switch_under_live_writes_pauses_intake_and_goes_through() {
    use embed_dlq::store::revision::activate_quiesced;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 20, ..MockConfig::default() }).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let s = settings(&db, &mock);
    let lines: String = (0..30).map(|i| line("a", i, &text("a", i, "v1"))).collect();
    let runs = s.fanout().await.unwrap().unwrap().run(input(lines.into_bytes()), CancellationToken::new()).await;
    assert!(runs.iter().all(|r| r.result.is_ok()), "{runs:?}");
    let stream = fresh_stream();
    let cancel = CancellationToken::new();
    let mut o = opts(&stream, "c1");
    o.idle_exit = None;
    let (targets, client) = (Arc::new(s.source_targets()), redis_client());
    let source = tokio::spawn({
        let cancel = cancel.clone();
        async move { run_source_into(targets, &client, o, cancel).await }
    });
    // The producer: a new chunk every 5 ms until told to stop.
    let producing = CancellationToken::new();
    let producer = tokio::spawn({
        let (stream, producing) = (stream.clone(), producing.clone());
        async move {
            let mut n = 0;
            while !producing.is_cancelled() {
                publish(&stream, &[chunk_entry("live", n, &format!("live {n}"))]).await;
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        }
    });
    wait_rows(&db, "SELECT count(*) FROM doc_embeddings__r2 WHERE doc_id = 'live'", 50, "the shadow").await;
    let switched = activate_quiesced(&db.pool, "doc_embeddings", Some(2), 0, Duration::from_secs(60)).await;
    let switched = switched.expect("the switch goes through under live writes");
    assert_eq!((switched.active, switched.previous, switched.coverage.uncovered()), (2, 1, 0));
    let paused: i64 = db.count("SELECT count(*) FROM embed_dlq_revision_switch").await;
    assert_eq!(paused, 0, "the pause ends with the switch");
    // Intake goes on after the switch.
    let before = db.count("SELECT count(*) FROM doc_embeddings__r1 WHERE doc_id = 'live'").await;
    for _ in 0..600 {
        if db.count("SELECT count(*) FROM doc_embeddings__r1 WHERE doc_id = 'live'").await > before + 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(db.count("SELECT count(*) FROM doc_embeddings__r1 WHERE doc_id = 'live'").await > before + 20);
    producing.cancel();
    let published: i32 = producer.await.unwrap();
    for relation in ["doc_embeddings__r1", "doc_embeddings__r2"] {
        let sql = format!("SELECT count(*) FROM {relation} WHERE doc_id = 'live'");
        for _ in 0..1200 {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone())).fetch_one(&db.pool).await.unwrap();
            if n >= i64::from(published) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    while pending(&stream, "it-ingest").await > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    let runs = source.await.unwrap().unwrap();
    assert!(runs.iter().all(|r| r.stopped.is_none()), "{runs:?}");
    for (relation, model, dims) in [("doc_embeddings__r1", "mock", 768), ("doc_embeddings__r2", "mock-next", 256)] {
        let got = hashes(&db, relation).await;
        for n in 0..published {
            assert_eq!(
                got.get(&("live".to_string(), n)),
                Some(&content_hash(model, dims, &format!("live {n}"))),
                "{relation} live#{n} of {published}"
            );
        }
    }
}
}

/// `ingest --from-stream` of `stream` until it is drained, as consumer `consumer`: exit 0
/// and nothing left pending; its output (`--json`).
async fn drain_stream(
    db: &TestDb,
    mock: &embed_dlq::testkit::mock_provider::MockProvider,
    stream: &str,
    consumer: &str,
) -> std::process::Output {
    let out = binary()
        .arg("ingest")
        .args(["--from-stream", stream, "--group", "it-ingest", "--consumer", consumer])
        .args(["--source-min-idle-ms", "1000", "--idle-exit-ms", "1500", "--json", "--no-progress"])
        .args(["--database-url", &db.url, "--redis-url", &redis_url()])
        .args([
            "--base-url",
            &mock.base_url(),
            "--model",
            "mock",
            "--retry-base-ms",
            "5",
            "--retry-cap-ms",
            "50",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(pending(stream, "it-ingest").await, 0, "every entry acknowledged");
    out
}

/// A backfill copies what the active revision holds, never what an older dump of the source
/// says. The dump here was written before live writes changed a/0..9, deleted a/29 and
/// published a/12 at v3 (an entry read only after the backfill ran). Before, a backfill was a
/// corpus run of every revision, and a corpus run's positions are later than every live write
/// before it: the backfill put v1 back into the live search for a/0..9, brought a/29 back in
/// both revisions, and a/12's v3 entry lost to the dump in both, so the newest text was lost
/// with every revision agreeing (coverage said "covered"). Now the backfill writes the shadow
/// alone, each line only where the active revision holds that very text, at the active
/// record's own position, and reports the lines it left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_from_an_older_dump_never_puts_its_text_back() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    let dump: String = (0..30).map(|i| line("a", i, &text("a", i, "v1"))).collect();
    let dir =
        std::env::temp_dir().join(format!("embed-dlq-dump-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dump.jsonl");
    std::fs::write(&path, dump).unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let stream = fresh_stream();
    let (entries, changed) = changes();
    publish(&stream, &entries).await;
    drain_stream(&db, &mock, &stream, "c1").await;
    // Read only after the backfill: its position (its id's time) is older than the backfill's.
    publish(&stream, &[chunk_entry("a", 12, &text("a", 12, "v3"))]).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let out = binary()
        .args(["revision", "backfill", path.to_str().unwrap(), "--json", "--no-progress"])
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let per_revision: Vec<(i64, i64, i64)> = summary["revisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let s = &r["summary"];
            (
                r["revision"].as_i64().unwrap(),
                s["stored"].as_i64().unwrap(),
                s["differs_from_active"].as_i64().unwrap(),
            )
        })
        .collect();
    // The shadow alone: a/10..28 but a/24 (poison, parked as in revision 1) stored; a/0..9
    // (other text in revision 1) and a/29 (gone from it) left out and reported.
    assert_eq!(per_revision, vec![(2, 18, 11)], "{summary}");

    drain_stream(&db, &mock, &stream, "c2").await;
    let mut expected: Texts = (0..29).map(|i| (("a".to_string(), i), text("a", i, "v1"))).collect();
    expected.extend(changed);
    expected.insert(("a".to_string(), 12), text("a", 12, "v3"));
    holds(&db, "doc_embeddings__r1", "mock", 768, &expected).await;
    holds(&db, "doc_embeddings__r2", "mock-next", 256, &expected).await;
    let out = binary()
        .args(["revision", "activate", "--revision", "2", "--database-url", &db.url])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The counters of what is written and spent carry the revision (issue 46): `serve`'s stream
/// source writes a target's active revision and its shadow, and a real scrape shows each
/// revision's stored chunks, parks, provider requests and tokens apart. The oracle is what the
/// test published: 20 new chunks (the 20th one the provider rejects) into each revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_and_spend_counters_carry_the_revision() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    first_corpus(&db, &mock).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let (stream, keys) = (fresh_stream(), fresh_keys());
    let port = (0..100)
        .map(|_| 20_000 + rand::random::<u16>() % 1_000)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port for the metrics endpoint");
    let mut serve = binary()
        .arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--model", "mock", "--stream-prefix", keys.prefix(), "--replayers", "1"])
        .args(["--from-stream", &stream, "--group", "it-ingest", "--consumer", "serve-1"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let entries: Vec<Entry> = (0..20).map(|i| chunk_entry("m", i, &text("m", i + 5, "v1"))).collect();
    publish(&stream, &entries).await;
    let value = |body: &str, name: &str, labels: &[&str]| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|w| l.contains(w)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut body = String::new();
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(r) = embed_dlq::http::client_builder().build().unwrap().get(&url).send().await
            && let Ok(text) = r.text().await
        {
            body = text;
            let parked = |r: &str| value(&body, "embed_dlq_chunks_parked_total", &[r]);
            if parked("revision=\"1\"") >= 1.0 && parked("revision=\"2\"") >= 1.0 {
                break;
            }
        }
    }
    let _ = serve.start_kill();
    let _ = serve.wait().await;
    for r in ["revision=\"1\"", "revision=\"2\""] {
        assert_eq!(value(&body, "embed_dlq_chunks_stored_total", &[r]), 19.0, "{r}: {body}");
        assert_eq!(value(&body, "embed_dlq_chunks_parked_total", &[r, "permanent_input"]), 1.0, "{r}");
        assert!(value(&body, "embed_dlq_provider_requests_total", &[r, "outcome=\"ok\""]) >= 1.0, "{r}");
        // 19 stored texts of about 17 characters: at least a token each.
        assert!(value(&body, "embed_dlq_tokens_total", &[r, "outcome=\"stored\""]) >= 19.0, "{r}: {body}");
    }
    assert_eq!(value(&body, "embed_dlq_chunks_stored_total", &["revision=\"3\""]), 0.0);
}
