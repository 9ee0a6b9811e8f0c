//! Ingest leases (`ingest_lease`, migration 0007): concurrent runs of the same corpus share
//! the work instead of each embedding all of it.
//!
//! - [`Store::claim_window`] is the intake window's one round trip: the manifest lookup of
//!   every key, and a lease claimed for every chunk this run is about to embed. A key whose
//!   lease another live run holds is reported `leased_elsewhere`: the holder embeds it.
//! - Leases are claimed only while another ingest run is alive in the database (its advisory
//!   lock is held), and in a run's first [`ALWAYS_LEASED_WINDOWS`] windows (runs started
//!   together may not see each other's lock yet; a first window of a corpus run that finds
//!   nothing to embed with the read-only lookup sends no claim, as it would lease nothing):
//!   a run alone writes no lease rows after
//!   that, so a lone ingest pays one lock-table read per window and nothing per chunk (a
//!   corpus run alone uses [`Store::lookup_window`], which only reads, unless a stream source
//!   feeds the table: then its unchanged skips move their rows' positions, see
//!   `CLAIM_WINDOW_SQL`). When a
//!   run starts beside an older one, the older one starts claiming at its next window, and
//!   what it had queued without leases is claimed by its workers before it is sent
//!   (`worker::LateClaims`, one lock-table read a request while alone): what may be embedded
//!   twice is what it had at the provider when the other began.
//! - A backfill (`revision backfill`) never claims a lease ([`LeaseClaims::Never`]): it must
//!   finish every chunk it copies even beside `serve`, which writes every revision.
//! - A lease is live while it has not expired (`[ingest] lease_secs`) and its run still holds
//!   the run's advisory lock ([`RunLease`]): a run killed with -9 loses its connection, so its
//!   leases are taken over at once, and a hung one's after `lease_secs`.
//! - A lease is taken over by its own run, after expiry or death of the holder, or by a newer
//!   record (higher `source_seq`) of different content: a lease never blocks a newer record.
//! - The holder's store or park marks the lease finished in the outcome's transaction (the
//!   manifest claim of `ingest.rs`), recording that transaction. A finished lease turns away
//!   another run's claim of the same content only if the claim's snapshot cannot see that
//!   transaction: its manifest lookup missed the outcome, and without the lease it would embed
//!   the chunk again (deleting the lease on outcome did exactly that: three concurrent runs
//!   sent 1.12–1.22 inputs per chunk). Once the outcome is visible the manifest speaks for the
//!   chunk, even if an operator purged it since. The holder sweeps its finished leases after
//!   [`FINISHED_GRACE`] at each window and deletes its unfinished ones when it ends
//!   ([`RunLease::release`]); each run start sweeps expired ones.
//!
//! Leases only save provider calls. Every outcome is still fenced by the manifest's content
//! hash and `source_seq`, so a lost, stolen or expired lease costs a duplicate call, never a
//! wrong or lost chunk.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::{Connection, PgConnection, Row};

use super::{Store, StoreError};
use crate::model::ChunkStatus;

/// How long a finished lease outlives its outcome: far longer than a claim statement runs,
/// so a claim whose snapshot missed the outcome still finds the lease.
pub(crate) const FINISHED_GRACE: Duration = Duration::from_secs(10);

/// A run's first windows claim leases whether or not another run is alive yet: runs started
/// together take their advisory locks a few milliseconds apart.
pub(crate) const ALWAYS_LEASED_WINDOWS: u64 = 8;

/// When a window's claim takes leases ([`Store::claim_window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseClaims {
    /// Only while another run is alive: a run past its first windows.
    WhileShared,
    /// Whether or not another run is seen yet: a run's first [`ALWAYS_LEASED_WINDOWS`].
    Always,
    /// Never: a backfill, whose copies are fenced by the active revision's positions and
    /// which must finish every chunk it copies rather than leave one to a live writer
    /// (`serve` writes every revision beside it; two backfills of one target at once embed
    /// the chunks they share twice).
    Never,
}

/// One key of an intake window, as [`Store::claim_window`] takes it.
#[derive(Debug, Clone)]
pub(crate) struct WindowKey<'a> {
    pub doc_id: &'a str,
    pub chunk_index: i32,
    pub content_hash: &'a str,
    /// Position of the record ([`crate::store::position`]).
    pub source_seq: i64,
    /// True for a chunk the run would send to the provider (not a broken record, which is
    /// parked without a call and needs no lease).
    pub embeds: bool,
    /// Met earlier in this run: embedded whatever the manifest holds, so it is claimed even
    /// when the manifest holds the same content.
    pub repeated: bool,
}

