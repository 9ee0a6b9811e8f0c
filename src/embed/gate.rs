//! Pool-wide admission to the provider: one shared rate-limit pause and one circuit breaker.
//!
//! A 429 with Retry-After pauses *every* worker until the server's time, instead of each
//! worker hammering the provider on its own schedule; a 429 without a usable wait pauses
//! them too, adaptively ([`ADAPTIVE_PAUSE_FIRST`] doubling up to [`ADAPTIVE_PAUSE_MAX`]). A run of consecutive transient failures
//! (an outage) opens the breaker: no new request starts until the cooldown ends, then one
//! probe goes out; its success closes the breaker, its failure reopens it with a longer
//! cooldown. An outage longer than `max_outage` ends the run with a clear error instead of
//! parking the whole corpus; so does a provider that answers nothing but 429 for that long.
//!
//! The [`crate::embed::Embedder`] probes with a canary input, never with the batch that was
//! failing (that batch may hold an input the server always fails on), and reports the
//! failures met while isolating one input as `Health::InputSuspect`: they say nothing about
//! the provider, so they neither open nor close the breaker. The gate also keeps the run's
//! `CanaryBook`, shared by every worker like the breaker.
//!
//! What a caller does while the breaker is open is its own choice, [`OnOutage`], passed to
//! `ProviderGate::admit`: wait for the probes (the default), park its work without a
//! provider call, or stop the run at once. The gate's state is the same for all of them.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::canary::CanaryBook;

/// Breaker tuning; defaults suit a remote API.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive transient request failures (rate limits excluded) that open the breaker.
    pub failure_threshold: u32,
    /// First open period; doubled after each failed probe up to `max_cooldown`.
    pub cooldown: Duration,
    /// Longest open period: the doubling of `cooldown` stops here.
    pub max_cooldown: Duration,
    /// Longest the breaker may stay open before the run gives up.
    pub max_outage: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 20,
            cooldown: Duration::from_secs(2),
            max_cooldown: Duration::from_secs(60),
            max_outage: Duration::from_secs(600),
        }
    }
}

/// What an ingest does while the circuit breaker is open (`--on-outage`, `[ingest]
/// on_outage`). A batch job that must finish wants `Wait` or `Stop`; a pipeline that runs
/// `serve` beside it wants `Park`, so that the replayers finish the work once the provider is
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnOutage {
    /// Hold the work and probe at growing intervals (`breaker_cooldown_ms` doubling up to
    /// 60 s); end the run (exit 4) once the breaker has been open `max_outage_secs`.
    #[default]
    Wait,
    /// Park the rest as `transient` without a provider call while the breaker is open (the
    /// rows get the DLQ schedule's first retry time, so `serve` replays them); the breaker
    /// still probes after each cooldown and, once the provider answers, embedding resumes.
    Park,
    /// End the run (exit 4) as soon as the breaker opens; what was not written is "not
    /// attempted" and a rerun of the same corpus resumes.
    Stop,
}

/// Observable breaker state (exported as a gauge later: 0 closed, 1 half-open, 2 open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

#[derive(Debug)]
enum Breaker {
    Closed,
    Open { until: Instant, since: Instant, cooldown: Duration },
    HalfOpen { since: Instant, cooldown: Duration, probe_out: bool },
}

#[derive(Debug)]
struct State {
    paused_until: Option<Instant>,
    consecutive_failures: u32,
    breaker: Breaker,
    opened_count: u64,
    /// First and latest 429 of the current run of rate limits (no answer in between).
    rate_limited: Option<(Instant, Instant)>,
    /// Longest shared pause ever set, for tests and the run summary.
    longest_pause: Duration,
    /// Callers held by the current pause resume at a random point within this long after
    /// it ends (half the wait that set it), not all at its last instant.
    pause_spread: Duration,
    /// The last pause set for a 429 that said nothing about how long to wait (zero: none
    /// since the last answer); the next one doubles it, see [`ADAPTIVE_PAUSE_FIRST`].
    adaptive_pause: Duration,
}

impl State {
    /// `None` with the breaker closed; otherwise whether a probe may go out now (the
    /// cooldown is over and no probe is out).
    fn breaker_open_turn(&self, now: Instant) -> Option<bool> {
        match self.breaker {
            Breaker::Closed => None,
            Breaker::Open { until, .. } => Some(until <= now),
            Breaker::HalfOpen { probe_out, .. } => Some(!probe_out),
        }
    }
}

