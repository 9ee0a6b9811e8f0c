//! Deletions (issue 21, parts 1 and 2): a corpus run's cleanup (`--cleanup incremental|full`)
//! and explicit deletes in the input (`{"doc_id": .., "op": "delete"}`).
//!
//! The oracle is always the corpus: the keys a version of the corpus holds, computed here,
//! compared with the vector table, the DLQ and the manifest read by plain SELECTs of the test's
//! own, plus the seed's leak query (`SeedChecks`). Never the product's own statements.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use embed_dlq::config::IngestSettings;
use embed_dlq::ingest::{CleanupMode, IngestError};
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider, POISON_400};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::support::*;

type Keys = BTreeSet<(String, i32)>;

/// A corpus version: document → its chunks' texts.
type Corpus = BTreeMap<String, Vec<String>>;

fn jsonl(corpus: &Corpus) -> Vec<u8> {
    let mut out = String::new();
    for (doc, texts) in corpus {
        for (i, t) in texts.iter().enumerate() {
            out.push_str(&line(doc, i as i32, t));
        }
    }
    out.into_bytes()
}

fn keys_of(corpus: &Corpus) -> Keys {
    corpus.iter().flat_map(|(d, texts)| (0..texts.len() as i32).map(move |i| (d.clone(), i))).collect()
}

fn delete_doc(doc: &str) -> String {
    format!("{}\n", serde_json::json!({"doc_id": doc, "op": "delete"}))
}

fn delete_chunk(doc: &str, idx: i32) -> String {
    format!("{}\n", serde_json::json!({"doc_id": doc, "chunk_index": idx, "op": "delete"}))
}

