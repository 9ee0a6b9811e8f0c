//! The seed write-up's retry-and-park design (`seed/000_*.txt`, "Step 3" and "Step 5"), run
//! as a deterministic simulation in virtual time against the mock provider's fault model, so
//! the economy benchmark can put embed-dlq's provider bill beside the design it replaced.
//!
//! What is simulated, from the seed's code:
//!
//! - **One input per request**, `workers` coroutines taking chunks from one queue.
//! - **`embed_with_retry`**: up to `MAX_RETRIES` = 6 attempts; after every transient failure
//!   (429, 5xx, timeout, reset) a sleep drawn uniformly from `[0, min(1 s · 2^attempt, 45 s)]`
//!   (full jitter; the code ignores `Retry-After`, although its text says otherwise), the
//!   last failure included, then a park as `transient` with `next_retry_at` 45 s later.
//!   A permanent answer parks at attempt 1.
//! - **`replay`**: one job taking due transient rows in `next_retry_at` order and running
//!   `embed_with_retry` on each in turn; a failure re-parks the row 45 s later.
//!
//! The provider is [`MockConfig`]'s model, evaluated in the mock's order when a request
//! arrives: the outage windows (`outage_after_ms`, `outage_after_inputs`), the account's
//! `rpm_limit`/`tpm_limit` token buckets (charged as the mock charges them), the input's own
//! verdict, then the fault dice (`rate_429`, `rate_5xx`, `rate_timeout`, `rate_reset`). The
//! dice come from this module's own seeded generator: the same probabilities as the mock's,
//! not the same draws. A held-back answer costs `min(timeout_hold_ms, client_timeout)`.
//!
//! Two of the seed's mistakes are *not* reproduced, in its favour: a connection reset is
//! retried as transient (its `classify` returns `permanent_unknown`, so the chunk would never
//! be stored), and inputs embed-dlq parks without a call (blank, over-long) are charged one
//! request and counted as not stored (the seed would send them and store whatever came back).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::mock_provider::MockConfig;

/// The seed's constants and what the simulation assumes about its deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedDesign {
    /// Ingest coroutines sending at once (the seed leaves it to its asyncio consumer pool).
    pub workers: usize,
    /// `MAX_RETRIES`: attempts per `embed_with_retry` call.
    pub max_retries: u32,
    /// `BASE_DELAY`, seconds.
    pub base_secs: f64,
    /// `BACKOFF_FACTOR`.
    pub factor: f64,
    /// `MAX_DELAY`, seconds: caps both a sleep and the park's `next_retry_at` delay.
    pub cap_secs: f64,
    /// How long an answered request takes, seconds (the mock's latency plus the loopback).
    pub latency_secs: f64,
    /// The HTTP client's timeout, seconds (httpx's default is 5 s).
    pub client_timeout_secs: f64,
    /// Replay passes a row may take before the simulation stops replaying it (the seed has
    /// no cap; this only bounds the simulation of an input that never succeeds).
    pub max_replay_passes: u32,
}

impl Default for SeedDesign {
    fn default() -> Self {
        SeedDesign {
            workers: 4,
            max_retries: 6,
            base_secs: 1.0,
            factor: 2.0,
            cap_secs: 45.0,
            latency_secs: 0.001,
            client_timeout_secs: 5.0,
            max_replay_passes: 100,
        }
    }
}

/// One chunk as the provider will judge it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeedInput {
    /// Embedded when no fault gets in the way; `tokens` as the mock counts them.
    Clean {
        /// Characters / 4, rounded up, at least 1 (the mock's `tpm_limit` count).
        tokens: u64,
    },
    /// Rejected or unusable whenever it is answered: parked at attempt 1.
    Poison {
        /// As for `Clean`.
        tokens: u64,
    },
}

impl SeedInput {
    fn tokens(self) -> u64 {
        match self {
            SeedInput::Clean { tokens } | SeedInput::Poison { tokens } => tokens,
        }
    }
}

/// What the provider was sent and what became of the chunks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeedOutcome {
    /// Requests during the ingest (one input each).
    pub ingest_requests: u64,
    /// Requests of the replay job, until no transient row was left (or the pass cap).
    pub replay_requests: u64,
    /// Requests that met a request-level fault (429, 5xx, timeout, reset), both phases.
    pub failed_requests: u64,
    /// Of those, 429s for being over the account's limits.
    pub over_limit: u64,
    /// Chunks stored (ingest and replay).
    pub stored: u64,
    /// Chunks parked at attempt 1 (never replayed).
    pub parked_permanent: u64,
    /// Chunks parked as transient by the ingest (the replay job's work).
    pub parked_transient: u64,
    /// Transient rows still parked when the simulation stopped replaying.
    pub left_parked: u64,
    /// Virtual seconds from the first request to the end of the ingest.
    pub ingest_secs: f64,
    /// Virtual seconds from the first request to the last replay.
    pub total_secs: f64,
}

