//! Systemic-failure detection and hostile providers (issue 7, items 9, 10 and 12): the
//! fault-injecting mock over real HTTP, and a tiny hostile HTTP server written here with tokio
//! for what no well-behaved server does (absurd `Retry-After`, endless bodies, redirects,
//! echoed keys, bare `NaN`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use base64::Engine as _;
use embed_dlq::embed::client::{ClientConfig, EmbedClient, EncodingFormat};
use embed_dlq::embed::gate::{BreakerConfig, ProviderGate};
use embed_dlq::embed::retry::RetryPolicy;
use embed_dlq::embed::{BatchStats, Embedder, ItemOutcome, Reason, Stop};
use embed_dlq::ingest::IngestError;
use embed_dlq::model::ErrorClass;
use embed_dlq::testkit::mock_provider::{self, MockConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::support::*;

// ---------------------------------------------------------------------------------------
// A hostile HTTP/1.1 server: one request per connection, answered by a closure.

/// One request as the hostile server read it.
#[derive(Debug, Clone)]
struct Seen {
    head: String,
    body: Vec<u8>,
}

impl Seen {
    fn inputs(&self) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        match &v["input"] {
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_str().unwrap_or("").to_string()).collect(),
            serde_json::Value::String(s) => vec![s.clone()],
            _ => vec![],
        }
    }
}

enum Reply {
    /// Raw bytes of a whole response (status line, headers, body).
    Raw(Vec<u8>),
    /// A head, then `total` bytes of `fill` streamed until the client hangs up.
    Endless { head: String, fill: u8, total: usize },
}

type Handler = Arc<dyn Fn(usize, &Seen) -> Reply + Send + Sync>;

struct Hostile {
    addr: std::net::SocketAddr,
    requests: Arc<std::sync::Mutex<Vec<Seen>>>,
    /// Body bytes the server managed to write (what the client accepted, plus socket buffers).
    written: Arc<AtomicU64>,
    cancel: CancellationToken,
}

impl Hostile {
    async fn start(handler: Handler) -> Hostile {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests: Arc<std::sync::Mutex<Vec<Seen>>> = Arc::default();
        let written = Arc::new(AtomicU64::new(0));
        let cancel = CancellationToken::new();
        let (reqs, wr, stop) = (requests.clone(), written.clone(), cancel.clone());
        tokio::spawn(async move {
            loop {
                let mut sock = tokio::select! {
                    _ = stop.cancelled() => break,
                    r = listener.accept() => match r { Ok((s, _)) => s, Err(_) => continue },
                };
                let (reqs, wr, handler) = (reqs.clone(), wr.clone(), handler.clone());
                tokio::spawn(async move {
                    let Some(seen) = read_request(&mut sock).await else { return };
                    let n = {
                        let mut r = reqs.lock().unwrap();
                        r.push(seen.clone());
                        r.len() - 1
                    };
                    match handler(n, &seen) {
                        Reply::Raw(bytes) => {
                            let _ = sock.write_all(&bytes).await;
                            let _ = sock.shutdown().await;
                        }
                        Reply::Endless { head, fill, total } => {
                            if sock.write_all(head.as_bytes()).await.is_err() {
                                return;
                            }
                            let chunk = vec![fill; 64 * 1024];
                            let mut sent = 0;
                            while sent < total {
                                if sock.write_all(&chunk).await.is_err() {
                                    break;
                                }
                                sent += chunk.len();
                                wr.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                            }
                            let _ = sock.shutdown().await;
                        }
                    }
                });
            }
        });
        Hostile { addr, requests, written, cancel }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some(Seen { head, body: buf[head_end..head_end + len].to_vec() })
}

fn response(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut out = format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n", body.len());
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    Reply::Raw(bytes)
}

/// A valid base64 response for `inputs` (the mock's deterministic vectors).
fn ok_body(inputs: &[String], dims: usize) -> Vec<u8> {
    let data: Vec<serde_json::Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let v = mock_provider::vector_for(t, dims);
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            serde_json::json!({"index": i, "embedding": base64::engine::general_purpose::STANDARD.encode(bytes)})
        })
        .collect();
    serde_json::json!({"data": data}).to_string().into_bytes()
}

const DIMS: usize = 16;

/// An embedder on `base_url` with fast retries, for tests that need no database.
fn embedder(base_url: String, policy: RetryPolicy, breaker: BreakerConfig) -> Embedder {
    let client = EmbedClient::new(ClientConfig {
        base_url,
        model: "hostile".into(),
        request_dimensions: None,
        encoding: EncodingFormat::Base64,
        api_key: Some(KEY.into()),
        api_key_header: None,
        extra_headers: vec![],
        timeout: Duration::from_secs(10),
    })
    .unwrap();
    Embedder {
        revision: 1,
        client,
        gate: Arc::new(ProviderGate::new(breaker)),
        policy,
        dimensions: DIMS,
        on_outage: Default::default(),
        isolation: Default::default(),
    }
}

