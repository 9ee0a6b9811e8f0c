//! One corpus run into every live revision of a target (issue 46): while a target has a
//! shadow revision (or keeps its previous one for a rollback), every ingest must write each
//! of them, each with its own model, under its own identity, so that the shadow covers the
//! active revision when it is switched to. The input is read once and handed to one
//! [`Pipeline`] per revision through a bounded pipe each: the slowest revision sets the pace
//! (memory stays bounded), and a revision whose run stops (its provider refused it, a
//! failure) stops reading without holding the others up. Each revision's run is the
//! ordinary one: its own positions, fences, DLQ rows and summary.

use super::*;
use crate::model::content_hash;
use crate::store::revision::Revision;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes buffered between the input and each revision's run.
const PIPE_BYTES: usize = 256 * 1024;

/// The pipelines of one target's live revisions, the active one first.
pub struct Fanout {
    /// Each live revision and the pipeline that writes it.
    pub revisions: Vec<(Revision, Pipeline)>,
    /// Set when the active revision holds chunks written before text hashes existed: the
    /// run also records theirs from the input ([`record_text_hashes`]), so that the
    /// coverage check can compare them.
    pub fill: Option<TextHashFill>,
}

/// What [`record_text_hashes`] needs to record the text hashes of one revision.
pub struct TextHashFill {
    /// The store of the revision's identity.
    pub store: Store,
    /// The revision whose rows are filled.
    pub revision: Revision,
    /// The model its content hashes were made with.
    pub model: String,
    /// Its vectors' dimension.
    pub dimensions: usize,
}

/// The revision a backfill copies (the active one): a backfill is not a statement of what
/// the source holds now, like a corpus run, but a copy of what the live revision holds, made
/// with another model. So each of its lines is written into the shadow only where this
/// revision's manifest holds the very same text for the chunk, and at that record's position:
/// a corpus older than the live writes can neither bring back text they changed or deleted,
/// nor outrank a live write still in flight (which is newer than the record it replaces, and
/// reaches every revision).
#[derive(Debug, Clone)]
pub struct CopyOf {
    /// The identity of the revision copied (its manifest rows' `target_table`).
    pub identity: String,
    /// The model its content hashes were made with (to compare rows written before text
    /// hashes existed).
    pub model: String,
    /// Its vectors' dimension (idem).
    pub dimensions: usize,
}

impl CopyOf {
    /// Whether `held` is a record of `text` in the copied revision: by its text hash, or for
    /// a row from before text hashes by its content hash (`content_hash` when given, else
    /// computed from the text with the copied revision's model).
    fn holds(
        &self,
        held: &crate::store::revision::HeldRecord,
        text: &[u8],
        content: impl FnOnce() -> String,
    ) -> bool {
        match &held.text_hash {
            Some(h) => h.as_slice() == text,
            None => held.content_hash == content(),
        }
    }
}

/// Keeps, of a backfill window's `records`, those the revision `copy` holds with the same
/// text, each at the position of that revision's record, and counts the others in the run's
/// `differs_from_active` (one statement a window).
pub(super) async fn keep_what_is_held(
    store: &Store,
    copy: &CopyOf,
    records: &mut batcher::WindowRecords,
    tally: &Mutex<Tally>,
) -> Result<(), StoreError> {
    let keys: Vec<(&str, i32)> = records
        .chunks
        .iter()
        .map(|c| (c.chunk.doc_id.as_str(), c.chunk.chunk_index))
        .chain(records.invalid.iter().map(|p| (p.doc_id.as_str(), p.chunk_index)))
        .collect();
    if keys.is_empty() {
        return Ok(());
    }
    let held =
        with_db_retry(|| crate::store::revision::held_records(store.pool(), &copy.identity, &keys)).await?;
    drop(keys);
    let (chunk_held, invalid_held) = held.split_at(records.chunks.len());
    let mut left_out: Vec<String> = Vec::new();
    let mut count = 0u64;
    let mut note = |doc_id: &str, chunk_index: i32| {
        count += 1;
        if left_out.len() < MAX_UNFINISHED_EXAMPLES {
            left_out.push(format!("{doc_id}#{chunk_index}"));
        }
    };
    let mut held = chunk_held.iter();
    records.chunks.retain_mut(|c| {
        let text = crate::model::TextHash::of(&c.chunk.text);
        match held.next().and_then(Option::as_ref) {
            Some(h)
                if copy.holds(h, text.as_bytes(), || {
                    content_hash(&copy.model, copy.dimensions, &c.chunk.text)
                }) =>
            {
                c.seq = h.source_seq;
                true
            }
            _ => {
                note(&c.chunk.doc_id, c.chunk.chunk_index);
                false
            }
        }
    });
    let mut held = invalid_held.iter();
    records.invalid.retain_mut(|p| match held.next().and_then(Option::as_ref) {
        Some(h) if copy.holds(h, p.text_hash.as_bytes(), || p.content_hash.clone()) => {
            p.source_seq = h.source_seq;
            true
        }
        _ => {
            note(&p.doc_id, p.chunk_index);
            false
        }
    });
    if count > 0 {
        crate::metrics::skipped(store.target().revision, "differs_from_active", count);
        let mut t = tally.lock().unwrap_or_else(PoisonError::into_inner);
        t.summary.differs_from_active += count;
        let room = MAX_UNFINISHED_EXAMPLES.saturating_sub(t.summary.differs_examples.len());
        t.summary.differs_examples.extend(left_out.into_iter().take(room));
    }
    Ok(())
}