impl SeedOutcome {
    /// Every request, ingest and replay (= inputs: one input per request).
    pub fn requests(&self) -> u64 {
        self.ingest_requests + self.replay_requests
    }
}

/// Virtual time in microseconds.
type Micros = u64;

fn micros(secs: f64) -> Micros {
    (secs.max(0.0) * 1e6).round() as Micros
}

/// The mock's per-minute token bucket (see `mock_provider`'s `Bucket`), in virtual time.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    per_minute: f64,
    capacity: f64,
    level: f64,
    at: Micros,
}

impl Bucket {
    fn new(per_minute: u64, window_ms: u64) -> Self {
        let capacity = (per_minute as f64 * window_ms as f64 / 60_000.0).max(1.0);
        Bucket { per_minute: per_minute as f64, capacity, level: capacity, at: 0 }
    }

    fn refill(&mut self, now: Micros) {
        let secs = now.saturating_sub(self.at) as f64 / 1e6;
        self.level = (self.level + secs * self.per_minute / 60.0).min(self.capacity);
        self.at = now;
    }

    fn has(&self, need: f64) -> bool {
        need.min(self.capacity) <= self.level
    }
}

/// How the provider answers one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Embedded,
    Rejected,
    /// A request-level fault; `held`: the answer was held back (a timeout).
    Fault {
        held: bool,
    },
}

/// The mock provider's model: outage windows, account limits, fault dice.
struct Provider<'a> {
    config: &'a MockConfig,
    rng: StdRng,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    inputs_received: u64,
    input_outage_began: Option<Micros>,
    failed: u64,
    over_limit: u64,
}

impl<'a> Provider<'a> {
    fn new(config: &'a MockConfig) -> Self {
        Provider {
            config,
            rng: StdRng::seed_from_u64(config.seed),
            requests: config.rpm_limit.filter(|&n| n > 0).map(|n| Bucket::new(n, config.limit_window_ms)),
            tokens: config.tpm_limit.filter(|&n| n > 0).map(|n| Bucket::new(n, config.limit_window_ms)),
            inputs_received: 0,
            input_outage_began: None,
            failed: 0,
            over_limit: 0,
        }
    }

    /// The end of every configured outage window (0 if none has begun or none is set).
    fn outage_over_at(&self) -> Micros {
        let c = self.config;
        let by_time = c.outage_after_ms.map_or(0, |a| (a + c.outage_for_ms) * 1000);
        let by_inputs = self.input_outage_began.map_or(0, |b| b + c.outage_for_ms * 1000);
        by_time.max(by_inputs)
    }

    fn answer(&mut self, now: Micros, input: SeedInput) -> Answer {
        let c = self.config;
        let before = self.inputs_received;
        self.inputs_received += 1;
        if c.outage_after_inputs.is_some_and(|n| before >= n) && self.input_outage_began.is_none() {
            self.input_outage_began = Some(now);
        }
        let for_us = c.outage_for_ms * 1000;
        let in_window = c.outage_after_ms.is_some_and(|a| now >= a * 1000 && now < a * 1000 + for_us);
        let in_input_window = self.input_outage_began.is_some_and(|b| now < b + for_us);
        if in_window || in_input_window {
            return self.fault(false);
        }
        if self.requests.is_some() || self.tokens.is_some() {
            let tokens = input.tokens() as f64;
            let mut fits = true;
            if let Some(b) = &mut self.requests {
                b.refill(now);
                fits &= b.has(1.0);
            }
            if let Some(b) = &mut self.tokens {
                b.refill(now);
                fits &= b.has(tokens);
            }
            if !fits {
                self.over_limit += 1;
                return self.fault(false);
            }
            if let Some(b) = &mut self.requests {
                b.level -= 1.0;
            }
            if let Some(b) = &mut self.tokens {
                b.level -= tokens.min(b.capacity);
            }
        }
        if matches!(input, SeedInput::Poison { .. }) {
            return Answer::Rejected;
        }
        let x: f64 = self.rng.random();
        let mut edge = c.rate_429 + c.rate_5xx;
        if x < edge {
            if x >= c.rate_429 {
                // The mock picks one of 500/502/503: one draw, as it does.
                let _: usize = self.rng.random_range(0..3);
            }
            return self.fault(false);
        }
        edge += c.rate_timeout;
        if x < edge {
            return self.fault(true);
        }
        edge += c.rate_reset;
        if x < edge {
            return self.fault(false);
        }
        Answer::Embedded
    }

