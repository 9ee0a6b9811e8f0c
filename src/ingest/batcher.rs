//! Groups records into intake windows with unique keys, filters each window against the
//! manifest in one lookup and hands provider-sized batches to the workers.
//!
//! Every record carries its position (`store::position`: when it entered): when one key occurs
//! twice, the store keeps the later line whatever order the outcomes are written in. A key seen before
//! in this run is therefore never skipped as "unchanged" or "already parked" (the manifest
//! may still hold what an earlier line of this run is about to replace): it is embedded and
//! written again, and its position decides.

use super::seen::{KeyHashState, SeenKeys, key_hash};
use super::*;
use std::collections::VecDeque;

/// Rejected lines, and invalid records, logged one by one (each kind) before the log only
/// counts them: a corpus of a million broken lines must not become a million log lines.
pub const LOGGED_BAD_LINES: u64 = 20;
/// After the first [`LOGGED_BAD_LINES`] of a kind, one line per this many more, with the
/// count so far; the totals come when the input ends.
pub const BAD_LINES_LOG_EVERY: u64 = 10_000;

/// How many rejected lines and invalid records a run met, for its log.
#[derive(Debug, Default)]
pub(super) struct BadLines {
    pub(super) rejected: u64,
    pub(super) invalid: u64,
}

impl BadLines {
    /// Whether the `n`-th line of a kind is logged on its own (else `None`), or `Some(false)`
    /// for a count line.
    pub(super) fn verdict(n: u64) -> Option<bool> {
        if n <= LOGGED_BAD_LINES {
            Some(true)
        } else if (n - LOGGED_BAD_LINES).is_multiple_of(BAD_LINES_LOG_EVERY) {
            Some(false)
        } else {
            None
        }
    }

    /// The totals, when some were not logged one by one.
    pub(super) fn log_totals(&self) {
        if self.rejected > LOGGED_BAD_LINES {
            let n = self.rejected;
            tracing::warn!(
                total = n,
                "rejected input lines in total: {n} (the first {LOGGED_BAD_LINES} logged one by one)"
            );
        }
        if self.invalid > LOGGED_BAD_LINES {
            let n = self.invalid;
            tracing::warn!(
                total = n,
                "invalid records in total: {n} (the first {LOGGED_BAD_LINES} logged one by one)"
            );
        }
    }
}

/// The batcher of one run: its window, its claim in flight and the keys it has met.
pub(super) struct Batcher<'a> {
    pub(super) pipeline: &'a Pipeline,
    /// Broken lines met so far (their log is bounded).
    pub(super) bad: BadLines,
    pub(super) tally: Arc<Mutex<Tally>>,
    pub(super) run_id: i64,
    /// The positions of the run's lines (records without their own).
    pub(super) positions: RunPositions,
    pub(super) chunks: Vec<WindowChunk>,
    pub(super) invalid: Vec<ParkedChunk>,
    /// The window's keys, by [`key_hash`]: a key met twice flushes the window first (two
    /// keys that share a hash only flush it early).
    pub(super) keys: HashSet<u64, KeyHashState>,
    /// Every key of this run so far, to recognise a key that occurs twice.
    pub(super) seen_in_run: SeenKeys,
    /// Keys of the current window seen earlier in this run: never skipped.
    pub(super) repeated: HashSet<(String, i32)>,
    /// The byte charges of the records in the window; shared by the window's jobs.
    pub(super) charge: Charge,
    /// Windows sent on so far (the first ones always claim leases, see `lease`).
    pub(super) windows: u64,
    /// The window's delete records (their keys are in `keys`: a whole document as index -1).
    pub(super) deletes: Vec<DeleteRequest>,
    /// A whole document was deleted earlier in this run: a later chunk of any document is
    /// looked up in `seen_in_run` under the document's key too.
    pub(super) doc_deletes: bool,
    /// The run cleans up: every window's keys are recorded (`ingest_seen`).
    pub(super) record_seen: bool,
    /// A dry run: windows are recorded and their deletes listed, nothing else.
    pub(super) dry_run: bool,
    /// Told of the records skipped as already stored or parked (settled, never written).
    pub(super) acks: Option<Arc<source::AckPart>>,
    /// Earlier windows whose statements are in flight while this one fills up, oldest first:
    /// the round trips overlap with reading and hashing the next records, and with each
    /// other. They are finished (skips counted, jobs sent) in order. Several only while each
    /// only reads ([`WINDOWS_IN_FLIGHT`]); a window that claims waits for all of them.
    pub(super) pending: VecDeque<PendingWindow>,
    /// No other ingest run was alive at the last answer: the next window, past the first
    /// ones and reading a corpus, is sent as the read-only [`Store::lookup_window`].
    pub(super) alone: bool,
}