/// How one revision's part of a [`Fanout`] run ended.
#[derive(Debug)]
pub struct RevisionRun {
    /// The revision written.
    pub revision: Revision,
    /// Its run's summary, or why it stopped.
    pub result: Result<IngestSummary, IngestError>,
}

impl Fanout {
    /// Runs one ingest of JSONL `input` into every revision at once; returns each revision's
    /// outcome, in the order of [`Fanout::revisions`]. An error reading `input` ends every
    /// revision's input there (each reports it, as a single run does).
    pub async fn run<R>(&self, mut input: R, cancel: CancellationToken) -> Vec<RevisionRun>
    where
        R: tokio::io::AsyncRead + Unpin + Send + 'static,
    {
        let mut writers = Vec::with_capacity(self.revisions.len());
        let mut runs = Vec::with_capacity(self.revisions.len());
        for (revision, pipeline) in &self.revisions {
            let (writer, reader) = tokio::io::duplex(PIPE_BYTES);
            writers.push(writer);
            let reader = tokio::io::BufReader::with_capacity(PIPE_BYTES, reader);
            let cancel = cancel.clone();
            runs.push(async move {
                RevisionRun { revision: revision.clone(), result: pipeline.run(reader, cancel).await }
            });
        }
        // The text-hash fill reads its own copy of the input beside the runs.
        let fill = self.fill.as_ref().map(|f| {
            let (writer, reader) = tokio::io::duplex(PIPE_BYTES);
            writers.push(writer);
            let reader = tokio::io::BufReader::with_capacity(PIPE_BYTES, reader);
            let max_line_bytes = self.revisions[0].1.options.within_bounds().max_line_bytes;
            record_text_hashes(&f.store, &f.revision, &f.model, f.dimensions, reader, max_line_bytes)
        });
        let tee = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match input.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) => {
                        // Each run sees its input end here; the error is logged once.
                        tracing::error!(error = %e, "reading the input failed; every revision's run stops reading here");
                        break;
                    }
                };
                // A revision whose run stopped reading drops its pipe: it is left out.
                let mut alive = Vec::with_capacity(writers.len());
                for mut w in writers {
                    if w.write_all(&buf[..n]).await.is_ok() {
                        alive.push(w);
                    }
                }
                writers = alive;
                if writers.is_empty() {
                    break;
                }
            }
            for mut w in writers {
                let _ = w.shutdown().await;
            }
        });
        let (results, filled) = match fill {
            Some(fill) => {
                let (results, filled) = tokio::join!(futures::future::join_all(runs), fill);
                (results, Some(filled))
            }
            None => (futures::future::join_all(runs).await, None),
        };
        match filled {
            Some(Ok(n)) if n > 0 => {
                tracing::info!(chunks = n, "recorded the text hashes of chunks written before them")
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "recording the text hashes of older chunks failed; their coverage stays unknown until a rerun records them")
            }
            _ => {}
        }
        // Every run has ended, so no pipe is read any more: the tee ends too.
        tee.abort();
        let _ = tee.await;
        results
    }
}

/// Most records [`record_text_hashes`] sends in one statement.
const FILL_BATCH: usize = 1_000;

/// Reads JSONL `input` (the corpus a backfill is about to write) and records, for each
/// chunk of `revision` written before text hashes existed, its text's hash where the
/// revision's content hash proves it holds that very text (embedded by `model` at
/// `dimensions`): what lets the coverage check compare such chunks with another revision's
/// ([`crate::store::revision::fill_text_hashes`]). Lines that are not chunk records are
/// skipped here (the ingest that follows reports them). Returns the chunks filled.
pub async fn record_text_hashes<R>(
    store: &Store,
    revision: &Revision,
    model: &str,
    dimensions: usize,
    input: R,
    max_line_bytes: usize,
) -> Result<u64, IngestError>
where
    R: AsyncBufRead + Unpin,
{
    let mut lines = super::reader::LineReader::new(input, max_line_bytes);
    let (mut batch, mut filled) = (Vec::with_capacity(FILL_BATCH), 0);
    loop {
        let raw = match lines.next_line().await.map_err(IngestError::Input)? {
            Some(raw) => raw,
            None => break,
        };
        // Parsed and checked as the ingest's reader does, so the text is the one it embeds.
        let Some(Record::Chunk { chunk, .. }) = super::reader::parse_line(&raw) else { continue };
        let hash = crate::model::content_hash(model, dimensions, &chunk.text);
        let text = crate::model::TextHash::of(&chunk.text);
        batch.push((chunk.doc_id, chunk.chunk_index, hash, text));
        if batch.len() >= FILL_BATCH {
            filled += crate::store::revision::fill_text_hashes(store.pool(), revision, &batch).await?;
            batch.clear();
        }
    }
    if !batch.is_empty() {
        filled += crate::store::revision::fill_text_hashes(store.pool(), revision, &batch).await?;
    }
    Ok(filled)
}