    fn fault(&mut self, held: bool) -> Answer {
        self.failed += 1;
        Answer::Fault { held }
    }
}

/// A chunk in the hands of a worker: which one, and the attempts of this `embed_with_retry`.
#[derive(Debug, Clone, Copy)]
struct InHand {
    chunk: usize,
    attempt: u32,
}

/// A transient DLQ row of the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct ParkedRow {
    next_retry_at: Micros,
    chunk: usize,
    passes: u32,
}

/// Runs the seed's design over `inputs` against `provider` and counts what it sends.
pub fn simulate(design: &SeedDesign, provider: &MockConfig, inputs: &[SeedInput]) -> SeedOutcome {
    let mut sim = Sim {
        design,
        inputs,
        provider: Provider::new(provider),
        jitter: StdRng::seed_from_u64(provider.seed ^ 0x5eed),
        out: SeedOutcome::default(),
        parked: BinaryHeap::new(),
    };
    sim.ingest();
    sim.replay();
    sim.out.failed_requests = sim.provider.failed;
    sim.out.over_limit = sim.provider.over_limit;
    sim.out
}

struct Sim<'a> {
    design: &'a SeedDesign,
    inputs: &'a [SeedInput],
    provider: Provider<'a>,
    jitter: StdRng,
    out: SeedOutcome,
    parked: BinaryHeap<Reverse<ParkedRow>>,
}

/// What one attempt led to.
enum Step {
    /// The chunk is settled (stored or parked); the worker is free at this time.
    Done(Micros),
    /// Try again at this time.
    Again(Micros),
}

