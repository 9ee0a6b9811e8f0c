//! A fault-injecting, OpenAI-compatible embeddings server for the demo, the tests and the
//! benchmarks. It speaks real HTTP, so the client under test runs its real code paths.
//!
//! Vectors are deterministic functions of the text (unit length, `dimensions` long). Faults:
//! - random, per request, at configured rates: 429 with `Retry-After`/`retry-after-ms`,
//!   500/502/503, timeouts (the answer is held back far longer than any client waits) and
//!   connection resets (the connection is closed without an answer);
//! - an outage window (every request answers 503), set by config (from server start, or from
//!   the first request after a number of inputs: the middle of a run, whatever its speed) or
//!   at run time;
//! - systemic states: a required API key (401 otherwise, or the status in
//!   `unauthorized_status`: a LiteLLM gateway answers a wrong key with 400), quota exhausted
//!   (429 `insufficient_quota`), a `dimensions` request field out of range (400 for every
//!   request, like OpenAI);
//! - limits like real servers: more than `max_inputs` per request → 413, an input longer than
//!   `max_input_chars` → 422 with a body that echoes the whole input;
//! - deterministic poison markers inside a text:
//!   `[[poison:400]]` the whole request answers 400; `[[poison:422]]` 422;
//!   `[[poison:500]]` 500 every time (like Ollama on certain inputs); `[[poison:dim]]` that
//!   input's vector has one extra dimension; `[[poison:nan]]` it contains NaN;
//!   `[[poison:empty]]` it is empty.
//!
//! `GET /stats` returns the counters as JSON; `POST /control/outage/on|off` and
//! `POST /control/quota/on|off` flip the run-time switches.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Marker that makes every request containing it answer 400.
pub const POISON_400: &str = "[[poison:400]]";
/// Marker that makes every request containing it answer 422.
pub const POISON_422: &str = "[[poison:422]]";
/// Marker that makes every request containing it answer 500, forever.
pub const POISON_500: &str = "[[poison:500]]";
/// Marker that gives that input a vector one dimension too long.
pub const POISON_DIM: &str = "[[poison:dim]]";
/// Marker that puts a NaN into that input's vector.
pub const POISON_NAN: &str = "[[poison:nan]]";
/// Marker that gives that input an empty vector.
pub const POISON_EMPTY: &str = "[[poison:empty]]";

/// Behaviour of the mock; every rate is a probability per request in [0, 1].
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockConfig {
    /// Length of every vector (a `dimensions` request field above it answers 400).
    pub dimensions: usize,
    /// Fixed latency added to every answer.
    pub latency_ms: u64,
    /// Share of requests answered 429 with a Retry-After.
    pub rate_429: f64,
    /// Retry-After sent with a random 429 (as `retry-after-ms`, and rounded up in seconds).
    pub retry_after_ms: u64,
    /// Share of requests answered 500, 502 or 503.
    pub rate_5xx: f64,
    /// Share of requests whose answer is held back for `timeout_hold_ms`.
    pub rate_timeout: f64,
    /// How long a "timed out" answer is held back.
    pub timeout_hold_ms: u64,
    /// Share of requests whose connection is closed without an answer.
    pub rate_reset: f64,
    /// 413 above this many inputs per request.
    pub max_inputs: usize,
    /// 422 (echoing the input) above this many characters in one input.
    pub max_input_chars: usize,
    /// When set, requests must carry `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Status answered to a request without the right key (401; LiteLLM answers 400).
    pub unauthorized_status: u16,
    /// Outage window, measured from server start: 503 for every request inside it.
    pub outage_after_ms: Option<u64>,
    /// Outage window that begins with the first request received after this many inputs
    /// (0..=10^10): the middle of a run, whatever its speed. It lasts `outage_for_ms` and
    /// happens once.
    pub outage_after_inputs: Option<u64>,
    /// Length of either outage window.
    pub outage_for_ms: u64,
    /// Seed of the fault dice, for repeatable runs.
    pub seed: u64,
    /// Adversarial: echo the request's Authorization header in error bodies (a leaky proxy),
    /// to prove the client never stores or logs the key.
    pub echo_auth_in_errors: bool,
    /// Requests per minute the "account" may send; beyond it the mock answers 429 with
    /// `Retry-After` and OpenAI-style `x-ratelimit-*` headers. `None`: no limit.
    pub rpm_limit: Option<u64>,
    /// Tokens per minute (characters / 4, at least 1 per input, like the client's estimate),
    /// enforced like `rpm_limit`. `None`: no limit.
    pub tpm_limit: Option<u64>,
    /// How much of a limit may be spent at once, as a window of it: 60000 (the default)
    /// lets a full minute's budget go in a burst, like an account; shorter windows model
    /// providers that enforce per-minute limits per second. 1..=3600000.
    pub limit_window_ms: u64,
    /// Send the `x-ratelimit-*` headers on successes too (on by default, like OpenAI); 429s
    /// for the limit carry them in `bucket` mode.
    pub limit_headers: bool,
    /// How `rpm_limit`/`tpm_limit` are enforced over `limit_window_ms` (see [`LimitMode`]).
    pub limit_mode: LimitMode,
    /// In `gateway` mode, send `llm_provider-retry-after: <seconds left in the window>` with
    /// a 429, as LiteLLM does (its only wait hint); off: a 429 with no usable header at all.
    pub gateway_retry_header: bool,
    /// Models the provider no longer serves: a request for one is answered 404
    /// `model_not_found`, like OpenAI after a model is retired (at most 64 names).
    pub retired_models: Vec<String>,
    /// Report every character as a token in `usage`, like some real servers (infinity-emb),
    /// instead of what the client estimates (characters / 4, at least 1 per input).
    pub usage_counts_characters: bool,
    /// A broken model: every vector of every answer (the canary's too) is unusable in this
    /// way, with status 200. `None`: vectors are fine.
    pub broken_vectors: Option<BrokenVectors>,
}

