//! Cheap poison isolation: how large a request may be, how a failing one is cut up, and
//! which inputs have already proven to fail alone.
//!
//! A poison input (one the provider rejects, or answers with 500 forever) fails its whole
//! request, so every neighbour in that request is sent again: the first failure costs the
//! request's size, whatever the isolation does after it. Two levers keep that bill small:
//!
//! - **Poison-aware request size.** [`Isolation`] counts the inputs the provider settled and
//!   the poison inputs it proved. Once a run has met poison, requests are cut to
//!   `ISOLATION_WASTE_BUDGET / poison rate` inputs (between `MIN_PIECE` and the batch; the
//!   rate counts `PRIOR_CLEAN_INPUTS` clean inputs on top, so a single early poison input
//!   does not shrink the rest of the run to pairs), so the expected resend stays near that
//!   budget; a corpus without poison keeps full batches, and the size grows back as clean
//!   inputs settle.
//! - **Cheap splits.** A failing piece of at most `SINGLES_AT` inputs is sent as singles
//!   (each clean neighbour is sent once more, no more); a larger one is cut into about √n
//!   parts, so a 64-input batch costs 64 + 8 resent inputs instead of bisection's ~126.
//!
//! Memory: the fingerprint of every input proven to fail alone is kept in-process (bounded,
//! oldest forgotten first), shared by every worker and replayer of the embedder, and such an
//! input is sent alone first, never in a batch again. Across processes the Postgres rows are
//! the memory: an ingest rerun skips content already parked, and a replayer marks a DLQ row
//! whose last failure was a lone `http_500` as suspect ([`Isolation::suspect`]).

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// Share of inputs the run accepts to resend because of poison: the request size is chosen
/// so that (poison rate × request size) stays about this small.
pub(crate) const ISOLATION_WASTE_BUDGET: f64 = 0.01;
/// Largest request before the run has settled any input; it grows to a sixteenth of the
/// inputs settled so far, so an early poison input costs a small request, not a full batch
/// (slowly: with several workers, many requests leave before the first isolation ends).
pub(crate) const SLOW_START: usize = 32;
/// Clean inputs assumed before any evidence: one poison input in a short run is not yet a
/// rate (1 in 32 would cut requests to 2 inputs for the rest of the run).
pub(crate) const PRIOR_CLEAN_INPUTS: u64 = 1_000;
/// Smallest request while poison is about (a size of 1 would multiply the requests for a
/// gain of one resent input per poison).
pub(crate) const MIN_PIECE: usize = 2;
/// A failing piece of at most this many inputs is isolated with singles.
pub(crate) const SINGLES_AT: usize = 8;
/// Fingerprints of proven poison inputs kept in memory (8 bytes each plus the set's).
pub(crate) const MAX_REMEMBERED: usize = 65_536;

/// The poison statistics and memory of one embedder, shared by its clones.
#[derive(Debug, Default)]
pub struct Isolation {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Inputs the provider settled (a vector or a verdict on the input alone).
    settled: u64,
    /// Inputs proven to fail their request alone (rejected, or 500 while neighbours passed).
    poison: u64,
    known: HashSet<u64>,
    order: VecDeque<u64>,
}

impl Isolation {
    /// The size of the next request carved from a batch of at most `max` inputs, for an
    /// account whose binding limit `weigh` says (see [`Weigh`]).
    pub(crate) fn piece_size(&self, max: usize, weigh: Weigh) -> usize {
        let s = self.state.lock().unwrap();
        let warm = usize::try_from((s.settled / 16).max(SLOW_START as u64)).unwrap_or(usize::MAX);
        let mut size = max.min(warm);
        if s.poison > 0 {
            let rate = s.poison as f64 / (s.settled + PRIOR_CLEAN_INPUTS) as f64;
            size = match weigh {
                Weigh::Inputs => size.min((ISOLATION_WASTE_BUDGET / rate) as usize),
                Weigh::Requests { inputs_per_request } => cheapest_piece(size, rate, inputs_per_request),
            };
        }
        size.max(MIN_PIECE).min(max).max(1)
    }

