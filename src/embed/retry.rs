//! *When* to try again, kept apart from *whether* to (see `super::classify`).
//!
//! Two schedules: [`RetryPolicy`] for the few in-process retries of a request, and
//! [`DlqSchedule`] for parked work, which waits much longer between passes and is persisted
//! as `next_retry_at` rather than slept on.

use std::time::Duration;

use rand::RngExt;

/// Capped exponential backoff with full jitter for in-process retries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first included. After the last one the batch is parked at once
    /// (no sleep after the final attempt).
    pub max_attempts: u32,
    /// Ceiling of the first sleep.
    pub base: Duration,
    /// Growth of the ceiling per failed attempt (2.0 doubles it).
    pub factor: f64,
    /// Upper bound of one backoff; also bounds a server's Retry-After (which gets up to one
    /// backoff of jitter on top, so no sleep is longer than twice this).
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(500),
            factor: 2.0,
            cap: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The ceiling of the sleep after failed attempt `attempt` (1-based): base·factor^(n-1),
    /// saturating at `cap`.
    pub(crate) fn ceiling(&self, attempt: u32) -> Duration {
        exp_ceiling(self.base, self.factor, self.cap, attempt)
    }

    /// The sleep after failed attempt `attempt`: uniform in [0, ceiling] (full jitter), so a
    /// fleet of workers hit by one outage does not come back in lockstep.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        jitter(self.ceiling(attempt))
    }

    /// Whether another attempt is allowed after `attempt` attempts have failed.
    pub(crate) fn allows_another(&self, attempt: u32) -> bool {
        attempt < self.max_attempts
    }

    /// The wait before the next attempt. A server-provided Retry-After is a floor, not a
    /// schedule: the wait is what it asked (at most `cap`) plus this attempt's full-jitter
    /// backoff, so the requests one 429 turned away do not all come back at the instant the
    /// server named (a new 429 storm). Never shorter than it asked (up to `cap`), never
    /// longer than twice `cap`.
    pub(crate) fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(ra) => ra.min(self.cap) + self.backoff(attempt),
            None => self.backoff(attempt),
        }
    }
}

/// The schedule of parked, replayable work: much longer than the in-process one, persisted as
/// `next_retry_at` so nothing sleeps while holding a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DlqSchedule {
    /// Delay before the first replay of a parked row.
    pub base: Duration,
    /// Growth of the delay per replay pass.
    pub factor: f64,
    /// Longest delay between two replay passes.
    pub cap: Duration,
    /// Replay passes before a row is marked exhausted.
    pub max_replays: u32,
}

impl Default for DlqSchedule {
    fn default() -> Self {
        DlqSchedule {
            base: Duration::from_secs(60),
            factor: 2.0,
            cap: Duration::from_secs(6 * 3600),
            max_replays: 8,
        }
    }
}

impl DlqSchedule {
    /// Delay before replay pass `replays + 1` of a row that has had `replays` passes: half the
    /// ceiling plus up to half again of jitter ("equal jitter"), so parked work is never due
    /// immediately after it was parked, yet a burst of parks spreads out.
    pub(crate) fn delay(&self, replays: u32) -> Duration {
        let ceiling = exp_ceiling(self.base, self.factor, self.cap, replays.saturating_add(1));
        let half = ceiling / 2;
        half + jitter(half)
    }
}

fn exp_ceiling(base: Duration, factor: f64, cap: Duration, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(64) as i32;
    let secs = base.as_secs_f64() * factor.max(1.0).powi(exp);
    if !secs.is_finite() || secs >= cap.as_secs_f64() { cap } else { Duration::from_secs_f64(secs) }
}

/// Capped exponential backoff with full jitter for the loops that reconnect to Postgres or
/// Redis (the relay, the replayers, the republisher of lost events): without jitter every
/// `serve` host retries a restarted database at the same instants, and they all hit it
/// together the moment it is back.
#[derive(Debug, Clone)]
pub(crate) struct Reconnect {
    first: Duration,
    cap: Duration,
    ceiling: Duration,
}

impl Reconnect {
    /// A backoff whose ceiling starts at `first` and doubles up to `cap`.
    pub(crate) fn new(first: Duration, cap: Duration) -> Self {
        Reconnect { first, cap, ceiling: first }
    }

    /// The wait before the next try: uniform in [0, ceiling] (full jitter); the ceiling then
    /// doubles, up to `cap`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = jitter(self.ceiling);
        self.ceiling = self.ceiling.saturating_mul(2).min(self.cap);
        delay
    }

    /// After a success: the next failure starts from `first` again.
    pub(crate) fn reset(&mut self) {
        self.ceiling = self.first;
    }
}