impl Sim<'_> {
    /// One attempt of `embed_with_retry` at `now`; parks or stores the chunk when settled.
    fn attempt(&mut self, now: Micros, hand: &mut InHand, replay: Option<u32>) -> Step {
        let d = self.design;
        if replay.is_some() {
            self.out.replay_requests += 1;
        } else {
            self.out.ingest_requests += 1;
        }
        let answer = self.provider.answer(now, self.inputs[hand.chunk]);
        let took = match answer {
            Answer::Fault { held: true } => micros(self.provider.config.timeout_hold_ms as f64 / 1000.0)
                .min(micros(d.client_timeout_secs)),
            _ => micros(d.latency_secs),
        };
        let done = now + took;
        match answer {
            Answer::Embedded => {
                self.out.stored += 1;
                Step::Done(done)
            }
            Answer::Rejected => {
                self.out.parked_permanent += 1;
                Step::Done(done)
            }
            Answer::Fault { .. } => {
                // The seed sleeps after every failure, the last one included.
                let ceiling = (d.base_secs * d.factor.powi(hand.attempt as i32)).min(d.cap_secs);
                let slept = done + micros(self.jitter.random::<f64>() * ceiling);
                hand.attempt += 1;
                if hand.attempt < d.max_retries {
                    return Step::Again(slept);
                }
                let delay = (d.base_secs * d.factor.powi(d.max_retries as i32)).min(d.cap_secs);
                let passes = replay.map_or(0, |p| p + 1);
                if replay.is_none() {
                    self.out.parked_transient += 1;
                }
                self.parked.push(Reverse(ParkedRow {
                    next_retry_at: slept + micros(delay),
                    chunk: hand.chunk,
                    passes,
                }));
                Step::Done(slept)
            }
        }
    }

    /// `workers` coroutines draining the chunk queue.
    fn ingest(&mut self) {
        let mut queue: VecDeque<usize> = (0..self.inputs.len()).collect();
        // (time, worker): when each worker acts next.
        let mut ready: BinaryHeap<Reverse<(Micros, usize)>> =
            (0..self.design.workers.max(1)).map(|w| Reverse((0, w))).collect();
        let mut hands: Vec<Option<InHand>> = vec![None; self.design.workers.max(1)];
        let mut end = 0;
        while let Some(Reverse((now, w))) = ready.pop() {
            end = end.max(now);
            let mut hand = match hands[w].take() {
                Some(h) => h,
                None => match queue.pop_front() {
                    Some(chunk) => InHand { chunk, attempt: 0 },
                    None => continue,
                },
            };
            match self.attempt(now, &mut hand, None) {
                Step::Done(t) => ready.push(Reverse((t, w))),
                Step::Again(t) => {
                    hands[w] = Some(hand);
                    ready.push(Reverse((t, w)));
                }
            }
        }
        self.out.ingest_secs = end as f64 / 1e6;
    }

    /// The replay job, once the ingest is done and any outage is over: rows in
    /// `next_retry_at` order, one at a time, each through `embed_with_retry`. Every row is
    /// taken as soon as the job gets to it, without waiting for its `next_retry_at` (as the
    /// benchmark makes embed-dlq's parked rows due at once): the count of requests is what
    /// matters here, not when they are sent.
    fn replay(&mut self) {
        let mut now = micros(self.out.ingest_secs).max(self.provider.outage_over_at());
        while let Some(Reverse(row)) = self.parked.pop() {
            if row.passes >= self.design.max_replay_passes {
                self.out.left_parked += 1;
                continue;
            }
            let mut hand = InHand { chunk: row.chunk, attempt: 0 };
            loop {
                match self.attempt(now, &mut hand, Some(row.passes)) {
                    Step::Done(t) => {
                        now = t;
                        break;
                    }
                    Step::Again(t) => now = t,
                }
            }
        }
        self.out.total_secs = (now as f64 / 1e6).max(self.out.ingest_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(n: usize) -> Vec<SeedInput> {
        vec![SeedInput::Clean { tokens: 75 }; n]
    }

    #[test]
    fn without_faults_every_chunk_costs_one_request() {
        let out = simulate(&SeedDesign::default(), &MockConfig::default(), &clean(1000));
        assert_eq!((out.ingest_requests, out.replay_requests, out.stored), (1000, 0, 1000));
        assert_eq!((out.failed_requests, out.parked_transient, out.left_parked), (0, 0, 0));
    }

    #[test]
    fn poison_costs_its_own_request_once() {
        let mut inputs = clean(1000);
        for i in (100..1000).step_by(200) {
            inputs[i] = SeedInput::Poison { tokens: 75 };
        }
        let out = simulate(&SeedDesign::default(), &MockConfig::default(), &inputs);
        assert_eq!((out.requests(), out.stored, out.parked_permanent), (1000, 995, 5));
    }

    /// With faults at rate p on every request, a chunk costs 1/(1-p) requests on average:
    /// retries up to 6 attempts, and the replay job's passes for the rare chunk that fails
    /// six times.
    #[test]
    fn random_faults_cost_the_geometric_mean_of_attempts() {
        let faults = MockConfig {
            rate_429: 0.05,
            rate_5xx: 0.08,
            rate_timeout: 0.005,
            rate_reset: 0.02,
            ..MockConfig::default()
        };
        let out = simulate(&SeedDesign::default(), &faults, &clean(50_000));
        assert_eq!((out.stored, out.left_parked), (50_000, 0));
        let p = out.failed_requests as f64 / out.requests() as f64;
        assert!((p - 0.155).abs() < 0.005, "{p}");
        let per_chunk = out.requests() as f64 / out.stored as f64;
        assert!((per_chunk - 1.0 / (1.0 - 0.155)).abs() < 0.01, "{per_chunk}");
        assert_eq!(out, simulate(&SeedDesign::default(), &faults, &clean(50_000)), "deterministic");
    }

    /// A 60 s outage costs each worker about two chunks of six attempts (the sleeps after
    /// them add up to 31.5 s on average); the replay job stores those chunks afterwards.
    #[test]
    fn an_outage_parks_a_few_chunks_per_worker_and_replay_stores_them() {
        let outage =
            MockConfig { outage_after_inputs: Some(500), outage_for_ms: 60_000, ..MockConfig::default() };
        let design = SeedDesign::default();
        let out = simulate(&design, &outage, &clean(1000));
        assert_eq!((out.stored, out.left_parked), (1000, 0));
        assert!(out.parked_transient >= 4 && out.parked_transient <= 20, "{out:?}");
        assert_eq!(out.replay_requests, out.parked_transient, "the provider is back for the replay");
        // Six requests per parked chunk; the chunk each worker had in hand when the provider
        // came back cost it at most five failed ones more.
        let extra = out.ingest_requests - (1000 + 5 * out.parked_transient);
        assert!(extra <= 5 * design.workers as u64, "{out:?}");
        assert!(out.ingest_secs >= 60.0, "{out:?}");
    }

    /// Over an account's limit the 429s are faults like any other: the seed retries them on
    /// its own schedule (never the provider's `Retry-After`).
    #[test]
    fn an_account_limit_far_below_demand_is_met_with_429s() {
        let account = MockConfig { rpm_limit: Some(600), limit_window_ms: 1_000, ..MockConfig::default() };
        let out = simulate(&SeedDesign::default(), &account, &clean(300));
        assert_eq!(out.stored, 300);
        assert!(out.over_limit > 0 && out.over_limit == out.failed_requests, "{out:?}");
        assert!(out.ingest_secs >= 300.0 / 10.0 - 1.0, "at most 10 a second: {out:?}");
    }
}
