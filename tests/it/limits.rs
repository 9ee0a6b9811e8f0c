//! Provider limits (issue 9, items 1–4): an in-process token budget, header pacing, AIMD
//! after a 429 shared through Redis, and three real `ingest` processes sharing one budget
//! against a mock that enforces it.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::embed::limit::{LimitConfig, ProviderLimiter, shared_key};
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::{LimitMode, MockConfig, MockStats};
use tokio_util::sync::CancellationToken;

use crate::support::*;

fn corpus(prefix: &str, chunks: usize) -> Vec<u8> {
    let spec = CorpusSpec { doc_prefix: prefix.into(), chunks, ..CorpusSpec::default() };
    let mut out = Vec::new();
    write_corpus(&mut out, &spec, 4_000).unwrap();
    out
}

/// A mock whose account allows `tpm` tokens a minute, two seconds' worth at once, and
/// sends no rate-limit headers on successes (so only the client's own budget can help).
fn token_limited_mock(tpm: u64) -> MockConfig {
    MockConfig {
        tpm_limit: Some(tpm),
        limit_window_ms: 2_000,
        limit_headers: false,
        // Like infinity-emb: the client must not believe it.
        usage_counts_characters: true,
        ..MockConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_token_budget_gets_no_429_where_an_unlimited_run_does() {
    const TPM: u64 = 300_000;
    // Unlimited: the same corpus at full speed overruns the account.
    let db = TestDb::new().await;
    let mock = start_mock(token_limited_mock(TPM)).await;
    let s = settings(&db, &mock);
    let summary = pipeline(&s).await.run(input(corpus("free", 600)), CancellationToken::new()).await.unwrap();
    assert_eq!(summary.records, 600);
    let unlimited = mock.control.stats();
    assert!(
        unlimited.over_limit > 0,
        "the corpus must be bigger than the account allows at once: {unlimited:?}"
    );
    mock.shutdown().await;

    // With the same budget as the account: every request waits its turn, none is refused.
    let db = TestDb::new().await;
    let mock = start_mock(token_limited_mock(TPM)).await;
    let mut s = settings(&db, &mock);
    s.limits = LimitConfig { max_tokens_per_minute: Some(TPM as u32), ..LimitConfig::default() };
    let pipeline = pipeline(&s).await;
    let summary = pipeline.run(input(corpus("paced", 600)), CancellationToken::new()).await.unwrap();
    let stats = mock.control.stats();
    assert_eq!(stats.over_limit, 0, "{stats:?}");
    assert_eq!(summary.stored, 600);
    let limiter = pipeline.embedder.client.limiter().stats();
    assert!(limiter.delayed_requests > 0, "the budget held requests back: {limiter:?}");
    // The mock reports characters as tokens (4x the estimate): ignored, not believed.
    assert_eq!(pipeline.embedder.client.limiter().token_ratio(), 1.0);
    mock.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_headers_pace_requests_before_the_provider_says_429() {
    let db = TestDb::new().await;
    // 1200 requests a minute, one second's worth (20) at once; headers on every answer.
    let mock =
        start_mock(MockConfig { rpm_limit: Some(1_200), limit_window_ms: 1_000, ..MockConfig::default() })
            .await;
    let mut s = settings(&db, &mock);
    // No budget of our own: only the headers can keep us under the limit.
    s.options.concurrency = 1;
    s.options.batch_max_inputs = 8;
    let pipeline = pipeline(&s).await;
    let summary = pipeline.run(input(corpus("hdr", 400)), CancellationToken::new()).await.unwrap();
    let stats = mock.control.stats();
    assert_eq!(summary.stored, 400);
    assert!(stats.requests > 40, "more requests than the account allows at once: {stats:?}");
    assert_eq!(stats.over_limit, 0, "{stats:?}");
    let limiter = pipeline.embedder.client.limiter().stats();
    assert!(limiter.header_pauses > 0 && limiter.delayed_requests > 0, "{limiter:?}");
    mock.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_seen_by_one_process_shrinks_the_shared_budget_for_all() {
    let url = embed_dlq::streams::client(&redis_url()).unwrap();
    let config = LimitConfig { max_requests_per_minute: Some(1_200), shared: true, ..LimitConfig::default() };
    // 1200 a minute (one per 50 ms), 100 ms worth at once: 2 requests go without waiting.
    let base = format!("http://aimd-{}.invalid/v1", rand::random::<u64>());
    let control = ProviderLimiter::with_redis(config, &url, &format!("{base}/control"), "m").await.unwrap();
    for _ in 0..2 {
        drop(control.acquire(1).await);
    }
    assert_eq!(control.stats().delayed_requests, 0);

    let seen_429 = ProviderLimiter::with_redis(config, &url, &base, "m").await.unwrap();
    let other = ProviderLimiter::with_redis(config, &url, &base, "m").await.unwrap();
    seen_429.on_rate_limited().await;
    assert_eq!(seen_429.stats().decreases, 1);
    assert_eq!(seen_429.factor(), 0.5);
    // The other process learns the halved factor from Redis, and its burst is halved too:
    // one per 100 ms, so the second request goes 100 ms after the first at the earliest (at
    // the full rate both would go at once). A bound the limiter keeps whatever the machine's
    // speed, where counting the waits would not be: a request sent 100 ms late waits for
    // nothing.
    let paced = std::time::Instant::now();
    drop(other.acquire(1).await);
    assert_eq!(other.factor(), 0.5);
    assert_eq!(other.stats().delayed_requests, 0);
    drop(other.acquire(1).await);
    assert!(
        paced.elapsed() >= Duration::from_millis(100),
        "the second request waits at half the rate: {:?} after the first, {:?}",
        paced.elapsed(),
        other.stats()
    );

    // The key names neither the URL nor the model.
    let key = shared_key(&base, "m");
    assert!(key.starts_with("embed-dlq:limit:") && !key.contains("invalid") && !key.contains("http"));
    let mut redis = redis().await;
    let factor: Option<String> =
        redis::cmd("HGET").arg(&key).arg("factor").query_async(&mut redis).await.unwrap();
    assert_eq!(factor.as_deref(), Some("0.500000"));
}

/// Runs three real `embed-dlq ingest` processes at once, each with its own corpus, each with
/// the same per-minute request budget as the mock's account; returns the mock's counters.
async fn three_processes(shared: bool) -> MockStats {
    const RPM: u64 = 3_000;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig {
        rpm_limit: Some(RPM),
        limit_window_ms: 2_000,
        limit_headers: false,
        ..MockConfig::default()
    })
    .await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-limits-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut children = Vec::new();
    for p in 0..3 {
        let path = dir.join(format!("corpus-{p}.jsonl"));
        std::fs::write(&path, corpus(&format!("proc{p}"), 400)).unwrap();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        cmd.env_remove("EMBED_DLQ_API_KEY")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .arg("ingest")
            .arg(&path)
            .args(["--database-url", &db.url, "--redis-url", &redis_url()])
            .args(["--base-url", &mock.base_url(), "--model", "mock", "--no-progress"])
            .args(["--batch-max-inputs", "4", "--concurrency", "4", "--request-timeout-ms", "5000"])
            .args(["--retry-max-attempts", "10", "--retry-base-ms", "20", "--retry-cap-ms", "2000"])
            .args(["--max-requests-per-minute", &RPM.to_string()]);
        if shared {
            cmd.arg("--shared-limits");
        }
        children.push(cmd.spawn().unwrap());
    }
    for child in children {
        let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
            .await
            .expect("ingest finishes")
            .unwrap();
        if shared {
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if shared {
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 1_200);
    }
    let stats = mock.control.stats();
    mock.shutdown().await;
    stats
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_with_shared_limits_get_no_429_where_unshared_ones_do() {
    // Each process alone stays under the account's limit; three together send 3x.
    let unshared = three_processes(false).await;
    eprintln!("three unshared processes: {unshared:?}");
    assert!(unshared.over_limit > 0, "three unshared budgets overrun the account: {unshared:?}");
    let shared = three_processes(true).await;
    eprintln!("three processes with --shared-limits: {shared:?}");
    assert_eq!(shared.over_limit, 0, "{shared:?}");
    assert_eq!(shared.rate_limited, 0, "{shared:?}");
    assert!(shared.requests >= 300, "{shared:?}");
}

/// A request waiting for its slot in the budget (here about a minute: one request a minute)
/// is not sent once the run is asked to stop: the wait ends at once, nothing reaches the
/// provider, and every claimed chunk is reported as not attempted. In-process and shared
/// through Redis alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_the_budget_ends_on_shutdown_and_sends_nothing() {
    for shared in [false, true] {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig::default()).await;
        let mut s = settings(&db, &mock);
        s.limits = LimitConfig { max_requests_per_minute: Some(1), shared, ..LimitConfig::default() };
        if shared {
            s.redis_url = Some(redis_url());
        }
        let p = pipeline(&s).await;
        // The budget lets one request go at once (its burst): spend it, so that the run's
        // first request waits about a minute.
        drop(p.embedder.client.limiter().acquire(1).await);
        let cancel = CancellationToken::new();
        let run = tokio::spawn({
            let (p, cancel) = (p.clone(), cancel.clone());
            async move { p.run(input(corpus("held", 40)), cancel).await }
        });
        // The first request waits ~60 s for its slot; the stop comes once the run has leased
        // the chunks it is about to send (counted, not slept on).
        wait_for("the run claimed its first window", Duration::from_secs(50), async || {
            db.count("SELECT count(*) FROM ingest_lease").await > 0
        })
        .await;
        cancel.cancel();
        // Only a safety net against a hang: a wait that ignored the token would end after
        // its minute and send the request, which the count below catches.
        let summary = tokio::time::timeout(Duration::from_secs(180), run)
            .await
            .expect("the run ended")
            .unwrap()
            .unwrap();
        let m = mock.control.stats();
        assert_eq!(m.requests, 0, "shared {shared}: nothing was sent after the stop: {m:?}");
        assert!(summary.records > 0, "shared {shared}: work had been claimed: {summary:?}");
        assert_eq!(summary.not_attempted, summary.records, "shared {shared}: {summary:?}");
        assert_eq!(summary.provider_calls, 0);
        if shared {
            let mut redis = redis().await;
            let _: () = redis::cmd("DEL")
                .arg(shared_key(&mock.base_url(), "mock"))
                .query_async(&mut redis)
                .await
                .unwrap();
        }
    }
}

fn short_corpus(prefix: &str, chunks: usize) -> Vec<u8> {
    // About 10 estimated tokens a chunk, whatever its number.
    (0..chunks)
        .map(|i| line(prefix, i as i32, &format!("pacing test chunk number {i:08} of the corpus")))
        .collect::<String>()
        .into_bytes()
}

/// Issue 20, item 14: a budget equal to 80% of a provider's per-minute limit, which the
/// provider enforces over every one-second window (at most a second's worth in any second),
/// gets no 429: the budget paces evenly with a small burst instead of letting a second's
/// worth go at once and then a second's worth more within the same second. For the request
/// budget and for the token budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_even_budget_gets_no_429_from_a_provider_enforcing_its_limit_per_second() {
    for tokens in [false, true] {
        let db = TestDb::new().await;
        // 20 requests (or 400 tokens: 20 requests of 2 chunks) in any one second.
        let mock = start_mock(MockConfig {
            rpm_limit: (!tokens).then_some(1_200),
            tpm_limit: tokens.then_some(24_000),
            limit_window_ms: 1_000,
            limit_mode: LimitMode::Sliding,
            ..MockConfig::default()
        })
        .await;
        let mut s = settings(&db, &mock);
        s.options.batch_max_inputs = 2;
        s.options.concurrency = 8;
        s.limits = if tokens {
            LimitConfig { max_tokens_per_minute: Some(19_200), ..LimitConfig::default() }
        } else {
            LimitConfig { max_requests_per_minute: Some(960), ..LimitConfig::default() }
        };
        let p = pipeline(&s).await;
        let summary = p.run(input(short_corpus("even", 200)), CancellationToken::new()).await.unwrap();
        let stats = mock.control.stats();
        eprintln!("tokens {tokens}: {stats:?}; limiter {:?}", p.embedder.client.limiter().stats());
        assert_eq!(summary.stored, 200, "tokens {tokens}: {summary:?}");
        assert!(stats.requests >= 100, "tokens {tokens}: {stats:?}");
        assert_eq!(stats.over_limit, 0, "tokens {tokens}: {stats:?}");
        mock.shutdown().await;
    }
}

/// Issue 20, item 15: a LiteLLM-like gateway counts a per-minute limit per fixed window and
/// answers 429 with no `Retry-After` for the rest of it (only `llm_provider-retry-after`, or
/// nothing at all). A client not told the limit must pause the whole pool until the window
/// clears and park nothing: the limit clears by itself. Without the header the pause grows
/// adaptively; with it the pause follows it. Counted: no chunk parked, and few 429s a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_429_without_retry_after_pauses_the_pool_and_parks_nothing() {
    for header in [false, true] {
        let db = TestDb::new().await;
        // 10 requests per fixed 2-second window.
        let mock = start_mock(MockConfig {
            rpm_limit: Some(300),
            limit_window_ms: 2_000,
            limit_mode: LimitMode::Gateway,
            gateway_retry_header: header,
            ..MockConfig::default()
        })
        .await;
        let mut s = settings(&db, &mock);
        s.options.batch_max_inputs = 4;
        s.options.concurrency = 4;
        s.retry.max_attempts = 5;
        s.retry.cap = Duration::from_secs(5);
        let p = pipeline(&s).await;
        let summary = p.run(input(short_corpus("gw", 120)), CancellationToken::new()).await.unwrap();
        let stats = mock.control.stats();
        eprintln!("header {header}: {stats:?}; retries {:?}", summary.retries);
        assert_eq!(summary.parked_total(), 0, "header {header}: {summary:?}");
        assert_eq!(summary.stored, 120, "header {header}: {summary:?}");
        // 30 requests need 3 windows; each window's end costs a few 429s (the requests in
        // flight, then one per growing pause), not one per worker per backoff.
        assert!(stats.over_limit <= 20, "header {header}: {stats:?}");
        mock.shutdown().await;
    }
}
