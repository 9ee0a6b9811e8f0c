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
    /// The size of the next request carved from a batch of at most `max` inputs.
    pub(crate) fn piece_size(&self, max: usize) -> usize {
        let s = self.state.lock().unwrap();
        let warm = usize::try_from((s.settled / 16).max(SLOW_START as u64)).unwrap_or(usize::MAX);
        let mut size = max.min(warm);
        if s.poison > 0 {
            let by_rate = ISOLATION_WASTE_BUDGET * (s.settled + PRIOR_CLEAN_INPUTS) as f64 / s.poison as f64;
            size = size.min(by_rate as usize);
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
        assert_eq!(iso.piece_size(64), SLOW_START, "nothing settled yet: a small first request");
        iso.settled(512);
        assert_eq!(iso.piece_size(64), 32, "a sixteenth of the inputs settled");
        iso.settled(512);
        assert_eq!(iso.piece_size(64), 64, "no poison seen: full batches");
        iso.settled(475);
        iso.proven_poison("bad", false);
        assert_eq!(iso.piece_size(64), 25, "1 in 1500, with the prior's 1000 clean: 0.01 × 2500");
        iso.proven_poison("bad", false);
        assert_eq!(iso.piece_size(64), 25, "a known poison input, sent alone, cost nothing");
        for i in 0..9 {
            iso.proven_poison(&format!("worse {i}"), false);
        }
        assert_eq!(iso.piece_size(64), 2, "10 in 1510, with the prior: 0.01 × 2510 / 10");
        for i in 0..10 {
            iso.proven_poison(&format!("worst {i}"), false);
        }
        assert_eq!(iso.piece_size(64), MIN_PIECE, "never below the floor");
        let counted = Isolation::default();
        counted.poison_found();
        assert_eq!(counted.piece_size(64), 10, "counted when its request was rejected: 0.01 × 1000");
        counted.proven_poison("found later", true);
        assert_eq!(counted.piece_size(64), 10, "and not again when found");
        assert!(counted.is_suspect("found later"));
        iso.settled(200_000);
        assert_eq!(iso.piece_size(64), 64, "a long clean stretch restores full batches");
        assert_eq!(iso.piece_size(1), 1);
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
