//! Proactive provider limits: requests and tokens per minute, paced *before* a request is
//! sent, instead of learning the limit from 429s.
//!
//! One [`ProviderLimiter`] serves every request of a process to one provider base URL and
//! model (ingest workers, replayers, canaries: it lives in the [`super::client::EmbedClient`],
//! whose clones share it). Four mechanisms stack:
//!
//! - **Local budget** (`--max-requests-per-minute`, `--max-tokens-per-minute`): two GCRA
//!   schedules (virtual scheduling, like the shared one). Each lets at most [`BURST`] worth
//!   of the budget (and never less than one request) through at once, then paces evenly at
//!   the configured rate: providers enforce per-minute limits over shorter windows.
//! - **Shared budget** (`--shared-limits`): the same schedule lives in Redis
//!   (`redis/limit.lua`, keyed by a hash of base URL + model, never the URL itself). Each
//!   request reserves its slot in one atomic round trip, so N processes on N hosts together
//!   stay under the limit. If Redis fails, the process falls back to its local budget.
//! - **Header pacing**: OpenAI-style `x-ratelimit-remaining-*`, `x-ratelimit-limit-*` and
//!   `x-ratelimit-reset-*` headers (every value clamped) pause every request of the process
//!   when the provider says fewer requests or tokens remain than are already in flight.
//! - **AIMD**: a 429 multiplies the budget by [`AIMD_DECREASE`] (down to [`AIMD_MIN_FACTOR`]);
//!   each [`AIMD_WINDOW`] without a 429 gives [`AIMD_STEP`] back. With shared limits the
//!   factor lives in Redis too, so a 429 seen by one process slows them all.
//!
//! A wait for a slot can be long (a small budget, a queue of reservations in Redis, a header
//! pause): callers that must stop promptly race it with their cancellation token
//! ([`super::client::EmbedClient::embed_unless_cancelled`]); a wait given up sends nothing.
//!
//! Tokens are estimated from characters ([`CHARS_PER_TOKEN`]) and corrected by the ratio of
//! the provider's reported `usage` to the estimate, when that ratio is plausible
//! ([`USAGE_PLAUSIBLE`]): some servers report characters as tokens, and their reports are
//! ignored rather than allowed to quadruple the charge.

use std::ops::RangeInclusive;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use reqwest::header::HeaderMap;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// Characters per token assumed when estimating a request's tokens before it is sent (the
/// usual figure for English text with OpenAI's tokenizers); corrected by reported usage.
pub const CHARS_PER_TOKEN: usize = 4;
/// How much of a budget may be spent at once: a tenth of a second's worth, and never less
/// than the request itself. Providers enforce a per-minute limit over shorter windows (OpenAI
/// per second or less): a burst of a second's worth followed by a second's worth of paced
/// requests put twice the limit's share into one second (a budget of 240/min met 429s from a
/// provider allowing 5 in any second). With this burst, any window of `w` seconds sees at
/// most `rate × (w + 0.1 s)` plus one request.
pub const BURST: Duration = Duration::from_millis(100);
/// Factor the budget is multiplied by after a 429.
pub const AIMD_DECREASE: f64 = 0.5;
/// The budget never shrinks below this share of the configured limit.
pub const AIMD_MIN_FACTOR: f64 = 0.1;
/// Share of the configured limit given back per [`AIMD_WINDOW`] without a 429.
pub const AIMD_STEP: f64 = 0.1;
/// The additive-recovery window.
pub const AIMD_WINDOW: Duration = Duration::from_secs(5);
/// 429s this soon after a decrease answer requests that were already in flight: one
/// congestion event, one decrease.
pub const AIMD_HOLDOFF: Duration = Duration::from_secs(1);
/// Longest pause the rate-limit headers can impose in one go (they are clamped to it).
pub const MAX_PACING_WAIT: Duration = Duration::from_secs(60);
/// Reported-to-estimated token ratios believed; outside it `usage` is ignored (a server
/// that counts characters reports 4×).
pub const USAGE_PLAUSIBLE: RangeInclusive<f64> = 0.5..=2.0;
/// Largest count read from a rate-limit header; larger values are clamped to it.
pub const MAX_HEADER_COUNT: u64 = 1_000_000_000_000;
/// Prefix of the shared budgets' Redis keys.
pub const SHARED_KEY_PREFIX: &str = "embed-dlq:limit:";