/// The keys of `sql` (doc_id, chunk_index rows), read by the test.
async fn keys_in(db: &TestDb, sql: &str) -> Keys {
    sqlx::query_as::<_, (String, i32)>(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn vectors(db: &TestDb) -> Keys {
    keys_in(db, "SELECT doc_id, chunk_index FROM doc_embeddings").await
}

async fn manifest(db: &TestDb) -> Keys {
    keys_in(db, "SELECT doc_id, chunk_index FROM ingest_manifest").await
}

async fn dlq(db: &TestDb) -> Keys {
    keys_in(db, "SELECT doc_id, chunk_index FROM embedding_dlq").await
}

/// `deleted` events in the outbox: key → (body of each).
async fn deleted_events(db: &TestDb) -> BTreeMap<(String, i32), Vec<serde_json::Value>> {
    let rows: Vec<(String, i32, serde_json::Value)> = sqlx::query_as(
        "SELECT doc_id, chunk_index, body FROM dlq_outbox WHERE event = 'deleted' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut out: BTreeMap<(String, i32), Vec<serde_json::Value>> = BTreeMap::new();
    for (d, i, b) in rows {
        out.entry((d, i)).or_default().push(b);
    }
    out
}

/// The table holds exactly `expected`: a vector for each key (none parked here), a manifest
/// row for each, nothing else; and the seed's leak query is clean.
async fn assert_exactly(db: &TestDb, expected: &Keys) {
    let v = vectors(db).await;
    let missing: Vec<_> = expected.difference(&v).take(5).collect();
    let extra: Vec<_> = v.difference(expected).take(5).collect();
    assert!(missing.is_empty() && extra.is_empty(), "vectors: missing {missing:?}, extra {extra:?}");
    assert_eq!(&manifest(db).await, expected, "manifest keys");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    assert_corpus_accounted(db, expected).await;
}

fn with_cleanup(mut s: IngestSettings, mode: CleanupMode) -> IngestSettings {
    s.options.cleanup.mode = mode;
    s
}

async fn run(s: &IngestSettings, bytes: Vec<u8>) -> Result<embed_dlq::ingest::IngestSummary, IngestError> {
    pipeline(s).await.run(input(bytes), CancellationToken::new()).await
}

fn texts(doc: &str, n: usize, version: &str) -> Vec<String> {
    (0..n).map(|i| format!("{doc} chunk {i} {version}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_cleanup_deletes_what_each_document_lost_and_nothing_else() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let mut v1 = Corpus::new();
    v1.insert("shrinks".into(), texts("shrinks", 5, "v1"));
    // Its last chunk is parked: the cleanup deletes its DLQ row too.
    v1.get_mut("shrinks").unwrap()[4] = format!("bad {POISON_400} input");
    v1.insert("same".into(), texts("same", 4, "v1"));
    v1.insert("absent".into(), texts("absent", 3, "v1"));
    let first = run(&s, jsonl(&v1)).await.unwrap();
    assert_eq!(first.parked_total(), 1, "{first:?}");

    let mut v2 = v1.clone();
    v2.insert("shrinks".into(), texts("shrinks", 3, "v1"));
    v2.remove("absent");
    let summary = run(&with_cleanup(s.clone(), CleanupMode::Incremental), jsonl(&v2)).await.unwrap();
    let cleanup = summary.cleanup.clone().expect("a cleanup report");
    assert_eq!((cleanup.deleted, cleanup.documents, cleanup.skipped.clone()), (2, 1, None), "{summary:?}");

    // Incremental: `absent` is not in this run, so it stays.
    let mut expected = keys_of(&v2);
    expected.extend(keys_of(&v1).into_iter().filter(|(d, _)| d == "absent"));
    assert_eq!(vectors(&db).await, expected);
    assert_eq!(manifest(&db).await, expected);
    assert!(dlq(&db).await.is_empty(), "the parked chunk's DLQ row went with it");
    assert_eq!(db.leaks().await, 0);
    let events = deleted_events(&db).await;
    let keys: Vec<_> = events.keys().cloned().collect();
    assert_eq!(keys, vec![("shrinks".to_string(), 3), ("shrinks".to_string(), 4)]);
    assert!(events.values().all(|e| e.len() == 1), "one event per deleted chunk: {events:?}");
    let parked = &events[&("shrinks".to_string(), 4)][0];
    assert!(parked["dlq_id"].is_i64() && parked["by"] == "cleanup", "{parked}");
    assert_eq!(events[&("shrinks".to_string(), 3)][0]["had_vector"], true);

    // The same corpus again: nothing more to delete, nothing written.
    let again = run(&with_cleanup(s, CleanupMode::Incremental), jsonl(&v2)).await.unwrap();
    assert_eq!(again.cleanup.unwrap().deleted, 0);
    assert_eq!(again.unchanged, keys_of(&v2).len() as u64);
    assert_eq!(deleted_events(&db).await.len(), 2);
}

/// The measured case of the issue: 1,000 documents, then a version with 100 removed and 100
/// shrunk; after `--cleanup full` the table equals the new corpus exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_cleanup_leaves_exactly_the_new_corpus() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let (v1, v2) = thousand_documents();
    let started = Instant::now();
    run(&s, jsonl(&v1)).await.unwrap();
    let first = started.elapsed();
    let started = Instant::now();
    let summary = run(&with_cleanup(s.clone(), CleanupMode::Full), jsonl(&v2)).await.unwrap();
    let cleaned = started.elapsed();
    let cleanup = summary.cleanup.clone().unwrap();
    let removed = keys_of(&v1).difference(&keys_of(&v2)).count() as u64;
    assert_eq!((cleanup.deleted, cleanup.documents), (removed, 200), "{summary:?}");
    assert_eq!(summary.unchanged, keys_of(&v2).len() as u64, "an unchanged chunk is skipped, not rewritten");
    assert_exactly(&db, &keys_of(&v2)).await;
    assert_eq!(deleted_events(&db).await.len() as u64, removed);
    // An unchanged rerun with the cleanup: nothing deleted.
    let started = Instant::now();
    let again = run(&with_cleanup(s.clone(), CleanupMode::Full), jsonl(&v2)).await.unwrap();
    let rerun = started.elapsed();
    assert_eq!(again.cleanup.unwrap().deleted, 0);
    let started = Instant::now();
    run(&s, jsonl(&v2)).await.unwrap();
    let plain = started.elapsed();
    assert_exactly(&db, &keys_of(&v2)).await;
    eprintln!(
        "measured: v1 {} chunks in {first:?}; v2 with --cleanup full ({removed} chunks deleted) in \
         {cleaned:?}; unchanged rerun with --cleanup full {rerun:?}, without {plain:?}",
        keys_of(&v1).len()
    );
}

/// 1,000 documents of 1..=6 chunks; the next version drops 100 of them and shrinks 100 others.
fn thousand_documents() -> (Corpus, Corpus) {
    let mut v1 = Corpus::new();
    for d in 0..1000 {
        let doc = format!("doc-{d:04}");
        v1.insert(doc.clone(), texts(&doc, 2 + d % 5, "v1"));
    }
    let mut v2 = v1.clone();
    for d in 0..1000 {
        let doc = format!("doc-{d:04}");
        if d % 10 == 3 {
            v2.remove(&doc);
        } else if d % 10 == 7 {
            let n = v2[&doc].len();
            v2.get_mut(&doc).unwrap().truncate(n - 1);
        }
    }
    (v1, v2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cleanup_after_an_input_that_broke_off_is_refused_and_deletes_nothing() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let (v1, v2) = thousand_documents();
    run(&s, jsonl(&v1)).await.unwrap();
    let before = vectors(&db).await;

    // A reader that fails half way (a broken pipe): refused.
    let bytes = jsonl(&v2);
    let half = bytes.len() / 2;
    let broken = tokio::io::AsyncReadExt::chain(std::io::Cursor::new(bytes[..half].to_vec()), BrokenPipe);
    let full = with_cleanup(s.clone(), CleanupMode::Full);
    let err = pipeline(&full)
        .await
        .run(tokio::io::BufReader::new(broken), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::CleanupRefused { .. }), "{err}");
    assert!(err.to_string().contains("not read to its end"), "{err}");
    assert_eq!(vectors(&db).await, before, "nothing deleted");

    // A rejected line: refused (its chunk would be deleted).
    let mut rejected = jsonl(&v2);
    rejected.extend_from_slice(b"{\"doc_id\": \"doc-0001\", \"chunk_index\": \"one\"}\n");
    let err = run(&full, rejected).await.unwrap_err();
    assert!(err.to_string().contains("rejected"), "{err}");
    assert_eq!(vectors(&db).await, before, "nothing deleted");
    assert!(deleted_events(&db).await.is_empty());

    // A stop signal before the end: refused.
    let cancel = CancellationToken::new();
    cancel.cancel();
    let err = pipeline(&full).await.run(input(jsonl(&v2)), cancel).await.unwrap_err();
    assert!(matches!(err, IngestError::CleanupRefused { .. }), "{err}");
    assert_eq!(vectors(&db).await, before, "nothing deleted");

    // An incremental cleanup after a broken input is skipped (the run's own error stands).
    let broken =
        tokio::io::AsyncReadExt::chain(std::io::Cursor::new(jsonl(&v2)[..half].to_vec()), BrokenPipe);
    let err = pipeline(&with_cleanup(s.clone(), CleanupMode::Incremental))
        .await
        .run(tokio::io::BufReader::new(broken), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::Input(_)), "{err}");
    assert_eq!(vectors(&db).await, before, "nothing deleted");

    // More than the allowed share: refused unless confirmed.
    let mut tiny = v2.clone();
    tiny.retain(|d, _| d.as_str() < "doc-0100");
    let err = run(&full, jsonl(&tiny)).await.unwrap_err();
    assert!(err.to_string().contains("cleanup_max_fraction"), "{err}");
    assert_eq!(vectors(&db).await, before, "nothing deleted");
    let mut yes = full.clone();
    yes.options.cleanup.confirmed = true;
    run(&yes, jsonl(&tiny)).await.unwrap();
    assert_exactly(&db, &keys_of(&tiny)).await;
}

/// An `AsyncRead` that fails like a producer that died (EPIPE).
struct BrokenPipe;

impl tokio::io::AsyncRead for BrokenPipe {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe)))
    }
}