/// Most windows in flight at once while the run only reads: a corpus run alone past its
/// first windows sends [`Store::lookup_window`] alone, which writes nothing, so the lookups
/// of neighbouring windows may run side by side. With one in flight the reader, the batcher
/// and Postgres took turns on an unchanged rerun (a third of the two cores idle); the pool
/// has a connection for each (`IngestSettings::pipeline`).
pub(crate) const WINDOWS_IN_FLIGHT: usize = 2;

/// A chunk of a window: the record, its content hash and position, and its metadata as read
/// (a tree only if it is parked: [`RawMetadata`]).
pub(super) struct WindowChunk {
    pub(super) chunk: Chunk,
    pub(super) hash: HexHash,
    pub(super) seq: i64,
    pub(super) metadata: Option<RawMetadata>,
}

/// A window's records and what [`Store::claim_window`] answered for their keys (and whether
/// another run was alive); `None`: the window was sent as a lookup alone, which found another
/// run alive, so it still needs its claim ([`Batcher::finish_oldest`] sends it).
pub(super) type ClaimedWindow = (WindowRecords, Result<Option<(Vec<WindowClaim>, bool)>, StoreError>);

/// A window sent to [`Store::claim_window`] and not yet finished ([`Batcher::finish_pending`]).
pub(super) struct PendingWindow {
    /// The window's records, with its statement, and once the task ends, their claims.
    pub(super) claim: tokio_util::task::AbortOnDropHandle<ClaimedWindow>,
    pub(super) charge: Arc<Charge>,
}

/// The records of one window: they travel with its statement, whose keys borrow from them
/// ([`WindowRecords::keys`]: no key owns a copy of a document id or a hash), and come back
/// with its answer.
pub(super) struct WindowRecords {
    pub(super) chunks: Vec<WindowChunk>,
    pub(super) invalid: Vec<ParkedChunk>,
    /// Keys of the window met earlier in this run: never skipped.
    pub(super) repeated: HashSet<(String, i32)>,
}

impl WindowRecords {
    /// The keys as [`Store::claim_window`] takes them: the chunks first, then the invalid
    /// records (the claims come back in this order).
    pub(super) fn keys(&self) -> Vec<WindowKey<'_>> {
        let is_repeated = |doc_id: &str, chunk_index: i32| {
            !self.repeated.is_empty() && self.repeated.contains(&(doc_id.to_owned(), chunk_index))
        };
        let window_key = |doc_id, chunk_index, content_hash, source_seq, embeds| WindowKey {
            doc_id,
            chunk_index,
            content_hash,
            source_seq,
            embeds,
            repeated: is_repeated(doc_id, chunk_index),
        };
        self.chunks
            .iter()
            .map(|c| window_key(&c.chunk.doc_id, c.chunk.chunk_index, c.hash.as_str(), c.seq, true))
            .chain(
                self.invalid
                    .iter()
                    .map(|p| window_key(&p.doc_id, p.chunk_index, &p.content_hash, p.source_seq, false)),
            )
            .collect()
    }
}

impl<'a> Batcher<'a> {
    pub(super) fn new(
        pipeline: &'a Pipeline,
        tally: Arc<Mutex<Tally>>,
        run_id: i64,
        positions: RunPositions,
    ) -> Self {
        Batcher {
            pipeline,
            bad: BadLines::default(),
            tally,
            run_id,
            positions,
            chunks: vec![],
            invalid: vec![],
            keys: HashSet::default(),
            seen_in_run: SeenKeys::new(),
            repeated: HashSet::new(),
            charge: Charge::default(),
            windows: 0,
            deletes: vec![],
            doc_deletes: false,
            record_seen: pipeline.options.cleanup.mode != CleanupMode::None,
            dry_run: pipeline.options.cleanup.dry_run,
            acks: None,
            pending: VecDeque::new(),
            alone: false,
        }
    }

