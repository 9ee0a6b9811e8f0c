//! The keys a run has met, in bounded memory (exact hashes, then a Bloom filter).

use super::*;

/// A key's 64-bit hash, the same for the whole process (foldhash with a fixed seed: about
/// a tenth of the cost of the standard library's SipHash, whose defence against chosen
/// collisions buys nothing here, where a collision only costs a flush or one more provider
/// call, see [`SeenKeys`]).
pub(super) fn key_hash(doc_id: &str, chunk_index: i32) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(KEY_SEED).hash_one((doc_id, chunk_index))
}

const KEY_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The hasher of sets of [`key_hash`]es.
pub(super) type KeyHashState = foldhash::fast::FixedState;

/// The keys an ingest run has met, in bounded memory: exact 64-bit key hashes up to
/// [`SeenKeys::EXACT_MAX`] keys (about 16 MB), then a Bloom filter of [`SeenKeys::BLOOM_BITS`]
/// bits (16 MiB) with 4 probes. A false "seen before" only means one more provider call for
/// an unchanged chunk (about 1 in 10^5 keys at 1M keys, 1 in 100 at 10M), never a wrong
/// outcome; a key really seen before is always recognised.
pub(super) struct SeenKeys {
    pub(super) exact: Option<HashSet<u64, KeyHashState>>,
    pub(super) bloom: Vec<u64>,
}

impl SeenKeys {
    const EXACT_MAX: usize = 1 << 20;
    const BLOOM_BITS: usize = 1 << 27;

    pub(super) fn new() -> Self {
        SeenKeys { exact: Some(HashSet::default()), bloom: Vec::new() }
    }

    /// Whether `h` was (or may have been) recorded.
    pub(super) fn contains(&self, h: u64) -> bool {
        if let Some(exact) = &self.exact {
            return exact.contains(&h);
        }
        let (a, b) = (h & 0xffff_ffff, (h >> 32) | 1);
        (0..4u64).all(|i| {
            let bit = (a.wrapping_add(i.wrapping_mul(b)) as usize) % Self::BLOOM_BITS;
            self.bloom[bit / 64] & (1u64 << (bit % 64)) != 0
        })
    }

    /// Records `h`; true if it was (or may have been) recorded before.
    pub(super) fn insert(&mut self, h: u64) -> bool {
        if let Some(exact) = &mut self.exact {
            let seen = !exact.insert(h);
            if exact.len() > Self::EXACT_MAX {
                let all = self.exact.take().expect("exact set");
                self.bloom = vec![0u64; Self::BLOOM_BITS / 64];
                for h in all {
                    self.bloom_insert(h);
                }
            }
            return seen;
        }
        self.bloom_insert(h)
    }

    pub(super) fn bloom_insert(&mut self, h: u64) -> bool {
        let (a, b) = (h & 0xffff_ffff, (h >> 32) | 1);
        let mut seen = true;
        for i in 0..4u64 {
            let bit = (a.wrapping_add(i.wrapping_mul(b)) as usize) % Self::BLOOM_BITS;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            seen &= self.bloom[word] & mask != 0;
            self.bloom[word] |= mask;
        }
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_keys_never_forget_a_key_even_past_the_exact_limit() {
        let mut seen = SeenKeys::new();
        assert!(!seen.contains(key_hash("a", 0)));
        assert!(!seen.insert(key_hash("a", 0)));
        assert!(seen.contains(key_hash("a", 0)));
        assert!(seen.insert(key_hash("a", 0)));
        assert!(!seen.insert(key_hash("a", 1)));
        for i in 0..(SeenKeys::EXACT_MAX as i32 + 10) {
            seen.insert(key_hash("bulk", i));
        }
        assert!(seen.exact.is_none(), "switched to the bounded filter");
        assert!(seen.insert(key_hash("a", 0)) && seen.insert(key_hash("bulk", 7)));
        // A deleted document's key (index -1) is found again past the limit too.
        assert!(seen.contains(key_hash("a", 0)) && !seen.contains(key_hash("deleted-doc", -1)));
        let fresh = (0..1000).filter(|i| !seen.insert(key_hash("new", *i))).count();
        assert!(fresh > 990, "false positives stay rare: {fresh} of 1000 new keys recognised as new");
    }
}
