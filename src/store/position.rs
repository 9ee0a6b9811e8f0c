//! Positions: the order in which records entered, on one scale for a corpus and a stream.
//!
//! Every write and every deletion is fenced by its record's position (`source_seq` in the
//! manifest, leases and tombstones): a record never overwrites, resolves or deletes what a
//! record with a later position wrote. A position is the time the record entered, in
//! milliseconds since the Unix epoch, shifted left by [`SUB_BITS`], plus a sub-position:
//!
//! - a stream entry `ms-seq` read from stream number `s` of its consumer: `(seq << 6) | s`
//!   ([`entry_position`]). It depends on the entry alone, so an entry redelivered, taken over
//!   from a dead consumer or read by another process keeps its place: an older version taken
//!   over late loses to a newer one already stored. (Ids of more than 32,767 entries in one
//!   millisecond of one stream, which only a producer choosing its own ids can make, carry
//!   into the next millisecond.)
//! - a corpus line: the run reserves blocks of [`BLOCK`] positions from Postgres's clock
//!   (`Store::reserve_positions`), never below the clock and never reused; line `n` of a
//!   block that begins at line `f` is the block's base plus `n - f`. Later lines beat earlier
//!   lines, and a run reading a line after a stream entry entered beats it.
//!
//! The two clocks (Redis's for entries, Postgres's for corpus blocks) are compared as they
//! are: they agree to within their hosts' clock skew. The scale lasts until 2109 (42 bits of
//! milliseconds).

use super::{Store, StoreError};

/// Bits of a position below the millisecond.
pub const SUB_BITS: u32 = 21;

/// Positions a corpus run reserves at a time (one millisecond of the scale): a run reads
/// [`BLOCK`] lines per reservation.
pub const BLOCK: u64 = 1 << SUB_BITS;

/// Bits of a stream entry's sub-position that hold its stream's number (at most
/// [`crate::ingest::source::MAX_SOURCE_STREAMS`] streams).
const STREAM_BITS: u32 = 6;

/// The position of stream entry `id` (`ms-seq`, as Redis gives it) read from stream number
/// `stream` of its consumer. Past the scale (an id from after 2109), the last position; an id
/// Redis would never send (not `ms-seq`) counts as the oldest.
pub fn entry_position(id: &str, stream: u16) -> i64 {
    let Some((ms, seq)) = id.split_once('-') else { return 0 };
    let (Ok(ms), Ok(seq)) = (ms.parse::<u64>(), seq.parse::<u64>()) else { return 0 };
    let p = (u128::from(ms) << SUB_BITS)
        + (u128::from(seq) << STREAM_BITS)
        + u128::from(stream & ((1 << STREAM_BITS) - 1));
    p.min(i64::MAX as u128) as i64
}

/// The SQL of the position of the database's clock now.
const CLOCK_SQL: &str = "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint << 21)";

impl Store {
    /// Reserves a block of [`BLOCK`] positions for a corpus run: returns its base, at or after
    /// the database's clock and after every block reserved before.
    pub(crate) async fn reserve_positions(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "UPDATE ingest_position_clock
                SET next_position = GREATEST(next_position, {CLOCK_SQL}) + $1
             RETURNING next_position - $1"
        )))
        .bind(BLOCK as i64)
        .fetch_one(&self.pool)
        .await?)
    }

    /// Records the oldest position run `run_id` may write (a corpus run's first; a stream
    /// segment's oldest entry it could take over): the tombstone sweep keeps what a live run
    /// older than a tombstone could still need.
    pub(crate) async fn record_run_start(&self, run_id: i64, first: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO ingest_run_start (run_id, first_position) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(run_id)
        .bind(first)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// The positions of one corpus run's lines: the block reserved last and the line it begins
/// at. Lines arrive in increasing order.
#[derive(Debug, Clone)]
pub(crate) struct RunPositions {
    first: i64,
    base: i64,
    first_line: u64,
}

impl RunPositions {
    /// A run whose first block begins at `first` (and at line 0).
    pub(crate) fn new(first: i64) -> Self {
        RunPositions { first, base: first, first_line: 0 }
    }

    /// The run's first position: what its cleanup deletes is older than this.
    pub(crate) fn first(&self) -> i64 {
        self.first
    }

    /// The position of `line`, `None` past the reserved block (reserve the next one and
    /// [`RunPositions::extend`]).
    pub(crate) fn get(&self, line: u64) -> Option<i64> {
        // Lines only grow; one from before the block would share its first position.
        let offset = line.saturating_sub(self.first_line);
        (offset < BLOCK).then(|| self.base + offset as i64)
    }

    /// A new block at `base` begins at `line`.
    pub(crate) fn extend(&mut self, line: u64, base: i64) {
        debug_assert!(base >= self.base + BLOCK as i64, "blocks are never reused");
        self.base = base;
        self.first_line = line;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_positions_follow_the_ids_and_tell_streams_apart() {
        let a = entry_position("1764633600000-0", 0);
        let b = entry_position("1764633600000-1", 0);
        let c = entry_position("1764633600001-0", 0);
        assert!(a < b && b < c);
        assert_ne!(entry_position("1764633600000-0", 1), a, "the same id on two streams");
        assert!(entry_position("1764633600000-0", 63) < b);
        assert_eq!(a, 1_764_633_600_000 << SUB_BITS, "milliseconds, shifted");
        // Ids a producer chose itself keep their order.
        assert!(entry_position("0-1", 0) < entry_position("0-2", 0));
        assert!(entry_position("5-0", 0) < entry_position("6-0", 0));
        // Never from Redis: the oldest. Past the scale: the last.
        assert_eq!(entry_position("garbage", 3), 0);
        assert_eq!(entry_position(&format!("{}-0", u64::MAX), 0), i64::MAX);
    }

    #[test]
    fn a_run_s_lines_take_blocks_in_order() {
        let mut p = RunPositions::new(1_000 << SUB_BITS);
        assert_eq!(p.get(0), Some(1_000 << SUB_BITS));
        assert_eq!(p.get(7), Some((1_000 << SUB_BITS) + 7));
        assert_eq!(p.get(BLOCK), None);
        p.extend(BLOCK, 1_005 << SUB_BITS);
        assert_eq!(p.get(BLOCK + 3), Some((1_005 << SUB_BITS) + 3));
        assert_eq!(p.first(), 1_000 << SUB_BITS);
    }

    #[test]
    fn the_database_clock_uses_the_same_scale() {
        assert!(CLOCK_SQL.ends_with(&format!("<< {SUB_BITS})")), "{CLOCK_SQL}");
    }
}
