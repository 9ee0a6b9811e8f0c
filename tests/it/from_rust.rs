//! The library used from Rust: `Pipeline::run_chunks` (chunks a program already holds, no
//! JSONL) against real Postgres+pgvector and the mock provider, and the `embed_from_rust`
//! example run as it is.

use embed_dlq::model::{Chunk, ErrorClass};
use embed_dlq::testkit::mock_provider::{MockConfig, POISON_400};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// The example's own code, run by the suite against the mock.
#[path = "../../examples/embed_from_rust.rs"]
#[allow(dead_code)] // its `main` is the example binary's, not the suite's
mod embed_from_rust;

/// The events consumer example's code, run against the suite's Redis.
#[path = "../../examples/events_consumer.rs"]
#[allow(dead_code)] // its `main` is the example binary's, not the suite's
mod events_consumer;

fn chunk(doc_id: &str, chunk_index: i32, text: &str) -> Chunk {
    Chunk { doc_id: doc_id.into(), chunk_index, text: text.into(), metadata: None }
}

/// Good chunks, a poison input, empty text, a NUL, an over-long doc id, a negative index and
/// one key twice (the later one differs).
fn mixed_chunks() -> Vec<Chunk> {
    let mut chunks: Vec<Chunk> = (0..40).map(|i| chunk("rust-doc", i, &format!("text number {i}"))).collect();
    chunks.push(chunk("poison", 0, &format!("bad {POISON_400} input")));
    chunks.push(chunk("empty", 0, "   "));
    chunks.push(chunk("nul", 0, "a\0b"));
    chunks
        .push(Chunk { metadata: Some(serde_json::json!(["not", "an", "object"])), ..chunk("meta", 0, "x") });
    chunks.push(chunk(&"d".repeat(2000), 0, "too long an id")); // position 45
    chunks.push(chunk("negative", -1, "x")); // position 46
    chunks.push(chunk("rust-doc", 3, "text number 3, revised"));
    chunks
}