on_single_and_cluster! {
async fn explicit_deletes_remove_a_document_or_a_chunk_with_one_event_each() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let keys = fresh_keys();
    let s = settings(&db, &mock);
    let mut v1 = Corpus::new();
    v1.insert("gone".into(), texts("gone", 3, "v1"));
    v1.insert("trimmed".into(), texts("trimmed", 3, "v1"));
    v1.insert("back".into(), texts("back", 2, "v1"));
    v1.get_mut("gone").unwrap()[1] = format!("bad {POISON_400} input");
    run(&s, jsonl(&v1)).await.unwrap();

    // Delete a document, one chunk of another, and a third document whose first chunk comes
    // back, unchanged, later in the same input (the last line wins: it is stored again).
    let mut input_lines = delete_doc("gone");
    input_lines.push_str(&delete_chunk("trimmed", 1));
    input_lines.push_str(&delete_doc("back"));
    input_lines.push_str(&line("back", 0, &v1["back"][0]));
    input_lines.push_str(&delete_doc("never-was"));
    let summary = run(&s, input_lines.into_bytes()).await.unwrap();
    assert_eq!((summary.delete_requests, summary.chunks_deleted), (4, 6), "{summary:?}");

    let expected: Keys =
        [("trimmed", 0), ("trimmed", 2), ("back", 0)].iter().map(|(d, i)| (d.to_string(), *i)).collect();
    assert_exactly(&db, &expected).await;
    assert!(dlq(&db).await.is_empty());
    let events = deleted_events(&db).await;
    assert_eq!(events.values().map(Vec::len).sum::<usize>(), 6, "{events:?}");
    assert!(events.values().flatten().all(|e| e["by"] == "input"));

    // Through the relay onto the events stream, one entry each.
    relay_all(&db, &keys).await;
    let mut redis = redis().await;
    let reply: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(keys.events()).arg("-").arg("+").query_async(&mut redis).await.unwrap();
    let entries: Vec<(String, String)> = reply
        .ids
        .iter()
        .map(|e| {
            let body: serde_json::Value = serde_json::from_str(&e.get::<String>("body").unwrap()).unwrap();
            let key = format!("{}#{}", body["doc_id"].as_str().unwrap(), body["chunk_index"]);
            (e.get::<String>("event").unwrap(), key)
        })
        .collect();
    let mut deleted: Vec<&str> =
        entries.iter().filter(|(e, _)| e == "deleted").map(|(_, k)| k.as_str()).collect();
    deleted.sort();
    assert_eq!(deleted, ["back#0", "back#1", "gone#0", "gone#1", "gone#2", "trimmed#1"]);
    // The parked chunk's events stay in order: parked, then deleted.
    let gone1: Vec<&str> = entries.iter().filter(|(_, k)| k == "gone#1").map(|(e, _)| e.as_str()).collect();
    assert_eq!(gone1, ["parked", "deleted"]);
    // The reconciler finds nothing wrong after deletions.
    let mut r = reconciler(&db, &keys, immediate()).await;
    let report = r.run_once(embed_dlq::reconcile::Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
}
}