impl MockConfig {
    /// The JSON keys of the settings (what `mock-provider --settings` takes), in order.
    pub fn keys() -> Vec<String> {
        match serde_json::to_value(MockConfig::default()) {
            Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }
}

/// How the mock's account enforces its per-minute limits over `limit_window_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitMode {
    /// A token bucket holding the window's worth, refilled continuously (an account); 429s
    /// carry `Retry-After`, `retry-after-ms` and the `x-ratelimit-*` headers.
    #[default]
    Bucket,
    /// At most the window's worth in *any* window of that length (a provider enforcing a
    /// per-minute limit per second); 429s carry `Retry-After` and `retry-after-ms`.
    Sliding,
    /// The window's worth per fixed window from server start (LiteLLM counts per clock
    /// minute); a 429 carries no `Retry-After` and no `x-ratelimit-*` header, only
    /// `llm_provider-retry-after` when `gateway_retry_header` is on.
    Gateway,
}

/// How a broken model spoils every vector ([`MockConfig::broken_vectors`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BrokenVectors {
    /// A NaN in every vector (`null` in float form).
    Nan,
    /// Every value zero.
    Zero,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            dimensions: 768,
            latency_ms: 0,
            rate_429: 0.0,
            retry_after_ms: 200,
            rate_5xx: 0.0,
            rate_timeout: 0.0,
            timeout_hold_ms: 60_000,
            rate_reset: 0.0,
            max_inputs: 2048,
            max_input_chars: 1_000_000,
            api_key: None,
            unauthorized_status: 401,
            outage_after_ms: None,
            outage_after_inputs: None,
            outage_for_ms: 0,
            seed: 42,
            echo_auth_in_errors: false,
            rpm_limit: None,
            tpm_limit: None,
            limit_window_ms: 60_000,
            limit_headers: true,
            limit_mode: LimitMode::Bucket,
            gateway_retry_header: true,
            retired_models: Vec::new(),
            usage_counts_characters: false,
            broken_vectors: None,
        }
    }
}

/// Counters of what the mock served, for assertions and the demo summary.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct MockStats {
    /// Every request to the embeddings endpoint, whatever the answer.
    pub requests: u64,
    /// Inputs in those requests.
    pub inputs: u64,
    /// Requests answered 200 with vectors.
    pub ok: u64,
    /// Requests answered 429 (random, or quota exhausted).
    pub rate_limited: u64,
    /// Requests answered 5xx (random, outage or `[[poison:500]]`).
    pub server_errors: u64,
    /// Requests held back as timeouts.
    pub timeouts: u64,
    /// Connections closed without an answer.
    pub resets: u64,
    /// Requests answered 400, 413 or 422 (bad JSON, poison markers, limits, bad `dimensions`).
    pub rejected: u64,
    /// Requests answered with the unauthorized status.
    pub unauthorized: u64,
    /// Requests whose only input was the client's canary text
    /// (`crate::embed::canary::CANARY_TEXT`).
    #[serde(default)]
    pub canaries: u64,
    /// Requests answered 429 because they were over `rpm_limit` or `tpm_limit` (also counted
    /// in `rate_limited`).
    #[serde(default)]
    pub over_limit: u64,
    /// Inputs of the requests counted in `rate_limited`, `server_errors`, `timeouts` or
    /// `resets`: what request-level faults made the client send again, weighed by inputs
    /// (a fault on a 64-input request costs 32 times one on a pair).
    #[serde(default)]
    pub fault_inputs: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    inputs: AtomicU64,
    ok: AtomicU64,
    rate_limited: AtomicU64,
    server_errors: AtomicU64,
    timeouts: AtomicU64,
    resets: AtomicU64,
    rejected: AtomicU64,
    unauthorized: AtomicU64,
    canaries: AtomicU64,
    over_limit: AtomicU64,
    fault_inputs: AtomicU64,
}

