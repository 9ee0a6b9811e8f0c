//! Embedding one batch of chunks: request, classify, retry, isolate.
//!
//! [`Embedder::embed_batch`] turns a batch into one [`ItemOutcome`] per chunk. Transient
//! failures are retried on the [`RetryPolicy`] schedule through the shared [`ProviderGate`];
//! an input rejection on a batch splits it in halves until the guilty input stands alone, so
//! one poison input never fails its neighbours (so does a 500 that outlives the retries:
//! some servers fail one input with 500 forever); a systemic error stops the run without
//! charging any chunk for it.

pub mod classify;
pub mod client;
pub mod gate;
pub mod retry;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::model::ErrorClass;
use classify::{Verdict, classify};
use client::{EmbedClient, EmbedError};
use gate::{GateError, Health, ProviderGate};
use retry::RetryPolicy;

/// What happened to one input of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemOutcome {
    Embedded(Vec<f32>),
    Failed(Failure),
    /// Shutdown came before the first attempt: nothing was spent, nothing is recorded, and a
    /// rerun picks the chunk up.
    NotAttempted,
}

/// A failure to park: everything the DLQ row needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub class: ErrorClass,
    /// Bounded reason code (e.g. `http_503`, `timeout`, `too_long`).
    pub reason: &'static str,
    /// Sanitised, truncated detail.
    pub detail: String,
    pub status: Option<u16>,
    /// Provider attempts spent on this input in this pass.
    pub attempts: u32,
}

/// The run cannot go on: not the chunks' fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Stop {
    #[error("provider refused the run ({reason}): {detail}")]
    Systemic { reason: &'static str, detail: String },
    #[error("{0}")]
    Outage(String),
}

/// Counters of one batch, merged into the run's summary.
#[derive(Debug, Default, Clone)]
pub struct BatchStats {
    pub provider_calls: u64,
    pub provider_inputs: u64,
    pub reported_tokens: u64,
    pub splits: u64,
    /// Attempts that were followed by another attempt, by reason.
    pub retries: BTreeMap<&'static str, u64>,
}

/// Client + classifier + policy + shared gate; one per run, shared by all workers.
#[derive(Clone)]
pub struct Embedder {
    pub client: EmbedClient,
    pub gate: Arc<ProviderGate>,
    pub policy: RetryPolicy,
    /// Dimension of the target column; every vector is checked against it.
    pub dimensions: usize,
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
        let mut outcomes: Vec<Option<ItemOutcome>> = vec![None; texts.len()];
        let mut work: Vec<Range<usize>> = Vec::new();
        if !texts.is_empty() {
            work.push(0..texts.len());
        }
        while let Some(range) = work.pop() {
            let mut attempt: u32 = 0;
            let mut last: Option<(EmbedError, &'static str)> = None;
            loop {
                let permit = match self.gate.admit(cancel).await {
                    Ok(p) => p,
                    Err(GateError::Cancelled) => {
                        let outcome = match &last {
                            None => ItemOutcome::NotAttempted,
                            Some((err, reason)) => ItemOutcome::Failed(transient(err, reason, attempt)),
                        };
                        fill(&mut outcomes, range.clone(), outcome);
                        break;
                    }
                    Err(GateError::Outage(d)) => {
                        return Err(Stop::Outage(format!(
                            "provider unavailable for more than {}s (circuit breaker stayed open); rerun the same corpus once it recovers",
                            d.as_secs()
                        )));
                    }
                };
                attempt += 1;
                stats.provider_calls += 1;
                stats.provider_inputs += range.len() as u64;
                let sent = std::time::Instant::now();
                let result = self.client.embed(&texts[range.clone()], self.dimensions).await;
                let outcome = match &result {
                    Ok(_) => "ok",
                    Err(e) => match classify(e) {
                        Verdict::Retry { .. } => "retry",
                        Verdict::Reject { .. } => "reject",
                        Verdict::Systemic { .. } => "systemic",
                    },
                };
                crate::metrics::provider_request(outcome, sent.elapsed().as_secs_f64());
                match result {
                    Ok(resp) => {
                        self.gate.record(permit, Health::Responsive);
                        stats.reported_tokens += resp.reported_tokens;
                        if let Some(stop) = systemic_dimension(&resp.items) {
                            return Err(stop);
                        }
                        for (i, item) in resp.items.into_iter().enumerate() {
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
                            if range.len() > 1 {
                                stats.splits += 1;
                                let mid = range.start + range.len() / 2;
                                work.push(mid..range.end);
                                work.push(range.start..mid);
                            } else {
                                let failure = Failure {
                                    class,
                                    reason,
                                    detail: err.to_string(),
                                    status: status_of(&err),
                                    attempts: attempt,
                                };
                                fill(&mut outcomes, range.clone(), ItemOutcome::Failed(failure));
                            }
                            break;
                        }
                        Verdict::Retry { reason, retry_after } => {
                            let health = if reason == "rate_limited" {
                                Health::RateLimited(retry_after)
                            } else {
                                Health::Failing
                            };
                            self.gate.record(permit, health);
                            if !self.policy.allows_another(attempt) {
                                if reason == "http_500" && range.len() > 1 {
                                    // Some servers answer 500 for one input forever (Ollama):
                                    // isolate it instead of parking its neighbours with it.
                                    stats.splits += 1;
                                    let mid = range.start + range.len() / 2;
                                    work.push(mid..range.end);
                                    work.push(range.start..mid);
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

/// Every vector of a multi-input response has the same wrong length: the model or the
/// `dimensions` setting does not fit the target column. That is configuration, not data.
fn systemic_dimension(items: &[Result<Vec<f32>, client::VectorProblem>]) -> Option<Stop> {
    if items.len() < 2 {
        return None;
    }
    let all_wrong = items.iter().all(|i| matches!(i, Err(p) if p.class == ErrorClass::DimensionMismatch));
    let first = match &items[0] {
        Err(p) => p.detail.clone(),
        Ok(_) => return None,
    };
    let uniform = items.iter().all(|i| matches!(i, Err(p) if p.detail == first));
    (all_wrong && uniform).then(|| Stop::Systemic {
        reason: "dimension_mismatch",
        detail: format!(
            "every vector of a batch is wrong: {first}; check --model/--dimensions against the target table"
        ),
    })
}