/// [`settings`] with a request timeout that outlasts the slow mock's latency.
fn slow_settings(db: &TestDb, mock: &MockProvider) -> IngestSettings {
    use embed_dlq::config::{IngestArgs, ProviderArgs, RetryArgs, ServiceArgs};
    IngestSettings::resolve(
        ServiceArgs { database_url: Some(db.url.clone()), redis_url: None, ..Default::default() },
        ProviderArgs {
            base_url: Some(mock.base_url()),
            model: Some("mock".into()),
            request_timeout_ms: Some(10_000),
            ..Default::default()
        },
        IngestArgs { batch_max_inputs: Some(32), ..Default::default() },
        RetryArgs { retry_max_attempts: Some(1), ..Default::default() },
        None,
    )
    .expect("valid test settings")
}

/// A write still in flight in an older run cannot bring back a chunk a newer run deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_runs_write_in_flight_never_resurrects_a_deleted_document() {
    let db = TestDb::new().await;
    let slow = start_mock(MockConfig { latency_ms: 1500, ..MockConfig::default() }).await;
    let fast = start_mock(MockConfig::default()).await;
    let corpus = jsonl(&Corpus::from([("late".to_string(), texts("late", 3, "v1"))]));
    let older = pipeline(&slow_settings(&db, &slow)).await;
    let older = tokio::spawn(async move { older.run(input(corpus), CancellationToken::new()).await });
    // The older run has its run id and positions and is waiting for the provider (counted,
    // not slept on: a loaded machine may take longer than any sleep to get there).
    wait_for("the older run at the provider", Duration::from_secs(60), async || {
        slow.control.stats().requests > 0
    })
    .await;
    let newer = run(&settings(&db, &fast), delete_doc("late").into_bytes()).await.unwrap();
    assert_eq!(newer.delete_requests, 1);
    let older = older.await.unwrap().unwrap();
    assert_eq!((older.stored, older.superseded), (0, 3), "{older:?}");
    assert_exactly(&db, &Keys::new()).await;

    // A newer run writes it again: the tombstone only fences older records.
    run(&settings(&db, &fast), jsonl(&Corpus::from([("late".to_string(), texts("late", 1, "v2"))])))
        .await
        .unwrap();
    assert_exactly(&db, &[("late".to_string(), 0)].into()).await;
}