struct Shared {
    config: MockConfig,
    started: tokio::time::Instant,
    rng: Mutex<StdRng>,
    outage: AtomicBool,
    quota_exhausted: AtomicBool,
    counters: Counters,
    limits: Mutex<AccountLimits>,
    /// When the `outage_after_inputs` window began (set once, by the first request past it).
    input_outage_began: std::sync::OnceLock<tokio::time::Instant>,
}

impl Shared {
    /// Counts a request-level fault in `counter` and its `inputs` in `fault_inputs`, at the
    /// moment the fault is decided (a held-back answer may never be sent: the client gives up).
    fn fault(&self, counter: &AtomicU64, inputs: usize) {
        counter.fetch_add(1, Ordering::Relaxed);
        self.counters.fault_inputs.fetch_add(inputs as u64, Ordering::Relaxed);
    }
}

/// Run-time switches and counters of a running mock; cheap to clone.
#[derive(Clone)]
pub struct MockControl(Arc<Shared>);

impl MockControl {
    /// Starts or ends an outage (every request answers 503).
    pub fn set_outage(&self, on: bool) {
        self.0.outage.store(on, Ordering::SeqCst);
    }

    /// Simulates an account out of credit (429 `insufficient_quota`).
    pub fn set_quota_exhausted(&self, on: bool) {
        self.0.quota_exhausted.store(on, Ordering::SeqCst);
    }

    /// Whether the mock is in an outage right now (switched on, or inside a configured window),
    /// so a benchmark can wait for the provider to be back.
    pub fn in_outage(&self) -> bool {
        in_outage(&self.0)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> MockStats {
        let c = &self.0.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MockStats {
            requests: g(&c.requests),
            inputs: g(&c.inputs),
            ok: g(&c.ok),
            rate_limited: g(&c.rate_limited),
            server_errors: g(&c.server_errors),
            timeouts: g(&c.timeouts),
            resets: g(&c.resets),
            rejected: g(&c.rejected),
            unauthorized: g(&c.unauthorized),
            canaries: g(&c.canaries),
            over_limit: g(&c.over_limit),
            fault_inputs: g(&c.fault_inputs),
        }
    }
}

/// A running mock provider on a local port; its faults can be switched at run time through
/// [`MockProvider::control`].
pub struct MockProvider {
    /// Where it listens (port 0 at start becomes the real port here).
    pub addr: SocketAddr,
    /// Run-time switches (outage, quota) and the counters.
    pub control: MockControl,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl MockProvider {
    /// Base URL to give the client (`http://addr/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Starts serving on `bind` (port 0 picks a free one) until [`MockProvider::shutdown`]
    /// or `cancel`.
    pub async fn start(
        config: MockConfig,
        bind: SocketAddr,
        cancel: CancellationToken,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
            started: tokio::time::Instant::now(),
            outage: AtomicBool::new(false),
            quota_exhausted: AtomicBool::new(false),
            counters: Counters::default(),
            limits: Mutex::new(AccountLimits::new(&config)),
            input_outage_began: std::sync::OnceLock::new(),
            config,
        });
        let tracker = TaskTracker::new();
        let control = MockControl(shared.clone());
        let accept_cancel = cancel.clone();
        let conn_tracker = tracker.clone();
        tracker.spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = accept_cancel.cancelled() => break,
                    r = listener.accept() => match r {
                        Ok(s) => s,
                        Err(_) => { tokio::time::sleep(Duration::from_millis(10)).await; continue; }
                    },
                };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let conn_cancel = accept_cancel.clone();
                conn_tracker.spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(shared.clone(), req));
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = conn_cancel.cancelled() => {}
                    }
                });
            }
        });
        tracker.close();
        Ok(MockProvider { addr, control, cancel, tracker })
    }

    /// Stops accepting, drops open connections and waits for every task.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.wait().await;
    }
}

