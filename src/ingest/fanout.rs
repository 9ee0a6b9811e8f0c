//! One corpus run into every live revision of a target (issue 46): while a target has a
//! shadow revision (or keeps its previous one for a rollback), every ingest must write each
//! of them, each with its own model, under its own identity, so that the shadow covers the
//! active revision when it is switched to. The input is read once and handed to one
//! [`Pipeline`] per revision through a bounded pipe each: the slowest revision sets the pace
//! (memory stays bounded), and a revision whose run stops (its provider refused it, a
//! failure) stops reading without holding the others up. Each revision's run is the
//! ordinary one: its own positions, fences, DLQ rows and summary.

use super::*;
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
