//! Pool-wide admission to the provider: one shared rate-limit pause and one circuit breaker.
//!
//! A 429 with Retry-After pauses *every* worker until the server's time, instead of each
//! worker hammering the provider on its own schedule. A run of consecutive transient failures
//! (an outage) opens the breaker: no new request starts until the cooldown ends, then one
//! probe goes out; its success closes the breaker, its failure reopens it with a longer
//! cooldown. An outage longer than `max_outage` ends the run with a clear error instead of
//! parking the whole corpus.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Breaker tuning; defaults suit a remote API.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive transient request failures (rate limits excluded) that open the breaker.
    pub failure_threshold: u32,
    /// First open period; doubled after each failed probe up to `max_cooldown`.
    pub cooldown: Duration,
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

/// Observable breaker state (exported as a gauge later: 0 closed, 1 half-open, 2 open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
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
}

/// Why admission was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GateError {
    #[error("shutting down")]
    Cancelled,
    #[error("provider unavailable for longer than {0:?} (circuit breaker open)")]
    Outage(Duration),
}

/// A granted request slot; report its outcome with [`ProviderGate::record`].
#[derive(Debug)]
#[must_use]
pub struct Permit {
    probe: bool,
}

/// What a request's outcome says about the provider's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Health {
    /// The provider answered (success or a rejection of the input).
    Responsive,
    /// Told to slow down; pause everyone for this long.
    RateLimited(Option<Duration>),
    /// Timeout, connection error or 5xx.
    Failing,
}

/// Shared by all workers of a run.
#[derive(Debug)]
pub struct ProviderGate {
    config: BreakerConfig,
    state: Mutex<State>,
}

impl ProviderGate {
    pub fn new(config: BreakerConfig) -> Self {
        ProviderGate {
            config,
            state: Mutex::new(State {
                paused_until: None,
                consecutive_failures: 0,
                breaker: Breaker::Closed,
                opened_count: 0,
            }),
        }
    }

    /// Current breaker state.
    pub fn breaker_state(&self) -> BreakerState {
        match self.state.lock().unwrap().breaker {
            Breaker::Closed => BreakerState::Closed,
            Breaker::Open { .. } => BreakerState::Open,
            Breaker::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// How many times the breaker has opened in this run.
    pub fn times_opened(&self) -> u64 {
        self.state.lock().unwrap().opened_count
    }

    /// Waits until a request may be sent: after any rate-limit pause, and, with the breaker
    /// open, until it is this caller's turn to probe.
    pub async fn admit(&self, cancel: &CancellationToken) -> Result<Permit, GateError> {
        loop {
            let wake = {
                let mut st = self.state.lock().unwrap();
                let now = Instant::now();
                match st.breaker {
                    Breaker::Open { since, .. } | Breaker::HalfOpen { since, .. }
                        if now.duration_since(since) > self.config.max_outage =>
                    {
                        return Err(GateError::Outage(self.config.max_outage));
                    }
                    _ => {}
                }
                match st.paused_until {
                    Some(t) if t > now => t,
                    _ => match st.breaker {
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
    pub fn record(&self, permit: Permit, health: Health) {
        self.record_inner(permit, health);
        let state = match self.breaker_state() {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        };
        metrics::gauge!(crate::metrics::BREAKER_STATE).set(state);
    }

    fn record_inner(&self, permit: Permit, health: Health) {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        match health {
            Health::Responsive => {
                st.consecutive_failures = 0;
                st.breaker = Breaker::Closed;
            }
            Health::RateLimited(wait) => {
                if let Some(wait) = wait {
                    let until = now + wait.min(self.config.max_cooldown);
                    st.paused_until = Some(st.paused_until.map_or(until, |p| p.max(until)));
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
            let p = gate.admit(&cancel).await.unwrap();
            gate.record(p, Health::Failing);
        }
        assert_eq!(gate.breaker_state(), BreakerState::Open);
        let start = Instant::now();
        let probe = gate.admit(&cancel).await.unwrap();
        assert!(probe.probe);
        assert!(Instant::now() - start >= Duration::from_secs(1), "waited out the cooldown");
        assert_eq!(gate.breaker_state(), BreakerState::HalfOpen);
        // A second caller must wait while the probe is out.
        let waiting = tokio::time::timeout(Duration::from_millis(500), gate.admit(&cancel)).await;
        assert!(waiting.is_err());
        gate.record(probe, Health::Responsive);
        assert_eq!(gate.breaker_state(), BreakerState::Closed);
        let p = gate.admit(&cancel).await.unwrap();
        assert!(!p.probe);
        gate.record(p, Health::Responsive);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probe_doubles_cooldown_and_long_outage_gives_up() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        for _ in 0..3 {
            let p = gate.admit(&cancel).await.unwrap();
            gate.record(p, Health::Failing);
        }
        let mut result = Ok(());
        for _ in 0..100 {
            match gate.admit(&cancel).await {
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
    async fn rate_limit_pauses_everyone() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel).await.unwrap();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(3))));
        let start = Instant::now();
        let p = gate.admit(&cancel).await.unwrap();
        assert!(Instant::now() - start >= Duration::from_secs(3));
        gate.record(p, Health::Responsive);
        assert_eq!(gate.breaker_state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn cancel_interrupts_a_wait() {
        let gate = ProviderGate::new(cfg());
        let cancel = CancellationToken::new();
        let p = gate.admit(&cancel).await.unwrap();
        gate.record(p, Health::RateLimited(Some(Duration::from_secs(3))));
        cancel.cancel();
        assert_eq!(gate.admit(&cancel).await.unwrap_err(), GateError::Cancelled);
    }
}