    /// Adds the key `(doc_id, chunk_index)` (its [`key_hash`] is `hash`) to the window,
    /// remembering whether this run met it before (or deleted its document earlier: the chunk
    /// must then be written again, never skipped as unchanged).
    pub(super) fn claim_key(&mut self, hash: u64, doc_id: &str, chunk_index: i32) {
        let seen = self.seen_in_run.insert(hash);
        if seen || (self.doc_deletes && self.seen_in_run.contains(key_hash(doc_id, -1))) {
            self.repeated.insert((doc_id.to_owned(), chunk_index));
        }
        self.keys.insert(hash);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.invalid.is_empty() && self.deletes.is_empty()
    }

    /// Nothing in the window and no window in flight: nothing a linger would flush.
    pub(super) fn is_idle(&self) -> bool {
        self.is_empty() && self.pending.is_empty()
    }

    pub(super) async fn push(
        &mut self,
        rec: Record,
        at: Option<i64>,
        jobs: &flume::Sender<Job>,
    ) -> Result<(), IngestError> {
        let position = match at {
            Some(p) => p,
            None => self.position(rec.line()).await?,
        };
        match rec {
            Record::Rejected { line, problem } => {
                self.bad.rejected += 1;
                let n = self.bad.rejected;
                match BadLines::verdict(n) {
                    Some(true) => {
                        tracing::warn!(line, problem = %Escaped(&problem), "rejected input line (no usable identity)")
                    }
                    Some(false) => tracing::warn!(so_far = n, "rejected input lines so far: {n}"),
                    None => {}
                }
                metrics::counter!(crate::metrics::LINES_REJECTED).increment(1);
                let mut t = self.tally.lock().unwrap();
                t.summary.rejected_lines += 1;
                if t.summary.rejected_examples.len() < 20 {
                    t.summary.rejected_examples.push(RejectedLine { line, problem });
                }
                return Ok(());
            }
            Record::Invalid { line, doc_id, chunk_index, problem, payload, raw_hash } => {
                self.bad.invalid += 1;
                let n = self.bad.invalid;
                match BadLines::verdict(n) {
                    Some(true) => tracing::warn!(line, doc_id = %Escaped(&doc_id), chunk_index,
                        problem = %Escaped(&problem), "invalid record (parked unless already in the DLQ)"),
                    Some(false) => tracing::warn!(so_far = n, "invalid records so far: {n}"),
                    None => {}
                }
                self.tally.lock().unwrap().summary.records += 1;
                let hash = key_hash(&doc_id, chunk_index);
                self.make_room(hash, jobs).await?;
                self.claim_key(hash, &doc_id, chunk_index);
                self.invalid.push(ParkedChunk {
                    source_seq: position,
                    doc_id,
                    chunk_index,
                    text_hash: crate::model::TextHash::of(&raw_hash),
                    content_hash: raw_hash,
                    payload,
                    class: ErrorClass::InvalidRecord,
                    reason: Reason::InvalidRecord.as_str().into(),
                    last_error: format!("line {line}: {problem}"),
                    last_status: None,
                    attempts: 0,
                    retry_in: None,
                });
            }
            Record::Delete { doc_id, chunk_index, .. } => {
                self.tally.lock().unwrap().summary.delete_requests += 1;
                let hash = key_hash(&doc_id, chunk_index.unwrap_or(-1));
                self.make_room(hash, jobs).await?;
                // A later record of the chunk (of the document) is written again, not skipped.
                self.seen_in_run.insert(hash);
                self.doc_deletes |= chunk_index.is_none();
                self.keys.insert(hash);
                self.deletes.push(DeleteRequest { doc_id, chunk_index, source_seq: position });
            }
            Record::Chunk { chunk, metadata, .. } => {
                self.tally.lock().unwrap().summary.records += 1;
                let key = key_hash(&chunk.doc_id, chunk.chunk_index);
                self.make_room(key, jobs).await?;
                let hash = HexHash::of_content(
                    self.pipeline.embedder.client.model(),
                    self.pipeline.embedder.dimensions,
                    &chunk.text,
                );
                self.claim_key(key, &chunk.doc_id, chunk.chunk_index);
                self.chunks.push(WindowChunk { chunk, hash, seq: position, metadata });
            }
        }
        if self.keys.len() >= self.pipeline.options.intake_window {
            self.flush(jobs).await?;
        }
        Ok(())
    }