/// The configured limits (all off by default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitConfig {
    /// Requests per minute, `None` for no request budget.
    pub max_requests_per_minute: Option<u32>,
    /// Estimated tokens per minute, `None` for no token budget.
    pub max_tokens_per_minute: Option<u32>,
    /// Keep the budget in Redis, shared by every process using the same provider and model.
    pub shared: bool,
}

impl LimitConfig {
    /// Whether any budget is configured (header pacing works without one).
    pub fn any(&self) -> bool {
        self.max_requests_per_minute.is_some() || self.max_tokens_per_minute.is_some()
    }
}

/// What the limiter did, for the run summary, the demo and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LimiterStats {
    /// Requests that had to wait for the budget or the headers before being sent.
    pub delayed_requests: u64,
    /// Total time requests waited before being sent.
    pub waited: Duration,
    /// Pauses set because the rate-limit headers said the provider was nearly out.
    pub header_pauses: u64,
    /// 429s the limiter saw.
    pub rate_limited: u64,
    /// Of those, the ones that shrank the budget (the others were within the hold-off).
    pub decreases: u64,
    /// Current AIMD factor (1 = the configured budget).
    pub factor: f64,
    /// Shared-budget calls that failed and fell back to the local budget.
    pub shared_failures: u64,
}

/// The additive-increase/multiplicative-decrease factor on the local budget.
#[derive(Debug, Clone, Copy)]
struct Aimd {
    /// The factor right after the last decrease.
    base: f64,
    /// When that was; `None`: never decreased.
    at: Option<Instant>,
}

impl Aimd {
    fn current(&self, now: Instant) -> f64 {
        match self.at {
            None => 1.0,
            Some(at) => {
                let windows =
                    (now.saturating_duration_since(at).as_secs_f64() / AIMD_WINDOW.as_secs_f64()).floor();
                (self.base + windows * AIMD_STEP).min(1.0)
            }
        }
    }

    /// Applies a 429 seen at `now`; returns whether the budget shrank.
    fn decrease(&mut self, now: Instant) -> bool {
        if self.at.is_some_and(|at| now.saturating_duration_since(at) < AIMD_HOLDOFF) {
            return false;
        }
        self.base = (self.current(now) * AIMD_DECREASE).max(AIMD_MIN_FACTOR);
        self.at = Some(now);
        true
    }
}

/// A local GCRA schedule (virtual scheduling, the same arithmetic as `redis/limit.lua`): each
/// request reserves its cost on the schedule and may go once the schedule's theoretical
/// arrival time, less the tolerance (its own cost or [`BURST`], whichever is longer), has
/// come. Reservations queue, so concurrent callers are paced evenly, not in bursts.
struct LocalBudget {
    per_minute: f64,
    /// Theoretical arrival time: when everything reserved so far has been paid for.
    tat: Mutex<Option<Instant>>,
}

impl LocalBudget {
    fn new(per_minute: u32) -> Self {
        LocalBudget { per_minute: f64::from(per_minute.max(1)), tat: Mutex::new(None) }
    }

    /// Reserves `cost` (requests or tokens) at the AIMD `factor` and returns how long to wait
    /// before sending. With `only_if_free`, nothing is reserved unless the wait is zero.
    fn reserve(&self, cost: f64, factor: f64, only_if_free: bool) -> Duration {
        let now = Instant::now();
        let interval = Duration::from_secs_f64(
            (cost * 60.0 / (self.per_minute * factor.max(AIMD_MIN_FACTOR))).min(3600.0),
        );
        let mut tat = self.tat.lock().unwrap();
        let start = tat.map_or(now, |t| t.max(now));
        let new_tat = start + interval;
        let go = new_tat.checked_sub(interval.max(BURST)).unwrap_or(now);
        let wait = go.saturating_duration_since(now);
        if !only_if_free || wait.is_zero() {
            *tat = Some(new_tat);
        }
        wait
    }
}