fn fast(max_attempts: u32) -> RetryPolicy {
    RetryPolicy { max_attempts, base: Duration::from_millis(2), factor: 2.0, cap: Duration::from_millis(40) }
}

const KEY: &str = "sk-Secret0Key1Value2XyZ";

/// Every case-insensitive window of 8 characters of `secret`: a partial echo leaks too.
fn leaks(text: &str, secret: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let s = secret.to_ascii_lowercase();
    (0..=s.len().saturating_sub(8)).map(|i| &s[i..i + 8]).find(|w| lower.contains(*w)).map(str::to_string)
}

/// Every text column of the DLQ and the outbox (the events), as one string.
async fn dlq_and_events(db: &TestDb) -> String {
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT d::text FROM embedding_dlq d UNION ALL SELECT o::text FROM dlq_outbox o")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    rows.join("\n")
}

fn corpus(doc: &str, n: i32, text: impl Fn(i32) -> String) -> Vec<u8> {
    (0..n).map(|i| line(doc, i, &text(i))).collect::<String>().into_bytes()
}

// ---------------------------------------------------------------------------------------
// Item 9: a provider that rejects every input alike is a stopped run, not bad data.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_answering_400_to_everything_stops_the_run_and_parks_nothing() {
    let db = TestDb::new().await;
    // LiteLLM without a database answers a wrong key with 400, not 401.
    let mock = start_mock(MockConfig {
        api_key: Some("right-key".into()),
        unauthorized_status: 400,
        ..MockConfig::default()
    })
    .await;
    let mut s = settings(&db, &mock);
    s.client.api_key = Some("wrong-key".into());
    let input_corpus = corpus("gw", 200, |i| format!("chunk {i}"));
    let err =
        pipeline(&s).await.run(input(input_corpus.clone()), CancellationToken::new()).await.unwrap_err();
    match &err {
        IngestError::Provider { stop: Stop::Systemic { reason, .. }, summary } => {
            assert_eq!(*reason, Reason::UniformRejection, "{err}");
            assert_eq!(summary.parked_total(), 0);
        }
        other => panic!("expected a systemic stop, got {other}"),
    }
    assert!(err.to_string().contains("400"), "the message names the status: {err}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0);
    let calls = mock.control.stats().requests;
    // One request per worker at most, plus the canary: no bisecting.
    assert!(calls <= s.options.concurrency as u64 + 2, "{calls} provider calls");

    // Fixed key: the rerun does everything.
    s.client.api_key = Some("right-key".into());
    let r = pipeline(&s).await.run(input(input_corpus), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dimensions_out_of_range_stop_the_run_with_a_bounded_number_of_calls() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.request_dimensions = Some(4096); // the mock's model has 768
    let err = pipeline(&s)
        .await
        .run(input(corpus("dims", 300, |i| format!("chunk {i}"))), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            IngestError::Provider { stop: Stop::Systemic { reason: Reason::UniformRejection, .. }, .. }
        ),
        "{err}"
    );
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    let st = mock.control.stats();
    assert!(st.requests <= s.options.concurrency as u64 + 2, "{st:?}");
    assert!(st.inputs <= 32 * s.options.concurrency as u64 + 1, "no bisecting: {st:?}");
    assert_eq!(st.canaries, 1, "one canary for the whole run: {st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_poison_input_among_good_ones_is_still_parked_as_permanent_input() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.batch_max_inputs = 16;
    s.options.concurrency = 1;
    // The very first batch holds the poison: the run has had no success yet.
    let c = corpus("poison", 64, |i| {
        if i == 0 { format!("bad {}", mock_provider::POISON_400) } else { format!("good {i}") }
    });
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 63);
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&1), "{r:?}");
    assert_eq!(mock.control.stats().canaries, 1, "checked once, then cached");
    assert_eq!(db.leaks().await, 0);
}

