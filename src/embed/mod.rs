//! Embedding one batch of chunks: request, classify, retry, isolate.
//!
//! [`Embedder::embed_batch`] turns a batch into one [`ItemOutcome`] per chunk. Transient
//! failures are retried on the [`RetryPolicy`] schedule through the shared [`ProviderGate`];
//! an input rejection on a batch splits it (into singles when small, about √n parts when
//! large) until the guilty input stands alone, so one poison input never fails its
//! neighbours (so does a 500 that outlives the retries: some servers fail one input with 500
//! forever); a systemic error stops the run without charging any chunk for it. Once a run
//! has met poison, batches are sent in smaller pieces and proven poison inputs are sent
//! alone first ([`isolate`]), so finding one costs a few resent inputs, not a batch.
//!
//! Every input sent is accounted in tokens ([`BatchStats::tokens_stored`] and
//! [`BatchStats::tokens_wasted`]): estimated from characters ([`limit::CHARS_PER_TOKEN`]), scaled by
//! the provider's reported usage when that is plausible.
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
pub mod isolate;
pub mod limit;
pub mod retry;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::model::ErrorClass;
pub use crate::model::Reason;
use canary::{CANARY_TEXT, CanaryVerdict, Consult, Signature, Target};
use classify::{Verdict, classify};
use client::{EmbedClient, EmbedError};
use gate::{GateError, Health, OnOutage, Permit, ProviderGate};
use isolate::Isolation;
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
    /// Why, as a bounded reason code.
    pub reason: Reason,
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
        /// Why (e.g. `unauthorized`, `insufficient_quota`, `not_found`).
        reason: Reason,
        /// Sanitised detail from the provider's answer.
        detail: String,
    },
    /// The circuit breaker stayed open longer than the configured maximum outage; the message
    /// says how long and what to do.
    #[error("{0}")]
    Outage(String),
}

impl Stop {
    /// Whether the refusal holds for every model and table this provider serves (the key,
    /// the account's quota, the URL, an outage), or only for the one a request was for (an
    /// unknown or retired model, a `dimensions` it cannot give, every input rejected alike
    /// for it): `serve` replays rows of many models, and one model's refusal must not hold
    /// back the others'.
    pub fn is_provider_wide(&self) -> bool {
        match self {
            Stop::Systemic { reason, .. } => reason.is_provider_wide(),
            Stop::Outage(_) => true,
        }
    }
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
    /// Times a failing piece was split to find the input at fault.
    pub splits: u64,
    /// Attempts that were followed by another attempt, by reason.
    pub retries: BTreeMap<Reason, u64>,
    /// Canary requests (breaker probes and systemic checks), included in `provider_calls`.
    pub canary_calls: u64,
    /// Tokens of the inputs whose vector came back usable (estimated, or the provider's
    /// plausible usage).
    pub tokens_stored: u64,
    /// Tokens sent for nothing: failed requests, unusable vectors, canaries, and so every
    /// input that had to be sent again.
    pub tokens_wasted: u64,
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
    /// What this embedder's caller does while the breaker is open: an ingest follows its
    /// `on_outage` setting; replay keeps `Wait` (its items stay pending in the stream).
    pub on_outage: OnOutage,
    /// Poison rate and memory of proven poison inputs, shared by every worker and replayer
    /// that uses this embedder, so what one learns the others do not pay for again.
    pub isolation: Arc<Isolation>,
    /// The revision of the target this embedder writes (1 for a table without revisions):
    /// the `revision` label of its request and token counters.
    pub revision: i32,
}

/// The estimated tokens of `text`: [`limit::CHARS_PER_TOKEN`] characters a token, rounded up
/// (the ratio the token limits use too).
pub fn estimate_tokens(text: &str) -> u64 {
    text.chars().count().div_ceil(limit::CHARS_PER_TOKEN) as u64
}

/// The 429s one piece has met: how many (they do not count as the policy's attempts) and
/// since when.
#[derive(Default)]
struct RateLimited {
    attempts: u32,
    since: Option<tokio::time::Instant>,
}