    /// The position of line `line` of a corpus run, reserving the next block when the line is
    /// past the last one (one statement per [`crate::store::position::BLOCK`] lines).
    pub(super) async fn position(&mut self, line: u64) -> Result<i64, IngestError> {
        if let Some(p) = self.positions.get(line) {
            return Ok(p);
        }
        let store = &self.pipeline.store;
        let base = with_db_retry(|| store.reserve_positions()).await?;
        self.positions.extend(line, base);
        Ok(self.positions.get(line).expect("the block just reserved holds the line"))
    }

    /// Flushes first if the key whose [`key_hash`] is `key` is already in the window: a later
    /// line for the same chunk must not share a statement with an earlier one.
    pub(super) async fn make_room(&mut self, key: u64, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        if self.keys.contains(&key) {
            self.flush(jobs).await?;
        }
        Ok(())
    }

    /// Sends the window on: skips what the manifest already holds, parks what cannot be
    /// embedded and hands the rest to the workers in provider-sized batches.
    pub(super) async fn flush(&mut self, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        let young = self.windows < ALWAYS_LEASED_WINDOWS;
        let stream = self.acks.is_some();
        // Only a window that will read and nothing else goes out beside earlier ones; its
        // statement checks again that the run is alone (and answers `None` if not). Its
        // deletes and keys repeated in the run need no more: every write is fenced by its
        // record's position (`store::position`), whichever window's answer comes first, as
        // the writes of earlier windows already race this one's deletes.
        let read_only = self.alone && !young && !stream;
        // A backfill takes no leases (`LeaseClaims::Never`), so its claims only read and
        // confirm positions, each statement locking its own rows in key order: they go out
        // beside earlier ones too, whoever else is alive (a backfill runs beside `serve`).
        let copying = self.pipeline.options.copy_of.is_some();
        let claims = match () {
            _ if copying => LeaseClaims::Never,
            _ if young => LeaseClaims::Always,
            _ => LeaseClaims::WhileShared,
        };
        let beside = if read_only || copying { WINDOWS_IN_FLIGHT - 1 } else { 0 };
        while self.pending.len() > beside {
            self.finish_oldest(jobs).await?;
        }
        // A run's first windows claim leases whether or not another run is seen, but a lease
        // is only taken for a chunk the window embeds: one with none to embed (an unchanged
        // rerun) gets the same answer from the lookup, which a first window of a corpus run
        // that may be alone (as the window before found) sends first, claiming only if it
        // finds something to embed.
        let look_first = young && !stream && (self.alone || self.windows == 0);
        if self.is_empty() {
            return Ok(());
        }
        // Released when the last job of this window has been written (or dropped).
        let charge = Arc::new(std::mem::take(&mut self.charge));
        let chunks = std::mem::take(&mut self.chunks);
        let invalid = std::mem::take(&mut self.invalid);
        let repeated = std::mem::take(&mut self.repeated);
        let deletes = std::mem::take(&mut self.deletes);
        self.keys.clear();
        self.apply_deletes(&deletes).await?;
        if self.record_seen {
            self.note_seen(&chunks, &invalid).await?;
        }
        if self.dry_run {
            let mut t = self.tally.lock().unwrap();
            t.summary.not_attempted += (chunks.len() + invalid.len()) as u64;
            return Ok(());
        }
        let mut records = WindowRecords { chunks, invalid, repeated };
        let store = self.pipeline.store.clone();
        let (run_id, lease) = (self.run_id, self.pipeline.options.lease);
        let (copy_of, tally, alone) = (self.pipeline.options.copy_of.clone(), self.tally.clone(), self.alone);
        // The records travel with the statement and come back with its answer.
        let claim = tokio::spawn(async move {
            if let Some(copy) = &copy_of
                && let Err(e) = super::fanout::keep_what_is_held(&store, copy, &mut records, &tally).await
            {
                return (records, Err(e));
            }
            // Nothing of the window is left to claim: no statement (and nothing learnt about
            // other runs).
            if records.chunks.is_empty() && records.invalid.is_empty() {
                return (records, Ok(Some((Vec::new(), !alone))));
            }
            let keys = records.keys();
            let claim = || async {
                with_db_retry(|| store.claim_window(&keys, run_id, lease, claims, stream)).await.map(Some)
            };
            let claims = if read_only {
                with_db_retry(|| store.lookup_window(&keys, run_id))
                    .await
                    .map(|found| found.map(|claims| (claims, false)))
            } else if look_first {
                match with_db_retry(|| store.lookup_window(&keys, run_id)).await {
                    Ok(Some(claims)) if !embeds_any(&keys, &claims) => Ok(Some((claims, false))),
                    Ok(_) => claim().await,
                    Err(e) => Err(e),
                }
            } else {
                claim().await
            };
            drop(keys);
            (records, claims)
        });
        self.windows += 1;
        let claim = tokio_util::task::AbortOnDropHandle::new(claim);
        self.pending.push_back(PendingWindow { claim, charge });
        Ok(())
    }