/// A rejected request proves one of its inputs poison before the isolation has found which:
/// the poison rate counts it at once, so a concurrent worker's next request is already cut
/// to the poison-aware size (not a full one, which would cost its size again if it held the
/// next poison input), and the input found later is not counted a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_shrinks_concurrent_requests_before_its_isolation_ends() {
    use std::sync::atomic::AtomicBool;
    const MARK: &str = "POISON";
    let held = Arc::new(AtomicBool::new(false));
    let server = {
        let held = held.clone();
        Hostile::start(Arc::new(move |_, seen| {
            let inputs = seen.inputs();
            if !inputs.iter().any(|t| t.contains(MARK)) {
                return response("200 OK", &[], &ok_body(&inputs, DIMS));
            }
            // The isolation's first part (the poison and 3 neighbours) waits 2 s once.
            if inputs.len() == 4 && !held.swap(true, Ordering::SeqCst) {
                return response("503 Service Unavailable", &[("retry-after", "2")], b"{}");
            }
            response("400 Bad Request", &[], br#"{"error":{"type":"invalid_request_error"}}"#)
        }))
        .await
    };
    let policy = RetryPolicy { cap: Duration::from_secs(5), ..fast(3) };
    let e = embedder(server.base_url(), policy, BreakerConfig::default());
    let texts = |tag: &str, n: usize| -> Vec<String> { (0..n).map(|i| format!("{tag} {i}")).collect() };
    let mut a = texts("a", 16);
    a[0] = format!("a {MARK}");
    let isolating = tokio::spawn({
        let e = e.clone();
        async move {
            let refs: Vec<&str> = a.iter().map(String::as_str).collect();
            e.embed_batch(&refs, &CancellationToken::new(), &mut BatchStats::default()).await.unwrap()
        }
    });
    // The 16 rejected, the canary, then the held part: the isolation is under way.
    while !held.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = server.seen().len();
    let b = texts("b", 64);
    let refs: Vec<&str> = b.iter().map(String::as_str).collect();
    let out = e.embed_batch(&refs, &CancellationToken::new(), &mut BatchStats::default()).await.unwrap();
    assert!(out.iter().all(|o| matches!(o, ItemOutcome::Embedded(_))));
    let first_b =
        server.seen()[before..].iter().find(|s| s.inputs()[0].starts_with("b ")).unwrap().inputs().len();
    // 1 poison input and nothing settled yet, with the prior of 1,000 clean inputs: 0.01 × 1000.
    assert_eq!(first_b, 10, "the concurrent request is cut to the poison-aware size");
    let a_out = isolating.await.unwrap();
    assert!(matches!(&a_out[0], ItemOutcome::Failed(f) if f.class == ErrorClass::PermanentInput));
    assert!(a_out[1..].iter().all(|o| matches!(o, ItemOutcome::Embedded(_))));
    // Once found, the same input is not counted again: 1 poison in 79 settled (+1,000 prior).
    let c = texts("c", 64);
    let refs: Vec<&str> = c.iter().map(String::as_str).collect();
    let before = server.seen().len();
    e.embed_batch(&refs, &CancellationToken::new(), &mut BatchStats::default()).await.unwrap();
    assert_eq!(server.seen()[before].inputs().len(), 10, "0.01 × 1080 / 1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_dimension_on_a_single_input_is_systemic_until_a_right_one_is_seen() {
    let db = TestDb::new().await;
    embed_dlq::store::create_target_table(&db.pool, "v16", 16).await.unwrap();
    // A model that answers 32 dimensions for a 16-dimension column, one input per run.
    let wrong = start_mock(MockConfig { dimensions: 32, ..MockConfig::default() }).await;
    let mut s = settings(&db, &wrong);
    s.table = "v16".into();
    let err = pipeline(&s)
        .await
        .run(input(line("one", 0, "only chunk").into_bytes()), CancellationToken::new())
        .await
        .unwrap_err();
    match &err {
        IngestError::Provider { stop: Stop::Systemic { reason: Reason::DimensionMismatch, .. }, summary } => {
            assert_eq!(summary.parked_total(), 0)
        }
        other => panic!("expected a systemic dimension stop, got {other}"),
    }
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0);

    // The right model, and one input that really has a wrong-size vector: the canary says
    // the provider is fine, so that input is parked.
    let right = start_mock(MockConfig { dimensions: 16, ..MockConfig::default() }).await;
    let mut s = settings(&db, &right);
    s.table = "v16".into();
    let text = format!("odd {}", mock_provider::POISON_DIM);
    let r = pipeline(&s)
        .await
        .run(input(line("one", 1, &text).into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.parked.get(&ErrorClass::DimensionMismatch), Some(&1), "{r:?}");
    assert_eq!(right.control.stats().canaries, 1);
}

// ---------------------------------------------------------------------------------------
// Item 10: hostile or broken responses.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_retry_after_values_neither_panic_nor_stall() {
    let waits: [(&str, &str); 6] = [
        ("retry-after", "1e30"),
        ("retry-after-ms", "1e30"),
        ("retry-after", "99999999"),
        ("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
        ("retry-after", "-5"),
        ("retry-after", "soon"),
    ];
    let server = Hostile::start(Arc::new(move |n, seen: &Seen| match waits.get(n) {
        Some((h, v)) => {
            response("429 Too Many Requests", &[(h, v)], b"{\"error\":{\"type\":\"rate_limit\"}}")
        }
        None => response("200 OK", &[("content-type", "application/json")], &ok_body(&seen.inputs(), DIMS)),
    }))
    .await;
    let e = embedder(server.base_url(), fast(10), BreakerConfig::default());
    let mut stats = BatchStats::default();
    let out = e.embed_batch(&["a", "b"], &CancellationToken::new(), &mut stats).await.unwrap();
    assert!(out.iter().all(|o| matches!(o, ItemOutcome::Embedded(_))), "{out:?}");
    assert_eq!(stats.retries.get(&Reason::RateLimited), Some(&6));
    // The shared pause honours the retry cap, whatever the server asked for; the two values
    // that are no wait at all ("-5", "soon") pause adaptively instead: 1 s, then 2 s.
    let adaptive = embed_dlq::embed::gate::ADAPTIVE_PAUSE_FIRST * 2;
    assert!(e.gate.longest_pause() <= adaptive.max(e.policy.cap), "{:?}", e.gate.longest_pause());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_rate_limited_for_longer_than_max_outage_stops_like_an_outage() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { rate_429: 1.0, retry_after_ms: 20, ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.retry.max_attempts = 200;
    s.breaker.max_outage = Duration::from_millis(300);
    let err = pipeline(&s)
        .await
        .run(input(corpus("rl", 50, |i| format!("chunk {i}"))), CancellationToken::new())
        .await
        .unwrap_err();
    match &err {
        IngestError::Provider { stop: Stop::Outage(msg), summary } => {
            assert!(msg.contains("rate-limited"), "{msg}");
            assert_eq!(summary.parked_total(), 0);
        }
        other => panic!("expected an outage stop, got {other}"),
    }
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_success_body_is_cut_off_at_the_cap() {
    const TOTAL: usize = 64 * 1024 * 1024;
    let server = Hostile::start(Arc::new(|_, _: &Seen| Reply::Endless {
        // No content-length: the body ends when the server closes, i.e. never soon.
        head: "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"data\":["
            .into(),
        fill: b' ',
        total: TOTAL,
    }))
    .await;
    let e = embedder(server.base_url(), fast(1), BreakerConfig::default());
    let mut stats = BatchStats::default();
    let out = e.embed_batch(&["x"], &CancellationToken::new(), &mut stats).await.unwrap();
    match &out[0] {
        ItemOutcome::Failed(f) => {
            assert_eq!((f.class, f.reason), (ErrorClass::Transient, Reason::BadResponse), "{f:?}");
            assert!(f.detail.len() < 600, "{}", f.detail.len());
        }
        other => panic!("expected a transient failure, got {other:?}"),
    }
    // Give the server a moment to notice the hang-up, then check it could not push it all.
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let written = server.written.load(Ordering::SeqCst) as usize;
    let cap = embed_dlq::embed::client::response_cap(1, DIMS);
    assert!(written < cap + 16 * 1024 * 1024, "the client read {written} bytes, the cap is {cap}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_origin_redirect_is_refused_and_credentials_stay_home() {
    let db = TestDb::new().await;
    let elsewhere = Hostile::start(Arc::new(|_, seen: &Seen| {
        response("200 OK", &[("content-type", "application/json")], &ok_body(&seen.inputs(), 768))
    }))
    .await;
    let target = format!("http://{}/v1/embeddings", elsewhere.addr);
    let redirector = Hostile::start(Arc::new(move |_, _: &Seen| {
        response("307 Temporary Redirect", &[("location", target.as_str())], b"")
    }))
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url = redirector.base_url();
    s.client.api_key = Some(KEY.into());
    s.client.api_key_header = Some("api-key".into());
    s.client.extra_headers = vec![("X-Tenant".into(), "tenant-secret-5678".into())];
    let err = pipeline(&s)
        .await
        .run(input(corpus("redir", 10, |i| format!("chunk {i}"))), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, IngestError::Provider { stop: Stop::Systemic { reason: Reason::Redirect, .. }, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("another origin"), "{err}");
    assert_eq!(elsewhere.seen().len(), 0, "nothing, and certainly no key, went to the other origin");
    let asked = redirector.seen();
    assert!(asked[0].head.to_ascii_lowercase().contains("api-key:"), "the first hop did get the key");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoes_of_the_key_are_redacted_before_they_are_truncated() {
    let db = TestDb::new().await;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let b64url = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    // The key straddles character 512; then lower-cased, then base64 echoes of the header.
    let mut echo = "e".repeat(500);
    echo.push_str(KEY);
    echo.push_str(&format!(
        " lower={} basic={} url={} ",
        KEY.to_lowercase(),
        b64(&format!("Bearer {KEY}")),
        b64url(&format!("x{KEY}"))
    ));
    echo.push_str(&"z".repeat(10_000));
    let body = serde_json::json!({"error": {"message": echo, "code": KEY}}).to_string();
    let garbled = format!("{{\"data\": \"{KEY} {}\"}}", "g".repeat(1_000_000));
    let server = Hostile::start(Arc::new(move |_, seen: &Seen| {
        let inputs = seen.inputs();
        if inputs.iter().any(|t| t.contains("echo")) {
            response("422 Unprocessable Entity", &[("content-type", "application/json")], body.as_bytes())
        } else if inputs.iter().any(|t| t.contains("garble")) {
            response("200 OK", &[("content-type", "application/json")], garbled.as_bytes())
        } else {
            response("200 OK", &[("content-type", "application/json")], &ok_body(&inputs, 768))
        }
    }))
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url = server.base_url();
    s.client.api_key = Some(KEY.into());
    s.options.batch_max_inputs = 1;
    let mut c = line("leak", 0, "fine").into_bytes();
    c.extend(line("leak", 1, "echo me").into_bytes());
    c.extend(line("leak", 2, "garble me").into_bytes());
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 1, "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&1), "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&1), "{r:?}");
    let everything = dlq_and_events(&db).await;
    assert!(everything.contains("[redacted]"), "{everything}");
    if let Some(w) = leaks(&everything, KEY) {
        panic!("a piece of the key ({w}) reached the DLQ or the events");
    }
    for enc in [b64(&format!("Bearer {KEY}")), b64url(&format!("x{KEY}"))] {
        assert!(!everything.contains(&enc[4..enc.len() - 4]), "base64 echo stored");
    }
    let lens: Vec<i32> =
        sqlx::query_scalar("SELECT length(last_error) FROM embedding_dlq").fetch_all(&db.pool).await.unwrap();
    assert!(lens.iter().all(|l| *l < 700), "{lens:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_echo_of_the_key_with_an_inserted_byte_is_redacted_too() {
    let db = TestDb::new().await;
    // The key echoed with one byte or invisible character inserted (a NUL, an invalid UTF-8
    // byte, a zero-width space, a percent-encoded dash, ...), as a proxy or a logger might.
    let (a, b) = KEY.split_at(9);
    let inserts: Vec<&[u8]> = vec![
        b"\x00",
        b"\xff",
        "\u{200b}".as_bytes(),
        "\u{feff}".as_bytes(),
        "\u{202e}".as_bytes(),
        b"%2D",
        b"%00",
        b"\x1b[0m",
        b"\r\n",
    ];
    let bodies: Vec<Vec<u8>> = inserts
        .iter()
        .map(|ins| [b"unauthorised: key ".as_slice(), a.as_bytes(), ins, b.as_bytes(), b" rejected"].concat())
        .collect();
    let n = bodies.len();
    let server = Hostile::start(Arc::new(move |_, seen: &Seen| {
        let inputs = seen.inputs();
        match inputs.iter().find_map(|t| t.strip_prefix("echo ").and_then(|i| i.parse::<usize>().ok())) {
            Some(i) => response("422 Unprocessable Entity", &[("content-type", "text/plain")], &bodies[i]),
            None => response("200 OK", &[("content-type", "application/json")], &ok_body(&inputs, 768)),
        }
    }))
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url = server.base_url();
    s.client.api_key = Some(KEY.into());
    s.options.batch_max_inputs = 1;
    let mut c = Vec::new();
    for i in 0..n {
        c.extend(line("fine", i as i32, "fine text").into_bytes());
        c.extend(line("leak", i as i32, &format!("echo {i}")).into_bytes());
    }
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&(n as u64)), "{r:?}");
    let everything = dlq_and_events(&db).await;
    if let Some(w) = leaks(&everything, KEY) {
        panic!("a piece of the key ({w}) reached the DLQ or the events:\n{everything}");
    }
    let errors: Vec<String> = sqlx::query_scalar("SELECT last_error FROM embedding_dlq ORDER BY chunk_index")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    for e in &errors {
        assert!(e.contains("[redacted]") && e.contains("rejected"), "{e}");
        assert!(
            !e.chars().any(|c| c.is_control() || c == '\u{200b}' || c == '\u{feff}' || c == '\u{202e}'),
            "{e:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_nan_in_one_float_vector_isolates_that_input() {
    let db = TestDb::new().await;
    let server = Hostile::start(Arc::new(|_, seen: &Seen| {
        let items: Vec<String> = seen
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let v = mock_provider::vector_for(t, 768);
                let mut vals: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                if t.contains("nan") {
                    vals[3] = "NaN".into();
                }
                if t.contains("inf") {
                    vals[5] = "-Infinity".into();
                }
                format!("{{\"index\":{i},\"embedding\":[{}]}}", vals.join(","))
            })
            .collect();
        let body = format!("{{\"data\":[{}],\"model\":\"NaN-Infinity\"}}", items.join(","));
        response("200 OK", &[("content-type", "application/json")], body.as_bytes())
    }))
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url = server.base_url();
    s.client.encoding = EncodingFormat::Float;
    let c = corpus("nan", 10, |i| match i {
        3 => "has nan".into(),
        7 => "has inf".into(),
        _ => format!("fine {i}"),
    });
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 8, "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::InvalidVector), Some(&2), "{r:?}");
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT error_reason FROM embedding_dlq ORDER BY chunk_index")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(reasons, vec!["non_finite", "non_finite"]);
}

// ---------------------------------------------------------------------------------------
// Item 12: one input that always answers 500 must not block the corpus.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_always_gets_500_is_parked_alone_and_never_opens_the_breaker() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    // The default breaker and attempts; fast waits; a short outage limit only so that a
    // regression fails quickly instead of after 600 s.
    s.breaker = BreakerConfig { max_outage: Duration::from_secs(5), ..BreakerConfig::default() };
    s.retry.max_attempts = RetryPolicy::default().max_attempts;
    s.options.batch_max_inputs = 64;
    let c = corpus("o500", 64, |i| {
        if i == 0 { format!("ollama {}", mock_provider::POISON_500) } else { format!("fine {i}") }
    });
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 63, "{r:?}");
    // Transient: a 500 may be the server's passing trouble with that input, so the longer
    // DLQ schedule tries it again (bounded by dlq_max_replays), unlike a 4xx.
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&1), "{r:?}");
    assert_eq!(r.breaker_opened, 0, "{r:?}");
    let st = mock.control.stats();
    // 5 tries of the batch, one per split level (6), 5 of the input alone, 6 good halves.
    assert!(st.requests <= 25, "{st:?}");
    let (idx, reason): (i32, String) = sqlx::query_as("SELECT chunk_index, error_reason FROM embedding_dlq")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((idx, reason.as_str()), (0, "http_500"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_probes_with_a_canary_not_with_the_batch_that_tripped_it() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    // The batch's own retries are enough to open the breaker.
    s.breaker = BreakerConfig {
        failure_threshold: 2,
        cooldown: Duration::from_millis(50),
        max_cooldown: Duration::from_millis(400),
        max_outage: Duration::from_secs(2),
    };
    s.retry.max_attempts = 3;
    let c = corpus("probe", 4, |i| {
        if i == 0 { format!("ollama {}", mock_provider::POISON_500) } else { format!("fine {i}") }
    });
    let r = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap();
    assert!(r.breaker_opened >= 1, "{r:?}");
    assert_eq!(r.stored, 3, "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&1), "{r:?}");
    assert!(mock.control.stats().canaries >= 1);
}

// ---------------------------------------------------------------------------------------
// The replayer shares the Embedder: a uniform rejection there postpones, charges nothing.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_provider_that_rejects_everything_alike_postpones_instead_of_parking_permanent() {
    use embed_dlq::replay::ReplayConfig;

    let db = TestDb::new().await;
    let keys = fresh_keys();
    let config = ReplayConfig {
        batch: 64,
        block: Duration::from_millis(200),
        systemic_pause: Duration::from_secs(120),
        ..Default::default()
    };
    let corpus = corpus("rep", 12, |i| format!("replay chunk {i}"));
    park_on_the_replay_stream(&db, &keys, corpus, 12, None, &config).await;
    let before: Vec<(i64, i32, i32, String)> =
        sqlx::query_as("SELECT id, replays, attempts, error_class FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();

    // Now the gateway in front of the provider answers our (rotated) key with 400.
    let gateway = start_mock(MockConfig {
        api_key: Some("the-right-key".into()),
        unauthorized_status: 400,
        ..MockConfig::default()
    })
    .await;
    let rp = pipeline(&settings(&db, &gateway)).await;
    let mut rep = replayer_on(rp, &keys, "uniform", config).await;
    let c = read_once(&mut rep).await;
    assert_eq!((c.postponed, c.reparked, c.exhausted), (12, 0, 0), "{c:?}");
    let after: Vec<(i64, i32, i32, String)> =
        sqlx::query_as("SELECT id, replays, attempts, error_class FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(before, after, "still transient, same generation and attempts: nothing charged");
    assert!(gateway.control.stats().requests <= 2, "one request and the canary, no bisecting");
}

// ---------------------------------------------------------------------------------------
// The binary: a uniform rejection is exit 4, with the status named and the key nowhere.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_4_when_a_gateway_rejects_everything_alike() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig {
        api_key: Some("the-right-key".into()),
        unauthorized_status: 400,
        echo_auth_in_errors: true,
        ..MockConfig::default()
    })
    .await;
    let path = std::env::temp_dir().join(format!("embed-dlq-it-uniform-{}.jsonl", rand::random::<u64>()));
    std::fs::write(&path, corpus("bin", 100, |i| format!("chunk {i}"))).unwrap();
    let (code, all) = ingest_binary(&db, &mock.base_url(), &path, Some(KEY)).await;
    assert_eq!(code, Some(4), "{all}");
    assert!(all.contains("uniform_rejection") && all.contains("400"), "{all}");
    assert!(leaks(&all, KEY).is_none(), "{all}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

/// Credentials in the base URL (`https://user:secret@gateway/v1`, which reqwest sends as Basic
/// auth) are secrets like the key: never in DLQ rows, events or the client's `Debug`, even when
/// the server echoes the `Authorization` header or the request URL back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_base_url_are_redacted_like_the_key() {
    const URL_SECRET: &str = "url-pw-9f3c1d7e5a";
    let db = TestDb::new().await;
    let server = Hostile::start(Arc::new(move |_, seen: &Seen| {
        let echo = serde_json::json!({"error": {"message": format!("rejected: {}", seen.head)}}).to_string();
        response("422 Unprocessable Entity", &[("content-type", "application/json")], echo.as_bytes())
    }))
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url =
        server.base_url().replacen("http://", &format!("http://gateway-user:{URL_SECRET}@"), 1);
    s.options.batch_max_inputs = 1;
    let debug = format!("{:?} {:?}", s.client, s);
    assert!(leaks(&debug, URL_SECRET).is_none(), "Debug shows the URL's password: {debug}");
    let r = pipeline(&s)
        .await
        .run(input(corpus("url", 2, |i| format!("text {i}"))), CancellationToken::new())
        .await;
    let everything = format!("{}\n{r:?}", dlq_and_events(&db).await);
    assert!(
        server.seen()[0].head.to_ascii_lowercase().contains("authorization: basic"),
        "sent as Basic auth"
    );
    if let Some(w) = leaks(&everything, URL_SECRET) {
        panic!("a piece of the URL's password ({w}) reached the DLQ, the events or the run's error");
    }
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("gateway-user:{URL_SECRET}"));
    assert!(!everything.contains(&basic[4..basic.len() - 4]), "its Basic encoding was stored");
}