/// An error returned to hyper closes the connection without an answer: a "reset" to the
/// client.
#[derive(Debug)]
struct InjectedReset;
impl std::fmt::Display for InjectedReset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected connection reset")
    }
}
impl std::error::Error for InjectedReset {}

type Answer = Result<Response<Full<Bytes>>, InjectedReset>;

#[derive(Deserialize)]
struct EmbeddingsRequest {
    input: InputField,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    model: Option<String>,
    /// Like OpenAI's `text-embedding-3-*`: vectors of this length instead of the configured
    /// one; above the configured length (or 0) the request is refused with 400.
    #[serde(default)]
    dimensions: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum InputField {
    One(String),
    Many(Vec<String>),
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Answer {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/embeddings" | "/embeddings") => embeddings(shared, req).await,
        (&Method::GET, "/stats") => {
            Ok(json(StatusCode::OK, serde_json::to_string(&MockControl(shared).stats()).unwrap()))
        }
        (&Method::GET, "/healthz") => Ok(json(StatusCode::OK, "{\"ok\":true}".into())),
        (&Method::POST, path) if path.starts_with("/control/") => {
            let on = path.ends_with("/on");
            match path.trim_end_matches("/on").trim_end_matches("/off") {
                "/control/outage" => shared.outage.store(on, Ordering::SeqCst),
                "/control/quota" => shared.quota_exhausted.store(on, Ordering::SeqCst),
                _ => return Ok(error(StatusCode::NOT_FOUND, "not_found", "unknown control")),
            }
            Ok(json(StatusCode::OK, format!("{{\"ok\":true,\"on\":{on}}}")))
        }
        _ => Ok(error(StatusCode::NOT_FOUND, "not_found", "no such endpoint")),
    }
}

enum Dice {
    Ok,
    RateLimit,
    ServerError(StatusCode),
    Timeout,
    Reset,
}

fn roll(shared: &Shared) -> Dice {
    let c = &shared.config;
    let mut rng = shared.rng.lock().unwrap();
    let x: f64 = rng.random();
    let mut edge = c.rate_429;
    if x < edge {
        return Dice::RateLimit;
    }
    edge += c.rate_5xx;
    if x < edge {
        let codes =
            [StatusCode::INTERNAL_SERVER_ERROR, StatusCode::BAD_GATEWAY, StatusCode::SERVICE_UNAVAILABLE];
        return Dice::ServerError(codes[rng.random_range(0..codes.len())]);
    }
    edge += c.rate_timeout;
    if x < edge {
        return Dice::Timeout;
    }
    edge += c.rate_reset;
    if x < edge {
        return Dice::Reset;
    }
    Dice::Ok
}

/// A response the mock sends (an [`Answer`] that is not a connection reset).
type Reply = Response<Full<Bytes>>;

async fn embeddings(shared: Arc<Shared>, req: Request<Incoming>) -> Answer {
    let c = &shared.config;
    let counters = &shared.counters;
    let echo = auth_echo(c, &req);
    let authorized = is_authorized(c, &req);
    let body = match Limited::new(req.into_body(), 256 * 1024 * 1024).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(InjectedReset),
    };
    counters.requests.fetch_add(1, Ordering::Relaxed);
    if c.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(c.latency_ms)).await;
    }
    if !authorized {
        counters.unauthorized.fetch_add(1, Ordering::Relaxed);
        let status = StatusCode::from_u16(c.unauthorized_status).unwrap_or(StatusCode::UNAUTHORIZED);
        return Ok(error(status, "invalid_api_key", &format!("Incorrect API key provided{echo}")));
    }
    let mut parsed: EmbeddingsRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            counters.rejected.fetch_add(1, Ordering::Relaxed);
            return Ok(error(StatusCode::BAD_REQUEST, "invalid_request_error", &format!("bad JSON: {e}")));
        }
    };
    let inputs = match std::mem::replace(&mut parsed.input, InputField::Many(Vec::new())) {
        InputField::One(s) => vec![s],
        InputField::Many(v) => v,
    };
    let before = counters.inputs.fetch_add(inputs.len() as u64, Ordering::Relaxed);
    if inputs.len() == 1 && inputs[0] == crate::embed::canary::CANARY_TEXT {
        counters.canaries.fetch_add(1, Ordering::Relaxed);
    }
    if c.outage_after_inputs.is_some_and(|n| before >= n) {
        shared.input_outage_began.get_or_init(tokio::time::Instant::now);
    }
    answer_inputs(&shared, &parsed, &inputs, &echo).await
}

