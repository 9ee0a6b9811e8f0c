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
    /// Set for a corpus run: its requests built while it was alone are claimed before they
    /// are sent if another run has begun since.
    pub(super) late_claims: Option<Arc<LateClaims>>,
}

/// A run alone past its first windows builds its requests without leases (`lease.rs`); a run
/// that starts beside it meanwhile cannot see what it has queued and would embed all of it
/// again (two runs started after the first one's leased windows re-sent 4,608 and 4,928
/// inputs for 4,000 chunks). So before a request with an unleased chunk is sent, the worker
/// asks whether another run is alive, and if so claims the request's unleased chunks as a
/// window would: what another run holds or has finished is dropped, the rest is leased. What
/// is sent twice is then at most what the lone run had at the provider when the other began.
pub(super) struct LateClaims {
    pub(super) store: Store,
    pub(super) run_id: i64,
    pub(super) lease: Duration,
}

impl LateClaims {
    /// The job as it may be sent now. A failed check or claim sends it as it is: leases only
    /// save provider calls, every write is fenced by its position anyway.
    async fn claim(&self, mut job: Job, tally: &Mutex<Tally>) -> Job {
        if job.embed.iter().all(|c| c.leased) {
            return job;
        }
        match with_db_retry(|| self.store.other_run_alive(self.run_id)).await {
            Ok(true) => {}
            Ok(false) => return job,
            Err(e) => {
                tracing::warn!(error = %e, "could not ask whether another ingest run is alive; sending the request");
                return job;
            }
        }
        let (unleased, mut kept): (Vec<Claimed>, Vec<Claimed>) = job.embed.drain(..).partition(|c| !c.leased);
        let keys: Vec<WindowKey<'_>> = unleased
            .iter()
            .map(|c| WindowKey {
                doc_id: &c.chunk.doc_id,
                chunk_index: c.chunk.chunk_index,
                content_hash: &c.hash,
                source_seq: c.seq,
                embeds: true,
                // A repeat in the run is skipped only if the manifest holds its content at a
                // position this claim confirmed (racing, below), never on a lookup alone.
                repeated: false,
            })
            .collect();
        // Racing: another run is alive, so a skip must move the manifest's position up.
        let answer = with_db_retry(|| {
            self.store.claim_window(&keys, self.run_id, self.lease, LeaseClaims::WhileShared, true)
        })
        .await;
        drop(keys);
        let claims = match answer {
            Ok((claims, _)) => claims,
            Err(e) => {
                tracing::warn!(error = %e, "could not claim the leases of a request built alone; sending it");
                kept.extend(unleased);
                job.embed = kept;
                return job;
            }
        };
        let (mut unchanged, mut already_parked, mut elsewhere) = (0u64, 0u64, Vec::new());
        for (mut c, claim) in unleased.into_iter().zip(claims) {
            match claim.manifest {
                _ if claim.leased_elsewhere => elsewhere.push((c.chunk.doc_id, c.chunk.chunk_index)),
                Some((true, ChunkStatus::Stored)) if claim.confirmed => unchanged += 1,
                Some((true, ChunkStatus::Parked | ChunkStatus::Exhausted)) if claim.confirmed => {
                    already_parked += 1
                }
                _ => {
                    c.leased = claim.leased;
                    kept.push(c);
                }
            }
        }
        job.embed = kept;
        let revision = self.store.target().revision;
        for (reason, n) in [
            ("unchanged", unchanged),
            ("already_parked", already_parked),
            ("leased_elsewhere", elsewhere.len() as u64),
        ] {
            crate::metrics::skipped(revision, reason, n);
        }
        let mut t = tally.lock().unwrap();
        t.summary.unchanged += unchanged;
        t.summary.already_parked += already_parked;
        t.summary.leased_elsewhere += elsewhere.len() as u64;
        t.summary.note_unfinished(elsewhere.iter().map(|(d, i)| (d.as_str(), *i)));
        job
    }
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
        let job = match &self.late_claims {
            Some(late) => late.claim(job, &self.tally).await,
            None => job,
        };
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
