//! Embedding one batch of chunks: request, classify, retry, isolate.
//!
//! [`Embedder::embed_batch`] turns a batch into one [`ItemOutcome`] per chunk. Transient
//! failures are retried on the [`RetryPolicy`] schedule through the shared [`ProviderGate`];
//! an input rejection on a batch splits it in halves until the guilty input stands alone, so
//! one poison input never fails its neighbours (so does a 500 that outlives the retries:
//! some servers fail one input with 500 forever); a systemic error stops the run without
//! charging any chunk for it.
//!
//! Systemic is a pattern as much as a status code: a rejection (or a wrong vector size) that
//! may be the provider's rather than the input's is confirmed with a canary input first
//! (`canary`), so a provider that rejects everything stops the run instead of having the
//! corpus bisected and parked. Isolating a 500 costs one request per split level, and its
//! failures are reported to the gate as `Health::InputSuspect`: an input that fails alone
//! while its neighbours succeed never feeds the breaker, and the breaker's probe is a canary,
//! never the batch that tripped it.

pub(crate) mod canary;
pub(crate) mod classify;
pub mod client;
pub mod gate;
pub mod retry;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::model::ErrorClass;
use canary::{CANARY_TEXT, CanaryVerdict, Consult, Signature, Target};
use classify::{Verdict, classify};
use client::{EmbedClient, EmbedError};
use gate::{GateError, Health, Permit, ProviderGate};
use retry::RetryPolicy;

/// What happened to one input of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemOutcome {
    /// A usable vector of the configured dimension, ready to store.
    Embedded(Vec<f32>),
    /// No vector: the input is to be parked with this failure.
    Failed(Failure),
    /// Shutdown came before the first attempt: nothing was spent, nothing is recorded, and a
    /// rerun picks the chunk up.
    NotAttempted,
}

/// A failure to park: everything the DLQ row needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The DLQ class, which decides whether replay may try the input again.
    pub class: ErrorClass,
    /// Bounded reason code (e.g. `http_503`, `timeout`, `too_long`).
    pub reason: &'static str,
    /// Sanitised, truncated detail.
    pub detail: String,
    /// The last HTTP status, when the failure came from a response.
    pub status: Option<u16>,
    /// Provider attempts spent on this input in this pass.
    pub attempts: u32,
}

/// The run cannot go on: not the chunks' fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Stop {
    /// The provider refused a request in a way no retry fixes (bad key, no quota, unknown model,
    /// wrong URL).
    #[error("provider refused the run ({reason}): {detail}")]
    Systemic {
        /// Bounded reason code (e.g. `unauthorized`, `insufficient_quota`, `not_found`).
        reason: &'static str,
        /// Sanitised detail from the provider's answer.
        detail: String,
    },
    /// The circuit breaker stayed open longer than the configured maximum outage; the message
    /// says how long and what to do.
    #[error("{0}")]
    Outage(String),
}

/// Counters of one batch, merged into the run's summary.
#[derive(Debug, Default, Clone)]
pub struct BatchStats {
    /// Requests sent, canaries included.
    pub provider_calls: u64,
    /// Inputs sent over all requests, retries and splits included (what the provider bills).
    pub provider_inputs: u64,
    /// `usage.total_tokens` summed over the responses (informative: some providers count
    /// characters).
    pub reported_tokens: u64,
    /// Times a rejected batch was split in two to find the input at fault.
    pub splits: u64,
    /// Attempts that were followed by another attempt, by reason.
    pub retries: BTreeMap<&'static str, u64>,
    /// Canary requests (breaker probes and systemic checks), included in `provider_calls`.
    pub canary_calls: u64,
}

/// Client + classifier + policy + shared gate; one per run, shared by all workers.
#[derive(Clone)]
pub struct Embedder {
    /// The HTTP client of the provider.
    pub client: EmbedClient,
    /// Breaker, rate-limit pause and canary history, shared by every worker that uses this
    /// embedder, so they pause and trip together.
    pub gate: Arc<ProviderGate>,
    /// In-process retries of transient failures before an input is parked.
    pub policy: RetryPolicy,
    /// Dimension of the target column; every vector is checked against it.
    pub dimensions: usize,
}