/// What the window's round trip found for one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WindowClaim {
    /// Whether the chunk's last finished ingest had this record's content, and its status;
    /// `None` when the manifest has no row for the chunk.
    pub manifest: Option<(bool, ChunkStatus)>,
    /// Another live run holds the chunk's lease: it is left to that run.
    pub leased_elsewhere: bool,
    /// This claim took the chunk's lease for this run: the outcome's transaction marks it
    /// finished. Without it (a run alone, past its first windows) the store skips the lease
    /// update altogether.
    pub leased: bool,
    /// The manifest's record of the chunk is at least as new as this one: it was already, or
    /// this statement moved its position up to this record's (same content). Only then may the
    /// record be skipped as unchanged or already parked: a skip that left the manifest at an
    /// older position would let an older version still in flight (a stream entry a dead
    /// consumer held, a concurrent older run) overwrite the content this record confirms.
    pub confirmed: bool,
}

/// Marks one ingest run alive for as long as it holds its leases: a session advisory lock on
/// a connection of its own (outside the pool, so no pooled statement ever runs on it and the
/// lock dies with the process). Call [`RunLease::release`] when the run ends.
pub(crate) struct RunLease {
    conn: PgConnection,
    run_id: i64,
}

impl Store {
    /// Takes the advisory lock that marks run `run_id` alive, and sweeps leases that expired
    /// (left by runs that hung or died; each run sweeps, so the table stays small).
    pub(crate) async fn hold_run(&self, run_id: i64) -> Result<RunLease, StoreError> {
        sqlx::query("DELETE FROM ingest_lease WHERE expires_at < now()").execute(&self.pool).await?;
        let mut conn = self.pool.acquire().await?.detach();
        sqlx::query("SELECT pg_advisory_lock(embed_dlq_lease_lock_space(), $1::int)")
            .bind(run_id)
            .execute(&mut conn)
            .await?;
        Ok(RunLease { conn, run_id })
    }