/// The answer to a parsed request with `inputs`: a refusal, an injected fault, or vectors.
async fn answer_inputs(shared: &Shared, parsed: &EmbeddingsRequest, inputs: &[String], echo: &str) -> Answer {
    let c = &shared.config;
    if let Some(refusal) = model_refusal(shared, parsed.model.as_deref())
        .or_else(|| dimensions_refusal(shared, parsed.dimensions))
        .or_else(|| unavailable(shared, inputs.len()))
    {
        return Ok(refusal);
    }
    let limit_headers = match admit_within_limits(shared, inputs) {
        Ok(headers) => headers,
        Err(refusal) => return Ok(*refusal),
    };
    if let Some(refusal) = input_refusal(shared, inputs, echo) {
        return Ok(refusal);
    }
    if let Some(fault) = injected_fault(shared, echo, inputs.len()).await {
        return fault;
    }
    shared.counters.ok.fetch_add(1, Ordering::Relaxed);
    let base64 = parsed.encoding_format.as_deref() != Some("float");
    let usage = if c.usage_counts_characters {
        inputs.iter().map(|t| t.chars().count() as u64).sum()
    } else {
        mock_tokens(inputs)
    };
    let dimensions =
        parsed.dimensions.map(|d| d as usize).filter(|d| (1..=16_000).contains(d)).unwrap_or(c.dimensions);
    let model = parsed.model.as_deref().unwrap_or("mock");
    let mut ok = json(StatusCode::OK, render(inputs, dimensions, base64, model, usage, c.broken_vectors));
    if c.limit_headers {
        add_headers(&mut ok, &limit_headers);
    }
    Ok(ok)
}

/// One per-minute limit as a token bucket: `capacity` (the window's worth of the limit)
/// refilled continuously at the per-minute rate.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    per_minute: u64,
    capacity: f64,
    level: f64,
    at: tokio::time::Instant,
}

impl Bucket {
    fn new(per_minute: u64, window_ms: u64) -> Self {
        let capacity = (per_minute as f64 * window_ms as f64 / 60_000.0).max(1.0);
        Bucket { per_minute, capacity, level: capacity, at: tokio::time::Instant::now() }
    }

    fn refill(&mut self, now: tokio::time::Instant) {
        let ms = now.saturating_duration_since(self.at).as_secs_f64() * 1000.0;
        self.level = (self.level + ms * self.per_minute as f64 / 60_000.0).min(self.capacity);
        self.at = now;
    }

    /// How long until `need` (at most the capacity) is available.
    fn wait_for(&self, need: f64) -> Duration {
        let missing = need.min(self.capacity) - self.level;
        if missing <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(missing * 60.0 / self.per_minute as f64)
        }
    }

    /// `(limit, remaining, reset)` header values, OpenAI style.
    fn headers(&self, kind: &str) -> [(String, String); 3] {
        let reset =
            Duration::from_secs_f64((self.capacity - self.level).max(0.0) * 60.0 / self.per_minute as f64);
        [
            (format!("x-ratelimit-limit-{kind}"), self.per_minute.to_string()),
            (format!("x-ratelimit-remaining-{kind}"), (self.level.max(0.0).floor() as u64).to_string()),
            (format!("x-ratelimit-reset-{kind}"), go_duration(reset)),
        ]
    }
}

/// The account's request and token buckets, and the log of what it admitted (for the
/// `sliding` and `gateway` modes).
struct AccountLimits {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    mode: LimitMode,
    window: Duration,
    /// Admitted requests (time, tokens) in the last window: `sliding` mode.
    log: std::collections::VecDeque<(tokio::time::Instant, f64)>,
    /// Start of the current fixed window and what it admitted: `gateway` mode.
    fixed: (tokio::time::Instant, f64, f64),
}

impl AccountLimits {
    fn new(c: &MockConfig) -> Self {
        AccountLimits {
            requests: c.rpm_limit.filter(|&n| n > 0).map(|n| Bucket::new(n, c.limit_window_ms)),
            tokens: c.tpm_limit.filter(|&n| n > 0).map(|n| Bucket::new(n, c.limit_window_ms)),
            mode: c.limit_mode,
            window: Duration::from_millis(c.limit_window_ms.max(1)),
            log: std::collections::VecDeque::new(),
            fixed: (tokio::time::Instant::now(), 0.0, 0.0),
        }
    }

