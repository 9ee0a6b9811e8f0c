//! Telling "this input is bad" from "the provider rejects everything" with a canary input.
//!
//! A provider that rejects every request alike — a `dimensions` value out of range, a gateway
//! that answers a wrong key with 400, a model that returns vectors of the wrong size, or NaN
//! or all-zero vectors, for everything — would otherwise have every batch split down to
//! single inputs and the whole corpus parked as the inputs' fault. So a rejection is *suspicious* when this run has had no success yet for the
//! target, or after [`SUSPICIOUS_STREAK`] rejections in a row; a suspicious rejection is
//! checked once with [`CANARY_TEXT`], a short input any model accepts:
//! - the canary is embedded: the provider is fine, the input really is bad (cached);
//! - the canary is rejected too (or has a wrong dimension, or an invalid vector): the run
//!   stops as systemic and nothing is parked (cached for [`SYSTEMIC_VERDICT_TTL`], so that a
//!   long-lived `serve` notices when the provider is fixed);
//! - the canary cannot get an answer (timeouts, 5xx): inconclusive, the input is parked as
//!   transient so that a later replay decides.
//!
//! One [`CanaryBook`] per run (it lives in the shared [`super::gate::ProviderGate`]), keyed by
//! target (model, requested dimensions, column dimension) and error signature. Checks are
//! serialised: concurrent workers wait for the one verdict instead of each bisecting their
//! batch. Cost: at most one canary per signature, plus one per [`SUSPICIOUS_STREAK`]
//! rejections that follow a success, plus one per [`SYSTEMIC_VERDICT_TTL`] while systemic.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::Stop;

/// The canary input: as short and plain as text gets, so that no length limit, however strict,
/// rejects it while accepting real chunks.
pub(crate) const CANARY_TEXT: &str = "hello world";
/// Consecutive rejections (no success in between) that make the next one suspicious again
/// after the run has had successes: a provider can start rejecting everything mid-run (a
/// revoked key behind a gateway).
pub(crate) const SUSPICIOUS_STREAK: u32 = 8;
/// How long a systemic verdict is trusted before another canary is sent.
pub(crate) const SYSTEMIC_VERDICT_TTL: Duration = Duration::from_secs(60);
/// Targets remembered per run (a `serve` replays into a handful of tables); beyond it the
/// book starts over.
const MAX_TARGETS: usize = 64;
/// Signatures remembered per target; beyond it that target's verdicts start over.
const MAX_SIGNATURES: usize = 64;

/// What a failure looks like, for "the same error on every input": status and error type
/// (never the server's message text), a response that does not line up with its inputs, our
/// own description of a wrong vector length, or the reason code of an invalid vector
/// (`non_finite`, `zero_vector`, `empty_vector`, `bad_base64`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Signature {
    Status { status: u16, error_type: Option<String> },
    Mismatch,
    Dimension(String),
    InvalidVector(super::Reason),
}

/// Where vectors go: verdicts for one target say nothing about another.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Target {
    pub model: String,
    pub request_dimensions: Option<usize>,
    pub dimensions: usize,
}

#[derive(Debug, Clone)]
enum Cached {
    /// The canary was embedded; valid until the target has another success (after which a
    /// new streak of rejections is needed to make the signature suspicious again).
    InputFault {
        at_successes: u64,
    },
    Systemic {
        at: Instant,
        stop: Stop,
    },
}

#[derive(Debug, Default)]
struct TargetHealth {
    /// Responses with at least one usable vector.
    successes: u64,
    /// Rejections since the last success.
    streak: u32,
    verdicts: HashMap<Signature, Cached>,
}

/// What to do with a failure.
#[derive(Debug)]
pub(crate) enum Consult {
    /// Treat it as the input's fault (split or park).
    Proceed,
    /// The provider rejects everything: stop.
    Stop(Stop),
    /// Ask the canary.
    RunCanary,
}

/// The canary's answer.
#[derive(Debug, Clone)]
pub(crate) enum CanaryVerdict {
    InputFault,
    Systemic(Stop),
}