    /// The manifest lookup of an intake window and the leases of the chunks this run will
    /// embed, in one statement: one claim per key, in the order of `keys`. Keys must be
    /// unique within the window. `lease` is clamped to
    /// at least a second. Leases are claimed as `claims` says: only while another run is
    /// alive, also in a run's first windows (two runs started together have not seen each
    /// other's lock yet), or never (a backfill).
    /// Also returns whether another run is alive: a run alone past its first windows, reading
    /// a corpus, sends [`Store::lookup_window`] instead (alone, the claim would take no lease
    /// and move no manifest row, so the lookup is the whole answer).
    pub(crate) async fn claim_window(
        &self,
        keys: &[WindowKey<'_>],
        run_id: i64,
        lease: Duration,
        claims: LeaseClaims,
        stream: bool,
    ) -> Result<(Vec<WindowClaim>, bool), StoreError> {
        crate::failpoint::hit!("ingest_claim");
        let KeyColumns { docs, idxs, hashes } = KeyColumns::of(keys);
        let seqs: Vec<i64> = keys.iter().map(|k| k.source_seq).collect();
        let embeds: Vec<bool> = keys.iter().map(|k| k.embeds).collect();
        let repeated: Vec<bool> = keys.iter().map(|k| k.repeated).collect();
        let rows = sqlx::query(sqlx::AssertSqlSafe(self.sized(CLAIM_WINDOW_SQL)))
            .bind(&self.target.name)
            .bind(&docs)
            .bind(&idxs)
            .bind(&hashes)
            .bind(&seqs)
            .bind(&embeds)
            .bind(&repeated)
            .bind(run_id)
            .bind(lease.as_secs_f64().max(1.0))
            .bind(FINISHED_GRACE.as_secs_f64())
            .bind(claims == LeaseClaims::Always)
            .bind(stream)
            .bind(claims != LeaseClaims::Never)
            .fetch_all(&self.pool)
            .await?;
        if let Some(r) = rows.first() {
            let bytes: i64 = r.try_get(3)?;
            self.claim_plan.store(plan_class(bytes), Ordering::Relaxed);
        }
        let mut out = vec![None; keys.len()];
        let mut others = false;
        // By column position, in the order of the statement's last SELECT.
        for r in rows {
            let (n, manifest) = key_and_manifest(&r)?;
            others |= r.try_get::<bool, _>(7)?;
            let claim = WindowClaim {
                manifest,
                leased_elsewhere: r.try_get(4)?,
                leased: r.try_get(5)?,
                confirmed: r.try_get::<Option<bool>, _>(6)?.unwrap_or(false),
            };
            place(&mut out, n, claim)?;
        }
        let claims = every_key_answered(out)?;
        Ok((claims, others))
    }

    /// The manifest lookup of an intake window alone, for a run that nothing can race (it
    /// reads a corpus, is past its first windows, no other ingest run is alive and no stream
    /// source feeds the table): the answer [`Store::claim_window`] would give, from a
    /// statement that only reads. `None` when something can race it after all: then the
    /// window needs the full claim, which fences its unchanged skips.
    pub(crate) async fn lookup_window(
        &self,
        keys: &[WindowKey<'_>],
        run_id: i64,
    ) -> Result<Option<Vec<WindowClaim>>, StoreError> {
        let ranges = WindowRanges::of(keys);
        let row = sqlx::query(sqlx::AssertSqlSafe(self.sized(LOOKUP_WINDOW_SQL)))
            .bind(&self.target.name)
            .bind(run_id)
            .bind(&ranges.docs)
            .bind(&ranges.los)
            .bind(&ranges.his)
            .fetch_one(self.lookup_pool.as_ref().unwrap_or(&self.pool))
            .await?;
        if row.try_get::<bool, _>(1)? {
            return Ok(None);
        }
        self.claim_plan.store(plan_class(row.try_get(0)?), Ordering::Relaxed);
        let in_range = row.try_get::<Option<Vec<i32>>, _>(2)?.unwrap_or_default();
        let chunks = row.try_get::<Option<Vec<i32>>, _>(3)?.unwrap_or_default();
        let found = row.try_get::<Option<&str>, _>(4)?.unwrap_or_default();
        if in_range.len() != chunks.len() {
            return Err(lookup_disagrees());
        }
        let mut manifest = vec![None; keys.len()];
        let mut rows = found.split(',').filter(|r| !r.is_empty());
        for (&range, &chunk) in in_range.iter().zip(&chunks) {
            let (code, hash) =
                rows.next().and_then(|r| r.split_at_checked(1)).ok_or_else(lookup_disagrees)?;
            // A row of the range that is not a key of the window (the range's gaps, or a key
            // of another range of the same document) answers nothing.
            if let Some(k) = ranges.key_at(range, chunk) {
                let status = lookup_code(code.as_bytes()[0])?;
                manifest[k] = Some((hash == keys[k].content_hash, status));
            }
        }
        if rows.next().is_some() {
            return Err(lookup_disagrees());
        }
        // Alone and reading a corpus: no lease to take, and nothing older in flight that a skip
        // must fence against (the claim's `racing` is false, so it confirms all).
        let claims = manifest
            .into_iter()
            .map(|manifest| WindowClaim { manifest, leased_elsewhere: false, leased: false, confirmed: true })
            .collect();
        Ok(Some(claims))
    }
}

impl Store {
    /// Whether another ingest run of this database is alive (holds its advisory lock): asked
    /// before a request built without leases is sent (`worker::LateClaims`).
    pub(crate) async fn other_run_alive(&self, run_id: i64) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(OTHER_RUN_ALIVE_SQL)
            .bind(run_id)
            .fetch_one(self.lookup_pool.as_ref().unwrap_or(&self.pool))
            .await?)
    }
}

/// [`Store::other_run_alive`]'s statement: the `live` runs of [`CLAIM_WINDOW_SQL`] but `$1`.
const OTHER_RUN_ALIVE_SQL: &str = r#"
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND objsubid = 2
       AND classid = embed_dlq_lease_lock_space()::oid
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND objid::bigint <> $1::bigint)
"#;

/// The manifest ranges that cover a window's keys, for [`Store::lookup_window`], and which
/// key each chunk of a range is. One `(doc_id, first, last)` chunk range per run of keys of
/// one document (the chunks of a document usually come together), read with one index
/// descent instead of one per key. A run whose chunks are sparse (its range more than twice
/// its keys, plus a few) gets a range per key instead, so a window never reads more than
/// about twice its keys' rows: two chunks a million apart of one document are two probes, not
/// a million rows. Two runs of one document may overlap (chunks 0 and 9, another document,
/// then 4): a manifest row is then found by both, and answers only the key of its own range.
struct WindowRanges<'a> {
    docs: Vec<&'a str>,
    los: Vec<i32>,
    his: Vec<i32>,
    /// Where each range's chunks start in `slots`.
    base: Vec<usize>,
    /// For each chunk of each range, first to last: its key's place in the window plus one,
    /// or 0 where the range has no key.
    slots: Vec<u32>,
}