    /// Counts `inputs` settled by the provider (the denominator of the poison rate).
    pub(crate) fn settled(&self, inputs: usize) {
        self.state.lock().unwrap().settled += inputs as u64;
    }

    /// Counts a poison input in the rate as soon as a rejected request proves that one of its
    /// inputs is (before the split has found which), so concurrent workers shrink their
    /// requests at once. A request holding two counts once until the second is found alone.
    pub(crate) fn poison_found(&self) {
        self.state.lock().unwrap().poison += 1;
    }

    /// Records an input proven to fail its request alone: remembered so that it is never
    /// sent in a batch again by this process, and counted in the poison rate unless it was
    /// already known (then it was sent alone and cost its neighbours nothing) or `counted`
    /// already when its request was rejected ([`Isolation::poison_found`]).
    pub(crate) fn proven_poison(&self, text: &str, counted: bool) {
        let mut s = self.state.lock().unwrap();
        s.settled += 1;
        if remember(&mut s, fingerprint(text)) && !counted {
            s.poison += 1;
        }
    }

    /// Marks `text` as suspect (e.g. its DLQ row says it failed alone before): it is sent
    /// alone first, so a neighbour never pays for it.
    pub fn suspect(&self, text: &str) {
        remember(&mut self.state.lock().unwrap(), fingerprint(text));
    }

    /// Whether `text` is remembered as poison or suspect.
    pub(crate) fn is_suspect(&self, text: &str) -> bool {
        self.state.lock().unwrap().known.contains(&fingerprint(text))
    }
}

/// What a request costs against an input while poison is about, from the account's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Weigh {
    /// Resent inputs are the cost (no request budget is configured, or tokens bind): pieces
    /// are cut so that about `ISOLATION_WASTE_BUDGET` of the inputs is sent again.
    Inputs,
    /// A request budget is configured: one request weighs as much as `inputs_per_request`
    /// inputs (the tokens budget's inputs a minute over the requests budget, or
    /// `MAX_REQUEST_WEIGHT` when only requests are limited), and the piece size minimises
    /// the expected cost of both ([`cheapest_piece`]).
    Requests {
        /// Inputs one request is worth.
        inputs_per_request: f64,
    },
}

impl Weigh {
    /// The weighing for a request budget of `rpm` and a token budget of `tpm`, inputs of
    /// about `tokens_per_input` estimated tokens: minutes of budget a request uses over the
    /// minutes an input uses.
    pub(crate) fn for_limits(rpm: Option<u32>, tpm: Option<u32>, tokens_per_input: f64) -> Weigh {
        let Some(rpm) = rpm else { return Weigh::Inputs };
        let inputs_per_request = match tpm {
            Some(tpm) => f64::from(tpm) / (f64::from(rpm.max(1)) * tokens_per_input.max(1.0)),
            None => MAX_REQUEST_WEIGHT,
        };
        Weigh::Requests { inputs_per_request: inputs_per_request.clamp(0.0, MAX_REQUEST_WEIGHT) }
    }
}

/// Largest weight of a request in inputs: past it only the request count matters.
pub(crate) const MAX_REQUEST_WEIGHT: f64 = 1.0e6;

/// The piece size in `MIN_PIECE..=cap` whose expected cost per input, `weight × requests +
/// inputs`, is lowest at a poison `rate`, by [`expected_cost`]. Candidate sizes step by an
/// eighth, so the search is a few dozen evaluations.
fn cheapest_piece(cap: usize, rate: f64, weight: f64) -> usize {
    let cost = |s: usize| {
        let (requests, inputs) = expected_cost(s, rate);
        weight * requests + inputs
    };
    let mut best = (cap, cost(cap));
    let mut s = MIN_PIECE;
    while s < cap {
        let c = cost(s);
        if c < best.1 {
            best = (s, c);
        }
        s = (s + s / 8).max(s + 1);
    }
    best.0
}