/// The shared pause after a 429 that carries no usable wait (no `Retry-After`,
/// `retry-after-ms`, `llm_provider-retry-after` or `x-ratelimit-reset-*`: TEI when
/// overloaded, LiteLLM behind some proxies): the pool still pauses, first this long, then
/// twice as long for each such 429 met after the previous pause ended, up to
/// [`ADAPTIVE_PAUSE_MAX`] (and `max_cooldown`); any answer starts over. Without it, every
/// worker would spend its retries within seconds while a gateway refuses for the rest of
/// its minute.
pub const ADAPTIVE_PAUSE_FIRST: Duration = Duration::from_secs(1);
/// Longest adaptive pause: a minute, the window of per-minute limits.
pub const ADAPTIVE_PAUSE_MAX: Duration = Duration::from_secs(60);

/// Two 429s further apart than this (with nothing in between) are two episodes, not one:
/// idle time between them is not "being rate-limited".
const RATE_LIMIT_EPISODE_GAP: Duration = Duration::from_secs(120);

/// Why admission was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum GateError {
    #[error("shutting down")]
    Cancelled,
    #[error("provider unavailable for longer than {0:?} (circuit breaker open)")]
    Outage(Duration),
    #[error("provider rate-limited every request for longer than {0:?}")]
    RateLimited(Duration),
    /// The breaker is open and the caller asked not to wait ([`OnOutage::Park`] or
    /// [`OnOutage::Stop`]): send nothing.
    #[error("provider failing (circuit breaker open)")]
    BreakerOpen,
}

/// A granted request slot; report its outcome with [`ProviderGate::record`].
#[derive(Debug)]
#[must_use]
pub(crate) struct Permit {
    probe: bool,
}

impl Permit {
    /// Whether this request is the breaker's probe: send something known to be good (a
    /// canary), not work that may fail for reasons of its own.
    pub(crate) fn is_probe(&self) -> bool {
        self.probe
    }
}

/// What a request's outcome says about the provider's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Health {
    /// The provider answered (success or a rejection of the input).
    Responsive,
    /// Told to slow down; pause everyone for this long.
    RateLimited(Option<Duration>),
    /// Timeout, connection error or 5xx.
    Failing,
    /// A failure while isolating one input that the provider fails on while its neighbours
    /// succeed: evidence against the input, not the provider. Neither counts towards the
    /// breaker nor resets it.
    InputSuspect,
}

/// Shared by all workers of a run.
#[derive(Debug)]
pub struct ProviderGate {
    config: BreakerConfig,
    state: Mutex<State>,
    canary: CanaryBook,
    /// Whether the breaker is open or half-open, for callers that must not sleep out a
    /// backoff once it opens ([`ProviderGate::opened`]).
    open: tokio::sync::watch::Sender<bool>,
}