impl<'a> WindowRanges<'a> {
    fn of(keys: &'a [WindowKey<'a>]) -> Self {
        let mut r = WindowRanges { docs: vec![], los: vec![], his: vec![], base: vec![], slots: vec![] };
        let mut start = 0;
        while let Some(first) = keys.get(start) {
            let run = keys[start..].iter().take_while(|k| k.doc_id == first.doc_id).count();
            let group = start..start + run;
            let lo = keys[group.clone()].iter().map(|k| k.chunk_index).min().unwrap_or(first.chunk_index);
            let hi = keys[group.clone()].iter().map(|k| k.chunk_index).max().unwrap_or(first.chunk_index);
            let span = i64::from(hi) - i64::from(lo) + 1;
            if span <= 2 * run as i64 + 8 {
                r.push(first.doc_id, lo, hi);
                for n in group {
                    let slot = r.base[r.base.len() - 1] + (keys[n].chunk_index - lo) as usize;
                    r.slots[slot] = n as u32 + 1;
                }
            } else {
                for n in group {
                    r.push(keys[n].doc_id, keys[n].chunk_index, keys[n].chunk_index);
                    *r.slots.last_mut().expect("a range of one chunk") = n as u32 + 1;
                }
            }
            start += run;
        }
        r
    }

    fn push(&mut self, doc: &'a str, lo: i32, hi: i32) {
        self.docs.push(doc);
        self.los.push(lo);
        self.his.push(hi);
        self.base.push(self.slots.len());
        self.slots.resize(self.slots.len() + (hi - lo) as usize + 1, 0);
    }

    /// The key (its place in the window) that chunk `chunk` of range `range` (from 1) is.
    fn key_at(&self, range: i32, chunk: i32) -> Option<usize> {
        let r = usize::try_from(range).ok()?.checked_sub(1)?;
        let (lo, hi) = (*self.los.get(r)?, self.his[r]);
        if !(lo..=hi).contains(&chunk) {
            return None;
        }
        match self.slots[self.base[r] + (chunk - lo) as usize] {
            0 => None,
            key => Some(key as usize - 1),
        }
    }

    /// The ranges as `(doc_id, first, last)`.
    #[cfg(test)]
    fn triples(&self) -> Vec<(&str, i32, i32)> {
        (0..self.docs.len()).map(|r| (self.docs[r], self.los[r], self.his[r])).collect()
    }
}

/// The key columns of a window, as the statements bind them.
struct KeyColumns<'a> {
    docs: Vec<&'a str>,
    idxs: Vec<i32>,
    hashes: Vec<&'a str>,
}

impl<'a> KeyColumns<'a> {
    fn of(keys: &'a [WindowKey<'a>]) -> Self {
        KeyColumns {
            docs: keys.iter().map(|k| k.doc_id).collect(),
            idxs: keys.iter().map(|k| k.chunk_index).collect(),
            hashes: keys.iter().map(|k| k.content_hash).collect(),
        }
    }
}

impl Store {
    /// `sql` under the name of the manifest's current size class: prepared once per
    /// connection and class (see [`plan_class`]), since planning the window's statement cost
    /// as much as running it.
    fn sized(&self, sql: &str) -> String {
        let size_class = self.claim_plan.load(Ordering::Relaxed);
        format!("/* manifest size class {size_class} */{sql}")
    }
}

/// Puts the claim of the window's `n`-th key (from 1) in its place.
fn place(out: &mut [Option<WindowClaim>], n: i64, claim: WindowClaim) -> Result<(), StoreError> {
    let slot = usize::try_from(n - 1).ok().and_then(|i| out.get_mut(i));
    *slot.ok_or_else(|| StoreError::Db(sqlx::Error::Decode(format!("no key {n} in the window").into())))? =
        Some(claim);
    Ok(())
}

/// The first three columns both window statements return: the key's place in the window
/// (`n`, from 1), and whether the manifest holds this content and its status (`same`,
/// `status`; no status: the manifest has no row for the key).
fn key_and_manifest(r: &sqlx::postgres::PgRow) -> Result<(i64, Option<(bool, ChunkStatus)>), StoreError> {
    let n: i64 = r.try_get(0)?;
    let manifest = match r.try_get::<Option<&str>, _>(2)? {
        Some(s) => {
            let status = ChunkStatus::parse(s).ok_or_else(|| {
                StoreError::Db(sqlx::Error::Decode(format!("unknown manifest status {s:?}").into()))
            })?;
            Some((r.try_get::<Option<bool>, _>(1)?.unwrap_or(false), status))
        }
        None => None,
    };
    Ok((n, manifest))
}

