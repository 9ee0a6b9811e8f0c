//! `on_outage`: what an ingest does while the provider's circuit breaker is open. Each mode
//! against a mock that answers 503 to everything: how many provider calls the run makes
//! during the outage, where every chunk ends, and (through the binary) the exit codes.
//! Counts only: no wall-clock assertion.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::embed::gate::{BreakerConfig, OnOutage};
use embed_dlq::embed::{Reason, Stop};
use embed_dlq::ingest::{IngestError, IngestSummary};
use embed_dlq::model::{Chunk, ErrorClass};
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Chunks per corpus: enough that most of it is still unread when the breaker opens.
const CHUNKS: i32 = 3_000;
/// Consecutive failures that open the breaker in these tests.
const THRESHOLD: u32 = 8;
/// Concurrent provider requests (the `settings` default).
const CONCURRENCY: u64 = 4;

fn outage_corpus(tag: &str) -> Vec<u8> {
    (0..CHUNKS)
        .map(|i| line(&format!("{tag}-{}", i / 10), i % 10, &format!("{tag} chunk {i}")))
        .collect::<String>()
        .into_bytes()
}

/// Requests the mock saw that carried work (canary probes excluded). Once the breaker is
/// open no mode sends work, so a run sends at most the `THRESHOLD` failures that open it
/// plus the requests already admitted at that moment.
fn work_requests(mock: &MockProvider) -> u64 {
    let st = mock.control.stats();
    st.requests - st.canaries
}

/// An outage mock and ingest settings with the given mode; `cooldown` is the breaker's first
/// open period.
async fn down_provider(
    db: &TestDb,
    on_outage: OnOutage,
    cooldown: Duration,
) -> (MockProvider, embed_dlq::config::IngestSettings) {
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(db, &mock);
    s.breaker = BreakerConfig { failure_threshold: THRESHOLD, cooldown, ..BreakerConfig::default() };
    s.options.on_outage = on_outage;
    (mock, s)
}

/// Every record the run claimed is accounted for once (a stopped run claims only what its
/// batcher had taken in; the rest of the input is for the rerun).
fn assert_accounted(r: &IngestSummary) {
    assert!(r.records <= CHUNKS as u64, "{r:?}");
    assert_eq!(
        r.stored + r.unchanged + r.already_parked + r.parked_total() + r.superseded + r.not_attempted,
        r.records,
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_parks_the_rest_without_provider_calls_and_replay_finishes_it() {
    let db = TestDb::new().await;
    // A one-minute cooldown: no probe is due while the corpus parks.
    let (mock, s) = down_provider(&db, OnOutage::Park, Duration::from_secs(60)).await;
    let r = pipeline(&s).await.run(input(outage_corpus("park")), CancellationToken::new()).await.unwrap();
    assert_accounted(&r);
    assert_eq!(r.records, CHUNKS as u64, "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&(CHUNKS as u64)), "{r:?}");
    assert_eq!((r.stored, r.not_attempted, r.breaker_opened), (0, 0, 1), "{r:?}");
    let st = mock.control.stats();
    assert_eq!(r.provider_calls, st.requests, "{r:?} {st:?}");
    assert!(
        work_requests(&mock) <= u64::from(THRESHOLD) + CONCURRENCY,
        "no work is sent once the breaker is open: {st:?}"
    );
    // Most of the corpus was never sent; every row waits for the DLQ schedule's first retry
    // (60 s base: 30..60 s from the park).
    let unsent = db
        .count("SELECT count(*) FROM embedding_dlq WHERE error_reason = 'breaker_open' AND attempts = 0")
        .await;
    // Counted against what the provider was sent (each input sent covers at most one row),
    // not against what the machine's speed let through before the breaker opened: the
    // requests' bound above is the breaker's promise.
    assert!(unsent >= i64::from(CHUNKS) - st.inputs as i64, "{unsent} unsent, {st:?}");
    assert!(unsent > 0, "the breaker kept some of the corpus from the provider");
    let scheduled = db
        .count(
            "SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient'
               AND next_retry_at BETWEEN now() + interval '20 seconds' AND now() + interval '61 seconds'",
        )
        .await;
    assert_eq!(scheduled, i64::from(CHUNKS));
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);

    // The provider is back: serve's path (scheduler, relay, replayer) stores every chunk.
    mock.control.set_outage(false);
    replay_everything(&db, &s).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, i64::from(CHUNKS));
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus_keys(&outage_corpus("park"))).await;
    assert_eq!(db.manifest_disagreements().await, 0);
}