/// The budget in Redis (`redis/limit.lua`).
struct SharedBudget {
    conn: crate::streams::RedisConn,
    key: String,
    script: redis::Script,
    warned: AtomicBool,
}

/// The shared-budget script (`redis/limit.lua`).
pub(crate) fn limit_script() -> redis::Script {
    redis::Script::new(include_str!("../../redis/limit.lua"))
}

/// The Redis key of the shared budget for `base_url` and `model`: a hash, so that no URL
/// (which may carry a token) and no secret ever appears in a Redis key.
pub fn shared_key(base_url: &str, model: &str) -> String {
    let mut h = Sha256::new();
    h.update(base_url.trim_end_matches('/').as_bytes());
    h.update([0u8]);
    h.update(model.as_bytes());
    let digest = h.finalize();
    format!("{SHARED_KEY_PREFIX}{}", crate::model::hex(&digest[..16]))
}

impl SharedBudget {
    async fn call(&self, mode: &str, rpm: u32, tpm: u32, tokens: u64) -> redis::RedisResult<(u64, u64)> {
        let mut conn = self.conn.clone();
        self.script
            .key(&self.key)
            .arg(mode)
            .arg(rpm)
            .arg(tpm)
            .arg(tokens)
            .arg(BURST.as_millis() as u64)
            .arg(AIMD_DECREASE)
            .arg(AIMD_MIN_FACTOR)
            .arg(AIMD_HOLDOFF.as_millis() as u64)
            .arg(AIMD_STEP)
            .arg(AIMD_WINDOW.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
    }
}

/// Header pacing and in-flight accounting.
#[derive(Debug, Default)]
struct Pacing {
    /// No request may start before this.
    paused_until: Option<Instant>,
}

/// The rate-limit headers of one response, clamped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    /// `x-ratelimit-limit-requests`: the per-minute request limit.
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-limit-tokens`: the per-minute token limit.
    pub limit_tokens: Option<u64>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// `x-ratelimit-reset-requests`: until the request budget is full again.
    pub reset_requests: Option<Duration>,
    /// `x-ratelimit-reset-tokens`: until the token budget is full again.
    pub reset_tokens: Option<Duration>,
}

impl RateHeaders {
    /// Reads the OpenAI-style headers; a malformed value counts as absent, counts are clamped
    /// to [`MAX_HEADER_COUNT`] and durations to [`MAX_PACING_WAIT`].
    pub fn parse(headers: &HeaderMap) -> Self {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
        let count =
            |name: &str| text(name).and_then(|s| s.parse::<u64>().ok()).map(|n| n.min(MAX_HEADER_COUNT));
        let duration = |name: &str| text(name).and_then(parse_reset).map(|d| d.min(MAX_PACING_WAIT));
        RateHeaders {
            limit_requests: count("x-ratelimit-limit-requests"),
            limit_tokens: count("x-ratelimit-limit-tokens"),
            remaining_requests: count("x-ratelimit-remaining-requests"),
            remaining_tokens: count("x-ratelimit-remaining-tokens"),
            reset_requests: duration("x-ratelimit-reset-requests"),
            reset_tokens: duration("x-ratelimit-reset-tokens"),
        }
    }

    fn is_empty(&self) -> bool {
        *self == RateHeaders::default()
    }

    /// What a 429 that carries no `Retry-After` should wait, from these headers: the reset
    /// of the limit that ran out (remaining 0; the longer if both did), else the shorter of
    /// the resets given (a guess; if it is too short the next 429 says so). `None` without
    /// a reset header. Clamped like every reset, to [`MAX_PACING_WAIT`].
    pub fn reset_wait(&self) -> Option<Duration> {
        let exhausted =
            [(self.remaining_requests, self.reset_requests), (self.remaining_tokens, self.reset_tokens)]
                .into_iter()
                .filter_map(|(remaining, reset)| (remaining == Some(0)).then_some(reset).flatten())
                .max();
        exhausted.or_else(|| [self.reset_requests, self.reset_tokens].into_iter().flatten().min())
    }
}

/// Parses an OpenAI-style duration (`1s`, `6m0s`, `20ms`, `1h2m3.5s`, `150us`) or a plain
/// number of seconds. `None` for anything else, negative or not finite.
pub fn parse_reset(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    if let Ok(secs) = s.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(1e9)));
    }
    let mut total = 0.0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += value * scale;
    }
    (total.is_finite() && total >= 0.0).then(|| Duration::from_secs_f64(total.min(1e9)))
}

/// Estimated tokens of `inputs`: characters / [`CHARS_PER_TOKEN`], rounded up, at least one
/// per input.
pub fn estimate_tokens(inputs: &[&str]) -> u64 {
    inputs.iter().map(|t| (t.chars().count().div_ceil(CHARS_PER_TOKEN)).max(1) as u64).sum()
}

/// The process-wide limiter of one provider and model; see the module doc.
pub struct ProviderLimiter {
    config: LimitConfig,
    requests: Option<LocalBudget>,
    tokens: Option<LocalBudget>,
    shared: Option<SharedBudget>,
    aimd: Mutex<Aimd>,
    pacing: Mutex<Pacing>,
    /// Reported-to-estimated token ratio (1 until a plausible report arrives).
    token_ratio: Mutex<f64>,
    in_flight_requests: AtomicU64,
    in_flight_tokens: AtomicU64,
    delayed: AtomicU64,
    waited_us: AtomicU64,
    header_pauses: AtomicU64,
    rate_limited: AtomicU64,
    decreases: AtomicU64,
    shared_factor_permille: AtomicU64,
    shared_failures: AtomicU64,
}

impl std::fmt::Debug for ProviderLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderLimiter")
            .field("config", &self.config)
            .field("shared_key", &self.shared.as_ref().map(|s| s.key.as_str()))
            .finish_non_exhaustive()
    }
}

/// A request admitted by [`ProviderLimiter::acquire`]: counted in flight until dropped.
#[derive(Debug)]
#[must_use]
pub struct Ticket<'a> {
    limiter: &'a ProviderLimiter,
    tokens: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.limiter.in_flight_requests.fetch_sub(1, Ordering::Relaxed);
        self.limiter.in_flight_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl ProviderLimiter {
    /// A limiter with local budgets only (and header pacing). `config.shared` is ignored
    /// here: see [`ProviderLimiter::with_redis`].
    pub fn local(config: LimitConfig) -> Self {
        let requests = config.max_requests_per_minute.map(LocalBudget::new);
        let tokens = config.max_tokens_per_minute.map(LocalBudget::new);
        ProviderLimiter {
            config,
            requests,
            tokens,
            shared: None,
            aimd: Mutex::new(Aimd { base: 1.0, at: None }),
            pacing: Mutex::new(Pacing::default()),
            token_ratio: Mutex::new(1.0),
            in_flight_requests: AtomicU64::new(0),
            in_flight_tokens: AtomicU64::new(0),
            delayed: AtomicU64::new(0),
            waited_us: AtomicU64::new(0),
            header_pauses: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            decreases: AtomicU64::new(0),
            shared_factor_permille: AtomicU64::new(1000),
            shared_failures: AtomicU64::new(0),
        }
    }

    /// A limiter whose budget lives in Redis under [`shared_key`]`(base_url, model)`, with
    /// the local budgets as the fallback when Redis fails. The script is loaded here, so a
    /// Redis that cannot run it fails the command at start rather than every request.
    pub async fn with_redis(
        config: LimitConfig,
        redis: &crate::streams::RedisClient,
        base_url: &str,
        model: &str,
    ) -> redis::RedisResult<Self> {
        let mut conn = redis.managed().await?;
        let script = limit_script();
        script.prepare_invoke().load_async(&mut conn).await?;
        let mut limiter = ProviderLimiter::local(config);
        limiter.shared = Some(SharedBudget {
            conn,
            key: shared_key(base_url, model),
            script,
            warned: AtomicBool::new(false),
        });
        Ok(limiter)
    }

    /// The configured limits.
    pub fn config(&self) -> LimitConfig {
        self.config
    }

    /// Estimated tokens of `inputs`, corrected by the plausible usage reports seen so far.
    pub fn estimate(&self, inputs: &[&str]) -> u64 {
        let raw = estimate_tokens(inputs);
        let ratio = *self.token_ratio.lock().unwrap();
        ((raw as f64) * ratio).ceil().max(1.0) as u64
    }

    /// Waits until a request of `tokens` estimated tokens may be sent: after any header
    /// pause, then within the (shared or local) budget scaled by the AIMD factor. The ticket
    /// counts the request in flight until it is dropped.
    pub async fn acquire(&self, tokens: u64) -> Ticket<'_> {
        let started = Instant::now();
        let mut delayed = self.wait_for_pacing().await;
        if self.config.any() {
            let tokens_for_budget =
                self.config.max_tokens_per_minute.map_or(0, |tpm| tokens.min(u64::from(tpm)));
            let shared = match &self.shared {
                Some(shared) => self.acquire_shared(shared, tokens_for_budget).await,
                None => None,
            };
            delayed |= match shared {
                Some(waited) => waited,
                None => self.acquire_local(tokens_for_budget).await,
            };
        }
        if delayed {
            let waited = started.elapsed();
            self.delayed.fetch_add(1, Ordering::Relaxed);
            self.waited_us.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
            metrics::counter!(crate::metrics::LIMITER_DELAYED).increment(1);
            metrics::histogram!(crate::metrics::LIMITER_WAIT).record(waited.as_secs_f64());
        }
        self.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight_tokens.fetch_add(tokens, Ordering::Relaxed);
        Ticket { limiter: self, tokens }
    }

    /// Waits out a header pause; `true` if there was one.
    async fn wait_for_pacing(&self) -> bool {
        let mut waited = false;
        loop {
            let until = self.pacing.lock().unwrap().paused_until;
            match until {
                Some(t) if t > Instant::now() => {
                    waited = true;
                    tokio::time::sleep_until(t).await;
                }
                _ => return waited,
            }
        }
    }

    /// Reserves the slot in Redis and waits for it: `Some(waited)`, or `None` when Redis
    /// failed (the caller falls back to the local budget).
    async fn acquire_shared(&self, shared: &SharedBudget, tokens: u64) -> Option<bool> {
        let rpm = self.config.max_requests_per_minute.unwrap_or(0);
        let tpm = self.config.max_tokens_per_minute.unwrap_or(0);
        match shared.call("acquire", rpm, tpm, tokens).await {
            Ok((wait_ms, factor)) => {
                self.shared_factor_permille.store(factor.min(1000), Ordering::Relaxed);
                // The script bounds the wait by the queue; clamp it anyway.
                let wait = Duration::from_millis(wait_ms).min(Duration::from_secs(3600));
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                Some(!wait.is_zero())
            }
            Err(e) => {
                self.shared_failed(shared, &e);
                None
            }
        }
    }

    fn shared_failed(&self, shared: &SharedBudget, e: &redis::RedisError) {
        self.shared_failures.fetch_add(1, Ordering::Relaxed);
        if !shared.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "shared rate limit unavailable in Redis: pacing with this process's own budget");
        }
    }

    /// Reserves the request's slot on the local schedules and waits for it; `true` if it had
    /// to wait. A wait given up (shutdown) leaves its reservation behind: the budget only
    /// runs slower for it, never faster.
    async fn acquire_local(&self, tokens: u64) -> bool {
        let factor = self.aimd.lock().unwrap().current(Instant::now());
        let mut wait = Duration::ZERO;
        if let Some(requests) = &self.requests {
            wait = wait.max(requests.reserve(1.0, factor, false));
        }
        if let (Some(budget), true) = (&self.tokens, tokens > 0) {
            wait = wait.max(budget.reserve(tokens as f64, factor, false));
        }
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        !wait.is_zero()
    }

    /// Takes from the local budget only if it needs no wait: `Err` is how long until it
    /// could. For tests of the pacing arithmetic.
    pub fn try_acquire_local(&self, tokens: u64) -> Result<(), Duration> {
        let factor = self.aimd.lock().unwrap().current(Instant::now());
        if let Some(requests) = &self.requests {
            let wait = requests.reserve(1.0, factor, true);
            if !wait.is_zero() {
                return Err(wait);
            }
        }
        if let (Some(budget), true) = (&self.tokens, tokens > 0) {
            let wait = budget.reserve(tokens as f64, factor, true);
            if !wait.is_zero() {
                return Err(wait);
            }
        }
        Ok(())
    }

    /// Reports a response's rate-limit headers (on a success or an error): when the provider
    /// says fewer requests or tokens remain than this process has in flight plus the next
    /// request, every request pauses until enough have refilled. `tokens` is the request's
    /// estimate (taken as the size of the next one).
    pub fn observe_headers(&self, headers: &HeaderMap, tokens: u64) {
        let h = RateHeaders::parse(headers);
        if h.is_empty() {
            return;
        }
        let in_flight = self.in_flight_requests.load(Ordering::Relaxed);
        let tokens_in_flight = self.in_flight_tokens.load(Ordering::Relaxed);
        let mut wait = Duration::ZERO;
        // The request that brought these headers is still in flight: it stands for the next
        // one, so what must remain is what is in flight.
        if let Some(remaining) = h.remaining_requests {
            let needed = in_flight.max(1);
            if remaining < needed {
                wait = wait.max(refill_wait(needed - remaining, h.limit_requests, h.reset_requests));
            }
        }
        if let Some(remaining) = h.remaining_tokens {
            let needed = tokens_in_flight.max(tokens);
            if remaining < needed {
                wait = wait.max(refill_wait(needed - remaining, h.limit_tokens, h.reset_tokens));
            }
        }
        if wait.is_zero() {
            return;
        }
        let until = Instant::now() + wait.min(MAX_PACING_WAIT);
        let mut pacing = self.pacing.lock().unwrap();
        if pacing.paused_until.is_none_or(|t| t < until) {
            pacing.paused_until = Some(until);
            self.header_pauses.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::LIMITER_HEADER_PAUSES).increment(1);
        }
    }

    /// Reports a 429: the budget shrinks (AIMD), locally and, with shared limits, for every
    /// process. Within [`AIMD_HOLDOFF`] of the last decrease it is the same congestion.
    pub async fn on_rate_limited(&self) {
        self.rate_limited.fetch_add(1, Ordering::Relaxed);
        if !self.config.any() {
            return;
        }
        if self.aimd.lock().unwrap().decrease(Instant::now()) {
            self.decreases.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(shared) = &self.shared {
            match shared.call("decrease", 0, 0, 0).await {
                Ok((_, factor)) => self.shared_factor_permille.store(factor.min(1000), Ordering::Relaxed),
                Err(e) => self.shared_failed(shared, &e),
            }
        }
        metrics::gauge!(crate::metrics::LIMITER_FACTOR).set(self.factor());
    }

    /// Corrects the token estimate from a response's reported usage when plausible.
    pub fn observe_usage(&self, estimated_raw: u64, reported: u64) {
        if estimated_raw == 0 || reported == 0 {
            return;
        }
        let ratio = reported as f64 / estimated_raw as f64;
        if USAGE_PLAUSIBLE.contains(&ratio) {
            let mut r = self.token_ratio.lock().unwrap();
            // A moving average: one odd response does not swing the budget.
            *r = (*r * 0.8 + ratio * 0.2).clamp(*USAGE_PLAUSIBLE.start(), *USAGE_PLAUSIBLE.end());
        }
    }

    /// The current AIMD factor: the shared one with shared limits, else the local one.
    pub fn factor(&self) -> f64 {
        if self.shared.is_some() {
            self.shared_factor_permille.load(Ordering::Relaxed) as f64 / 1000.0
        } else {
            self.aimd.lock().unwrap().current(Instant::now())
        }
    }

    /// The reported-to-estimated token ratio in use.
    pub fn token_ratio(&self) -> f64 {
        *self.token_ratio.lock().unwrap()
    }

    /// What the limiter did so far.
    pub fn stats(&self) -> LimiterStats {
        LimiterStats {
            delayed_requests: self.delayed.load(Ordering::Relaxed),
            waited: Duration::from_micros(self.waited_us.load(Ordering::Relaxed)),
            header_pauses: self.header_pauses.load(Ordering::Relaxed),
            rate_limited: self.rate_limited.load(Ordering::Relaxed),
            decreases: self.decreases.load(Ordering::Relaxed),
            factor: self.factor(),
            shared_failures: self.shared_failures.load(Ordering::Relaxed),
        }
    }
}

/// How long until `missing` units have refilled: at the per-minute `limit` when it is known
/// (60 s / limit per unit), else the whole `reset`; never longer than `reset` when both are
/// known, and [`MAX_PACING_WAIT`] at most.
fn refill_wait(missing: u64, limit: Option<u64>, reset: Option<Duration>) -> Duration {
    let by_rate = limit.filter(|&l| l > 0).map(|l| {
        Duration::from_secs_f64((60.0 * missing as f64 / l as f64).min(MAX_PACING_WAIT.as_secs_f64()))
    });
    let wait = match (by_rate, reset) {
        (Some(r), Some(reset)) => r.min(reset),
        (Some(r), None) => r,
        (None, Some(reset)) => reset,
        (None, None) => Duration::ZERO,
    };
    wait.min(MAX_PACING_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_durations_parse_openai_style_and_reject_garbage() {
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_reset("1h2m3.5s"), Some(Duration::from_secs_f64(3723.5)));
        assert_eq!(parse_reset("0.25"), Some(Duration::from_millis(250)));
        for bad in ["", "-1s", "1x", "s", "NaN", "1e400", "inf", "--"] {
            assert_eq!(parse_reset(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn headers_are_clamped() {
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-requests", "99999999999999999999".parse().unwrap());
        h.insert("x-ratelimit-remaining-tokens", "12".parse().unwrap());
        h.insert("x-ratelimit-reset-requests", "9999h".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "garbage".parse().unwrap());
        h.insert("x-ratelimit-limit-requests", "-5".parse().unwrap());
        let r = RateHeaders::parse(&h);
        assert_eq!(r.remaining_requests, None, "not a u64");
        assert_eq!(r.remaining_tokens, Some(12));
        assert_eq!(r.reset_requests, Some(MAX_PACING_WAIT));
        assert_eq!(r.reset_tokens, None);
        assert_eq!(r.limit_requests, None);
        h.insert("x-ratelimit-remaining-requests", "18446744073709551615".parse().unwrap());
        assert_eq!(RateHeaders::parse(&h).remaining_requests, Some(MAX_HEADER_COUNT));
    }

    #[test]
    fn tokens_are_estimated_from_characters() {
        assert_eq!(estimate_tokens(&["abcd", "abcde", ""]), 1 + 2 + 1);
        let limiter = ProviderLimiter::local(LimitConfig::default());
        // A server that counts characters (4x) is not believed.
        limiter.observe_usage(100, 400);
        assert_eq!(limiter.token_ratio(), 1.0);
        for _ in 0..50 {
            limiter.observe_usage(100, 150);
        }
        assert!((limiter.token_ratio() - 1.5).abs() < 0.01, "{}", limiter.token_ratio());
        assert_eq!(limiter.estimate(&["abcdefgh"]), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn aimd_halves_on_a_429_ignores_the_echo_and_recovers_per_window() {
        let mut aimd = Aimd { base: 1.0, at: None };
        let t0 = Instant::now();
        assert!(aimd.decrease(t0));
        assert_eq!(aimd.current(t0), 0.5);
        assert!(!aimd.decrease(t0 + AIMD_HOLDOFF / 2), "in-flight 429s are one event");
        assert_eq!(aimd.current(t0 + AIMD_WINDOW), 0.6);
        assert!((aimd.current(t0 + AIMD_WINDOW * 3) - 0.8).abs() < 1e-9);
        assert_eq!(aimd.current(t0 + AIMD_WINDOW * 100), 1.0);
        assert!(aimd.decrease(t0 + AIMD_WINDOW * 2));
        assert!((aimd.current(t0 + AIMD_WINDOW * 2) - 0.35).abs() < 1e-9, "halves the recovered factor");
        for i in 0..20 {
            aimd.decrease(t0 + AIMD_WINDOW * 2 + AIMD_HOLDOFF * (i + 1));
        }
        assert_eq!(aimd.current(t0 + AIMD_WINDOW * 2 + AIMD_HOLDOFF * 20), AIMD_MIN_FACTOR);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_shrinks_the_local_budget() {
        // 6000 requests a minute: a burst of 100 ms worth (10), then one every 10 ms.
        let limiter = ProviderLimiter::local(LimitConfig {
            max_requests_per_minute: Some(6_000),
            ..Default::default()
        });
        for _ in 0..10 {
            assert_eq!(limiter.try_acquire_local(0), Ok(()));
        }
        assert_eq!(limiter.try_acquire_local(0), Err(Duration::from_millis(10)));
        limiter.on_rate_limited().await;
        assert_eq!(limiter.stats().decreases, 1);
        assert_eq!(limiter.factor(), 0.5);
        // Each request now costs 20 ms: after a pause, a burst of 5, then 20 ms apart.
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..5 {
            assert_eq!(limiter.try_acquire_local(0), Ok(()));
        }
        assert_eq!(limiter.try_acquire_local(0), Err(Duration::from_millis(20)));
    }

    #[tokio::test(start_paused = true)]
    async fn budgets_pace_evenly_with_a_burst_of_at_least_one_request() {
        // 240 a minute (4 a second): one at once, then one every 250 ms, so any one second
        // sees at most 5 (a provider allowing 5 in any second gives no 429).
        let limiter =
            ProviderLimiter::local(LimitConfig { max_requests_per_minute: Some(240), ..Default::default() });
        let start = Instant::now();
        let mut sent = Vec::new();
        for _ in 0..12 {
            drop(limiter.acquire(1).await);
            sent.push(Instant::now() - start);
        }
        let most_in_a_second = sent
            .iter()
            .map(|a| sent.iter().filter(|b| **b >= *a && **b <= *a + Duration::from_secs(1)).count())
            .max();
        assert_eq!(most_in_a_second, Some(5), "{sent:?}");
        // Tokens: 600 a minute (10 a second), requests of 5 tokens: a burst of one request.
        let limiter =
            ProviderLimiter::local(LimitConfig { max_tokens_per_minute: Some(600), ..Default::default() });
        assert_eq!(limiter.try_acquire_local(5), Ok(()));
        assert_eq!(limiter.try_acquire_local(5), Err(Duration::from_millis(500)));
    }

    #[tokio::test(start_paused = true)]
    async fn headers_pause_every_request_before_the_provider_runs_out() {
        let limiter = ProviderLimiter::local(LimitConfig::default());
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-limit-requests", "60".parse().unwrap());
        h.insert("x-ratelimit-remaining-requests", "5".parse().unwrap());
        h.insert("x-ratelimit-reset-requests", "55s".parse().unwrap());
        limiter.observe_headers(&h, 10);
        assert_eq!(limiter.stats().header_pauses, 0, "enough left");
        h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
        limiter.observe_headers(&h, 10);
        assert_eq!(limiter.stats().header_pauses, 1);
        let start = Instant::now();
        drop(limiter.acquire(10).await);
        // One request refills in 60 s / 60 = 1 s (not the 55 s until the budget is full).
        assert_eq!(Instant::now() - start, Duration::from_secs(1));
        // Tokens: 100 remaining, 300 in flight (this request of 200 and another of 100).
        let other = limiter.acquire(100).await;
        let this = limiter.acquire(200).await;
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-limit-tokens", "6000".parse().unwrap());
        h.insert("x-ratelimit-remaining-tokens", "100".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "1m".parse().unwrap());
        limiter.observe_headers(&h, 200);
        drop((other, this));
        let start = Instant::now();
        drop(limiter.acquire(1).await);
        // 200 missing at 6000 a minute: 2 s.
        assert_eq!(Instant::now() - start, Duration::from_secs(2));
    }
}