/// The lookup's columns (ranges, chunks, rows found) did not have one entry per row found.
fn lookup_disagrees() -> StoreError {
    StoreError::Db(sqlx::Error::Decode("the lookup's columns disagree in length".into()))
}

/// A manifest row's status as [`LOOKUP_WINDOW_SQL`] spells it: one letter.
fn lookup_code(code: u8) -> Result<ChunkStatus, StoreError> {
    match code {
        b's' => Ok(ChunkStatus::Stored),
        b'p' => Ok(ChunkStatus::Parked),
        b'e' => Ok(ChunkStatus::Exhausted),
        b'r' => Ok(ChunkStatus::Reingest),
        _ => {
            let problem = format!("unknown manifest status code {:?}", char::from(code));
            Err(StoreError::Db(sqlx::Error::Decode(problem.into())))
        }
    }
}

/// The claims of a window, once every key has one.
fn every_key_answered(out: Vec<Option<WindowClaim>>) -> Result<Vec<WindowClaim>, StoreError> {
    out.into_iter()
        .map(|c| {
            c.ok_or_else(|| StoreError::Db(sqlx::Error::Decode("a key of the window got no claim".into())))
        })
        .collect()
}

/// The size class of a manifest of `bytes` on disk: one more each time it doubles. The claim
/// statement is prepared under a name of its class, so Postgres plans it again (and caches a
/// generic plan after a few windows) whenever the manifest has doubled since: a plan cached
/// while the manifest was nearly empty, where a scan of its one page beats an index probe per
/// key, is never kept while it grows to millions of rows. Between doublings the cached plan is
/// planned for at least half the size it meets, and an `ANALYZE` replans it anyway.
fn plan_class(bytes: i64) -> u32 {
    const PAGE: i64 = 8192;
    u64::BITS - ((bytes.max(0) / PAGE) as u64).leading_zeros()
}

impl RunLease {
    /// Ends the run's claim on everything: deletes the leases of chunks it did not finish (so
    /// another run need not wait for their expiry) and its finished leases past
    /// [`FINISHED_GRACE`] (the rest expire), then drops its advisory lock by closing its
    /// connection. Best effort: if this fails, the closed connection still frees the leases
    /// for takeover.
    pub(crate) async fn release(mut self) {
        let released = sqlx::query(
            "DELETE FROM ingest_lease
              WHERE run_id = $1 AND (finished_at IS NULL OR finished_at < now() - make_interval(secs => $2))",
        )
        .bind(self.run_id)
        .bind(FINISHED_GRACE.as_secs_f64())
        .execute(&mut self.conn)
        .await;
        if let Err(e) = released {
            tracing::warn!(error = %e, run_id = self.run_id, "could not release the run's leases; they are taken over once its connection closes");
        }
        let _ = self.conn.close().await;
    }
}

