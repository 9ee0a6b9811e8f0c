//! The reader side of a run: records from JSONL or a stream, each charged to the byte
//! budget before the batcher gets it, handed on a few dozen at a time.

use super::*;
use std::task::Poll;

/// Most records handed to the batcher at once ([`Handed`]). Handing them on one by one cost
/// each record a budget permit of its own, a channel slot and, on a quiet channel, a thread
/// wake-up: a quarter of an unchanged rerun's CPU was the reader's, most of it that.
pub(super) const RECORDS_PER_HANDOFF: usize = 64;

/// Records the reader hands to the batcher together, in input order, and their bytes of the
/// budget in one [`Charge`]: released together, with the window the last of them joins (a
/// window's charge may so carry up to one handoff's bytes of its neighbour's records).
#[derive(Debug)]
pub(super) struct Handed {
    pub(super) records: Vec<(Record, Option<i64>)>,
    pub(super) charge: Charge,
}

/// The reader side of a run, whatever its input: records, each charged to the byte budget
/// before it is handed to the batcher. An I/O error ends the input (what was read is still
/// processed) and is reported when the run ends.
pub(super) struct Feed {
    pub(super) budget: ByteBudget,
    pub(super) records: mpsc::Sender<Handed>,
    pub(super) halt: CancellationToken,
    pub(super) progress: Progress,
    /// Lines read, or chunks taken.
    pub(super) lines_read: Arc<AtomicU64>,
    pub(super) error: Arc<Mutex<Option<std::io::Error>>>,
}

/// What the reader has charged and not handed on yet: the records read, and bytes taken from
/// the budget ahead of need, in blocks ([`Feed::block`]), so that a record's charge is a sum,
/// not a permit of its own.
#[derive(Default)]
struct Handoff {
    records: Vec<(Record, Option<i64>)>,
    /// Everything taken from the budget: `batched` + `current` + what is spare.
    held: Charge,
    /// The bytes of `records`.
    batched: u64,
    /// The bytes of the record being read (not yet in `records`).
    current: u64,
}

impl Handoff {
    fn spare(&self) -> u64 {
        self.held.bytes() - self.batched - self.current
    }

    /// The record read goes with the next handoff, its bytes with it.
    fn push(&mut self, rec: Record, at: Option<i64>) {
        self.records.push((rec, at));
        self.batched += std::mem::take(&mut self.current);
    }
}

impl Feed {
    /// The reader task of [`Pipeline::run`]: JSONL lines → records.
    pub(super) async fn read_jsonl<R: AsyncBufRead + Unpin>(self, input: R, max_line_bytes: usize) {
        let mut lines = LineReader::new(input, max_line_bytes);
        let mut handoff = Handoff::default();
        loop {
            let Some(next) = self.next_or_halt(&mut handoff, lines.next_line()).await else { break };
            let raw = match next {
                Ok(Some(raw)) => raw,
                Ok(None) => break,
                Err(e) => {
                    *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                    break;
                }
            };
            self.lines_read.fetch_add(1, Ordering::Relaxed);
            self.progress.set_bytes(lines.bytes_read);
            // Charged in two steps, the line before it is parsed and then its parsed form, so
            // the reader waits for room holding a line, not a parsed record that may be many
            // times larger. Together about twice the record: that covers the copy made to
            // park it. At most the whole budget: a huge record runs alone.
            if !self.charge_into(&mut handoff, raw.bytes.len() as u64).await {
                break;
            }
            let Some(rec) = parse_line(&raw) else {
                handoff.current = 0;
                continue;
            };
            drop(raw);
            if !self.charge_parsed(&mut handoff, rec, None).await {
                break;
            }
        }
        self.hand_on_all(&mut handoff).await;
    }

    /// The reader task of [`Pipeline::run_stream`]: chunks → records, through the same checks
    /// as parsed lines ([`Record::from_chunk`]).
    pub(super) async fn read_chunks<S: futures::Stream<Item = Chunk>>(self, chunks: S) {
        use futures::StreamExt;
        let mut position = 0u64;
        self.read_records(chunks.map(move |chunk| {
            position += 1;
            Record::from_chunk(position, chunk)
        }))
        .await
    }

