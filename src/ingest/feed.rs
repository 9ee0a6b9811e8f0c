//! The reader side of a run: records from JSONL or a stream, each charged to the byte
//! budget before the batcher gets it.

use super::*;

/// The reader side of a run, whatever its input: records, each charged to the byte budget
/// before it is handed to the batcher. An I/O error ends the input (what was read is still
/// processed) and is reported when the run ends.
pub(super) struct Feed {
    pub(super) budget: ByteBudget,
    pub(super) records: mpsc::Sender<(Record, Option<i64>, Charge)>,
    pub(super) halt: CancellationToken,
    pub(super) progress: Progress,
    /// Lines read, or chunks taken.
    pub(super) lines_read: Arc<AtomicU64>,
    pub(super) error: Arc<Mutex<Option<std::io::Error>>>,
}

impl Feed {
    /// The reader task of [`Pipeline::run`]: JSONL lines → records.
    pub(super) async fn read_jsonl<R: AsyncBufRead + Unpin>(self, input: R, max_line_bytes: usize) {
        let mut lines = LineReader::new(input, max_line_bytes);
        loop {
            // A halted run stops reading even if the producer (stdin) has gone quiet.
            let next = tokio::select! {
                biased;
                _ = self.halt.cancelled() => break,
                r = lines.next_line() => r,
            };
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
            let Some(charge) = self.charge(raw.bytes.len() as u64).await else { break };
            let Some(rec) = parse_line(&raw) else { continue };
            drop(raw);
            if !self.hand_on(rec, charge).await {
                break;
            }
        }
    }

    /// The reader task of [`Pipeline::run_stream`]: chunks → records, through the same checks
    /// as parsed lines ([`Record::from_chunk`]).
    pub(super) async fn read_chunks<S: futures::Stream<Item = Chunk>>(self, chunks: S) {
        use futures::StreamExt;
        let mut chunks = std::pin::pin!(chunks);
        let mut position = 0u64;
        loop {
            let next = tokio::select! {
                biased;
                _ = self.halt.cancelled() => break,
                c = chunks.next() => c,
            };
            let Some(chunk) = next else { break };
            position += 1;
            self.lines_read.fetch_add(1, Ordering::Relaxed);
            let rec = Record::from_chunk(position, chunk);
            // The record's own size stands in for the line a JSONL record is charged first:
            // together about twice the record, like a parsed line.
            let Some(charge) = self.charge(rec.approx_bytes()).await else { break };
            if !self.hand_on(rec, charge).await {
                break;
            }
        }
    }

    /// Charges `bytes` to the budget, waiting for room; `None` if the run halts meanwhile.
    pub(super) async fn charge(&self, bytes: u64) -> Option<Charge> {
        tokio::select! {
            biased;
            _ = self.halt.cancelled() => None,
            c = self.budget.charge(bytes) => Some(c),
        }
    }

    /// Adds the parsed record's size to `charge` (at most up to the whole budget) and hands
    /// the record to the batcher; false once the run halts or the batcher is gone.
    pub(super) async fn hand_on(&self, rec: Record, charge: Charge) -> bool {
        self.hand_on_at(rec, None, charge).await
    }

    /// [`Feed::hand_on`] for a record that brings its position (`at`, a stream entry's; see
    /// `store::position`); without one, the run positions it by its line.
    pub(super) async fn hand_on_at(&self, rec: Record, at: Option<i64>, mut charge: Charge) -> bool {
        let parsed = rec.approx_bytes().min(self.budget.capacity().saturating_sub(charge.bytes()));
        if parsed > 0 {
            let Some(more) = self.charge(parsed).await else { return false };
            charge.merge(more);
        }
        self.records.send((rec, at, charge)).await.is_ok()
    }
}