/// Why no request may be sent.
enum Halt {
    Cancelled,
    Stop(Stop),
    /// The breaker is open and the caller parks ([`OnOutage::Park`]): send nothing.
    Park,
}

/// Outcome of checking a failure with the canary.
enum Checked {
    /// The provider embeds a known-good input: the failure is the input's.
    InputFault,
    /// No verdict (the canary could not get an answer, or shutdown): park as transient.
    Inconclusive(String),
}

/// A range of the batch still to embed. `isolating`: it comes from splitting a batch that
/// kept failing with 500 (or holds a remembered suspect), so a 500 on it is evidence against
/// one of its inputs. `carve`: not yet cut to the request size (see [`isolate`]). `counted`:
/// it comes from splitting a rejected piece, whose poison input the poison rate already
/// counts (so finding it does not count it again).
struct Piece {
    range: Range<usize>,
    isolating: bool,
    carve: bool,
    counted: bool,
}

/// The state of one `embed_batch` call: an outcome slot per text, the pieces still to embed,
/// and what every piece shares.
struct Progress<'a> {
    /// The model and dimensions the batch is embedded for (the canary's key).
    target: Target,
    outcomes: Vec<Option<ItemOutcome>>,
    /// Pieces still to embed; the top one is next.
    work: Vec<Piece>,
    /// Inputs remembered as poison or suspect: each is sent alone, first.
    suspects: Vec<bool>,
    /// The batch's texts (a proven poison input is remembered by its text).
    texts: &'a [&'a str],
    cancel: &'a CancellationToken,
    stats: &'a mut BatchStats,
}