// ---------------------------------------------------------------------------------------
// Issue 20, item 4: a model that returns unusable vectors for every input is systemic.

/// A provider that answers NaN (or all-zero) vectors for every input, the canary's too, stops
/// the run like a wrong dimension does: nothing parked, no manifest row, one canary; the
/// binary exits 4. An unusable vector among good ones stays the input's fault (see
/// `json_nan_in_one_float_vector_isolates_that_input`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_returning_unusable_vectors_for_every_input_stops_the_run_and_parks_nothing() {
    use embed_dlq::testkit::mock_provider::BrokenVectors;
    for broken in [BrokenVectors::Nan, BrokenVectors::Zero] {
        let db = TestDb::new().await;
        let mock = start_mock(MockConfig { broken_vectors: Some(broken), ..MockConfig::default() }).await;
        let s = settings(&db, &mock);
        let err = pipeline(&s)
            .await
            .run(input(corpus("broken", 300, |i| format!("chunk {i}"))), CancellationToken::new())
            .await
            .unwrap_err();
        match &err {
            IngestError::Provider { stop: Stop::Systemic { reason: Reason::InvalidVector, .. }, summary } => {
                assert_eq!(summary.parked_total(), 0, "{broken:?}: {summary:?}");
            }
            other => panic!("{broken:?}: expected a systemic invalid_vector stop, got {other}"),
        }
        assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0, "{broken:?}");
        assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0, "{broken:?}");
        let st = mock.control.stats();
        assert_eq!(st.canaries, 1, "{broken:?}: one canary for the whole run: {st:?}");
        assert!(st.requests <= s.options.concurrency as u64 + 2, "{broken:?}: no bisecting: {st:?}");
        mock.shutdown().await;
    }

    // The binary: exit 4, nothing parked.
    let db = TestDb::new().await;
    let mock =
        start_mock(MockConfig { broken_vectors: Some(BrokenVectors::Nan), ..MockConfig::default() }).await;
    let path = std::env::temp_dir().join(format!("embed-dlq-it-nan-{}.jsonl", rand::random::<u64>()));
    std::fs::write(&path, corpus("bin-nan", 100, |i| format!("chunk {i}"))).unwrap();
    let (code, all) = ingest_binary(&db, &mock.base_url(), &path, None).await;
    assert_eq!(code, Some(4), "{all}");
    assert!(all.contains("invalid_vector"), "{all}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

// ---------------------------------------------------------------------------------------
// Issue 20, item 8: a stop in the middle of a batch keeps what was already embedded.

/// A provider whose key is revoked after its 4th request: a batch holding `poison` is
/// answered 400, the first 4 requests otherwise embed, every later one is 401.
fn key_revoked_after_request_4() -> Handler {
    Arc::new(|n, seen: &Seen| {
        let inputs = seen.inputs();
        if inputs.iter().any(|t| t.contains("poison")) {
            response("400 Bad Request", &[], b"{\"error\":{\"type\":\"invalid_request_error\"}}")
        } else if n <= 4 {
            response("200 OK", &[("content-type", "application/json")], &ok_body(&inputs, 768))
        } else {
            response("401 Unauthorized", &[], b"{\"error\":{\"type\":\"invalid_api_key\"}}")
        }
    })
}

/// A batch split to isolate a poison input has embedded two of its inputs when the key is
/// revoked (401 from then on): the run stops, nothing is parked, and the two vectors the
/// provider already answered (and billed) are stored instead of being sent again on the
/// rerun; the rest is not attempted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_in_the_middle_of_a_batch_stores_what_was_already_embedded() {
    let db = TestDb::new().await;
    // 1: the canary; 3 and 4: the first two inputs after the poison one, alone.
    let server = Hostile::start(key_revoked_after_request_4()).await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.client.base_url = server.base_url();
    s.options.concurrency = 1;
    s.options.batch_max_inputs = 8;
    let c = corpus("midstop", 8, |i| if i == 0 { "poison input".into() } else { format!("fine {i}") });
    let err = pipeline(&s).await.run(input(c), CancellationToken::new()).await.unwrap_err();
    match &err {
        IngestError::Provider { stop: Stop::Systemic { reason: Reason::Unauthorized, .. }, summary } => {
            assert_eq!(summary.parked_total(), 0, "{summary:?}");
            assert_eq!(summary.stored, 2, "{summary:?}");
            assert_eq!(summary.not_attempted, 6, "{summary:?}");
        }
        other => panic!("expected an unauthorized stop, got {other}"),
    }
    let stored: Vec<i32> = sqlx::query_scalar("SELECT chunk_index FROM doc_embeddings ORDER BY chunk_index")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, vec![1, 2]);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.leaks().await, 0);
}