/// Expected requests and inputs sent per input for pieces of `s` at a poison `rate`: a
/// clean piece costs one request and `s` inputs; one holding poison (probability
/// q = 1 - (1 - rate)^s) also costs its isolation ([`isolation_extra`]), and each further
/// poison input expected in it the isolation of its part.
pub(crate) fn expected_cost(s: usize, rate: f64) -> (f64, f64) {
    let n = s as f64;
    let q = 1.0 - (1.0 - rate).powf(n);
    let (first_requests, first_inputs) = isolation_extra(s);
    let part = part_lengths(s).first().copied().unwrap_or(1);
    let (more_requests, more_inputs) = isolation_extra(part);
    let more = (n * rate - q).max(0.0);
    let requests = 1.0 + q * first_requests + more * more_requests;
    let inputs = n + q * first_inputs + more * more_inputs;
    (requests / n, inputs / n)
}

/// Requests and inputs a piece of `n` holding one poison input sends beyond a clean piece's
/// one request and `n` inputs, with the splits of [`part_lengths`]: the failed request, the
/// healthy parts, and the failing part's own isolation down to the single input.
pub(crate) fn isolation_extra(n: usize) -> (f64, f64) {
    fn total(n: usize) -> (f64, f64) {
        if n <= 1 {
            return (1.0, 1.0);
        }
        let parts = part_lengths(n);
        let failing = parts[0];
        let (r, i) = total(failing);
        (1.0 + (parts.len() - 1) as f64 + r, n as f64 + (n - failing) as f64 + i)
    }
    let (r, i) = total(n);
    (r - 1.0, i - n as f64)
}

/// Remembers `f` (forgetting the oldest beyond the bound); `false` when it was known.
fn remember(s: &mut State, f: u64) -> bool {
    if !s.known.insert(f) {
        return false;
    }
    s.order.push_back(f);
    if s.order.len() > MAX_REMEMBERED
        && let Some(old) = s.order.pop_front()
    {
        s.known.remove(&old);
    }
    true
}