/// The window's round trip. `$1` table, `$2..$5` keys, hashes and positions, `$6` whether the
/// key is a chunk to embed, `$7` whether the run met it before, `$8` run id, `$9` lease
/// seconds, `$10` [`FINISHED_GRACE`] in seconds, `$11` claim even if no other run is alive,
/// `$12` the run reads a stream source, `$13` the run takes leases at all (not a backfill).
///
/// `confirmed`: the keys whose manifest row holds this record's content at an older position
/// (about to be skipped as unchanged or already parked) get this record's position, locked in
/// key order like every manifest writer; a row changed meanwhile is left alone (and the record
/// then is not skipped). Only while something older could still be in flight (`racing`):
/// another run is alive, `$12` (a stream source: a dead consumer's pending entries are
/// older records no live run holds), or a stream source feeds the table (`fed`,
/// `ingest_stream_fed`: an entry older than this corpus run, held by a dead consumer or not
/// read yet, could be written after it). A corpus run alone of a table no stream feeds moves
/// nothing, so an identical rerun changes no row.
///
/// `known`: one index probe of the manifest per key (the `OFFSET 0` keeps the planner from
/// turning the lookup into a hash join over every manifest row of the table: custom plans
/// chose that once the manifest held a few thousand rows, at a cost that grows with it).
/// `wanted`: chunks this run embeds unless the lease is elsewhere (not already finished with
/// the same content, or repeated in the run). `shared`: another run of this database is
/// alive (holds its advisory lock), or `$11` (the run is young), unless `$13` is false; a run
/// alone claims nothing after its first windows, so it writes no lease rows.
/// Otherwise the wanted chunks' leases are inserted in key order (no
/// deadlock with other claims or with the outcome transactions, which lock in the same
/// order). A lease is taken over when it is this run's; when it is for different content
/// that is finished or older than ours (a lease never blocks a newer record); when it is
/// unfinished and expired or its holder is dead (no advisory lock); when it is finished in a
/// transaction this statement's snapshot sees (the manifest lookup above saw the outcome, so
/// if the chunk is still wanted the manifest changed since); or when the manifest already
/// holds a newer record than the lease's (the holder's outcome is superseded). A lease not
/// taken over is another run's, in flight or finished unseen: `leased_elsewhere`.
/// `manifest_bytes`: the manifest's size on disk, which picks the statement's size class for
/// the next window (`plan_class`). Read by column position: `n` (the key's place in the
/// window, from 1), `same` (the manifest holds this content), `status`, `manifest_bytes`,
/// `leased_elsewhere`, `leased`, `confirmed`, `others` (another run is alive or a stream
/// feeds the table: the next window cannot be a lookup alone).
/// The statement decides from the lease row as it is when the row lock is granted, so two
/// runs claiming the same window at once agree on one holder. `swept`: the run's own leases
/// finished more than the grace ago.
const CLAIM_WINDOW_SQL: &str = r#"
WITH input AS (
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::bigint[], $6::bool[], $7::bool[])
        WITH ORDINALITY AS t(doc_id, chunk_index, content_hash, source_seq, embeds, repeated, n)
), known AS (
    SELECT i.n, i.doc_id, i.chunk_index, i.content_hash, i.source_seq, m.content_hash AS done_hash, m.status,
           m.source_seq AS done_seq, i.repeated,
           i.embeds AND (i.repeated OR m.content_hash IS DISTINCT FROM i.content_hash) AS wanted
      FROM input i
      LEFT JOIN LATERAL (
           SELECT m.content_hash, m.status, m.source_seq FROM ingest_manifest m
            WHERE m.target_table = $1::text AND m.doc_id = i.doc_id AND m.chunk_index = i.chunk_index
           OFFSET 0) m ON true
), snap AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
), live AS MATERIALIZED (
    SELECT objid::bigint AS run_id
      FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND objsubid = 2
       AND classid = embed_dlq_lease_lock_space()::oid
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
), others AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM live WHERE run_id <> $8::bigint) AS yes
), shared AS MATERIALIZED (
    SELECT $13::bool AND ($11::bool OR (SELECT yes FROM others)) AS yes
), fed AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM ingest_stream_fed WHERE target_table = $1::text) AS yes
), racing AS MATERIALIZED (
    SELECT $12::bool OR (SELECT yes FROM others) OR (SELECT yes FROM fed) AS yes
), claimed AS (
    INSERT INTO ingest_lease AS l (target_table, doc_id, chunk_index, content_hash, source_seq, run_id, expires_at)
    SELECT $1::text, doc_id, chunk_index, content_hash, source_seq, $8::bigint,
           now() + make_interval(secs => $9::float8)
      FROM known WHERE wanted AND (SELECT yes FROM shared) ORDER BY doc_id, chunk_index
    ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE SET
        content_hash = EXCLUDED.content_hash,
        source_seq   = EXCLUDED.source_seq,
        run_id       = EXCLUDED.run_id,
        expires_at   = EXCLUDED.expires_at,
        finished_at  = NULL,
        finished_xact = NULL
      WHERE l.run_id = EXCLUDED.run_id
         OR (l.content_hash <> EXCLUDED.content_hash
             AND (l.finished_xact IS NOT NULL OR l.source_seq < EXCLUDED.source_seq))
         OR (l.finished_xact IS NULL
             AND (l.expires_at <= now() OR l.run_id NOT IN (SELECT run_id FROM live)))
         OR pg_visible_in_snapshot(l.finished_xact, (SELECT s FROM snap))
         OR EXISTS (SELECT 1 FROM ingest_manifest m
                     WHERE m.target_table = l.target_table AND m.doc_id = l.doc_id
                       AND m.chunk_index = l.chunk_index AND m.source_seq > l.source_seq)
    RETURNING l.doc_id, l.chunk_index
), swept AS (
    DELETE FROM ingest_lease
     WHERE run_id = $8::bigint AND finished_at < now() - make_interval(secs => $10::float8)
), confirming AS MATERIALIZED (
    -- The rows to confirm, each locked by its key, in key order (a `LATERAL ... FOR UPDATE`
    -- is never flattened into a join): joined with the manifest, a manifest believed empty
    -- (deleted, analyzed, filled again) was walked once a window. The tuple id locked is the
    -- row as this statement sees it, or, where another writer changed it meanwhile, its newer
    -- version, which this statement cannot see: the update below then skips it, and the
    -- record is written again instead of skipped (not `confirmed`).
    SELECT x.tid, k2.doc_id, k2.chunk_index, k2.content_hash, k2.source_seq
      FROM (SELECT doc_id, chunk_index, content_hash, source_seq FROM known
             WHERE NOT repeated AND done_hash = content_hash AND done_seq < source_seq
               AND (SELECT yes FROM racing)
             ORDER BY doc_id, chunk_index) k2
     CROSS JOIN LATERAL (SELECT x.ctid AS tid FROM ingest_manifest x
                          WHERE x.target_table = $1::text AND x.doc_id = k2.doc_id
                            AND x.chunk_index = k2.chunk_index
                            FOR UPDATE) x
), confirmed AS (
    -- By tuple id (a TID scan: no join with the manifest to plan), the rows locked above;
    -- the conditions are checked again on the row as it is.
    UPDATE ingest_manifest m SET source_seq = c.source_seq
      FROM confirming c
     WHERE m.ctid = ANY (ARRAY(SELECT tid FROM confirming)) AND m.ctid = c.tid
       AND m.target_table = $1::text AND m.doc_id = c.doc_id AND m.chunk_index = c.chunk_index
       AND m.content_hash = c.content_hash AND m.source_seq < c.source_seq
    RETURNING m.doc_id, m.chunk_index
)
SELECT k.n, k.done_hash = k.content_hash AS same, k.status,
       (SELECT pg_relation_size('ingest_manifest'::regclass)) AS manifest_bytes,
       (k.wanted AND (SELECT yes FROM shared) AND c.doc_id IS NULL) AS leased_elsewhere,
       c.doc_id IS NOT NULL AS leased,
       (k.done_seq >= k.source_seq OR f.doc_id IS NOT NULL OR NOT (SELECT yes FROM racing)) AS confirmed,
       (SELECT yes FROM others) OR (SELECT yes FROM fed) AS others
  FROM known k
  LEFT JOIN claimed c ON c.doc_id = k.doc_id AND c.chunk_index = k.chunk_index
  LEFT JOIN confirmed f ON f.doc_id = k.doc_id AND f.chunk_index = k.chunk_index