/// Makes every parked row due and drains it as `serve` would, with a pipeline of its own (a
/// separate process, whose breaker never saw the outage).
async fn replay_everything(db: &TestDb, s: &embed_dlq::config::IngestSettings) {
    use embed_dlq::relay::{Relay, RelayConfig};
    use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};

    make_due(db).await;
    let keys = fresh_keys();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let config = ReplayConfig { batch: 256, block: Duration::from_millis(200), ..Default::default() };
    let p = pipeline(s).await;
    Scheduler::new(p.store.clone(), config.clone(), redis.clone(), keys.clone()).run_once().await.unwrap();
    let mut relay = Relay::new(db.pool.clone(), redis.clone(), keys.clone(), RelayConfig::default());
    while relay.run_once().await.unwrap().claimed > 0 {}
    let mut replayer = Replayer {
        name: "outage".into(),
        store: p.store,
        embedder: p.embedder,
        client: embed_dlq::streams::client(&redis_url()).unwrap(),
        redis,
        keys,
        config,
        paused_until: None,
    };
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let mut replayed = 0;
    for _ in 0..100 {
        let c = replayer.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
        assert_eq!((c.reparked, c.exhausted), (0, 0), "{c:?}");
        replayed += c.replayed;
        if replayed >= CHUNKS as u64 {
            break;
        }
    }
    assert_eq!(replayed, CHUNKS as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_embeds_again_once_a_probe_finds_the_provider_back() {
    let db = TestDb::new().await;
    let (mock, mut s) = down_provider(&db, OnOutage::Park, Duration::from_millis(10)).await;
    s.breaker.max_cooldown = Duration::from_millis(10);
    let p = pipeline(&s).await;
    let chunk = |i: i32| Chunk {
        doc_id: format!("back-{}", i / 10),
        chunk_index: i % 10,
        text: format!("back chunk {i}"),
        metadata: None,
    };
    // The corpus arrives in two halves, the provider coming back in between.
    let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(64);
    let chunks = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let run = tokio::spawn(async move { p.run_stream(chunks, CancellationToken::new()).await });
    for i in 0..200 {
        tx.send(chunk(i)).await.unwrap();
    }
    for _ in 0..1_500 {
        if db.count("SELECT count(*) FROM embedding_dlq").await == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 200, "the first half parked");
    let canaries_down = mock.control.stats().canaries;
    mock.control.set_outage(false);
    // Past the 10 ms cooldown: the next request is the breaker's probe.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for i in 200..400 {
        tx.send(chunk(i)).await.unwrap();
    }
    drop(tx);
    let r = run.await.unwrap().unwrap();
    assert_eq!(r.stored + r.parked_total(), 400, "{r:?}");
    assert!(r.stored > 0, "the probe closed the breaker and embedding resumed: {r:?}");
    assert!(mock.control.stats().canaries > canaries_down, "a probe found the provider back");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ends_the_run_when_the_breaker_opens_and_a_rerun_finishes_it() {
    let db = TestDb::new().await;
    let (mock, s) = down_provider(&db, OnOutage::Stop, Duration::from_millis(50)).await;
    let err =
        pipeline(&s).await.run(input(outage_corpus("stop")), CancellationToken::new()).await.unwrap_err();
    let IngestError::Provider { stop: Stop::Outage(message), summary: r } = err else {
        panic!("expected an outage stop, got {err:?}")
    };
    assert!(message.contains("on_outage is stop"), "{message}");
    assert_accounted(&r);
    assert_eq!(r.stored, 0, "{r:?}");
    assert!(r.not_attempted > 0, "{r:?}");
    let st = mock.control.stats();
    assert_eq!(st.canaries, 0, "stop never probes: {st:?}");
    assert!(work_requests(&mock) <= u64::from(THRESHOLD) + CONCURRENCY, "{st:?}");
    // Only pieces whose retries ran out before the breaker opened were parked.
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, r.parked_total() as i64);
    assert_eq!(db.leaks().await, 0);

    // The provider is back: the same corpus again finishes the work, nothing twice.
    mock.control.set_outage(false);
    let again = pipeline(&s).await.run(input(outage_corpus("stop")), CancellationToken::new()).await.unwrap();
    assert_eq!(again.stored + again.already_parked, CHUNKS as u64, "{again:?}");
    assert_eq!(again.already_parked, r.parked_total(), "{again:?}");
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus_keys(&outage_corpus("stop"))).await;
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_sends_only_probes_while_open_and_stops_after_max_outage() {
    let db = TestDb::new().await;
    let (mock, mut s) = down_provider(&db, OnOutage::Wait, Duration::from_millis(50)).await;
    s.breaker.max_outage = Duration::from_secs(1);
    let err =
        pipeline(&s).await.run(input(outage_corpus("wait")), CancellationToken::new()).await.unwrap_err();
    let IngestError::Provider { stop: Stop::Outage(message), summary: r } = err else {
        panic!("expected an outage stop, got {err:?}")
    };
    assert!(message.contains("more than 1s"), "{message}");
    assert_accounted(&r);
    let st = mock.control.stats();
    assert!(st.canaries >= 1, "the breaker probed: {st:?}");
    assert!(work_requests(&mock) <= u64::from(THRESHOLD) + CONCURRENCY, "only probes while open: {st:?}");
    assert_eq!(r.stored, 0, "{r:?}");
    assert!(r.not_attempted > r.parked_total(), "most of it was held, then left: {r:?}");
    assert_eq!(db.leaks().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_never_parks_a_systemic_failure() {
    let db = TestDb::new().await;
    // A gateway that answers a wrong key with 400 for every input, the canary's too.
    let mock = start_mock(MockConfig {
        api_key: Some("the-right-key".into()),
        unauthorized_status: 400,
        ..MockConfig::default()
    })
    .await;
    let mut s = settings(&db, &mock);
    s.breaker = BreakerConfig { failure_threshold: 2, ..BreakerConfig::default() };
    s.options.on_outage = OnOutage::Park;
    let err =
        pipeline(&s).await.run(input(outage_corpus("sys")), CancellationToken::new()).await.unwrap_err();
    assert!(
        matches!(
            &err,
            IngestError::Provider { stop: Stop::Systemic { reason: Reason::UniformRejection, .. }, .. }
        ),
        "{err:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

/// The binary: `--on-outage` as a user runs it, with its exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_0_when_parking_and_4_when_stopping_or_waiting_too_long() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let path = std::env::temp_dir().join(format!("embed-dlq-it-outage-{}.jsonl", rand::random::<u64>()));
    std::fs::write(&path, (0..200).map(|i| line("bin", i, &format!("chunk {i}"))).collect::<String>())
        .unwrap();
    let run = |extra: &[&str]| {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        c.env_remove("RUST_LOG")
            .env_remove("EMBED_DLQ_API_KEY")
            .arg("ingest")
            .arg(&path)
            .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
            .args(["--batch-max-inputs", "16", "--retry-base-ms", "5", "--retry-cap-ms", "50"])
            .args(["--breaker-failure-threshold", "4", "--no-progress"])
            .args(extra)
            .stdin(Stdio::null());
        c.output()
    };
    let out = run(&["--on-outage", "stop"]).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("on_outage is stop"), "{stderr}");

    let out =
        run(&["--on-outage", "wait", "--breaker-cooldown-ms", "50", "--max-outage-secs", "1"]).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("circuit breaker stayed open"), "{stderr}");

    let out = run(&["--on-outage", "park", "--breaker-cooldown-ms", "60000", "--json"]).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let parked_now = summary["parked"]["transient"].as_u64().unwrap_or(0);
    let earlier = summary["already_parked"].as_u64().unwrap_or(0);
    assert_eq!(parked_now + earlier, 200, "{summary}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient'").await, 200);

    let out = run(&["--on-outage", "later"]).await.unwrap();
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_file(&path);
}