/// A process-local fingerprint of an input. A collision only sends a clean input alone.
fn fingerprint(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// The lengths of the parts a failing piece of `n` inputs is cut into: singles up to
/// `SINGLES_AT`, else about √n parts of equal size (the last may be shorter).
pub(crate) fn part_lengths(n: usize) -> Vec<usize> {
    if n <= SINGLES_AT {
        return vec![1; n];
    }
    let parts = (n as f64).sqrt().ceil() as usize;
    let len = n.div_ceil(parts);
    let mut out = Vec::with_capacity(parts);
    let mut left = n;
    while left > 0 {
        let l = len.min(left);
        out.push(l);
        left -= l;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_pieces_split_into_singles_large_ones_into_about_root_n_parts() {
        assert_eq!(part_lengths(1), vec![1]);
        assert_eq!(part_lengths(5), vec![1; 5]);
        assert_eq!(part_lengths(64), vec![8; 8]);
        let p = part_lengths(30);
        assert_eq!(p.iter().sum::<usize>(), 30);
        assert!(p.len() >= 5 && p.len() <= 6, "{p:?}");
        assert_eq!(part_lengths(2048).iter().sum::<usize>(), 2048);
    }

    #[test]
    fn requests_shrink_with_the_poison_rate_and_grow_back() {
        let iso = Isolation::default();
        assert_eq!(
            iso.piece_size(64, Weigh::Inputs),
            SLOW_START,
            "nothing settled yet: a small first request"
        );
        iso.settled(512);
        assert_eq!(iso.piece_size(64, Weigh::Inputs), 32, "a sixteenth of the inputs settled");
        iso.settled(512);
        assert_eq!(iso.piece_size(64, Weigh::Inputs), 64, "no poison seen: full batches");
        iso.settled(475);
        iso.proven_poison("bad", false);
        assert_eq!(
            iso.piece_size(64, Weigh::Inputs),
            25,
            "1 in 1500, with the prior's 1000 clean: 0.01 × 2500"
        );
        iso.proven_poison("bad", false);
        assert_eq!(iso.piece_size(64, Weigh::Inputs), 25, "a known poison input, sent alone, cost nothing");
        for i in 0..9 {
            iso.proven_poison(&format!("worse {i}"), false);
        }
        assert_eq!(iso.piece_size(64, Weigh::Inputs), 2, "10 in 1510, with the prior: 0.01 × 2510 / 10");
        for i in 0..10 {
            iso.proven_poison(&format!("worst {i}"), false);
        }
        assert_eq!(iso.piece_size(64, Weigh::Inputs), MIN_PIECE, "never below the floor");
        let counted = Isolation::default();
        counted.poison_found();
        assert_eq!(
            counted.piece_size(64, Weigh::Inputs),
            10,
            "counted when its request was rejected: 0.01 × 1000"
        );
        counted.proven_poison("found later", true);
        assert_eq!(counted.piece_size(64, Weigh::Inputs), 10, "and not again when found");
        assert!(counted.is_suspect("found later"));
        iso.settled(200_000);
        assert_eq!(iso.piece_size(64, Weigh::Inputs), 64, "a long clean stretch restores full batches");
        assert_eq!(iso.piece_size(1, Weigh::Inputs), 1);
    }

    #[test]
    fn the_isolation_cost_model_counts_the_failed_request_the_parts_and_the_singles() {
        assert_eq!(isolation_extra(1), (0.0, 0.0), "a lone input costs nothing more");
        // 2: the failed pair, then each alone: 2 more requests, 2 more inputs.
        assert_eq!(isolation_extra(2), (2.0, 2.0));
        // 64: the failed 64, 8 parts of 8 (one fails), its 8 singles.
        assert_eq!(isolation_extra(64), (16.0, 64.0 + 8.0));
        let (r, i) = expected_cost(64, 0.0);
        assert_eq!((r, i), (1.0 / 64.0, 1.0), "no poison: one request a piece, each input once");
    }

    #[test]
    fn under_a_request_budget_pieces_stay_large_and_follow_the_weight() {
        let iso = Isolation::default();
        iso.settled(9_000);
        for i in 0..100 {
            iso.proven_poison(&format!("bad {i}"), false);
        }
        // 1% poison: inputs-first cuts to pairs; requests-only keeps pieces of a few dozen.
        assert_eq!(iso.piece_size(64, Weigh::Inputs), MIN_PIECE);
        let requests_only = Weigh::for_limits(Some(1_000), None, 10.0);
        assert_eq!(requests_only, Weigh::Requests { inputs_per_request: MAX_REQUEST_WEIGHT });
        let big = iso.piece_size(64, requests_only);
        assert!((24..=64).contains(&big), "{big}");
        let (r_big, _) = expected_cost(big, 0.01);
        let (r_pair, _) = expected_cost(2, 0.01);
        assert!(r_big * 3.0 < r_pair, "{r_big} against pairs' {r_pair}");
        // A token budget that binds long before the requests' (OpenAI tier 1 at 500 tokens
        // an input: a request is worth 0.67 inputs) brings the pieces back down.
        let tokens_bind = Weigh::for_limits(Some(3_000), Some(1_000_000), 500.0);
        let small = iso.piece_size(64, tokens_bind);
        assert!(small <= 8, "{small}");
        let middle = iso.piece_size(64, Weigh::for_limits(Some(1_200), Some(400_000), 15.0));
        assert!(small < middle && middle <= big, "{small} < {middle} <= {big}");
        assert_eq!(Weigh::for_limits(None, Some(1_000), 10.0), Weigh::Inputs);
        let clean = Isolation::default();
        clean.settled(100_000);
        assert_eq!(clean.piece_size(64, requests_only), 64, "no poison: full batches");
    }

    #[test]
    fn proven_and_suspect_inputs_are_remembered_within_a_bound() {
        let iso = Isolation::default();
        iso.proven_poison("bad", false);
        iso.suspect("odd");
        assert!(iso.is_suspect("bad") && iso.is_suspect("odd"));
        assert!(!iso.is_suspect("good"));
        for i in 0..MAX_REMEMBERED {
            iso.suspect(&format!("x{i}"));
        }
        assert!(!iso.is_suspect("bad"), "the oldest is forgotten first");
        assert!(iso.state.lock().unwrap().known.len() <= MAX_REMEMBERED);
    }
}