"#;

/// [`Store::lookup_window`]'s statement: what `known` of [`CLAIM_WINDOW_SQL`] finds and its
/// `others` (another run alive, or a stream feeds the table), nothing written, and the comparison of contents left to the caller. The manifest
/// is read by chunk ranges (`$3..$5`, from [`WindowRanges`]): one index descent per range (the
/// `OFFSET 0` keeps each one an index scan whatever the manifest's size), where a probe per
/// key cost three times as much (2.9 against 0.9 ms for 512 keys of 64 documents). One row
/// comes back, by column position: `manifest_bytes`, `others`, then each manifest row found
/// as its range (from 1), its chunk and `status letter || content_hash` ([`lookup_code`]),
/// comma-separated, in one order (the aggregates of one row read their rows in the same
/// order). Sending the window's keys and hashes to be joined, sorted and answered a row per
/// key was most of an unchanged rerun's statement, on both sides. `$1` table, `$2` run id.
const LOOKUP_WINDOW_SQL: &str = r#"
WITH others AS MATERIALIZED (
    SELECT EXISTS (
        SELECT 1 FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 2
           AND classid = embed_dlq_lease_lock_space()::oid
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND objid::bigint <> $2::bigint)
        OR EXISTS (SELECT 1 FROM ingest_stream_fed WHERE target_table = $1::text) AS yes
)
SELECT (SELECT pg_relation_size('ingest_manifest'::regclass)) AS manifest_bytes,
       (SELECT yes FROM others) AS others,
       array_agg(r.n::int) AS in_range,
       array_agg(m.chunk_index) AS chunks,
       string_agg(CASE m.status WHEN 'stored' THEN 's' WHEN 'parked' THEN 'p' WHEN 'exhausted' THEN 'e'
                                WHEN 'reingest' THEN 'r' ELSE '?' END || m.content_hash, ',') AS found
  FROM UNNEST($3::text[], $4::int[], $5::int[]) WITH ORDINALITY AS r(doc_id, lo, hi, n),
  LATERAL (
       SELECT m.chunk_index, m.content_hash, m.status FROM ingest_manifest m
        WHERE m.target_table = $1::text AND m.doc_id = r.doc_id
          AND m.chunk_index BETWEEN r.lo AND r.hi
       OFFSET 0) m