/// Issue 20, item 8, replay side: a replay request split to isolate a poison row has
/// embedded two rows when the key is revoked: those two are replayed (vector stored, row
/// gone), the other six are postponed unchanged, and nothing is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_in_the_middle_of_a_replay_request_replays_what_was_already_embedded() {
    use embed_dlq::replay::ReplayConfig;

    let db = TestDb::new().await;
    let keys = fresh_keys();
    let config = ReplayConfig {
        batch: 64,
        request_inputs: 8,
        requests_in_flight: 1,
        block: Duration::from_millis(200),
        systemic_pause: Duration::from_secs(120),
        ..Default::default()
    };
    let c = corpus("midrep", 8, |i| if i == 0 { "poison row".into() } else { format!("fine row {i}") });
    let down = park_on_the_replay_stream(&db, &keys, c, 8, Some(8), &config).await;

    let server = Hostile::start(key_revoked_after_request_4()).await;
    let mut rs = settings(&db, &down);
    rs.client.base_url = server.base_url();
    let rp = pipeline(&rs).await;
    let mut rep = replayer_on(rp, &keys, "midstop", config).await;
    let c = read_once(&mut rep).await;
    assert_eq!((c.replayed, c.postponed, c.reparked, c.exhausted), (2, 6, 0, 0), "{c:?}");
    let stored: Vec<i32> = sqlx::query_scalar("SELECT chunk_index FROM doc_embeddings ORDER BY chunk_index")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, vec![1, 2]);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 6);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE replays > 0").await, 0, "nothing charged");
}