async fn revised_hash(db: &TestDb) -> String {
    sqlx::query_scalar(
        "SELECT content_hash FROM doc_embeddings WHERE doc_id = 'rust-doc' AND chunk_index = 3",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_from_rust_are_stored_parked_or_rejected_like_lines_and_unchanged_on_rerun() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &mock)).await;

    let s = p.run_chunks(mixed_chunks(), CancellationToken::new()).await.unwrap();
    assert_eq!(s.lines_read, 47, "{s:?}");
    assert_eq!(s.records, 45, "rejected chunks are no records: {s:?}");
    assert_eq!(s.stored + s.superseded, 41, "{s:?}");
    assert_eq!(s.stored, 40 + 1 - s.superseded);
    assert_eq!(s.parked.get(&ErrorClass::PermanentInput), Some(&2), "poison and empty: {s:?}");
    assert_eq!(s.parked.get(&ErrorClass::InvalidRecord), Some(&2), "NUL and metadata: {s:?}");
    assert_eq!(s.rejected_lines, 2);
    let rejected: Vec<u64> = s.rejected_examples.iter().map(|r| r.line).collect();
    assert_eq!(rejected, vec![45, 46], "{:?}", s.rejected_examples);
    assert!(s.rejected_examples[0].problem.contains("2000 bytes"), "{:?}", s.rejected_examples);
    assert!(s.stopped.is_none());

    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 4);
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'permanent_input' AND error_reason = 'empty_text'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'nul' AND payload->>'line' = '43'").await,
        1,
        "a broken chunk is parked with its position"
    );
    // The later of the two chunks with one key won.
    let revised = embed_dlq::model::content_hash(
        p.embedder.client.model(),
        p.embedder.dimensions,
        "text number 3, revised",
    );
    assert_eq!(revised_hash(&db).await, revised);
    assert_eq!(db.leaks().await, 0);
    // Every chunk once, the two rejected ones (an over-long doc id, a negative index) nowhere.
    let mut expected: std::collections::BTreeSet<(String, i32)> =
        (0..40).map(|i| ("rust-doc".to_string(), i)).collect();
    expected.extend(["poison", "empty", "nul", "meta"].map(|d| (d.to_string(), 0)));
    assert_corpus_accounted(&db, &expected).await;
    assert_eq!(db.manifest_disagreements().await, 0);

    // Rerun: nothing parked again. The one key that occurs twice is
    // embedded again (its two chunks, in one run, decide by position, as for JSONL lines);
    // everything else makes no provider call.
    let inputs_before = mock.control.stats().inputs;
    let again = p.run_chunks(mixed_chunks(), CancellationToken::new()).await.unwrap();
    assert_eq!(again.unchanged, 39, "{again:?}");
    assert_eq!(again.already_parked, 4, "{again:?}");
    assert_eq!(again.stored + again.superseded, 2, "{again:?}");
    assert_eq!(again.parked_total(), 0, "{again:?}");
    assert_eq!(again.rejected_lines, 2);
    assert_eq!(again.provider_inputs, 2, "{again:?}");
    assert_eq!(mock.control.stats().inputs, inputs_before + 2);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
    assert_eq!(revised_hash(&db).await, revised, "the later chunk still wins");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_chunks_is_pulled_only_as_the_byte_budget_allows() {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicU64, Ordering};

    let db = TestDb::new().await;
    // Slow answers: nothing is written (and no budget released) for the first 10 s, and no
    // request times out meanwhile however loaded the machine is.
    let mock = start_mock(MockConfig { latency_ms: 10_000, ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.client.timeout = std::time::Duration::from_secs(30);
    s.options.max_inflight_bytes = 0; // clamped to the smallest budget, 1 MiB
    let p = pipeline(&s).await;
    let text = "x".repeat(2048);
    let produced = std::sync::Arc::new(AtomicU64::new(0));
    let counter = produced.clone();
    // Each chunk is charged about twice its 2 KB: about 250 fit in the budget.
    let chunks = futures::stream::iter(0..2000).map(move |i| {
        counter.fetch_add(1, Ordering::Relaxed);
        chunk("streamed", i, &format!("{i} {text}"))
    });
    let cancel = CancellationToken::new();
    let run = tokio::spawn({
        let cancel = cancel.clone();
        async move { p.run_stream(chunks, cancel).await }
    });
    // Wait until the intake stops pulling (the budget is full), however slowly it gets there:
    // a full second without a pull (a busy intake is not stalled that long by a loaded
    // machine), within the 10 s before the first answer.
    let (mut pulled, mut unchanged) = (0, 0);
    for _ in 0..160 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let now = produced.load(Ordering::Relaxed);
        unchanged = if now > 0 && now == pulled { unchanged + 1 } else { 0 };
        pulled = now;
        if unchanged == 20 {
            break;
        }
    }
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 0, "nothing written yet");
    cancel.cancel();
    assert!((200..600).contains(&pulled), "pulled {pulled} of 2000 chunks before any was written");

    let summary = run.await.unwrap().unwrap();
    assert_eq!(summary.stopped.as_deref(), Some("shutdown requested"));
    assert_eq!(summary.stored + summary.not_attempted, summary.records, "{summary:?}");
    assert!(summary.stored > 0, "claimed work finishes on shutdown: {summary:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await as u64, summary.stored);
    assert_eq!(db.leaks().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embed_from_rust_example_retries_parks_and_reruns_against_the_mock() {
    let db = TestDb::new().await;
    // Every other request fails at first: the example's in-process retries absorb them.
    let mock = start_mock(MockConfig {
        rate_5xx: 0.3,
        rate_429: 0.2,
        retry_after_ms: 5,
        seed: 11,
        ..MockConfig::default()
    })
    .await;
    let target = embed_from_rust::Target {
        database_url: db.url.clone(),
        base_url: mock.base_url(),
        model: "mock".into(),
    };
    let chunks = embed_from_rust::sample_chunks();
    let good = chunks.len() as u64 - 2;

    let s = embed_from_rust::run(&target, chunks.clone(), CancellationToken::new()).await.unwrap();
    assert_eq!(s.records, good + 2, "{s:?}");
    assert_eq!(s.stored + s.parked_total(), s.records, "{s:?}");
    // The empty chunk never reaches the provider; the poison one is rejected by it (or, if the
    // faults exhausted its batch's retries first, parked as transient for replay).
    let permanent = s.parked.get(&ErrorClass::PermanentInput).copied().unwrap_or(0);
    let transient = s.parked.get(&ErrorClass::Transient).copied().unwrap_or(0);
    assert!(permanent >= 1 && permanent + transient >= 2, "poison and empty are parked: {s:?}");
    assert!(s.retries.values().sum::<u64>() > 0, "the faults were retried: {s:?}");
    let report = embed_from_rust::report(&s);
    assert!(
        report.contains(&format!("records:   {}", s.records)) && report.contains("permanent_input"),
        "{report}"
    );
    assert_eq!(db.leaks().await, 0);
    let expected = chunks.iter().map(|c| (c.doc_id.clone(), c.chunk_index)).collect();
    assert_corpus_accounted(&db, &expected).await;
    assert_eq!(db.manifest_disagreements().await, 0);

    // The same chunks again: whatever was stored or parked is skipped.
    let again = embed_from_rust::run(&target, chunks, CancellationToken::new()).await.unwrap();
    assert_eq!(again.unchanged, s.stored, "{again:?}");
    assert_eq!(again.already_parked, s.parked_total(), "{again:?}");
    assert_eq!(again.provider_calls, 0, "{again:?}");
}

on_single_and_cluster! {
async fn the_events_consumer_example_acks_what_it_handled_and_claims_what_another_left() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let keys = fresh_keys();
    let group = "example-test";
    // The group is created (with its stream) before anything is published: it sees everything.
    let mut first =
        events_consumer::EventsConsumer::connect(&redis_url(), &keys, group, "first").await.unwrap();
    // Created once: connecting again finds the group and keeps its position.
    let mut second =
        events_consumer::EventsConsumer::connect(&redis_url(), &keys, group, "second").await.unwrap();

    let chunks: Vec<Chunk> = (0..3).map(|i| chunk("consumed", i, &format!("{POISON_400} {i}"))).collect();
    let s = pipeline(&settings(&db, &mock)).await.run_chunks(chunks, CancellationToken::new()).await.unwrap();
    assert_eq!(s.parked_total(), 3, "{s:?}");
    assert_eq!(relay_all(&db, &keys).await, 3);

    // The first consumer handles every event but the first one, which stays pending.
    let mut seen: Vec<events_consumer::Delivered> = Vec::new();
    let mut handled = 0;
    for _ in 0..5 {
        handled += first
            .read_once(&mut |d: &events_consumer::Delivered| {
                seen.push(d.clone());
                seen.len() > 1
            })
            .await
            .unwrap();
        if seen.len() >= 3 {
            break;
        }
    }
    assert_eq!(seen.len(), 3);
    assert_eq!(handled, 2);
    for d in &seen {
        let body = d.body.as_ref().unwrap_or_else(|| panic!("typed body: {d:?}"));
        assert_eq!((body.event.as_str(), body.doc_id.as_str()), ("parked", "consumed"));
        assert_eq!(body.error_class, Some(ErrorClass::PermanentInput));
        assert_eq!(body.table, "public.doc_embeddings");
    }
    let pending = |c: &mut embed_dlq::streams::RedisConn| {
        let mut c = c.clone();
        let stream = keys.events();
        async move {
            let reply: redis::streams::StreamPendingReply =
                redis::cmd("XPENDING").arg(&stream).arg(group).query_async(&mut c).await.unwrap();
            reply.count()
        }
    };
    let mut conn = redis().await;
    assert_eq!(pending(&mut conn).await, 1, "the refused event stays pending");

    // The second consumer starts: it claims the stale entry, handles and acknowledges it.
    let mut claimed = Vec::new();
    let n = second
        .claim_stale(std::time::Duration::ZERO, &mut |d: &events_consumer::Delivered| {
            claimed.push(d.entry.id.clone());
            events_consumer::print_event(d)
        })
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(claimed, vec![seen[0].entry.id.clone()]);
    assert_eq!(pending(&mut conn).await, 0);
    // Nothing new: a read waits out its BLOCK (longer than redis-rs's default response
    // timeout) and comes back empty instead of failing.
    assert_eq!(second.read_once(&mut events_consumer::print_event).await.unwrap(), 0);
}
}