    /// `sliding` and `gateway` modes: whether a request of `tokens` fits the window now (and
    /// then it is counted), else how long until it might.
    fn admit_windowed(&mut self, now: tokio::time::Instant, tokens: f64) -> Result<(), Duration> {
        let cap_requests = self.requests.map(|b| b.capacity.floor().max(1.0));
        let cap_tokens = self.tokens.map(|b| b.capacity);
        let tokens = cap_tokens.map_or(tokens, |c| tokens.min(c));
        match self.mode {
            LimitMode::Gateway => {
                let (start, requests, used) = &mut self.fixed;
                let windows = now.saturating_duration_since(*start).as_nanos() / self.window.as_nanos();
                if windows > 0 {
                    *start += self.window * windows as u32;
                    (*requests, *used) = (0.0, 0.0);
                }
                let full = cap_requests.is_some_and(|c| *requests + 1.0 > c)
                    || cap_tokens.is_some_and(|c| *used + tokens > c);
                if full {
                    return Err((*start + self.window).saturating_duration_since(now));
                }
                *requests += 1.0;
                *used += tokens;
                Ok(())
            }
            _ => {
                while self.log.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) >= self.window)
                {
                    self.log.pop_front();
                }
                let requests = self.log.len() as f64;
                let used: f64 = self.log.iter().map(|(_, t)| t).sum();
                let full = cap_requests.is_some_and(|c| requests + 1.0 > c)
                    || cap_tokens.is_some_and(|c| used + tokens > c);
                if full {
                    let oldest = self.log.front().map_or(now, |(t, _)| *t);
                    return Err((oldest + self.window).saturating_duration_since(now));
                }
                self.log.push_back((now, tokens));
                Ok(())
            }
        }
    }
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*` (`20ms`, `1.5s`).
fn go_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}

/// Tokens of `inputs` as the mock counts them (for `tpm_limit` and in `usage`): the client's
/// estimate, characters / 4 rounded up, at least one per input.
fn mock_tokens(inputs: &[String]) -> u64 {
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    crate::embed::limit::estimate_tokens(&inputs)
}

/// Charges the request to the account's limits: `Ok` with the headers to send, or a 429 with
/// `Retry-After`, `retry-after-ms` and the same headers when it is over a limit.
fn admit_within_limits(shared: &Shared, inputs: &[String]) -> Result<Vec<(String, String)>, Box<Reply>> {
    let mut limits = shared.limits.lock().unwrap();
    if limits.requests.is_none() && limits.tokens.is_none() {
        return Ok(Vec::new());
    }
    let now = tokio::time::Instant::now();
    let tokens = mock_tokens(inputs) as f64;
    if limits.mode != LimitMode::Bucket {
        let Err(wait) = limits.admit_windowed(now, tokens) else { return Ok(Vec::new()) };
        shared.fault(&shared.counters.rate_limited, inputs.len());
        shared.counters.over_limit.fetch_add(1, Ordering::Relaxed);
        let ms = (wait.as_secs_f64() * 1000.0).ceil().max(1.0) as u64;
        let mut headers = Vec::new();
        if limits.mode == LimitMode::Sliding {
            headers.push(("retry-after-ms".to_string(), ms.to_string()));
            headers.push(("retry-after".to_string(), ms.div_ceil(1000).to_string()));
        } else if shared.config.gateway_retry_header {
            headers.push(("llm_provider-retry-after".to_string(), ms.div_ceil(1000).to_string()));
        }
        let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", "Rate limit reached");
        add_headers(&mut r, &headers);
        return Err(Box::new(r));
    }
    let mut wait = Duration::ZERO;
    if let Some(b) = &mut limits.requests {
        b.refill(now);
        wait = wait.max(b.wait_for(1.0));
    }
    if let Some(b) = &mut limits.tokens {
        b.refill(now);
        wait = wait.max(b.wait_for(tokens));
    }
    if wait.is_zero() {
        if let Some(b) = &mut limits.requests {
            b.level -= 1.0;
        }
        if let Some(b) = &mut limits.tokens {
            b.level -= tokens.min(b.capacity);
        }
    }
    let mut headers = Vec::new();
    for (bucket, kind) in [(&limits.requests, "requests"), (&limits.tokens, "tokens")] {
        if let Some(b) = bucket {
            headers.extend(b.headers(kind));
        }
    }
    if wait.is_zero() {
        return Ok(headers);
    }
    shared.fault(&shared.counters.rate_limited, inputs.len());
    shared.counters.over_limit.fetch_add(1, Ordering::Relaxed);
    let ms = (wait.as_secs_f64() * 1000.0).ceil() as u64;
    headers.push(("retry-after-ms".into(), ms.to_string()));
    headers.push(("retry-after".into(), ms.div_ceil(1000).to_string()));
    let mut r =
        error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", "Rate limit reached for requests");
    add_headers(&mut r, &headers);
    Err(Box::new(r))
}

fn add_headers(r: &mut Reply, headers: &[(String, String)]) {
    for (name, value) in headers {
        if let (Ok(n), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(name.as_bytes()),
            hyper::header::HeaderValue::from_str(value),
        ) {
            r.headers_mut().insert(n, v);
        }
    }
}

/// What error messages append: with `echo_auth_in_errors`, the request's `Authorization`
/// header (as a leaky gateway would); else nothing.
fn auth_echo(c: &MockConfig, req: &Request<Incoming>) -> String {
    if !c.echo_auth_in_errors {
        return String::new();
    }
    let auth = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    format!(" (request carried Authorization: {})", auth.unwrap_or("none"))
}

/// Whether the request carries the configured key as `Bearer` (always, without a key).
fn is_authorized(c: &MockConfig, req: &Request<Incoming>) -> bool {
    match &c.api_key {
        None => true,
        Some(key) => req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.strip_prefix("Bearer ") == Some(key.as_str())),
    }
}

/// A `dimensions` request parameter the model cannot give: 400.
/// A model in `retired_models`: 404 `model_not_found`, OpenAI's answer for a retired model.
fn model_refusal(shared: &Shared, model: Option<&str>) -> Option<Reply> {
    let model = model.filter(|m| shared.config.retired_models.iter().any(|r| r == m))?;
    shared.counters.rejected.fetch_add(1, Ordering::Relaxed);
    let message = format!("The model `{model}` does not exist or you do not have access to it.");
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "code": "model_not_found"}});
    Some(json(StatusCode::NOT_FOUND, body.to_string()))
}

fn dimensions_refusal(shared: &Shared, dimensions: Option<u64>) -> Option<Reply> {
    let c = &shared.config;
    let d = dimensions.filter(|&d| d == 0 || d > c.dimensions as u64)?;
    shared.counters.rejected.fetch_add(1, Ordering::Relaxed);
    Some(error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        &format!("dimensions must be between 1 and {}, got {d}", c.dimensions),
    ))
}

/// Whether every request answers 503 now: the run-time switch, or inside a configured window.
fn in_outage(shared: &Shared) -> bool {
    let c = &shared.config;
    let elapsed = shared.started.elapsed().as_millis() as u64;
    let in_window =
        c.outage_after_ms.is_some_and(|start| elapsed >= start && elapsed < start + c.outage_for_ms);
    let in_input_window = shared
        .input_outage_began
        .get()
        .is_some_and(|began| began.elapsed() < Duration::from_millis(c.outage_for_ms));
    shared.outage.load(Ordering::SeqCst) || in_window || in_input_window
}

/// The provider is unavailable to everyone: quota exhausted (429), or an outage (503, switched
/// on by the control or in the configured window).
fn unavailable(shared: &Shared, inputs: usize) -> Option<Reply> {
    if shared.quota_exhausted.load(Ordering::SeqCst) {
        shared.fault(&shared.counters.rate_limited, inputs);
        return Some(error(
            StatusCode::TOO_MANY_REQUESTS,
            "insufficient_quota",
            "You exceeded your current quota, please check your plan and billing details.",
        ));
    }
    if in_outage(shared) {
        shared.fault(&shared.counters.server_errors, inputs);
        return Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The server is overloaded or not ready yet.",
        ));
    }
    None
}

/// What the inputs themselves cause, deterministically: too many (413), a poison marker
/// (400/422, or 500 forever), one too long (422 echoing the whole input, like a real server).
fn input_refusal(shared: &Shared, inputs: &[String], echo: &str) -> Option<Reply> {
    let c = &shared.config;
    let counters = &shared.counters;
    if inputs.len() > c.max_inputs {
        counters.rejected.fetch_add(1, Ordering::Relaxed);
        return Some(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &format!("batch size {} > maximum allowed batch size {}", inputs.len(), c.max_inputs),
        ));
    }
    for (status, marker) in
        [(StatusCode::BAD_REQUEST, POISON_400), (StatusCode::UNPROCESSABLE_ENTITY, POISON_422)]
    {
        if inputs.iter().any(|t| t.contains(marker)) {
            counters.rejected.fetch_add(1, Ordering::Relaxed);
            return Some(error(status, "invalid_request_error", &format!("input rejected{echo}")));
        }
    }
    if let Some(long) = inputs.iter().find(|t| t.chars().count() > c.max_input_chars) {
        counters.rejected.fetch_add(1, Ordering::Relaxed);
        let msg = format!(
            "Input validation error: inputs must have less than {} characters. Given: {long}",
            c.max_input_chars
        );
        return Some(error(StatusCode::UNPROCESSABLE_ENTITY, "validation", &msg));
    }
    if inputs.iter().any(|t| t.contains(POISON_500)) {
        shared.fault(&counters.server_errors, inputs.len());
        return Some(error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "failed to run the model"));
    }
    None
}

/// A random fault at the configured rates (429 with its wait, 5xx, a held-back timeout, a
/// connection reset), or `None` to answer normally.
async fn injected_fault(shared: &Shared, echo: &str, inputs: usize) -> Option<Answer> {
    let c = &shared.config;
    let counters = &shared.counters;
    match roll(shared) {
        Dice::Ok => None,
        Dice::RateLimit => {
            shared.fault(&counters.rate_limited, inputs);
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", "Rate limit reached");
            let h = r.headers_mut();
            h.insert("retry-after-ms", c.retry_after_ms.to_string().parse().unwrap());
            h.insert("retry-after", c.retry_after_ms.div_ceil(1000).to_string().parse().unwrap());
            Some(Ok(r))
        }
        Dice::ServerError(code) => {
            shared.fault(&counters.server_errors, inputs);
            Some(Ok(error(code, "server_error", &format!("injected server error{echo}"))))
        }
        Dice::Timeout => {
            shared.fault(&counters.timeouts, inputs);
            tokio::time::sleep(Duration::from_millis(c.timeout_hold_ms)).await;
            Some(Ok(error(StatusCode::GATEWAY_TIMEOUT, "timeout", "held back")))
        }
        Dice::Reset => {
            shared.fault(&counters.resets, inputs);
            Some(Err(InjectedReset))
        }
    }
}

fn render(
    inputs: &[String],
    dimensions: usize,
    base64: bool,
    model: &str,
    usage: u64,
    broken: Option<BrokenVectors>,
) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(inputs.len() * (dimensions * 6 + 64) + 128);
    out.push_str("{\"object\":\"list\",\"data\":[");
    for (i, text) in inputs.iter().enumerate() {
        let mut v = vector_for(text, dimensions);
        match broken {
            Some(BrokenVectors::Nan) => v.iter_mut().take(1).for_each(|x| *x = f32::NAN),
            Some(BrokenVectors::Zero) => v.iter_mut().for_each(|x| *x = 0.0),
            None => {}
        }
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{{\"object\":\"embedding\",\"index\":{i},\"embedding\":");
        if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            out.push('"');
            base64::engine::general_purpose::STANDARD.encode_string(bytes, &mut out);
            out.push('"');
        } else {
            out.push('[');
            for (j, x) in v.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                if x.is_finite() {
                    let _ = write!(out, "{x}");
                } else {
                    out.push_str("null");
                }
            }
            out.push(']');
        }
        out.push('}');
    }
    let _ = write!(
        out,
        "],\"model\":{},\"usage\":{{\"prompt_tokens\":{usage},\"total_tokens\":{usage}}}}}",
        serde_json::Value::from(model)
    );
    out
}

/// The deterministic vector the mock returns for `text` (poison markers applied), exposed so
/// tests can check what was stored.
pub fn vector_for(text: &str, dimensions: usize) -> Vec<f32> {
    if text.contains(POISON_EMPTY) {
        return Vec::new();
    }
    let dims = if text.contains(POISON_DIM) { dimensions + 1 } else { dimensions };
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    let mut state = h.finish() | 1;
    let mut v: Vec<f32> = (0..dims)
        .map(|_| {
            // splitmix64: fast and good enough for spreading points on the sphere.
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
    v.iter_mut().for_each(|x| *x /= norm);
    if text.contains(POISON_NAN) {
        v[0] = f32::NAN;
    }
    v
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, "application/json".parse().unwrap());
    r
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": kind}});
    json(status, body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_unit_length_and_poisonable() {
        let a = vector_for("hello", 16);
        assert_eq!(a, vector_for("hello", 16));
        assert_ne!(a, vector_for("hello!", 16));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4);
        assert_eq!(vector_for("x [[poison:dim]]", 16).len(), 17);
        assert!(vector_for("x [[poison:nan]]", 16)[0].is_nan());
        assert!(vector_for("x [[poison:empty]]", 16).is_empty());
    }
}
