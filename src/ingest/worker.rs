//! A worker: embeds a job's chunks and turns every input into an outcome for the writers.

use super::*;

/// Outcomes of one job, on their way to the writer.
pub(super) struct Outcomes {
    pub(super) store: Vec<StoredChunk>,
    pub(super) park: Vec<ParkedChunk>,
    /// The job's byte charge, released once these are written.
    pub(super) charge: Arc<Charge>,
}

pub(super) struct Worker {
    pub(super) embedder: Embedder,
    pub(super) schedule: DlqSchedule,
    pub(super) tally: Arc<Mutex<Tally>>,
    pub(super) cancel: CancellationToken,
    pub(super) halt: CancellationToken,
    pub(super) writer: flume::Sender<Outcomes>,
}

impl Worker {
    pub(super) async fn run(self, jobs: flume::Receiver<Job>) {
        while let Ok(job) = jobs.recv_async().await {
            // After a systemic stop or a write failure, queued jobs are dropped unrecorded;
            // after a shutdown request they still run (they were claimed) but retry waits
            // are cut short.
            if self.halt.is_cancelled() && !self.cancel.is_cancelled() {
                job.not_attempted(&mut self.tally.lock().unwrap().summary);
                continue;
            }
            if let Some(out) = self.process(job).await
                && self.writer.send_async(out).await.is_err()
            {
                break;
            }
        }
    }

    pub(super) async fn process(&self, job: Job) -> Option<Outcomes> {
        crate::failpoint::hit!("ingest_worker");
        let mut stats = BatchStats::default();
        let mut out =
            Outcomes { store: Vec::with_capacity(job.embed.len()), park: job.park, charge: job.charge };
        let mut not_attempted: Vec<(String, i32)> = Vec::new();
        if !job.embed.is_empty() {
            let texts: Vec<&str> = job.embed.iter().map(|c| c.chunk.text.as_str()).collect();
            let (outcomes, stop) =
                self.embedder.embed_batch_until_stop(&texts, &self.cancel, &mut stats).await;
            if let Some(stop) = stop {
                // Nothing is parked for a stop; what the provider embedded before it was paid
                // for and is stored, the rest is left for the rerun.
                tracing::error!(error = %stop, "provider refused the run; stopping without parking");
                let (mut store, mut left) = (Vec::new(), Vec::new());
                for (claimed, outcome) in job.embed.into_iter().zip(outcomes) {
                    match outcome {
                        ItemOutcome::Embedded(embedding) => store.push(claimed.stored(embedding)),
                        _ => left.push((claimed.chunk.doc_id, claimed.chunk.chunk_index)),
                    }
                }
                let mut t = self.tally.lock().unwrap();
                merge_stats(&mut t.summary, &stats);
                t.summary.not_attempted += (left.len() + out.park.len()) as u64;
                t.summary.note_unfinished(left.iter().map(|(d, i)| (d.as_str(), *i)));
                t.summary.note_unfinished(out.park.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)));
                if t.stop.is_none() {
                    t.stop = Some(stop);
                }
                drop(t);
                self.halt.cancel();
                return (!store.is_empty()).then(|| Outcomes { store, park: Vec::new(), charge: out.charge });
            }
            for (claimed, outcome) in job.embed.into_iter().zip(outcomes) {
                match outcome {
                    ItemOutcome::Embedded(embedding) => out.store.push(claimed.stored(embedding)),
                    ItemOutcome::Failed(f) => out.park.push(ParkedChunk {
                        text_hash: crate::model::TextHash::of(&claimed.chunk.text),
                        payload: RawMetadata::payload(&claimed.chunk, claimed.metadata),
                        doc_id: claimed.chunk.doc_id,
                        chunk_index: claimed.chunk.chunk_index,
                        content_hash: claimed.hash,
                        retry_in: f.class.is_replayable().then(|| self.schedule.delay(0)),
                        source_seq: claimed.seq,
                        class: f.class,
                        reason: f.reason.as_str().into(),
                        last_error: f.detail,
                        last_status: f.status,
                        attempts: f.attempts,
                    }),
                    ItemOutcome::NotAttempted => {
                        not_attempted.push((claimed.chunk.doc_id, claimed.chunk.chunk_index));
                    }
                }
            }
        }
        let mut t = self.tally.lock().unwrap();
        merge_stats(&mut t.summary, &stats);
        t.summary.not_attempted += not_attempted.len() as u64;
        t.summary.note_unfinished(not_attempted.iter().map(|(d, i)| (d.as_str(), *i)));
        Some(out)
    }
}
