//! A writer: gathers outcomes into large store and park statements.

use super::*;

/// A writer: gathers the workers' outcomes into large statements (the provider's batch size
/// is not the database's), one store and one park statement per flush. A couple of writers
/// keep the database busy while the other one is between statements.
pub(super) struct Writer {
    pub(super) store: Store,
    pub(super) tally: Arc<Mutex<Tally>>,
    pub(super) halt: CancellationToken,
    pub(super) progress: Progress,
    pub(super) rows: usize,
    pub(super) linger: Duration,
    /// Told of every outcome once its write committed (a stream source acknowledges it).
    pub(super) acks: Option<Arc<source::AckPart>>,
}

/// The longest a finished outcome waits in a writer for its statement to fill up, when a
/// slow trickle keeps the writer from ever being idle for `linger`.
pub(super) const MAX_GATHER: Duration = Duration::from_secs(1);

/// What a writer has gathered and not yet written.
#[derive(Default)]
pub(super) struct Gathered {
    pub(super) store: Vec<StoredChunk>,
    pub(super) park: Vec<ParkedChunk>,
    pub(super) keys: HashSet<(String, i32)>,
    /// Byte charges of the gathered outcomes, released once they are written.
    pub(super) charges: Vec<Arc<Charge>>,
    /// When the gathered outcomes are written if no more arrive: `linger` after the latest
    /// one, but never later than [`MAX_GATHER`] after the oldest one.
    pub(super) deadline: Option<tokio::time::Instant>,
    /// Arrival of the oldest gathered outcome.
    pub(super) oldest: Option<tokio::time::Instant>,
}

impl Gathered {
    pub(super) fn len(&self) -> usize {
        self.store.len() + self.park.len()
    }
}

impl Writer {
    pub(super) async fn run(self, rx: flume::Receiver<Outcomes>) {
        let mut g = Gathered::default();
        let mut failed = false;
        loop {
            // Waiting on the channel holds no lock, so every writer's deadline fires on time.
            let next = match g.deadline {
                None => rx.recv_async().await.ok(),
                Some(at) => tokio::select! {
                    r = rx.recv_async() => r.ok(),
                    _ = tokio::time::sleep_until(at) => {
                        failed |= !self.flush(&mut g).await;
                        continue;
                    }
                },
            };
            let Some(out) = next else { break };
            if failed {
                // The run is stopping after a write failure: what is left stays unwritten and
                // a rerun does it.
                let mut t = self.tally.lock().unwrap();
                t.summary.not_attempted += (out.store.len() + out.park.len()) as u64;
                t.summary.note_unfinished(out.store.iter().map(|c| (c.doc_id.as_str(), c.chunk_index)));
                t.summary.note_unfinished(out.park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                continue;
            }
            let clash = out
                .store
                .iter()
                .map(|s| (&s.doc_id, s.chunk_index))
                .chain(out.park.iter().map(|p| (&p.doc_id, p.chunk_index)))
                .any(|(d, i)| g.keys.contains(&(d.clone(), i)));
            if clash {
                failed |= !self.flush(&mut g).await;
            }
            g.keys.extend(out.store.iter().map(|s| (s.doc_id.clone(), s.chunk_index)));
            g.keys.extend(out.park.iter().map(|p| (p.doc_id.clone(), p.chunk_index)));
            g.store.extend(out.store);
            g.park.extend(out.park);
            g.charges.push(out.charge);
            let now = tokio::time::Instant::now();
            let oldest = *g.oldest.get_or_insert(now);
            g.deadline = Some((now + self.linger).min(oldest + MAX_GATHER.max(self.linger)));
            if g.len() >= self.rows {
                failed |= !self.flush(&mut g).await;
            }
        }
        if !failed {
            self.flush(&mut g).await;
        }
    }

    /// Writes what is gathered; false (and the run halted) if the database refused.
    pub(super) async fn flush(&self, g: &mut Gathered) -> bool {
        g.keys.clear();
        g.deadline = None;
        g.oldest = None;
        let (to_store, to_park) = (std::mem::take(&mut g.store), std::mem::take(&mut g.park));
        // Released at the end of this call, written or not.
        let _charges = std::mem::take(&mut g.charges);
        if to_store.is_empty() && to_park.is_empty() {
            return true;
        }
        crate::failpoint::hit!("ingest_writer");
        let result = async {
            let counts = with_db_retry(|| self.store.store_batch(&to_store)).await?;
            let parked = with_db_retry(|| self.store.park_batch(&to_park)).await?;
            Ok::<_, StoreError>((counts, parked))
        }
        .await;
        let mut t = self.tally.lock().unwrap();
        match result {
            Ok((counts, parked)) => {
                self.count_written(&mut t.summary, to_store.len(), counts, &to_park, &parked);
                drop(t);
                // Committed (stored, parked, or superseded by a newer record already written):
                // only now may a source acknowledge them.
                if let Some(acks) = &self.acks {
                    acks.settled(
                        to_store.iter().map(|c| c.source_seq).chain(to_park.iter().map(|p| p.source_seq)),
                    );
                }
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "database write failed; stopping the run");
                t.summary.not_attempted += (to_store.len() + to_park.len()) as u64;
                t.summary.note_unfinished(to_store.iter().map(|c| (c.doc_id.as_str(), c.chunk_index)));
                t.summary.note_unfinished(to_park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                if t.fatal.is_none() {
                    t.fatal = Some(e);
                }
                self.halt.cancel();
                false
            }
        }
    }
}

impl Writer {
    /// Adds what one flush wrote to the summary, the metrics, the log and the progress bar.
    pub(super) fn count_written(
        &self,
        s: &mut IngestSummary,
        stored_rows: usize,
        counts: StoreCounts,
        to_park: &[ParkedChunk],
        parked: &ParkCounts,
    ) {
        let superseded: HashSet<usize> = parked.superseded.iter().copied().collect();
        let to_park: Vec<&ParkedChunk> =
            to_park.iter().enumerate().filter(|(n, _)| !superseded.contains(n)).map(|(_, p)| p).collect();
        for p in &to_park {
            tracing::debug!(doc_id = %Escaped(&p.doc_id), chunk_index = p.chunk_index, class = %p.class,
                reason = %p.reason, attempts = p.attempts, "parked");
        }
        let stored = stored_rows as u64 - counts.superseded;
        let revision = self.store.target().revision;
        crate::metrics::stored(revision, stored);
        for p in &to_park {
            crate::metrics::parked(revision, p.class, 1);
        }
        s.stored += stored;
        s.superseded += counts.superseded + superseded.len() as u64;
        s.vectors_written += counts.vectors_written;
        s.dlq_resolved += counts.dlq_resolved;
        s.vectors_withdrawn += parked.withdrawn;
        for p in &to_park {
            *s.parked.entry(p.class).or_default() += 1;
        }
        self.progress.set_counts(s.stored + s.unchanged, s.parked_total());
    }
}