impl ProviderGate {
    /// A closed breaker with no history; share one per provider (in an `Arc`) between all workers
    /// of a run, so they pause and trip together.
    pub fn new(config: BreakerConfig) -> Self {
        ProviderGate {
            config,
            state: Mutex::new(State {
                paused_until: None,
                consecutive_failures: 0,
                breaker: Breaker::Closed,
                opened_count: 0,
                rate_limited: None,
                longest_pause: Duration::ZERO,
                pause_spread: Duration::ZERO,
                adaptive_pause: Duration::ZERO,
            }),
            canary: CanaryBook::default(),
            open: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Resolves once the breaker is open (at once if it already is): a caller that parks or
    /// stops on an outage cuts its retry backoff short here instead of sleeping it out.
    pub(crate) async fn opened(&self) {
        let mut open = self.open.subscribe();
        // The sender lives as long as `self`, so this only ends when the breaker is open.
        let _ = open.wait_for(|open| *open).await;
    }

    /// What the run has learnt about the provider as a whole (successes, canary verdicts).
    pub(crate) fn canary(&self) -> &CanaryBook {
        &self.canary
    }

    /// How long a run of failures may hold the provider before the run gives up
    /// ([`BreakerConfig::max_outage`]); also how long one piece may stay rate-limited before
    /// it is parked.
    pub(crate) fn max_outage(&self) -> Duration {
        self.config.max_outage
    }

    /// The longest shared rate-limit pause set in this run (bounded by the retry cap the
    /// embedder applies and by `max_cooldown`).
    pub fn longest_pause(&self) -> Duration {
        self.state.lock().unwrap().longest_pause
    }

    /// How long until the breaker lets its next probe out: `None` when it is closed, zero
    /// when a probe is due or out. Work given up for an outage need not come back before
    /// that probe, since nothing can succeed earlier.
    pub(crate) fn next_probe_in(&self) -> Option<Duration> {
        match self.state.lock().unwrap().breaker {
            Breaker::Closed => None,
            Breaker::Open { until, .. } => Some(until.saturating_duration_since(Instant::now())),
            Breaker::HalfOpen { .. } => Some(Duration::ZERO),
        }
    }

    /// Current breaker state.
    pub(crate) fn breaker_state(&self) -> BreakerState {
        match self.state.lock().unwrap().breaker {
            Breaker::Closed => BreakerState::Closed,
            Breaker::Open { .. } => BreakerState::Open,
            Breaker::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// How many times the breaker has opened in this run.
    pub(crate) fn times_opened(&self) -> u64 {
        self.state.lock().unwrap().opened_count
    }

    /// Waits until a request may be sent: after any rate-limit pause (at a point of this
    /// caller's own within the pause's spread, so the held requests do not all go out at
    /// once), and, with the breaker open, until it is this caller's turn to probe. With the breaker open, `on_outage`
    /// decides: `Wait` waits as above; `Park` gets [`GateError::BreakerOpen`] at once unless
    /// a probe is due (then it probes); `Stop` gets [`GateError::BreakerOpen`] and never probes.
    pub(crate) async fn admit(
        &self,
        cancel: &CancellationToken,
        on_outage: OnOutage,
    ) -> Result<Permit, GateError> {
        // The end of the pause this caller was held by, and its own point to resume.
        let mut resume: Option<(Instant, Instant)> = None;
        loop {
            let wake = {
                let mut st = self.state.lock().unwrap();
                let now = Instant::now();
                match (st.breaker_open_turn(now), on_outage) {
                    (None, _) => {}
                    (Some(_), OnOutage::Stop) | (Some(false), OnOutage::Park) => {
                        return Err(GateError::BreakerOpen);
                    }
                    // Parking never gives up: the rest is parked, not held.
                    (Some(true), OnOutage::Park) => {}
                    // Past `max_outage` a waiting caller gives up, unless a probe is due:
                    // the breaker must keep probing, or a long-lived process (`serve`)
                    // would never learn that the provider is back.
                    (Some(probe_due), OnOutage::Wait) => match st.breaker {
                        Breaker::Open { since, .. } | Breaker::HalfOpen { since, .. }
                            if !probe_due && now.duration_since(since) > self.config.max_outage =>
                        {
                            return Err(GateError::Outage(self.config.max_outage));
                        }
                        _ => {}
                    },
                }
                if let Some((first, last)) = st.rate_limited
                    && last.duration_since(first) > self.config.max_outage
                    && now.duration_since(last) < RATE_LIMIT_EPISODE_GAP
                {
                    return Err(GateError::RateLimited(self.config.max_outage));
                }
                let held_until = match st.paused_until {
                    Some(end) if end > now => Some(match resume {
                        Some((seen, at)) if seen == end => at,
                        // A new or extended pause: draw again.
                        _ => {
                            let at = end + super::retry::jitter(st.pause_spread);
                            resume = Some((end, at));
                            at
                        }
                    }),
                    _ => resume.map(|(_, at)| at).filter(|at| *at > now),
                };
                match held_until {
                    Some(at) => at,
                    None => match st.breaker {
                        Breaker::Closed => return Ok(Permit { probe: false }),
                        Breaker::Open { until, since, cooldown } => {
                            if until <= now {
                                st.breaker = Breaker::HalfOpen { since, cooldown, probe_out: true };
                                return Ok(Permit { probe: true });
                            }
                            until
                        }
                        Breaker::HalfOpen { since, cooldown, probe_out } => {
                            if !probe_out {
                                st.breaker = Breaker::HalfOpen { since, cooldown, probe_out: true };
                                return Ok(Permit { probe: true });
                            }
                            now + Duration::from_millis(50)
                        }
                    },
                }
            };
            let wake = wake.min(Instant::now() + Duration::from_millis(250));
            tokio::select! {
                _ = cancel.cancelled() => return Err(GateError::Cancelled),
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Reports how the permitted request went.
    pub(crate) fn record(&self, permit: Permit, health: Health) {
        self.record_inner(permit, health);
        let state = match self.breaker_state() {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        };
        metrics::gauge!(crate::metrics::BREAKER_STATE).set(state);
        self.open.send_if_modified(|open| std::mem::replace(open, state > 0.0) != (state > 0.0));
    }

    fn record_inner(&self, permit: Permit, health: Health) {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        match health {
            Health::Responsive => {
                st.consecutive_failures = 0;
                st.breaker = Breaker::Closed;
                st.rate_limited = None;
                st.adaptive_pause = Duration::ZERO;
            }
            Health::InputSuspect => {
                if permit.probe
                    && let Breaker::HalfOpen { since, cooldown, .. } = st.breaker
                {
                    // Not evidence either way: let another probe go.
                    st.breaker = Breaker::HalfOpen { since, cooldown, probe_out: false };
                }
            }
            Health::RateLimited(wait) => {
                st.rate_limited = match st.rate_limited {
                    Some((first, last)) if now.duration_since(last) < RATE_LIMIT_EPISODE_GAP => {
                        Some((first, now))
                    }
                    _ => Some((now, now)),
                };
                // No usable wait: pause adaptively, unless this 429 answers a request sent
                // before the current pause (the same congestion: no growth).
                let wait = wait.or_else(|| {
                    if st.paused_until.is_some_and(|p| p > now) {
                        return None;
                    }
                    let next = match st.adaptive_pause {
                        d if d.is_zero() => ADAPTIVE_PAUSE_FIRST,
                        d => d.saturating_mul(2),
                    };
                    st.adaptive_pause = next.min(ADAPTIVE_PAUSE_MAX).min(self.config.max_cooldown);
                    Some(st.adaptive_pause)
                });
                if let Some(wait) = wait {
                    let wait = wait.min(self.config.max_cooldown);
                    st.longest_pause = st.longest_pause.max(wait);
                    let until = now + wait;
                    if st.paused_until.is_none_or(|p| p < until) {
                        st.paused_until = Some(until);
                        st.pause_spread = wait / 2;
                    }
                }
                if permit.probe {
                    // The provider is up, just busy.
                    st.breaker = Breaker::Closed;
                }
            }
            Health::Failing => {
                st.consecutive_failures = st.consecutive_failures.saturating_add(1);
                match st.breaker {
                    Breaker::HalfOpen { since, cooldown, .. } if permit.probe => {
                        let cooldown = (cooldown * 2).min(self.config.max_cooldown);
                        st.breaker = Breaker::Open { until: now + cooldown, since, cooldown };
                    }
                    Breaker::Closed if st.consecutive_failures >= self.config.failure_threshold => {
                        st.opened_count += 1;
                        metrics::counter!(crate::metrics::BREAKER_OPENED).increment(1);
                        tracing::warn!(
                            failures = st.consecutive_failures,
                            "provider failing: circuit breaker open, intake paused"
                        );
                        st.breaker = Breaker::Open {
                            until: now + self.config.cooldown,
                            since: now,
                            cooldown: self.config.cooldown,
                        };
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            cooldown: Duration::from_secs(1),
            max_cooldown: Duration::from_secs(4),
            max_outage: Duration::from_secs(30),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_threshold_probes_and_closes() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::Failing);
        }
        assert_eq!(gate.breaker_state(), BreakerState::Open);
        let start = Instant::now();
        let probe = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        assert!(probe.probe);
        assert!(Instant::now() - start >= Duration::from_secs(1), "waited out the cooldown");
        assert_eq!(gate.breaker_state(), BreakerState::HalfOpen);
        // A second caller must wait while the probe is out.
        let waiting =
            tokio::time::timeout(Duration::from_millis(500), gate.admit(&cancel, OnOutage::Wait)).await;
        assert!(waiting.is_err());
        gate.record(probe, Health::Responsive);
        assert_eq!(gate.breaker_state(), BreakerState::Closed);
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        assert!(!p.probe);
        gate.record(p, Health::Responsive);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probe_doubles_cooldown_and_long_outage_gives_up() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::Failing);
        }
        let mut result = Ok(());
        for _ in 0..100 {
            match gate.admit(&cancel, OnOutage::Wait).await {
                Ok(p) => gate.record(p, Health::Failing),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        assert_eq!(result, Err(GateError::Outage(Duration::from_secs(30))));
    }

    #[tokio::test(start_paused = true)]
    async fn past_max_outage_a_due_probe_still_goes_out_and_an_answer_closes_the_breaker() {
        // `serve` outlives any outage: once callers have given up, the breaker must still
        // probe at its cooldown, or the provider's return would never be noticed.
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::Failing);
        }
        while let Ok(p) = gate.admit(&cancel, OnOutage::Wait).await {
            gate.record(p, Health::Failing);
        }
        let wait = gate.next_probe_in().expect("open");
        assert!(wait > Duration::ZERO, "the give-up came between probes");
        assert_eq!(
            gate.admit(&cancel, OnOutage::Wait).await.err(),
            Some(GateError::Outage(Duration::from_secs(30)))
        );
        tokio::time::sleep(wait).await;
        let probe = gate.admit(&cancel, OnOutage::Wait).await.expect("the due probe goes out");
        assert!(probe.is_probe());
        gate.record(probe, Health::Responsive);
        assert_eq!(gate.next_probe_in(), None, "closed");
        assert!(!gate.admit(&cancel, OnOutage::Wait).await.unwrap().is_probe());
    }

    #[tokio::test(start_paused = true)]
    async fn the_requests_a_pause_held_go_out_spread_over_half_the_pause_after_it() {
        // Eight workers held by one `Retry-After: 4`: all sent at the pause's last instant
        // they would be the next 429 together.
        let gate = std::sync::Arc::new(ProviderGate::new(cfg()));
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        let start = Instant::now();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(4))));
        let held: Vec<_> = (0..8)
            .map(|_| {
                let (gate, cancel) = (gate.clone(), cancel.clone());
                tokio::spawn(async move {
                    let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
                    let sent = Instant::now() - start;
                    gate.record(p, Health::Responsive);
                    sent
                })
            })
            .collect();
        let mut sent = Vec::new();
        for h in held {
            sent.push(h.await.unwrap());
        }
        assert!(sent.iter().all(|s| *s >= Duration::from_secs(4)), "one went out during the pause: {sent:?}");
        assert!(sent.iter().all(|s| *s <= Duration::from_secs(6)), "held longer than the spread: {sent:?}");
        let spread = *sent.iter().max().unwrap() - *sent.iter().min().unwrap();
        assert!(spread >= Duration::from_millis(500), "all sent within {spread:?}: {sent:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_without_a_wait_pauses_adaptively_and_an_answer_starts_over() {
        let gate = ProviderGate::new(BreakerConfig {
            max_cooldown: Duration::from_secs(60),
            max_outage: Duration::from_secs(3600),
            ..cfg()
        });
        let cancel = CancellationToken::new();
        let mut pauses = Vec::new();
        for _ in 0..9 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::RateLimited(None));
            pauses.push(gate.state.lock().unwrap().adaptive_pause.as_secs());
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60, 60], "doubling up to a minute");
        // A 429 answering a request sent before the pause is the same congestion.
        let echo = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::Responsive);
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::RateLimited(None));
        assert_eq!(gate.state.lock().unwrap().adaptive_pause, ADAPTIVE_PAUSE_FIRST, "an answer starts over");
        gate.record(echo, Health::RateLimited(None));
        assert_eq!(
            gate.state.lock().unwrap().adaptive_pause,
            ADAPTIVE_PAUSE_FIRST,
            "no growth inside a pause"
        );
        assert_eq!(gate.longest_pause(), ADAPTIVE_PAUSE_MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_pauses_everyone() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(3))));
        let start = Instant::now();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        assert!(Instant::now() - start >= Duration::from_secs(3));
        gate.record(p, Health::Responsive);
        assert_eq!(gate.breaker_state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limited_longer_than_max_outage_stops_like_an_outage() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let mut result = Ok(());
        for _ in 0..1_000 {
            match gate.admit(&cancel, OnOutage::Wait).await {
                Ok(p) => gate.record(p, Health::RateLimited(Some(Duration::from_secs(1)))),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        assert_eq!(result, Err(GateError::RateLimited(Duration::from_secs(30))));
        assert_eq!(gate.breaker_state(), BreakerState::Closed, "429s are not failures");
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_ends_a_rate_limit_episode_and_idle_time_does_not_count() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..20 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::RateLimited(Some(Duration::from_secs(1))));
        }
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::Responsive);
        for _ in 0..20 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::RateLimited(Some(Duration::from_secs(1))));
        }
        // Idle for an hour, then one more 429: a new episode.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(1))));
        assert!(gate.admit(&cancel, OnOutage::Wait).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn input_suspects_neither_open_nor_reset_the_breaker() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::Failing);
        for _ in 0..50 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::InputSuspect);
        }
        assert_eq!(gate.breaker_state(), BreakerState::Closed);
        assert_eq!(gate.times_opened(), 0);
        for _ in 0..2 {
            let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
            gate.record(p, Health::Failing);
        }
        assert_eq!(gate.breaker_state(), BreakerState::Open, "the earlier failure still counted");
    }

    #[tokio::test(start_paused = true)]
    async fn park_is_refused_at_once_while_open_and_probes_when_due() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel, OnOutage::Park).await.unwrap();
            gate.record(p, Health::Failing);
        }
        let start = Instant::now();
        assert_eq!(gate.admit(&cancel, OnOutage::Park).await.unwrap_err(), GateError::BreakerOpen);
        assert_eq!(Instant::now(), start, "refused without waiting");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let probe = gate.admit(&cancel, OnOutage::Park).await.unwrap();
        assert!(probe.is_probe(), "the cooldown is over: this caller probes");
        assert_eq!(gate.admit(&cancel, OnOutage::Park).await.unwrap_err(), GateError::BreakerOpen);
        gate.record(probe, Health::Failing);
        // Parking never gives up, however long the outage lasts.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let probe = gate.admit(&cancel, OnOutage::Park).await.unwrap();
        assert!(probe.is_probe());
        gate.record(probe, Health::Responsive);
        let p = gate.admit(&cancel, OnOutage::Park).await.unwrap();
        assert!(!p.is_probe(), "closed again: work goes out");
        gate.record(p, Health::Responsive);
    }

    #[tokio::test(start_paused = true)]
    async fn stop_is_refused_once_open_and_never_probes() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel, OnOutage::Stop).await.unwrap();
            gate.record(p, Health::Failing);
        }
        assert_eq!(gate.admit(&cancel, OnOutage::Stop).await.unwrap_err(), GateError::BreakerOpen);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(gate.admit(&cancel, OnOutage::Stop).await.unwrap_err(), GateError::BreakerOpen);
        assert_eq!(gate.breaker_state(), BreakerState::Open, "no probe was taken");
    }

    #[tokio::test(start_paused = true)]
    async fn opened_resolves_when_the_breaker_opens_and_not_before() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel, OnOutage::Park).await.unwrap();
        gate.record(p, Health::Failing);
        assert!(tokio::time::timeout(Duration::from_secs(5), gate.opened()).await.is_err(), "still closed");
        for _ in 0..2 {
            let p = gate.admit(&cancel, OnOutage::Park).await.unwrap();
            gate.record(p, Health::Failing);
        }
        assert!(tokio::time::timeout(Duration::from_millis(1), gate.opened()).await.is_ok());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let probe = gate.admit(&cancel, OnOutage::Park).await.unwrap();
        gate.record(probe, Health::Responsive);
        assert!(tokio::time::timeout(Duration::from_secs(5), gate.opened()).await.is_err(), "closed again");
    }

    #[tokio::test(start_paused = true)]
    async fn cancel_interrupts_a_wait() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel, OnOutage::Wait).await.unwrap();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(3))));
        cancel.cancel();
        assert_eq!(gate.admit(&cancel, OnOutage::Wait).await.unwrap_err(), GateError::Cancelled);
    }
}