/// An older run's cleanup never deletes what a newer run wrote meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_runs_cleanup_never_deletes_a_newer_runs_chunk() {
    let db = TestDb::new().await;
    let slow = start_mock(MockConfig { latency_ms: 1500, ..MockConfig::default() }).await;
    let fast = start_mock(MockConfig::default()).await;
    let mut base = Corpus::new();
    for d in 0..20 {
        base.insert(format!("base-{d:02}"), texts(&format!("base-{d:02}"), 2, "v1"));
    }
    run(&settings(&db, &fast), jsonl(&base)).await.unwrap();
    let mut v2 = base.clone();
    v2.insert("slow-new".into(), texts("slow-new", 1, "v2"));
    let older = pipeline(&with_cleanup(slow_settings(&db, &slow), CleanupMode::Full)).await;
    let bytes = jsonl(&v2);
    let older = tokio::spawn(async move { older.run(input(bytes), CancellationToken::new()).await });
    wait_for("the older run at the provider", Duration::from_secs(60), async || {
        slow.control.stats().requests > 0
    })
    .await;
    let newer = Corpus::from([("newer".to_string(), texts("newer", 2, "v1"))]);
    run(&settings(&db, &fast), jsonl(&newer)).await.unwrap();
    let older = older.await.unwrap().unwrap();
    assert_eq!(older.cleanup.unwrap().deleted, 0);
    let mut expected = keys_of(&v2);
    expected.extend(keys_of(&newer));
    assert_exactly(&db, &expected).await;
}

fn ingest_cmd(db: &TestDb, mock: &MockProvider, corpus: &Path) -> Command {
    let mut c = binary();
    c.arg("ingest")
        .arg(corpus)
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .args(["--batch-max-inputs", "32", "--concurrency", "2", "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress"]);
    c
}