    /// Finishes every window in flight, oldest first.
    pub(super) async fn finish_pending(&mut self, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        while !self.pending.is_empty() {
            self.finish_oldest(jobs).await?;
        }
        Ok(())
    }

    /// Finishes the oldest window in flight, if any: waits for its statement (and sends its
    /// claim now if it went out as a lookup that found another run alive, after every earlier
    /// window is finished), drops what the manifest already holds or another run has leased,
    /// and sends the rest to the workers. A panic of the statement's task is the batcher's own.
    pub(super) async fn finish_oldest(&mut self, jobs: &flume::Sender<Job>) -> Result<(), IngestError> {
        let Some(PendingWindow { claim, charge }) = self.pending.pop_front() else {
            return Ok(());
        };
        let (mut records, claims) = match claim.await {
            Ok((records, Ok(Some((claims, others))))) => {
                self.alone = !others;
                (records, claims)
            }
            Ok((_, Err(e))) => return Err(e.into()),
            Ok((records, Ok(None))) => {
                let store = &self.pipeline.store;
                let (run_id, lease, stream) = (self.run_id, self.pipeline.options.lease, self.acks.is_some());
                let leases = match self.pipeline.options.copy_of {
                    Some(_) => LeaseClaims::Never,
                    None => LeaseClaims::WhileShared,
                };
                let keys = records.keys();
                let (claims, others) =
                    with_db_retry(|| store.claim_window(&keys, run_id, lease, leases, stream)).await?;
                drop(keys);
                self.alone = !others;
                (records, claims)
            }
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only dropping the handle aborts the task, and the handle is here.
            Err(e) => {
                let gone = format!("the intake window's claim task ended without an answer: {e}");
                return Err(IngestError::Store(StoreError::Db(sqlx::Error::Protocol(gone))));
            }
        };
        let (leased, fresh) = self.skip_known(&mut records, &claims);
        let (batches, park) = self.provider_batches(records.chunks, records.invalid, &leased, &fresh);
        self.dispatch(batches, park, charge, jobs).await;
        Ok(())
    }

    /// Applies the window's delete records (in a dry run, lists what they would delete).
    /// Their order against the window's other records does not matter: every record's
    /// position fences every other's (`store::delete`).
    pub(super) async fn apply_deletes(&self, deletes: &[DeleteRequest]) -> Result<(), IngestError> {
        if deletes.is_empty() {
            return Ok(());
        }
        let store = &self.pipeline.store;
        let gone = if self.dry_run {
            with_db_retry(|| store.delete_requested_plan(deletes)).await?
        } else {
            with_db_retry(|| store.delete_requested(deletes)).await?
        };
        if !self.dry_run {
            metrics::counter!(crate::metrics::CHUNKS_DELETED, "by" => "input").increment(gone.len() as u64);
            // Committed: a stream source may acknowledge the delete entries.
            if let Some(acks) = &self.acks {
                acks.settled(deletes.iter().map(|d| d.source_seq));
            }
        }
        let listed = if self.dry_run { cleanup::DRY_RUN_LISTED } else { cleanup::DELETED_EXAMPLES };
        let mut t = self.tally.lock().unwrap();
        t.summary.chunks_deleted += gone.len() as u64;
        for c in gone.iter().take(listed.saturating_sub(t.summary.deleted_examples.len())) {
            t.summary.deleted_examples.push(format!("{}#{}", c.doc_id, c.chunk_index));
        }
        Ok(())
    }