impl Embedder {
    /// Embeds `texts`, returning one outcome per text (same order) or the reason the whole run
    /// must stop. `cancel` interrupts backoff waits and waits for the limiter's slot (nothing
    /// is sent after it): inputs already attempted are then reported as transient failures
    /// (to be parked), the rest as not attempted. A stop discards what the batch embedded
    /// before it; [`Embedder::embed_batch_until_stop`] keeps it.
    pub async fn embed_batch(
        &self,
        texts: &[&str],
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> Result<Vec<ItemOutcome>, Stop> {
        match self.embed_batch_until_stop(texts, cancel, stats).await {
            (outcomes, None) => Ok(outcomes),
            (_, Some(stop)) => Err(stop),
        }
    }

    /// Like [`Embedder::embed_batch`], but a stop keeps what was embedded before it: the
    /// vectors of the pieces the provider had already answered were paid for, and resending
    /// them on the rerun would pay again. With a stop (`Some`), every outcome but
    /// [`ItemOutcome::Embedded`] is [`ItemOutcome::NotAttempted`]: a failure met before a
    /// systemic stop may be the provider's doing, so nothing is charged to its input.
    pub async fn embed_batch_until_stop(
        &self,
        texts: &[&str],
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> (Vec<ItemOutcome>, Option<Stop>) {
        let mut progress = Progress {
            target: self.target(),
            outcomes: vec![None; texts.len()],
            work: Vec::new(),
            suspects: texts.iter().map(|t| self.isolation.is_suspect(t)).collect(),
            texts,
            cancel,
            stats,
        };
        if !texts.is_empty() {
            progress.work.push(Piece {
                range: 0..texts.len(),
                isolating: false,
                carve: true,
                counted: false,
            });
        }
        while let Some(piece) = progress.work.pop() {
            let piece = self.carve(piece, texts, &progress.suspects, &mut progress.work);
            if let Err(stop) = self.embed_piece(texts, piece, &mut progress).await {
                let kept = progress
                    .outcomes
                    .into_iter()
                    .map(|o| match o {
                        Some(embedded @ ItemOutcome::Embedded(_)) => embedded,
                        _ => ItemOutcome::NotAttempted,
                    })
                    .collect();
                return (kept, Some(stop));
            }
        }
        (progress.outcomes.into_iter().map(|o| o.unwrap_or(ItemOutcome::NotAttempted)).collect(), None)
    }

    /// The next request to send from `piece`: a remembered suspect alone first, else the
    /// head of the piece at the poison-aware request size; the rest goes back on `work`.
    fn carve(&self, piece: Piece, texts: &[&str], suspects: &[bool], work: &mut Vec<Piece>) -> Piece {
        if !piece.carve {
            return piece;
        }
        let Range { start, end } = piece.range;
        if let Some(i) = (start..end).find(|&i| suspects[i]) {
            if i + 1 < end {
                work.push(Piece { range: i + 1..end, isolating: false, carve: true, counted: false });
            }
            if start < i {
                work.push(Piece { range: start..i, isolating: false, carve: true, counted: false });
            }
            return Piece { range: i..i + 1, isolating: true, carve: false, counted: false };
        }
        let size = self.isolation.piece_size(end - start, self.weigh(&texts[start..end]));
        if start + size < end {
            work.push(Piece { range: start + size..end, isolating: false, carve: true, counted: false });
        }
        Piece { range: start..start + size, isolating: piece.isolating, carve: false, counted: piece.counted }
    }

    /// How poison isolation weighs a request against an input: by the configured budgets
    /// (a request budget makes requests count; see [`isolate::Weigh`]), with `texts` giving
    /// the tokens an input is estimated at.
    fn weigh(&self, texts: &[&str]) -> isolate::Weigh {
        let limiter = self.client.limiter();
        let limits = limiter.config();
        if limits.max_requests_per_minute.is_none() {
            return isolate::Weigh::Inputs;
        }
        let per_input = limiter.estimate(texts) as f64 / texts.len().max(1) as f64;
        isolate::Weigh::for_limits(limits.max_requests_per_minute, limits.max_tokens_per_minute, per_input)
    }

    /// Sends one piece, retrying it under the policy, until it is settled: embedded, failed,
    /// or split into smaller pieces (pushed on the work stack).
    async fn embed_piece(&self, texts: &[&str], piece: Piece, p: &mut Progress<'_>) -> Result<(), Stop> {
        let cancel = p.cancel;
        let mut attempt: u32 = 0;
        // Rate limits clear by themselves: 429s do not use up the policy's attempts, they are
        // bounded by time instead (see `settle_without_retry`).
        let mut limited = RateLimited::default();
        let mut last: Option<(EmbedError, Reason)> = None;
        loop {
            let permit = match self.admit(cancel, p.stats).await {
                Ok(permit) => permit,
                Err(Halt::Cancelled) => {
                    let outcome = match &last {
                        None => ItemOutcome::NotAttempted,
                        Some((err, reason)) => ItemOutcome::Failed(transient(err, *reason, attempt)),
                    };
                    fill(&mut p.outcomes, piece.range.clone(), outcome);
                    return Ok(());
                }
                Err(Halt::Park) => {
                    let failure = match &last {
                        None => parked_unsent(),
                        Some((err, reason)) => transient(err, *reason, attempt),
                    };
                    fill(&mut p.outcomes, piece.range.clone(), ItemOutcome::Failed(failure));
                    return Ok(());
                }
                Err(Halt::Stop(stop)) => return Err(stop),
            };
            let sent = std::time::Instant::now();
            let inputs = &texts[piece.range.clone()];
            let Some(result) = self.client.embed_unless_cancelled(inputs, self.dimensions, cancel).await
            else {
                // Shutdown while the request waited for its slot in the limiter: not sent.
                self.gate.record(permit, Health::InputSuspect);
                let outcome = match &last {
                    None => ItemOutcome::NotAttempted,
                    Some((err, reason)) => ItemOutcome::Failed(transient(err, *reason, attempt)),
                };
                fill(&mut p.outcomes, piece.range.clone(), outcome);
                return Ok(());
            };
            attempt += 1;
            p.stats.provider_calls += 1;
            p.stats.provider_inputs += piece.range.len() as u64;
            crate::metrics::provider_request(
                self.revision,
                outcome_label(&result),
                sent.elapsed().as_secs_f64(),
            );
            let err = match result {
                Ok(resp) => {
                    self.gate.record(permit, Health::Responsive);
                    account_response(self.revision, &texts[piece.range.clone()], &resp, p.stats);
                    self.isolation.settled(piece.range.len());
                    return self.settle_response(resp, &piece.range, attempt, p).await;
                }
                Err(err) => {
                    account_wasted(self.revision, &texts[piece.range.clone()], p.stats);
                    err
                }
            };
            let (reason, retry_after) = match classify(&err) {
                Verdict::Systemic { reason } => {
                    self.gate.record(permit, Health::Responsive);
                    return Err(Stop::Systemic { reason, detail: err.to_string() });
                }
                Verdict::Reject { class, reason } => {
                    self.gate.record(permit, Health::Responsive);
                    return self.settle_rejection(&err, class, reason, &piece, attempt, p).await;
                }
                Verdict::Retry { reason, retry_after } => (reason, retry_after),
            };
            // Isolating an input that always gets 500: the split that succeeded proved the
            // provider is up, so this says nothing about it.
            let suspect = piece.isolating && reason == Reason::Http500;
            let health = if suspect { Health::InputSuspect } else { self.retry_health(reason, retry_after) };
            self.gate.record(permit, health);
            if reason == Reason::RateLimited {
                limited.attempts += 1;
                limited.since.get_or_insert_with(tokio::time::Instant::now);
            }
            if self.settle_without_retry(&err, reason, suspect, &piece, (attempt, &limited), p) {
                return Ok(());
            }
            *p.stats.retries.entry(reason).or_default() += 1;
            metrics::counter!(crate::metrics::RETRIES, "reason" => reason.as_str()).increment(1);
            let delay = self.policy.delay(attempt, retry_after);
            tokio::select! {
                _ = cancel.cancelled() => {
                    fill(&mut p.outcomes, piece.range.clone(), ItemOutcome::Failed(transient(&err, reason, attempt)));
                    return Ok(());
                }
                // Parking or stopping on an outage: the gate answers the next admit at once.
                _ = self.gate.opened(), if self.on_outage != OnOutage::Wait => {}
                _ = tokio::time::sleep(delay) => {}
            }
            last = Some((err, reason));
        }
    }

    /// Records a provider answer: a vector or a per-item problem for each input of `range`.
    /// When every vector has the same wrong length, or every one is unusable alike (NaN,
    /// zeros, empty), the model or `dimensions` may be broken or not fit the column at all:
    /// the canary is asked (unless usable vectors have been seen and this is one input), and
    /// without a verdict the problems are parked as transient.
    async fn settle_response(
        &self,
        resp: client::EmbedResponse,
        range: &Range<usize>,
        attempt: u32,
        p: &mut Progress<'_>,
    ) -> Result<(), Stop> {
        p.stats.reported_tokens += resp.reported_tokens;
        let mut items = resp.items;
        if items.iter().any(Result::is_ok) {
            self.gate.canary().record_success(&p.target);
        } else if let Some((signature, detail)) = uniform_unusable(&items) {
            let force = items.len() > 1;
            if (force || !self.gate.canary().has_success(&p.target))
                && let Checked::Inconclusive(why) =
                    self.check(&p.target, signature, &detail, force, p.cancel, p.stats).await?
            {
                for item in &mut items {
                    if let Err(problem) = item {
                        problem.class = ErrorClass::Transient;
                        problem.detail = format!("{}; {why}", problem.detail);
                    }
                }
            }
        }
        for (i, item) in items.into_iter().enumerate() {
            p.outcomes[range.start + i] = Some(match item {
                Ok(v) => ItemOutcome::Embedded(v),
                Err(problem) => ItemOutcome::Failed(Failure {
                    class: problem.class,
                    reason: problem.reason,
                    detail: problem.detail,
                    status: Some(200),
                    attempts: attempt,
                }),
            });
        }
        Ok(())
    }

    /// Settles a piece the provider rejected: when the canary says the provider is fine, the
    /// input is at fault (a piece of several is split to find it); without a verdict the
    /// piece is parked as transient.
    async fn settle_rejection(
        &self,
        err: &EmbedError,
        class: ErrorClass,
        reason: Reason,
        piece: &Piece,
        attempt: u32,
        p: &mut Progress<'_>,
    ) -> Result<(), Stop> {
        self.gate.canary().record_rejection(&p.target);
        let signature = signature_of(err);
        let detail = err.to_string();
        let status = status_of(err);
        match self.check(&p.target, signature, &detail, false, p.cancel, p.stats).await? {
            Checked::Inconclusive(why) => {
                let failure = Failure {
                    class: ErrorClass::Transient,
                    reason,
                    detail: format!("{detail}; {why}"),
                    status,
                    attempts: attempt,
                };
                fill(&mut p.outcomes, piece.range.clone(), ItemOutcome::Failed(failure));
            }
            Checked::InputFault if piece.range.len() > 1 => {
                p.stats.splits += 1;
                // One of these inputs is poison: count it now, not when the split has found
                // it, so other workers cut their requests to the poison-aware size meanwhile.
                if !piece.counted {
                    self.isolation.poison_found();
                }
                split(&mut p.work, &piece.range, piece.isolating, true);
            }
            Checked::InputFault => {
                self.isolation.proven_poison(p.texts[piece.range.start], piece.counted);
                let failure = Failure { class, reason, detail, status, attempts: attempt };
                fill(&mut p.outcomes, piece.range.clone(), ItemOutcome::Failed(failure));
            }
        }
        Ok(())
    }

    /// Settles a piece after a retryable failure when retrying it makes no sense (returns
    /// `true`): a `suspect` piece is split (one try per split level is enough); once the
    /// policy allows no other attempt, a piece of several that keeps getting 500 is split to
    /// isolate the input (some servers, e.g. Ollama, answer 500 for one input forever)
    /// instead of parking its neighbours with it, and anything else is parked as transient
    /// (a lone `suspect` input is then remembered as poison: it failed alone every time).
    ///
    /// A rate limit is not the piece's failure and clears by itself (a gateway refuses for
    /// the rest of its minute): 429s do not count towards the policy's attempts, and a piece
    /// is parked for them only once it has been rate-limited for twice the gate's
    /// `max_outage` (a run whose every request is refused for `max_outage` stops first, in
    /// the gate: this bound only ends a piece refused while others get answers).
    fn settle_without_retry(
        &self,
        err: &EmbedError,
        reason: Reason,
        suspect: bool,
        piece: &Piece,
        (attempt, limited): (u32, &RateLimited),
        p: &mut Progress<'_>,
    ) -> bool {
        let several = piece.range.len() > 1;
        if suspect && several {
            p.stats.splits += 1;
            split(&mut p.work, &piece.range, true, piece.counted);
            return true;
        }
        let may_retry = if reason == Reason::RateLimited {
            limited.since.is_none_or(|since| since.elapsed() < self.gate.max_outage().saturating_mul(2))
        } else {
            self.policy.allows_another(attempt - limited.attempts)
        };
        if may_retry {
            return false;
        }
        if reason == Reason::Http500 && several {
            p.stats.splits += 1;
            split(&mut p.work, &piece.range, true, piece.counted);
        } else {
            if suspect {
                self.isolation.proven_poison(p.texts[piece.range.start], piece.counted);
            }
            fill(&mut p.outcomes, piece.range.clone(), ItemOutcome::Failed(transient(err, reason, attempt)));
        }
        true
    }

    /// What a retryable failure tells the gate: a rate limit (with the server's wait, capped
    /// by the policy; without one the gate pauses adaptively) or a failing provider.
    fn retry_health(&self, reason: Reason, retry_after: Option<std::time::Duration>) -> Health {
        if reason == Reason::RateLimited {
            Health::RateLimited(retry_after.map(|d| d.min(self.policy.cap)))
        } else {
            Health::Failing
        }
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
            let permit = match self.gate.admit(cancel, self.on_outage).await {
                Ok(p) => p,
                Err(GateError::Cancelled) => return Err(Halt::Cancelled),
                Err(GateError::BreakerOpen) if self.on_outage == OnOutage::Park => return Err(Halt::Park),
                Err(GateError::BreakerOpen) => {
                    return Err(Halt::Stop(Stop::Outage(
                        "provider failing: the circuit breaker opened and on_outage is stop; rerun the same corpus once it recovers"
                            .into(),
                    )));
                }
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
            let Some(result) = self.send_canary(cancel, stats).await else {
                self.gate.record(permit, Health::InputSuspect);
                return Err(Halt::Cancelled);
            };
            let health = match &result {
                Ok(_) => Health::Responsive,
                Err(e) => match classify(e) {
                    Verdict::Retry { reason, retry_after } => self.retry_health(reason, retry_after),
                    Verdict::Reject { .. } | Verdict::Systemic { .. } => Health::Responsive,
                },
            };
            self.gate.record(permit, health);
        }
    }

    /// Sends the canary input; `None` when `cancel` ended its wait for the limiter (not sent).
    async fn send_canary(
        &self,
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> Option<Result<client::EmbedResponse, EmbedError>> {
        let sent = std::time::Instant::now();
        let result = self.client.embed_unless_cancelled(&[CANARY_TEXT], self.dimensions, cancel).await?;
        stats.provider_calls += 1;
        stats.provider_inputs += 1;
        stats.canary_calls += 1;
        account_wasted(self.revision, &[CANARY_TEXT], stats);
        crate::metrics::provider_request(self.revision, outcome_label(&result), sent.elapsed().as_secs_f64());
        Some(result)
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
            _ = cancel.cancelled() => return Ok(Checked::Inconclusive(CANARY_SHUTDOWN.into())),
            g = book.check.lock() => g,
        };
        // Another worker may have asked while we waited.
        match book.consult(target, &signature, force) {
            Consult::Proceed => return Ok(Checked::InputFault),
            Consult::Stop(stop) => return Err(stop),
            Consult::RunCanary => {}
        }
        let verdict = match self.run_canary(detail, cancel, stats).await? {
            Ok(verdict) => verdict,
            Err(why) => return Ok(Checked::Inconclusive(why)),
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

    /// Sends the known-good canary input (retrying under the policy) and judges the provider
    /// by its answer. `Ok(Err(why))`: no verdict (nothing is remembered); `Err`: the run's
    /// stop. `detail` is the real inputs' first failure, quoted in a uniform rejection.
    async fn run_canary(
        &self,
        detail: &str,
        cancel: &CancellationToken,
        stats: &mut BatchStats,
    ) -> Result<Result<CanaryVerdict, String>, Stop> {
        let mut attempt = 0;
        loop {
            let permit = match self.admit(cancel, stats).await {
                Ok(p) => p,
                Err(Halt::Stop(stop)) => return Err(stop),
                Err(Halt::Cancelled) => return Ok(Err(CANARY_SHUTDOWN.into())),
                Err(Halt::Park) => return Ok(Err(CANARY_BREAKER_OPEN.into())),
            };
            let Some(sent) = self.send_canary(cancel, stats).await else {
                self.gate.record(permit, Health::InputSuspect);
                return Ok(Err(CANARY_SHUTDOWN.into()));
            };
            attempt += 1;
            let e = match sent {
                Ok(resp) => {
                    self.gate.record(permit, Health::Responsive);
                    return Ok(judge_canary_answer(resp));
                }
                Err(e) => e,
            };
            let stop = match classify(&e) {
                Verdict::Systemic { reason } => Stop::Systemic { reason, detail: e.to_string() },
                Verdict::Reject { .. } => Stop::Systemic {
                    reason: Reason::UniformRejection,
                    detail: format!(
                        "the provider rejects every input alike, a known-good canary input too ({e}); first rejection: {detail}. Check the key, --model, --dimensions and the gateway"
                    ),
                },
                Verdict::Retry { reason, retry_after } => {
                    self.gate.record(permit, self.retry_health(reason, retry_after));
                    if !self.policy.allows_another(attempt) {
                        return Ok(Err(format!(
                            "the provider could not be checked with a canary input ({e})"
                        )));
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return Ok(Err(CANARY_SHUTDOWN.into())),
                        _ = tokio::time::sleep(self.policy.delay(attempt, retry_after)) => {}
                    }
                    continue;
                }
            };
            self.gate.record(permit, Health::Responsive);
            return Ok(Ok(CanaryVerdict::Systemic(stop)));
        }
    }
}

/// Why a canary check ended without a verdict when the run was shut down.
const CANARY_SHUTDOWN: &str = "shutdown before the provider could be checked";

/// Why a canary check ended without a verdict while the breaker was open and the run parks.
const CANARY_BREAKER_OPEN: &str = "the circuit breaker opened before the provider could be checked";

/// The verdict of a canary input the provider answered: a usable vector clears the provider
/// (the failure was the input's); a vector of the wrong size means the model or `dimensions`
/// do not fit the table; an invalid one (NaN, zeros, empty) means the model is broken for
/// every input; a missing one gives no verdict (`Err`).
fn judge_canary_answer(resp: client::EmbedResponse) -> Result<CanaryVerdict, String> {
    match resp.items.into_iter().next() {
        Some(Ok(_)) => Ok(CanaryVerdict::InputFault),
        Some(Err(p)) if p.class == ErrorClass::DimensionMismatch => {
            Ok(CanaryVerdict::Systemic(Stop::Systemic {
                reason: Reason::DimensionMismatch,
                detail: format!(
                    "every vector has the wrong size, a known-good canary input's too: {}; check --model/--dimensions against the target table",
                    p.detail
                ),
            }))
        }
        Some(Err(p)) if p.class == ErrorClass::InvalidVector => Ok(CanaryVerdict::Systemic(Stop::Systemic {
            reason: Reason::InvalidVector,
            detail: format!(
                "every vector is unusable, a known-good canary input's too ({}: {}); the model is broken or misconfigured, check --model/--dimensions and the server",
                p.reason, p.detail
            ),
        })),
        Some(Err(p)) => Err(format!(
            "the canary input's vector was unusable too ({}), so the provider could not be checked",
            p.reason
        )),
        None => Err("the canary got no vector".into()),
    }
}

/// Pushes the parts of a failing `range` ([`isolate::part_lengths`]: singles when small,
/// about √n parts when large), the first part on top so it is done first.
fn split(work: &mut Vec<Piece>, range: &Range<usize>, isolating: bool, counted: bool) {
    let mut start = range.start;
    let mut parts = Vec::new();
    for len in isolate::part_lengths(range.len()) {
        parts.push(Piece { range: start..start + len, isolating, carve: false, counted });
        start += len;
    }
    work.extend(parts.into_iter().rev());
}

/// Accounts the tokens of a request the provider answered: those of the inputs that came
/// back with a usable vector are `stored`, the rest `wasted`. The estimate is scaled to the
/// provider's reported usage when that is plausible (see [`plausible_usage`]).
fn account_response(revision: i32, texts: &[&str], resp: &client::EmbedResponse, stats: &mut BatchStats) {
    let estimates: Vec<u64> = texts.iter().map(|t| estimate_tokens(t)).collect();
    let estimated: u64 = estimates.iter().sum();
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    let billed = plausible_usage(resp.reported_tokens, bytes).unwrap_or(estimated);
    let usable: u64 =
        estimates.iter().zip(&resp.items).filter(|(_, item)| item.is_ok()).map(|(e, _)| *e).sum();
    let stored = if estimated == 0 {
        0
    } else {
        ((usable as f64) * (billed as f64) / (estimated as f64)).round() as u64
    }
    .min(billed);
    stats.tokens_stored += stored;
    stats.tokens_wasted += billed - stored;
    crate::metrics::tokens(revision, stored, billed - stored);
}

/// Accounts a request that brought no vector back (or a canary, whose vector is thrown
/// away): all its estimated tokens are wasted. A provider may not bill a rejected request;
/// the figure is then an upper bound.
fn account_wasted(revision: i32, texts: &[&str], stats: &mut BatchStats) {
    let wasted = texts.iter().map(|t| estimate_tokens(t)).sum::<u64>();
    stats.tokens_wasted += wasted;
    crate::metrics::tokens(revision, 0, wasted);
}

/// The provider's reported usage, when it can be tokens of these inputs: positive, fewer than
/// the inputs' bytes (a token spans at least one byte; a count equal to the length is
/// characters, as some servers report) and not absurdly few (at most 32 bytes a token).
fn plausible_usage(reported: u64, bytes: usize) -> Option<u64> {
    let bytes = bytes as u64;
    (reported > 0 && reported < bytes && reported.saturating_mul(32) >= bytes).then_some(reported)
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

fn transient(err: &EmbedError, reason: Reason, attempts: u32) -> Failure {
    Failure {
        class: ErrorClass::Transient,
        reason,
        detail: err.to_string(),
        status: status_of(err),
        attempts,
    }
}

/// The failure of an input parked unsent because the breaker was open ([`OnOutage::Park`]):
/// transient, so replay sends it once the provider is back.
fn parked_unsent() -> Failure {
    Failure {
        class: ErrorClass::Transient,
        reason: Reason::BreakerOpen,
        detail: "not sent: the provider was failing (circuit breaker open) and on_outage is park".into(),
        status: None,
        attempts: 0,
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

/// Every vector of a response is unusable the same way: the same wrong length (the model or
/// the `dimensions` setting may not fit the target column), or the same invalid value (a
/// broken model answering NaN or zeros for everything). Configuration, not data, until the
/// canary says otherwise.
fn uniform_unusable(items: &[Result<Vec<f32>, client::VectorProblem>]) -> Option<(Signature, String)> {
    let first = match items.first()? {
        Err(p) if matches!(p.class, ErrorClass::DimensionMismatch | ErrorClass::InvalidVector) => p,
        _ => return None,
    };
    let same = |p: &client::VectorProblem| match first.class {
        ErrorClass::DimensionMismatch => p.class == first.class && p.detail == first.detail,
        _ => p.class == first.class && p.reason == first.reason,
    };
    if !items.iter().all(|i| matches!(i, Err(p) if same(p))) {
        return None;
    }
    let signature = match first.class {
        ErrorClass::DimensionMismatch => Signature::Dimension(first.detail.clone()),
        _ => Signature::InvalidVector(first.reason),
    };
    Some((signature, first.detail.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_of_the_key_quota_or_url_are_provider_wide_and_of_a_model_are_not() {
        let systemic = |reason| Stop::Systemic { reason, detail: String::new() };
        for reason in [Reason::Unauthorized, Reason::Forbidden, Reason::InsufficientQuota, Reason::Redirect] {
            assert!(systemic(reason).is_provider_wide(), "{reason}");
        }
        for reason in
            [Reason::NotFound, Reason::UniformRejection, Reason::DimensionMismatch, Reason::UnexpectedStatus]
        {
            assert!(!systemic(reason).is_provider_wide(), "{reason}");
        }
        assert!(Stop::Outage("breaker open".into()).is_provider_wide());
    }

    fn problem() -> client::VectorProblem {
        client::VectorProblem {
            class: ErrorClass::InvalidVector,
            reason: Reason::NonFinite,
            detail: "NaN".into(),
        }
    }

    #[test]
    fn tokens_are_estimated_at_four_characters_rounded_up() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        assert_eq!(estimate_tokens("日本語です"), 2, "characters, not bytes");
    }

    #[test]
    fn plausible_usage_is_preferred_and_characters_are_not_believed() {
        let texts = ["a".repeat(400), "b".repeat(400)];
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let resp = |reported| client::EmbedResponse {
            items: vec![Ok(vec![0.0]), Err(problem())],
            reported_tokens: reported,
        };
        // 200 tokens estimated; the provider says 300: half of them bought a usable vector.
        let mut stats = BatchStats::default();
        account_response(1, &texts, &resp(300), &mut stats);
        assert_eq!((stats.tokens_stored, stats.tokens_wasted), (150, 150));
        // A count equal to the characters sent (800) is characters: the estimate is used.
        for implausible in [0, 800, 5_000, 10] {
            let mut stats = BatchStats::default();
            account_response(1, &texts, &resp(implausible), &mut stats);
            assert_eq!((stats.tokens_stored, stats.tokens_wasted), (100, 100), "{implausible}");
        }
        let mut stats = BatchStats::default();
        account_wasted(1, &texts, &mut stats);
        assert_eq!((stats.tokens_stored, stats.tokens_wasted), (0, 200));
    }
}