/// Uniform in [0, ceiling]: the random part of every wait here and of the gate's pauses.
pub(crate) fn jitter(ceiling: Duration) -> Duration {
    if ceiling.is_zero() {
        return ceiling;
    }
    let frac: f64 = rand::rng().random::<f64>();
    ceiling.mul_f64(frac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_waits_are_jittered_under_a_doubling_capped_ceiling() {
        let mut r = Reconnect::new(Duration::from_millis(100), Duration::from_secs(5));
        let ceilings = [100u64, 200, 400, 800, 1600, 3200, 5000, 5000];
        for c in ceilings {
            let d = r.next_delay();
            assert!(d <= Duration::from_millis(c), "{d:?} > {c} ms");
        }
        // Hosts failing together do not come back together: full jitter.
        let draws: Vec<Duration> = (0..2_000)
            .map(|_| {
                let mut r = Reconnect::new(Duration::from_secs(5), Duration::from_secs(5));
                r.next_delay()
            })
            .collect();
        assert_full_jitter(&draws, Duration::from_secs(5));
        r.reset();
        assert!(r.next_delay() <= Duration::from_millis(100), "reset starts over");
    }
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn backoff_stays_within_zero_and_cap(
            base_ms in 0u64..10_000,
            factor in 1.0f64..10.0,
            cap_ms in 0u64..120_000,
            attempt in 1u32..200,
        ) {
            let p = RetryPolicy {
                max_attempts: 10,
                base: Duration::from_millis(base_ms),
                factor,
                cap: Duration::from_millis(cap_ms),
            };
            let ceiling = p.ceiling(attempt);
            prop_assert!(ceiling <= p.cap);
            let b = p.backoff(attempt);
            prop_assert!(b <= ceiling);
        }

        #[test]
        fn ceiling_never_decreases(attempt in 1u32..100) {
            let p = RetryPolicy::default();
            prop_assert!(p.ceiling(attempt) <= p.ceiling(attempt + 1));
        }

        #[test]
        fn retry_after_is_a_floor_with_at_most_one_backoff_on_top(ra_ms in 0u64..100_000, attempt in 1u32..10) {
            let p = RetryPolicy::default();
            let ra = Duration::from_millis(ra_ms);
            let d = p.delay(attempt, Some(ra));
            prop_assert!(d >= ra.min(p.cap));
            prop_assert!(d <= ra.min(p.cap) + p.ceiling(attempt));
            prop_assert!(d <= p.cap * 2);
        }

        #[test]
        fn dlq_delay_is_positive_and_capped(replays in 0u32..1000) {
            let s = DlqSchedule::default();
            let d = s.delay(replays);
            prop_assert!(d >= s.base.min(s.cap) / 2);
            prop_assert!(d <= s.cap);
        }
    }

    #[test]
    fn first_ceiling_is_base_and_grows_by_factor() {
        let p = RetryPolicy {
            max_attempts: 4,
            base: Duration::from_millis(100),
            factor: 3.0,
            cap: Duration::from_secs(1),
        };
        assert_eq!(p.ceiling(1), Duration::from_millis(100));
        assert_eq!(p.ceiling(2), Duration::from_millis(300));
        assert_eq!(p.ceiling(3), Duration::from_millis(900));
        assert_eq!(p.ceiling(4), Duration::from_secs(1));
        assert!(p.allows_another(3));
        assert!(!p.allows_another(4));
    }

    #[test]
    fn requests_turned_away_by_one_retry_after_come_back_spread_out() {
        // Fifty requests got `Retry-After: 1`: resending all of them at the same instant
        // would earn the next 429 together.
        let p = RetryPolicy::default();
        let ra = Duration::from_secs(1);
        let waits: Vec<Duration> = (0..50).map(|_| p.delay(1, Some(ra))).collect();
        assert!(waits.iter().all(|w| *w >= ra), "{waits:?}");
        let spread = *waits.iter().max().unwrap() - *waits.iter().min().unwrap();
        assert!(spread >= p.ceiling(1) / 4, "resent within {spread:?} of each other: {waits:?}");
    }

    /// Full jitter is uniform over `[0, ceiling]`: about half the draws below the middle,
    /// some near zero and some near the ceiling. A fixed wait, or "equal jitter" (half the
    /// ceiling plus a random half), fails it; a false failure over 2,000 draws is beyond
    /// nine standard deviations.
    fn assert_full_jitter(draws: &[Duration], ceiling: Duration) {
        let below_half = draws.iter().filter(|d| **d < ceiling / 2).count() as f64 / draws.len() as f64;
        assert!((0.4..=0.6).contains(&below_half), "{below_half} of the draws below half the ceiling");
        assert!(draws.iter().any(|d| *d < ceiling / 10), "no draw near zero");
        assert!(draws.iter().any(|d| *d > ceiling * 9 / 10), "no draw near the ceiling");
        assert!(draws.iter().all(|d| *d <= ceiling), "a draw above the ceiling");
    }

    #[test]
    fn backoff_is_full_jitter_under_its_ceiling() {
        let p = RetryPolicy::default();
        let draws: Vec<Duration> = (0..2_000).map(|_| p.backoff(3)).collect();
        assert_full_jitter(&draws, p.ceiling(3));
    }
}