    /// Records the window's keys for the run's cleanup (one statement).
    pub(super) async fn note_seen(
        &self,
        chunks: &[WindowChunk],
        invalid: &[ParkedChunk],
    ) -> Result<(), IngestError> {
        let keys: Vec<(&str, i32)> = chunks
            .iter()
            .map(|c| (c.chunk.doc_id.as_str(), c.chunk.chunk_index))
            .chain(invalid.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)))
            .collect();
        let store = &self.pipeline.store;
        let n = with_db_retry(|| store.record_seen(self.run_id, &keys)).await?;
        self.tally.lock().unwrap().seen_written += n;
        Ok(())
    }

    /// Drops (and counts) the records whose content the manifest already holds, stored or
    /// parked (replay owns it then), and the chunks another live run holds the lease of (it
    /// embeds them), as the window's claim found them (`claims`, one per key of
    /// [`WindowRecords::keys`], which also leased the rest to this run); keys `repeated` in this run
    /// are never skipped as done. Returns the keys whose lease this run took (none once a run
    /// alone is past its first windows), and for each chunk kept whether it is new: the
    /// manifest had no row for it and it is not repeated in this run, so its store may try
    /// plain inserts first ([`crate::store::StoredChunk::new_chunk`]).
    pub(super) fn skip_known(
        &self,
        records: &mut WindowRecords,
        claims: &[WindowClaim],
    ) -> (HashSet<(String, i32)>, Vec<bool>) {
        let keys = records.keys();
        let leased: HashSet<(String, i32)> = keys
            .iter()
            .zip(claims)
            .filter(|(_, c)| c.leased)
            .map(|(k, _)| (k.doc_id.to_owned(), k.chunk_index))
            .collect();
        let (mut unchanged, mut already_parked, mut leased_elsewhere) = (0u64, 0u64, 0u64);
        let mut left: Vec<(String, i32)> = Vec::new();
        // Skipped as done: their outcome is already committed, so a source may acknowledge
        // them. What is left to a concurrent run is not settled (it may die before its write).
        let (mut done, mut elsewhere): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
        let skip: Vec<bool> = keys
            .iter()
            .zip(claims)
            .map(|(key, claim)| {
                if claim.leased_elsewhere {
                    leased_elsewhere += 1;
                    elsewhere.push(key.source_seq);
                    if left.len() < MAX_UNFINISHED_EXAMPLES {
                        left.push((key.doc_id.to_owned(), key.chunk_index));
                    }
                    return true;
                }
                match claim.manifest {
                    _ if key.repeated => false,
                    // Same content, but the manifest's position could not be moved up to this
                    // record's (the row changed meanwhile): written again, its position decides.
                    _ if !claim.confirmed => false,
                    Some((true, ChunkStatus::Stored)) => {
                        unchanged += 1;
                        done.push(key.source_seq);
                        true
                    }
                    Some((true, ChunkStatus::Parked | ChunkStatus::Exhausted)) => {
                        already_parked += 1;
                        done.push(key.source_seq);
                        true
                    }
                    _ => false,
                }
            })
            .collect();
        let fresh: Vec<bool> = keys[..records.chunks.len()]
            .iter()
            .zip(claims)
            .zip(&skip)
            .filter(|(_, skipped)| !**skipped)
            .map(|((key, claim), _)| claim.manifest.is_none() && !key.repeated)
            .collect();
        drop(keys);
        let (chunk_skips, invalid_skips) = skip.split_at(records.chunks.len());
        let mut n = 0;
        records.chunks.retain(|_| {
            n += 1;
            !chunk_skips[n - 1]
        });
        let mut n = 0;
        records.invalid.retain(|_| {
            n += 1;
            !invalid_skips[n - 1]
        });
        if let Some(acks) = &self.acks {
            acks.settled(done);
            acks.release(elsewhere);
        }
        {
            let mut t = self.tally.lock().unwrap();
            t.summary.unchanged += unchanged;
            t.summary.already_parked += already_parked;
            t.summary.leased_elsewhere += leased_elsewhere;
            t.summary.note_unfinished(left.iter().map(|(d, i)| (d.as_str(), *i)));
        }
        let revision = self.pipeline.store.target().revision;
        for (reason, n) in [
            ("unchanged", unchanged),
            ("already_parked", already_parked),
            ("leased_elsewhere", leased_elsewhere),
        ] {
            crate::metrics::skipped(revision, reason, n);
        }
        (leased, fresh)
    }

    /// Splits the chunks into provider batches (by count and characters); what fails the
    /// pre-flight checks joins `park` instead. `fresh`: per chunk, whether it is new
    /// ([`Self::skip_known`]).
    pub(super) fn provider_batches(
        &self,
        chunks: Vec<WindowChunk>,
        mut park: Vec<ParkedChunk>,
        leased: &HashSet<(String, i32)>,
        fresh: &[bool],
    ) -> (Vec<Vec<Claimed>>, Vec<ParkedChunk>) {
        let opts = &self.pipeline.options;
        let mut batches: Vec<Vec<Claimed>> = Vec::new();
        let (mut current, mut chars) = (Vec::new(), 0usize);
        for (WindowChunk { chunk, hash, seq, metadata }, &new_chunk) in chunks.into_iter().zip(fresh) {
            if let Some((reason, detail)) = preflight(&chunk, opts.max_input_chars) {
                park.push(ParkedChunk {
                    doc_id: chunk.doc_id.clone(),
                    chunk_index: chunk.chunk_index,
                    content_hash: hash.as_str().to_owned(),
                    text_hash: crate::model::TextHash::of(&chunk.text),
                    payload: RawMetadata::payload(&chunk, metadata),
                    class: ErrorClass::PermanentInput,
                    reason: reason.as_str().into(),
                    last_error: detail,
                    last_status: None,
                    attempts: 0,
                    retry_in: None,
                    source_seq: seq,
                });
                continue;
            }
            // Characters, as replay counts them (`request_ranges`), not bytes.
            let len = chunk.text.chars().count();
            if !current.is_empty()
                && (current.len() >= opts.batch_max_inputs || chars + len > opts.batch_max_chars)
            {
                batches.push(std::mem::take(&mut current));
                chars = 0;
            }
            chars += len;
            let leased = !leased.is_empty() && leased.contains(&(chunk.doc_id.clone(), chunk.chunk_index));
            current.push(Claimed { chunk, hash: hash.as_str().to_owned(), seq, leased, new_chunk, metadata });
        }
        if !current.is_empty() {
            batches.push(current);
        }
        (batches, park)
    }

    /// Hands the window's jobs to the workers; the parks ride with the first one.
    pub(super) async fn dispatch(
        &self,
        batches: Vec<Vec<Claimed>>,
        park: Vec<ParkedChunk>,
        charge: Arc<Charge>,
        jobs: &flume::Sender<Job>,
    ) {
        let mut jobs_out: Vec<Job> = batches
            .into_iter()
            .map(|embed| Job { embed, park: Vec::new(), charge: charge.clone() })
            .collect();
        if !park.is_empty() {
            match jobs_out.first_mut() {
                Some(first) => first.park = park,
                None => jobs_out.push(Job { embed: Vec::new(), park, charge: charge.clone() }),
            }
        }
        for job in jobs_out {
            // A closed channel means every worker is gone (systemic stop): drop the job
            // unrecorded, a rerun does it.
            if let Err(flume::SendError(job)) = jobs.send_async(job).await {
                job.not_attempted(&mut self.tally.lock().unwrap().summary);
            }
        }
    }
}

/// Whether the window would embed any of its keys, as [`Store::claim_window`] decides what it
/// leases (`wanted`): a chunk, not a broken record, met before in this run or whose content
/// the manifest does not hold.
pub(super) fn embeds_any(keys: &[WindowKey<'_>], claims: &[WindowClaim]) -> bool {
    keys.iter().zip(claims).any(|(k, c)| k.embeds && (k.repeated || !matches!(c.manifest, Some((true, _)))))
}

/// Client-side checks that save a provider call: empty input (some servers answer it with a
/// real-looking vector) and inputs beyond the configured length.
pub(super) fn preflight(chunk: &Chunk, max_chars: usize) -> Option<(Reason, String)> {
    if chunk.text.trim().is_empty() {
        return Some((Reason::EmptyText, "text is empty or whitespace only".into()));
    }
    let chars = chunk.text.chars().count();
    if chars > max_chars {
        return Some((Reason::TooLong, format!("text has {chars} characters, the limit is {max_chars}")));
    }
    None
}