/// Why no request may be sent.
enum Halt {
    Cancelled,
    Stop(Stop),
}

/// Outcome of checking a failure with the canary.
enum Checked {
    /// The provider embeds a known-good input: the failure is the input's.
    InputFault,
    /// No verdict (the canary could not get an answer, or shutdown): park as transient.
    Inconclusive(String),
}

/// A range of the batch still to embed. `isolating`: it comes from splitting a batch that
/// kept failing with 500, so a 500 on it is evidence against one of its inputs.
struct Piece {
    range: Range<usize>,
    isolating: bool,
}

impl Embedder {
    /// Embeds `texts`, returning one outcome per text (same order) or the reason the whole run
    /// must stop. `cancel` interrupts backoff waits: inputs already attempted are then
    /// reported as transient failures (to be parked), the rest as not attempted.
    pub async fn embed_batch(
        &self,
        texts: &[&str],
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> Result<Vec<ItemOutcome>, Stop> {
        let target = self.target();
        let mut outcomes: Vec<Option<ItemOutcome>> = vec![None; texts.len()];
        let mut work: Vec<Piece> = Vec::new();
        if !texts.is_empty() {
            work.push(Piece { range: 0..texts.len(), isolating: false });
        }
        while let Some(Piece { range, isolating }) = work.pop() {
            let mut attempt: u32 = 0;
            let mut last: Option<(EmbedError, &'static str)> = None;
            loop {
                let permit = match self.admit(cancel, stats).await {
                    Ok(p) => p,
                    Err(Halt::Cancelled) => {
                        let outcome = match &last {
                            None => ItemOutcome::NotAttempted,
                            Some((err, reason)) => ItemOutcome::Failed(transient(err, reason, attempt)),
                        };
                        fill(&mut outcomes, range.clone(), outcome);
                        break;
                    }
                    Err(Halt::Stop(stop)) => return Err(stop),
                };
                attempt += 1;
                stats.provider_calls += 1;
                stats.provider_inputs += range.len() as u64;
                let sent = std::time::Instant::now();
                let result = self.client.embed(&texts[range.clone()], self.dimensions).await;
                crate::metrics::provider_request(outcome_label(&result), sent.elapsed().as_secs_f64());
                match result {
                    Ok(resp) => {
                        self.gate.record(permit, Health::Responsive);
                        stats.reported_tokens += resp.reported_tokens;
                        let mut items = resp.items;
                        if items.iter().any(Result::is_ok) {
                            self.gate.canary().record_success(&target);
                        } else if let Some((signature, detail)) = uniform_wrong_dimension(&items) {
                            // Every vector has the same wrong length: the model or `dimensions`
                            // may not fit the column at all. Ask the canary unless vectors of
                            // the right size have been seen and this is one input.
                            let force = items.len() > 1;
                            if force || !self.gate.canary().has_success(&target) {
                                match self.check(&target, signature, &detail, force, cancel, stats).await? {
                                    Checked::InputFault => {}
                                    Checked::Inconclusive(why) => {
                                        for item in &mut items {
                                            if let Err(p) = item {
                                                p.class = ErrorClass::Transient;
                                                p.detail = format!("{}; {why}", p.detail);
                                            }
                                        }
                                    }
                                }
                            }
                        }
                        for (i, item) in items.into_iter().enumerate() {
                            outcomes[range.start + i] = Some(match item {
                                Ok(v) => ItemOutcome::Embedded(v),
                                Err(p) => ItemOutcome::Failed(Failure {
                                    class: p.class,
                                    reason: p.reason,
                                    detail: p.detail,
                                    status: Some(200),
                                    attempts: attempt,
                                }),
                            });
                        }
                        break;
                    }
                    Err(err) => match classify(&err) {
                        Verdict::Systemic { reason } => {
                            self.gate.record(permit, Health::Responsive);
                            return Err(Stop::Systemic { reason, detail: err.to_string() });
                        }
                        Verdict::Reject { class, reason } => {
                            self.gate.record(permit, Health::Responsive);
                            self.gate.canary().record_rejection(&target);
                            let signature = signature_of(&err);
                            let detail = err.to_string();
                            match self.check(&target, signature, &detail, false, cancel, stats).await? {
                                Checked::Inconclusive(why) => {
                                    let failure = Failure {
                                        class: ErrorClass::Transient,
                                        reason,
                                        detail: format!("{detail}; {why}"),
                                        status: status_of(&err),
                                        attempts: attempt,
                                    };
                                    fill(&mut outcomes, range.clone(), ItemOutcome::Failed(failure));
                                }
                                Checked::InputFault if range.len() > 1 => {
                                    stats.splits += 1;
                                    split(&mut work, &range, isolating);
                                }
                                Checked::InputFault => {
                                    let failure = Failure {
                                        class,
                                        reason,
                                        detail,
                                        status: status_of(&err),
                                        attempts: attempt,
                                    };
                                    fill(&mut outcomes, range.clone(), ItemOutcome::Failed(failure));
                                }
                            }
                            break;
                        }
                        Verdict::Retry { reason, retry_after } => {
                            // Isolating an input that always gets 500: the split that
                            // succeeded proved the provider is up, so this says nothing
                            // about it, and one try per split level is enough.
                            let suspect = isolating && reason == "http_500";
                            let health = if reason == "rate_limited" {
                                Health::RateLimited(retry_after.map(|d| d.min(self.policy.cap)))
                            } else if suspect {
                                Health::InputSuspect
                            } else {
                                Health::Failing
                            };
                            self.gate.record(permit, health);
                            if suspect && range.len() > 1 {
                                stats.splits += 1;
                                split(&mut work, &range, true);
                                break;
                            }
                            if !self.policy.allows_another(attempt) {
                                if reason == "http_500" && range.len() > 1 {
                                    // Some servers answer 500 for one input forever (Ollama):
                                    // isolate it instead of parking its neighbours with it.
                                    stats.splits += 1;
                                    split(&mut work, &range, true);
                                    break;
                                }
                                fill(
                                    &mut outcomes,
                                    range.clone(),
                                    ItemOutcome::Failed(transient(&err, reason, attempt)),
                                );
                                break;
                            }
                            *stats.retries.entry(reason).or_default() += 1;
                            metrics::counter!(crate::metrics::RETRIES, "reason" => reason).increment(1);
                            let delay = self.policy.delay(attempt, retry_after);
                            last = Some((err, reason));
                            tokio::select! {
                                _ = cancel.cancelled() => {
                                    let (err, reason) = last.as_ref().expect("just set");
                                    fill(&mut outcomes, range.clone(), ItemOutcome::Failed(transient(err, reason, attempt)));
                                    break;
                                }
                                _ = tokio::time::sleep(delay) => {}
                            }
                        }
                    },
                }
            }
        }
        Ok(outcomes.into_iter().map(|o| o.unwrap_or(ItemOutcome::NotAttempted)).collect())
    }

    fn target(&self) -> Target {
        Target {
            model: self.client.model().to_string(),
            request_dimensions: self.client.request_dimensions(),
            dimensions: self.dimensions,
        }
    }

    /// A request slot from the gate. When the gate wants a breaker probe, the probe is a
    /// canary input (not this caller's work, which may be what keeps failing); then this
    /// caller asks again.
    async fn admit(&self, cancel: &CancellationToken, stats: &mut BatchStats) -> Result<Permit, Halt> {
        loop {
            let permit = match self.gate.admit(cancel).await {
                Ok(p) => p,
                Err(GateError::Cancelled) => return Err(Halt::Cancelled),
                Err(GateError::Outage(d)) => {
                    return Err(Halt::Stop(Stop::Outage(format!(
                        "provider unavailable for more than {}s (circuit breaker stayed open); rerun the same corpus once it recovers",
                        d.as_secs()
                    ))));
                }
                Err(GateError::RateLimited(d)) => {
                    return Err(Halt::Stop(Stop::Outage(format!(
                        "provider rate-limited every request for more than {}s; rerun the same corpus once the limit is lifted (or raise it)",
                        d.as_secs()
                    ))));
                }
            };
            if !permit.is_probe() {
                return Ok(permit);
            }
            let result = self.send_canary(stats).await;
            let health = match &result {
                Ok(_) => Health::Responsive,
                Err(e) => match classify(e) {
                    Verdict::Retry { reason: "rate_limited", retry_after } => {
                        Health::RateLimited(retry_after.map(|d| d.min(self.policy.cap)))
                    }
                    Verdict::Retry { .. } => Health::Failing,
                    Verdict::Reject { .. } | Verdict::Systemic { .. } => Health::Responsive,
                },
            };
            self.gate.record(permit, health);
        }
    }

    async fn send_canary(&self, stats: &mut BatchStats) -> Result<client::EmbedResponse, EmbedError> {
        stats.provider_calls += 1;
        stats.provider_inputs += 1;
        stats.canary_calls += 1;
        let sent = std::time::Instant::now();
        let result = self.client.embed(&[CANARY_TEXT], self.dimensions).await;
        crate::metrics::provider_request(outcome_label(&result), sent.elapsed().as_secs_f64());
        result
    }

    /// Decides whether a failure with `signature` is the input's or the provider's, asking
    /// the canary when it is suspicious (see [`canary`]). Concurrent callers wait for one
    /// verdict. `Err` is the run's stop.
    async fn check(
        &self,
        target: &Target,
        signature: Signature,
        detail: &str,
        force: bool,
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> Result<Checked, Stop> {
        let book = self.gate.canary();
        match book.consult(target, &signature, force) {
            Consult::Proceed => return Ok(Checked::InputFault),
            Consult::Stop(stop) => return Err(stop),
            Consult::RunCanary => {}
        }
        let _turn = tokio::select! {
            _ = cancel.cancelled() => return Ok(Checked::Inconclusive("shutdown before the provider could be checked".into())),
            g = book.check.lock() => g,
        };
        // Another worker may have asked while we waited.
        match book.consult(target, &signature, force) {
            Consult::Proceed => return Ok(Checked::InputFault),
            Consult::Stop(stop) => return Err(stop),
            Consult::RunCanary => {}
        }
        let mut attempt = 0;
        let verdict = loop {
            let permit = match self.admit(cancel, stats).await {
                Ok(p) => p,
                Err(Halt::Stop(stop)) => return Err(stop),
                Err(Halt::Cancelled) => {
                    return Ok(Checked::Inconclusive("shutdown before the provider could be checked".into()));
                }
            };
            attempt += 1;
            let result = self.send_canary(stats).await;
            match result {
                Ok(resp) => {
                    self.gate.record(permit, Health::Responsive);
                    match resp.items.into_iter().next() {
                        Some(Ok(_)) => break CanaryVerdict::InputFault,
                        Some(Err(p)) if p.class == ErrorClass::DimensionMismatch => {
                            break CanaryVerdict::Systemic(Stop::Systemic {
                                reason: "dimension_mismatch",
                                detail: format!(
                                    "every vector has the wrong size, a known-good canary input's too: {}; check --model/--dimensions against the target table",
                                    p.detail
                                ),
                            });
                        }
                        Some(Err(p)) => {
                            return Ok(Checked::Inconclusive(format!(
                                "the canary input's vector was unusable too ({}), so the provider could not be checked",
                                p.reason
                            )));
                        }
                        None => return Ok(Checked::Inconclusive("the canary got no vector".into())),
                    }
                }
                Err(e) => match classify(&e) {
                    Verdict::Systemic { reason } => {
                        self.gate.record(permit, Health::Responsive);
                        break CanaryVerdict::Systemic(Stop::Systemic { reason, detail: e.to_string() });
                    }
                    Verdict::Reject { .. } => {
                        self.gate.record(permit, Health::Responsive);
                        break CanaryVerdict::Systemic(Stop::Systemic {
                            reason: "uniform_rejection",
                            detail: format!(
                                "the provider rejects every input alike, a known-good canary input too ({e}); first rejection: {detail}. Check the key, --model, --dimensions and the gateway"
                            ),
                        });
                    }
                    Verdict::Retry { reason, retry_after } => {
                        let health = if reason == "rate_limited" {
                            Health::RateLimited(retry_after.map(|d| d.min(self.policy.cap)))
                        } else {
                            Health::Failing
                        };
                        self.gate.record(permit, health);
                        if !self.policy.allows_another(attempt) {
                            return Ok(Checked::Inconclusive(format!(
                                "the provider could not be checked with a canary input ({e})"
                            )));
                        }
                        tokio::select! {
                            _ = cancel.cancelled() => {
                                return Ok(Checked::Inconclusive("shutdown before the provider could be checked".into()));
                            }
                            _ = tokio::time::sleep(self.policy.delay(attempt, retry_after)) => {}
                        }
                    }
                },
            }
        };
        book.store(target, signature, &verdict);
        match verdict {
            CanaryVerdict::InputFault => Ok(Checked::InputFault),
            CanaryVerdict::Systemic(stop) => {
                tracing::error!(error = %stop, "a known-good canary input failed like the real inputs");
                Err(stop)
            }
        }
    }
}

/// Pushes the halves of `range` (first half on top, so it is done first).
fn split(work: &mut Vec<Piece>, range: &Range<usize>, isolating: bool) {
    let mid = range.start + range.len() / 2;
    work.push(Piece { range: mid..range.end, isolating });
    work.push(Piece { range: range.start..mid, isolating });
}

fn outcome_label(result: &Result<client::EmbedResponse, EmbedError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(e) => match classify(e) {
            Verdict::Retry { .. } => "retry",
            Verdict::Reject { .. } => "reject",
            Verdict::Systemic { .. } => "systemic",
        },
    }
}

fn signature_of(err: &EmbedError) -> Signature {
    match err {
        EmbedError::Status { status, error_type, .. } => {
            Signature::Status { status: *status, error_type: error_type.clone() }
        }
        _ => Signature::Mismatch,
    }
}

fn transient(err: &EmbedError, reason: &'static str, attempts: u32) -> Failure {
    Failure {
        class: ErrorClass::Transient,
        reason,
        detail: err.to_string(),
        status: status_of(err),
        attempts,
    }
}

fn status_of(err: &EmbedError) -> Option<u16> {
    match err {
        EmbedError::Status { status, .. } => Some(*status),
        _ => None,
    }
}

fn fill(outcomes: &mut [Option<ItemOutcome>], range: Range<usize>, outcome: ItemOutcome) {
    for slot in &mut outcomes[range] {
        *slot = Some(outcome.clone());
    }
}

/// Every vector of a response has the same wrong length: the model or the `dimensions`
/// setting may not fit the target column (configuration, not data); the canary decides.
fn uniform_wrong_dimension(items: &[Result<Vec<f32>, client::VectorProblem>]) -> Option<(Signature, String)> {
    let first = match items.first()? {
        Err(p) if p.class == ErrorClass::DimensionMismatch => p,
        _ => return None,
    };
    let uniform = items
        .iter()
        .all(|i| matches!(i, Err(p) if p.class == ErrorClass::DimensionMismatch && p.detail == first.detail));
    uniform.then(|| (Signature::Dimension(first.detail.clone()), first.detail.clone()))
}