/// A temporary file removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(bytes: &[u8]) -> TempFile {
        let p = std::env::temp_dir().join(format!(
            "embed-dlq-del-{}-{}.jsonl",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&p, bytes).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Each document of `v1` is, in the table, either as `v1` had it or as `v2` has it (a
/// document `v2` dropped: all of its chunks or none), never half deleted.
async fn assert_each_document_old_or_new(db: &TestDb, v1: &Corpus, v2: &Corpus) {
    let have = vectors(db).await;
    for doc in v1.keys() {
        let now: Keys = have.iter().filter(|(d, _)| d == doc).cloned().collect();
        let old: Keys = keys_of(&Corpus::from([(doc.clone(), v1[doc].clone())]));
        let new: Keys =
            v2.get(doc).map_or_else(Keys::new, |t| keys_of(&Corpus::from([(doc.clone(), t.clone())])));
        assert!(now == old || now == new, "{doc}: {now:?} is neither {old:?} nor {new:?}");
    }
}

/// SIGKILLs (aborts at failpoints) while the run writes and while it cleans up; each rerun of
/// the same corpus with `--cleanup full` picks up, and the last one leaves the new corpus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_the_cleanup_run_a_rerun_finishes_it() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let (v1, v2) = thousand_documents();
    // Every document changes text, so the second version has writes to kill.
    let v2: Corpus =
        v2.into_iter().map(|(d, t)| (d, t.into_iter().map(|x| x.replace("v1", "v2")).collect())).collect();
    let old = TempFile::new(&jsonl(&v1));
    let new = TempFile::new(&jsonl(&v2));
    let out = ingest_cmd(&db, &mock, &old.0).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    for failpoint in ["ingest_writer@3", "cleanup_delete@2"] {
        let out = ingest_cmd(&db, &mock, &new.0)
            .args(["--cleanup", "full"])
            .env("EMBED_DLQ_FAILPOINT", failpoint)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), None, "{failpoint}: killed: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(db.leaks().await, 0, "{failpoint}");
        assert_eq!(db.manifest_disagreements().await, 0, "{failpoint}");
        if failpoint.starts_with("cleanup") {
            // Killed in the middle of the cleanup (its second page of documents): the first
            // page is cleaned, the second is not, and no document is half deleted.
            let have = vectors(&db).await;
            assert!(!have.iter().any(|(d, _)| d == "doc-0003"), "the first page was committed");
            assert!(have.iter().any(|(d, _)| d == "doc-0503"), "the second page was not");
            assert_each_document_old_or_new(&db, &v1, &v2).await;
        }
    }
    let out = ingest_cmd(&db, &mock, &new.0).args(["--cleanup", "full", "--json"]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_exactly(&db, &keys_of(&v2)).await;
    let deleted = deleted_events(&db).await;
    let removed: Keys = keys_of(&v1).difference(&keys_of(&v2)).cloned().collect();
    assert_eq!(deleted.keys().cloned().collect::<Keys>(), removed);
    assert!(deleted.values().all(|e| e.len() == 1), "one event per deleted chunk, across the kills");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_refuses_a_large_or_truncated_full_cleanup_and_a_dry_run_lists_it() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut v1 = Corpus::new();
    for d in 0..10 {
        v1.insert(format!("d{d}"), texts(&format!("d{d}"), 2, "v1"));
    }
    let old = TempFile::new(&jsonl(&v1));
    assert_eq!(ingest_cmd(&db, &mock, &old.0).output().await.unwrap().status.code(), Some(0));
    let mut v2 = v1.clone();
    v2.remove("d3");
    v2.get_mut("d5").unwrap().truncate(1);
    let new = TempFile::new(&jsonl(&v2));

    // 3 of 20 chunks is more than 0.1 of the table: refused, exit 2, nothing deleted.
    let out = ingest_cmd(&db, &mock, &new.0)
        .args(["--cleanup", "full", "--cleanup-max-fraction", "0.1"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cleanup_max_fraction") && stderr.contains("--yes"), "{stderr}");
    assert_eq!(vectors(&db).await, keys_of(&v1));

    // A dry run lists what would go and changes nothing.
    let out = ingest_cmd(&db, &mock, &new.0).args(["--cleanup", "full", "--dry-run"]).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for key in ["d3#0", "d3#1", "d5#1"] {
        assert!(stdout.contains(&format!("would delete {key}")), "{stdout}");
    }
    assert_eq!(stdout.matches("would delete d").count(), 3, "{stdout}");
    assert_eq!(vectors(&db).await, keys_of(&v1));
    assert!(deleted_events(&db).await.is_empty());

    // A truncated file (a line cut in the middle is rejected): refused.
    let mut cut = jsonl(&v2);
    cut.truncate(cut.len() - 10);
    let cut = TempFile::new(&cut);
    let out = ingest_cmd(&db, &mock, &cut.0).args(["--cleanup", "full"]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("rejected"), "{stderr}");
    assert_eq!(vectors(&db).await, keys_of(&v1));

    // With --yes it goes through.
    let out = ingest_cmd(&db, &mock, &new.0)
        .args(["--cleanup", "full", "--cleanup-max-fraction", "0.1", "--yes"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_exactly(&db, &keys_of(&v2)).await;
}

/// A vector table believed empty (its vectors deleted and the table analyzed before its pages
/// were vacuumed away, then filled again): the statements that delete a batch of chunks'
/// vectors, a park withdrawing superseded vectors and an explicit deletion, read only those
/// vectors. Joined with the batch, each walked the whole table for each batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_and_deletions_read_only_their_batch_of_the_vector_table_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.retry.max_attempts = 1;
    // Once the breaker opens, the rest of an outage's input is parked without a call.
    s.options.on_outage = embed_dlq::embed::gate::OnOutage::Park;
    leave_believed_empty(&db, "doc_embeddings", &fake_vectors("deleted", 20_000)).await;
    // 20 documents of 100 chunks stored, beside 20,000 other vectors.
    let mut v1 = Corpus::new();
    for d in 0..20 {
        v1.insert(format!("doc{d:02}"), texts(&format!("doc{d:02}"), 100, "v1"));
    }
    run(&s, jsonl(&v1)).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(fake_vectors("other", 20_000))).execute(&db.pool).await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 22_000);

    // The first ten documents change while the provider is down: parked, and their old
    // vectors withdrawn (`on_newer_parked = withdraw`, the default).
    mock.control.set_outage(true);
    let v2: Corpus = v1.iter().take(10).map(|(d, _)| (d.clone(), texts(d, 100, "v2"))).collect();
    quiet_statistics().await;
    let before = rows_read(&db, "doc_embeddings").await;
    run(&s, jsonl(&v2)).await.unwrap();
    quiet_statistics().await;
    let withdraw_read = rows_read(&db, "doc_embeddings").await - before;
    mock.control.set_outage(false);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 1_000);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 21_000);

    // The other ten are deleted.
    let deletes: String = v1.keys().skip(10).map(|d| delete_doc(d)).collect();
    quiet_statistics().await;
    let before = rows_read(&db, "doc_embeddings").await;
    run(&s, deletes.into_bytes()).await.unwrap();
    quiet_statistics().await;
    let delete_read = rows_read(&db, "doc_embeddings").await - before;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 20_000);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id LIKE 'doc%'").await, 0);

    // A probe and the delete's own read a vector (2 each, and the statement's few others).
    // Walking the table for each batch read its 21,000-22,000 rows a batch.
    assert!(withdraw_read <= 4 * 1_000, "vectors read by the withdrawals: {withdraw_read}");
    assert!(delete_read <= 4 * 1_000, "vectors read by the deletions: {delete_read}");
}