/// The run's knowledge of the provider as a whole; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct CanaryBook {
    state: Mutex<HashMap<Target, TargetHealth>>,
    /// Held while a canary check runs, so that concurrent workers wait for its verdict.
    pub(crate) check: tokio::sync::Mutex<()>,
}

impl CanaryBook {
    fn with<R>(&self, target: &Target, f: impl FnOnce(&mut TargetHealth) -> R) -> R {
        let mut st = self.state.lock().unwrap();
        if !st.contains_key(target) && st.len() >= MAX_TARGETS {
            st.clear();
        }
        f(st.entry(target.clone()).or_default())
    }

    /// A response with at least one usable vector.
    pub(crate) fn record_success(&self, target: &Target) {
        self.with(target, |h| {
            h.successes += 1;
            h.streak = 0;
        });
    }

    /// A request rejected as the input's fault.
    pub(crate) fn record_rejection(&self, target: &Target) {
        self.with(target, |h| h.streak = h.streak.saturating_add(1));
    }

    /// Whether the target has had a usable vector in this run.
    pub(crate) fn has_success(&self, target: &Target) -> bool {
        self.with(target, |h| h.successes > 0)
    }

    /// Decides about a failure with `signature`; `force` makes it suspicious whatever the
    /// history (a multi-input response whose vectors are all the same wrong length).
    pub(crate) fn consult(&self, target: &Target, signature: &Signature, force: bool) -> Consult {
        self.with(target, |h| {
            let suspicious = force || h.successes == 0 || h.streak >= SUSPICIOUS_STREAK;
            if !suspicious {
                return Consult::Proceed;
            }
            match h.verdicts.get(signature) {
                Some(Cached::Systemic { at, stop }) if at.elapsed() < SYSTEMIC_VERDICT_TTL => {
                    Consult::Stop(stop.clone())
                }
                Some(Cached::InputFault { at_successes }) if *at_successes == h.successes => Consult::Proceed,
                _ => Consult::RunCanary,
            }
        })
    }

    /// Records the canary's verdict for `signature`.
    pub(crate) fn store(&self, target: &Target, signature: Signature, verdict: &CanaryVerdict) {
        self.with(target, |h| {
            if h.verdicts.len() >= MAX_SIGNATURES && !h.verdicts.contains_key(&signature) {
                h.verdicts.clear();
            }
            let cached = match verdict {
                CanaryVerdict::InputFault => Cached::InputFault { at_successes: h.successes },
                CanaryVerdict::Systemic(stop) => Cached::Systemic { at: Instant::now(), stop: stop.clone() },
            };
            h.verdicts.insert(signature, cached);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target { model: "m".into(), request_dimensions: None, dimensions: 4 }
    }

    fn sig() -> Signature {
        Signature::Status { status: 400, error_type: None }
    }

    #[tokio::test(start_paused = true)]
    async fn suspicion_and_cached_verdicts() {
        let book = CanaryBook::default();
        let t = target();
        assert!(matches!(book.consult(&t, &sig(), false), Consult::RunCanary), "no success yet");
        book.store(&t, sig(), &CanaryVerdict::InputFault);
        assert!(matches!(book.consult(&t, &sig(), false), Consult::Proceed), "cached");
        book.record_success(&t);
        for _ in 0..SUSPICIOUS_STREAK - 1 {
            book.record_rejection(&t);
        }
        assert!(matches!(book.consult(&t, &sig(), false), Consult::Proceed), "short streak");
        book.record_rejection(&t);
        assert!(
            matches!(book.consult(&t, &sig(), false), Consult::RunCanary),
            "a streak after a success asks again"
        );
        let stop = Stop::Systemic { reason: crate::embed::Reason::UniformRejection, detail: "x".into() };
        book.store(&t, sig(), &CanaryVerdict::Systemic(stop.clone()));
        assert!(matches!(book.consult(&t, &sig(), false), Consult::Stop(s) if s == stop));
        tokio::time::advance(SYSTEMIC_VERDICT_TTL + Duration::from_secs(1)).await;
        assert!(matches!(book.consult(&t, &sig(), false), Consult::RunCanary), "systemic verdicts expire");
        let other = Target { dimensions: 8, ..target() };
        assert!(!book.has_success(&other), "targets are apart");
    }
}