    /// Like [`Feed::read_chunks`], for records already made (a table source's chunks and
    /// deletes), each with its 1-based position in the stream as its line.
    pub(super) async fn read_records<S: futures::Stream<Item = Record>>(self, records: S) {
        use futures::StreamExt;
        let mut records = std::pin::pin!(records);
        let mut handoff = Handoff::default();
        loop {
            let Some(Some(rec)) = self.next_or_halt(&mut handoff, records.next()).await else { break };
            self.lines_read.fetch_add(1, Ordering::Relaxed);
            // The record's own size stands in for the line a JSONL record is charged first:
            // together about twice the record, like a parsed line.
            if !self.charge_into(&mut handoff, rec.approx_bytes()).await
                || !self.charge_parsed(&mut handoff, rec, None).await
            {
                break;
            }
        }
        self.hand_on_all(&mut handoff).await;
    }

    /// What `next` (the input's next line or chunk) gives: at once if it is ready, else when
    /// it comes, what was read going on first. `None` once the run halts (a halted run stops
    /// reading even if the producer, say stdin, has gone quiet) or the batcher is gone.
    async fn next_or_halt<F: Future>(&self, handoff: &mut Handoff, next: F) -> Option<F::Output> {
        let mut next = std::pin::pin!(next);
        if let Poll::Ready(r) = futures::poll!(next.as_mut()) {
            return Some(r);
        }
        if !self.hand_on_all(handoff).await {
            return None;
        }
        tokio::select! {
            biased;
            _ = self.halt.cancelled() => None,
            r = next => Some(r),
        }
    }

    /// Charges the parsed record's size (at most up to the whole budget with its line) and
    /// adds it to the handoff, handing that on when full; false once the run halts or the
    /// batcher is gone.
    async fn charge_parsed(&self, handoff: &mut Handoff, rec: Record, at: Option<i64>) -> bool {
        let parsed = rec.approx_bytes().min(self.budget.capacity().saturating_sub(handoff.current));
        if parsed > 0 && !self.charge_into(handoff, parsed).await {
            return false;
        }
        handoff.push(rec, at);
        handoff.records.len() < RECORDS_PER_HANDOFF || self.hand_on_all(handoff).await
    }

    /// Adds `bytes` (at least 1, at most the whole budget) to the record being read, taking
    /// them from the budget if what is spare does not cover them: a block at a time if it is
    /// free, else (first handing on the records held, so that the budget can drain) waiting
    /// for just what is missing. False if the run halts meanwhile.
    async fn charge_into(&self, handoff: &mut Handoff, bytes: u64) -> bool {
        let n = bytes.clamp(1, self.budget.capacity());
        let spare = handoff.spare();
        if spare < n {
            let missing = n - spare;
            match self
                .budget
                .try_charge(missing.max(self.block()))
                .or_else(|| self.budget.try_charge(missing))
            {
                Some(more) => handoff.held.merge(more),
                None => {
                    if !self.hand_on_all(handoff).await {
                        return false;
                    }
                    // A halt is seen here at the latest: a reader that never waits checks it
                    // with each handoff.
                    let Some(more) = self.charge(missing).await else { return false };
                    handoff.held.merge(more);
                }
            }
        }
        handoff.current += n;
        true
    }

    /// Bytes taken from the budget at once ahead of need: a sixty-fourth of it, so that the
    /// spare the reader holds is never a real part of the budget.
    fn block(&self) -> u64 {
        (self.budget.capacity() / 64).max(1)
    }

    /// Hands the records held to the batcher with their bytes; false once the run halts or
    /// the batcher is gone.
    async fn hand_on_all(&self, handoff: &mut Handoff) -> bool {
        if self.halt.is_cancelled() {
            return false;
        }
        if handoff.records.is_empty() {
            return true;
        }
        let charge = handoff.held.split(std::mem::take(&mut handoff.batched));
        let records = std::mem::take(&mut handoff.records);
        self.records.send(Handed { records, charge }).await.is_ok()
    }

    /// Charges `bytes` to the budget, waiting for room; `None` if the run halts meanwhile.
    pub(super) async fn charge(&self, bytes: u64) -> Option<Charge> {
        tokio::select! {
            biased;
            _ = self.halt.cancelled() => None,
            c = self.budget.charge(bytes) => Some(c),
        }
    }

    /// Hands one record that brings its position (`at`, a stream entry's; see
    /// `store::position`) to the batcher on its own, after adding its parsed size to `charge`
    /// (at most up to the whole budget); false once the run halts or the batcher is gone.
    pub(super) async fn hand_on_at(&self, rec: Record, at: Option<i64>, mut charge: Charge) -> bool {
        let parsed = rec.approx_bytes().min(self.budget.capacity().saturating_sub(charge.bytes()));
        if parsed > 0 {
            let Some(more) = self.charge(parsed).await else { return false };
            charge.merge(more);
        }
        self.records.send(Handed { records: vec![(rec, at)], charge }).await.is_ok()
    }
}