/// Runs the binary's `ingest` of `path` (then deleted) against `base_url` with small batches
/// and fast retries, the API key `key` (`None`: unset); returns its exit code and its stdout
/// and stderr together.
async fn ingest_binary(
    db: &TestDb,
    base_url: &str,
    path: &std::path::Path,
    key: Option<&str>,
) -> (Option<i32>, String) {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("RUST_LOG");
    match key {
        Some(k) => c.env("EMBED_DLQ_API_KEY", k),
        None => c.env_remove("EMBED_DLQ_API_KEY"),
    };
    let out = c
        .arg("ingest")
        .arg(path)
        .args(["--database-url", &db.url, "--base-url", base_url, "--model", "mock"])
        .args(["--batch-max-inputs", "16", "--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let _ = std::fs::remove_file(path);
    (
        out.status.code(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// Parks `corpus` (`n` chunks) as transient through a provider in an outage (batches of at
/// most `batch_max_inputs`), makes the rows due and puts their work items on the replay
/// stream of `keys`; returns the provider, still down.
async fn park_on_the_replay_stream(
    db: &TestDb,
    keys: &embed_dlq::streams::StreamKeys,
    corpus: Vec<u8>,
    n: u64,
    batch_max_inputs: Option<usize>,
    config: &embed_dlq::replay::ReplayConfig,
) -> embed_dlq::testkit::mock_provider::MockProvider {
    use embed_dlq::relay::{Relay, RelayConfig};
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 2;
    if let Some(b) = batch_max_inputs {
        s.options.batch_max_inputs = b;
    }
    let p = pipeline(&s).await;
    let r = p.run(input(corpus), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&n));
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, keys).await.unwrap();
    let scheduler =
        embed_dlq::replay::Scheduler::new(p.store.clone(), config.clone(), redis.clone(), keys.clone());
    scheduler.run_once().await.unwrap();
    let mut relay = Relay::new(db.pool.clone(), redis, keys.clone(), RelayConfig::default());
    while relay.run_once().await.unwrap().claimed > 0 {}
    down
}