"#;

#[cfg(test)]
mod tests {
    use super::{lookup_code, plan_class};
    use crate::model::ChunkStatus;

    #[test]
    fn every_lookup_code_reads_as_its_status() {
        for status in
            [ChunkStatus::Stored, ChunkStatus::Parked, ChunkStatus::Exhausted, ChunkStatus::Reingest]
        {
            assert_eq!(lookup_code(status.as_str().as_bytes()[0]).unwrap(), status);
        }
        // The statement's answer for a status it does not know: an error, never a guess.
        assert!(lookup_code(b'?').is_err());
        assert!(lookup_code(b'S').is_err());
    }

    fn key(doc: &str, chunk_index: i32) -> super::WindowKey<'_> {
        super::WindowKey {
            doc_id: doc,
            chunk_index,
            content_hash: "",
            source_seq: 0,
            embeds: true,
            repeated: false,
        }
    }

    #[test]
    fn a_window_is_read_by_document_ranges_never_much_beyond_its_keys() {
        let keys = [
            key("a", 0),
            key("a", 1),
            key("a", 3),
            key("b", 7),
            key("a", 9),
            key("c", 5),
            key("c", 1_000_000),
        ];
        let ranges = super::WindowRanges::of(&keys);
        assert_eq!(
            ranges.triples(),
            vec![("a", 0, 3), ("b", 7, 7), ("a", 9, 9), ("c", 5, 5), ("c", 1_000_000, 1_000_000)]
        );
        // Each chunk of a range is its key, or none (range 1's chunk 2 is not in the window).
        let at = |range, chunk| ranges.key_at(range, chunk);
        assert_eq!([at(1, 0), at(1, 1), at(1, 2), at(1, 3)], [Some(0), Some(1), None, Some(2)]);
        assert_eq!([at(2, 7), at(3, 9), at(4, 5), at(5, 1_000_000)], [Some(3), Some(4), Some(5), Some(6)]);
        // Outside any range, or no such range.
        assert_eq!([at(1, 4), at(2, 6), at(0, 0), at(6, 0), at(-1, 0)], [None; 5]);
        let dense: Vec<_> = (0..512).rev().map(|i| key("d", i * 2)).collect();
        let ranges = super::WindowRanges::of(&dense);
        assert_eq!(ranges.triples(), vec![("d", 0, 1022)]);
        assert_eq!(
            (ranges.key_at(1, 1022), ranges.key_at(1, 0), ranges.key_at(1, 1)),
            (Some(0), Some(511), None)
        );
        assert_eq!(super::WindowRanges::of(&[]).triples(), vec![]);
    }

    /// One document in two runs whose ranges overlap: each chunk answers the key of its own
    /// range only.
    #[test]
    fn overlapping_ranges_of_one_document_answer_each_key_once() {
        let keys = [key("x", 0), key("x", 9), key("y", 0), key("x", 4), key("x", 1), key("x", 8)];
        let ranges = super::WindowRanges::of(&keys);
        assert_eq!(ranges.triples(), vec![("x", 0, 9), ("y", 0, 0), ("x", 1, 8)]);
        // Chunks 4 and 8 are found by both ranges of x; each is the key of the third only.
        let at = |range, chunk| ranges.key_at(range, chunk);
        assert_eq!([at(1, 4), at(1, 8), at(1, 1)], [None; 3]);
        assert_eq!(
            [at(3, 4), at(3, 1), at(3, 8), at(1, 0), at(1, 9)],
            [Some(3), Some(4), Some(5), Some(0), Some(1)]
        );
    }

    #[test]
    fn the_size_class_grows_by_one_each_time_the_manifest_doubles() {
        assert_eq!(plan_class(0), 0);
        assert_eq!(plan_class(-1), 0);
        assert_eq!(plan_class(8191), 0);
        assert_eq!(plan_class(8192), 1);
        assert_eq!(plan_class(2 * 8192 - 1), 1);
        assert_eq!(plan_class(2 * 8192), 2);
        assert_eq!(plan_class(1 << 40), 28);
        assert_eq!(plan_class(i64::MAX), 50);
    }
}
