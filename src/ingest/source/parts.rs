//! A stream source into every live revision of a target (issue 46): each segment hands every
//! entry read to one pipeline per revision, its *parts* (the active revision's first), and an
//! entry is acknowledged once each part still writing has committed its outcome
//! ([`super::acks::AckPart`]).
//!
//! - **The set of revisions is looked up for every segment** ([`SourceTargets::writers`]),
//!   and watched while one runs ([`SourceTargets::changed`], every [`WATCH_EVERY`]): a
//!   revision made, switched to or retired meanwhile ends the segment, and the next one
//!   writes the new set. Entries settled between a `revision create` and that moment reach
//!   the new revision only through its backfill; its coverage shows any that did not.
//! - **A shadow never holds the active revision up.** A part other than the active one whose
//!   run stops on its own (its provider refuses its model, its writes fail) is let go for the
//!   rest of the segment: the entries only it had not settled are acknowledged, and the next
//!   segment tries it again. What it missed shows in its coverage (missing or other text), so
//!   a switch to it is refused until a backfill has written it. A stop of the active part, or
//!   of the whole source, lets nothing go: what is not settled stays pending.
//! - **The slowest part sets the pace**: each part has its own byte budget, and the reader
//!   waits for room in each, so memory stays bounded whatever a part's provider does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::acks::Acks;
use crate::ingest::reader::Record;
use crate::ingest::{Feed, IngestError, Pipeline};
use crate::store::revision::Revision;

/// How often a running segment looks whether the target's revisions changed.
pub const WATCH_EVERY: Duration = Duration::from_secs(2);

/// How often a running segment looks whether a switch asks it to pause its intake
/// ([`SourceTargets::paused`]).
pub const PAUSE_POLL: Duration = Duration::from_millis(250);

/// One pipeline of a segment: the revision it writes (`None`: a table without revisions).
#[derive(Clone)]
pub struct SourceWriter {
    /// The revision written, if the target has revisions.
    pub revision: Option<Revision>,
    /// The pipeline that writes it.
    pub pipeline: Pipeline,
}

/// Where a stream source writes: asked for the pipelines of each segment, so that a source
/// running for days follows the target's revisions as they are made, switched and retired.
pub trait SourceTargets: Send + Sync {
    /// The pipelines of the next segment: at least one, the active revision's first, at most
    /// 64 (one a bit of the entries' acknowledgement).
    fn writers(&self) -> BoxFuture<'_, Result<Vec<SourceWriter>, IngestError>>;

    /// Whether the revisions differ from `current` (the segment then ends, and the next one
    /// asks [`SourceTargets::writers`] again). A look that fails answers `false`.
    fn changed<'a>(&'a self, current: &'a [SourceWriter]) -> BoxFuture<'a, bool> {
        let _ = current;
        Box::pin(async { false })
    }

    /// Whether a switch between the revisions of `current` asks the source to read no new
    /// entry for now (`revision activate --wait-secs`), so that what is in flight commits in
    /// every revision. A look that fails answers `false`.
    fn paused<'a>(&'a self, current: &'a [SourceWriter]) -> BoxFuture<'a, bool> {
        let _ = current;
        Box::pin(async { false })
    }
}

/// One pipeline, always: what [`Pipeline::run_source`] writes.
impl SourceTargets for Pipeline {
    fn writers(&self) -> BoxFuture<'_, Result<Vec<SourceWriter>, IngestError>> {
        Box::pin(async { Ok(vec![SourceWriter { revision: None, pipeline: self.clone() }]) })
    }
}

/// What the source's reader hands records to during a segment: the feed of every part.
pub(in crate::ingest) struct SourceFeed {
    /// Each part's feed (`None`: its run failed before it began reading).
    feeds: Vec<Option<Feed>>,
    /// Whether each part still writes (a shadow whose run stopped is let go).
    alive: Arc<Vec<AtomicBool>>,
    /// Stops the reading: the active part halted, or the revisions changed.
    pub(super) halt: CancellationToken,
    /// Set while a switch asks the source to read no new entry.
    paused: Arc<AtomicBool>,
    /// The whole source's stop: while it is set, no part is let go.
    cancel: CancellationToken,
    acks: Arc<Acks>,
    /// Each part's name, for the log.
    names: Arc<Vec<String>>,
}

impl SourceFeed {
    /// The active part's feed: its byte budget and line count stand for the segment's.
    fn active(&self) -> &Feed {
        self.feeds[0].as_ref().expect("a segment reads only once its active part's feed is there")
    }

    /// Whether a switch between revisions asks the reader to read no new entry for now.
    pub(super) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// Entries read in the segment (the active part's count).
    pub(super) fn lines_read(&self) -> &AtomicU64 {
        &self.active().lines_read
    }

    /// The largest record a part takes (each part's budget is the same setting).
    pub(super) fn budget_capacity(&self) -> u64 {
        self.active().budget.capacity()
    }

    /// Bytes of the active part's budget free now (at least 1): what one read may bring in
    /// besides its last entry.
    pub(super) fn budget_available(&self) -> u64 {
        self.active().budget.available().max(1)
    }

    /// Hands `rec` (an entry at position `at`) to every part still writing, each charged to
    /// its own budget; false once the active part halts or the reading ends. A shadow that
    /// cannot take it is let go.
    pub(super) async fn hand_on(&self, rec: Record, at: i64) -> bool {
        let live: Vec<usize> =
            (0..self.feeds.len()).filter(|&i| self.feeds[i].is_some() && self.is_alive(i)).collect();
        let mut rec = Some(rec);
        for (n, &i) in live.iter().enumerate() {
            let feed = self.feeds[i].as_ref().expect("filtered above");
            let this = if n + 1 == live.len() { rec.take() } else { rec.clone() };
            let Some(this) = this else { break };
            let handed = match feed.charge(this.approx_bytes()).await {
                Some(charge) => feed.hand_on_at(this, Some(at), charge).await,
                None => false,
            };
            if handed {
                continue;
            }
            if i == 0 || self.cancel.is_cancelled() || self.halt.is_cancelled() {
                return false;
            }
            self.let_go(i);
        }
        !self.halt.is_cancelled()
    }

    fn is_alive(&self, part: usize) -> bool {
        self.alive[part].load(Ordering::Acquire)
    }

    /// Lets part `part` (not the active one) go for the rest of the segment.
    fn let_go(&self, part: usize) {
        let_go(&self.alive, &self.acks, &self.names, part);
    }
}

fn let_go(alive: &[AtomicBool], acks: &Acks, names: &[String], part: usize) {
    if part == 0 || !alive[part].swap(false, Ordering::AcqRel) {
        return;
    }
    acks.drop_part(part);
    metrics::counter!(crate::metrics::SOURCE_REVISION_DROPPED).increment(1);
    tracing::warn!(revision = %names[part],
        "this revision's run stopped: the stream source goes on without it for the rest of the segment \
         (its coverage shows what it missed; a backfill writes it)");
}

/// Runs one segment: every writer's pipeline at once, the reader (`read`, given the
/// [`SourceFeed`]) on the active one's reader thread. Returns each writer's result, in order.
pub(super) async fn run_segment<R, Fut>(
    writers: &[SourceWriter],
    targets: Arc<dyn SourceTargets>,
    acks: &Arc<Acks>,
    cancel: &CancellationToken,
    read: R,
) -> Vec<Result<crate::ingest::IngestSummary, IngestError>>
where
    R: FnOnce(SourceFeed) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    acks.begin_parts(writers.len());
    let names: Arc<Vec<String>> = Arc::new(
        writers
            .iter()
            .map(|w| match &w.revision {
                Some(r) => format!("{} revision {} ({})", r.target, r.revision, r.relation),
                None => w.pipeline.store.target().name.clone(),
            })
            .collect(),
    );
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 1..writers.len() {
        let (tx, rx) = tokio::sync::oneshot::channel::<Feed>();
        senders.push(Some(tx));
        receivers.push(rx);
    }
    let mut runs: Vec<BoxFuture<'_, _>> = Vec::with_capacity(writers.len());
    let mut reading = Some((receivers, read, writers.to_vec()));
    for (i, writer) in writers.iter().enumerate() {
        let part = Some(Arc::new(acks.part(i)));
        if i == 0 {
            let (receivers, read, current) = reading.take().expect("the active part is first");
            let (acks, cancel, names, targets) =
                (acks.clone(), cancel.clone(), names.clone(), targets.clone());
            runs.push(Box::pin(writer.pipeline.execute_with(cancel.clone(), part, move |feed| async move {
                let mut feeds = vec![Some(feed)];
                for rx in receivers {
                    feeds.push(rx.await.ok());
                }
                let alive: Arc<Vec<AtomicBool>> =
                    Arc::new(feeds.iter().map(|f| AtomicBool::new(f.is_some())).collect());
                for (i, f) in feeds.iter().enumerate().skip(1) {
                    if f.is_none() {
                        acks.drop_part(i);
                    }
                }
                let halt = feeds[0].as_ref().expect("set above").halt.child_token();
                let done = CancellationToken::new();
                let _done_guard = done.clone().drop_guard();
                // A shadow whose run halts on its own is let go at once: its entries would
                // otherwise hold the backpressure until the segment ends.
                for (i, f) in feeds.iter().enumerate().skip(1) {
                    let Some(f) = f else { continue };
                    let (own, done, cancel) = (f.halt.clone(), done.clone(), cancel.clone());
                    let (alive, acks, names) = (alive.clone(), acks.clone(), names.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = own.cancelled() => if !cancel.is_cancelled() && !done.is_cancelled() {
                                let_go(&alive, &acks, &names, i);
                            },
                            _ = done.cancelled() => {}
                        }
                    });
                }
                // The revisions changing ends the reading (the next segment writes the new set);
                // a switch under way pauses it.
                let paused = Arc::new(AtomicBool::new(false));
                {
                    let (halt, done, paused) = (halt.clone(), done.clone(), paused.clone());
                    tokio::spawn(async move {
                        let mut last_change_check = std::time::Instant::now();
                        loop {
                            tokio::select! {
                                _ = tokio::time::sleep(PAUSE_POLL) => {}
                                _ = done.cancelled() => return,
                                _ = halt.cancelled() => return,
                            }
                            let now = targets.paused(&current).await;
                            if paused.swap(now, Ordering::AcqRel) != now {
                                tracing::info!(paused = now, "a switch between the target's revisions pauses the stream source's intake");
                            }
                            if last_change_check.elapsed() < WATCH_EVERY {
                                continue;
                            }
                            last_change_check = std::time::Instant::now();
                            if targets.changed(&current).await {
                                tracing::info!("the target's revisions changed: the stream source's segment ends, the next one writes the new set");
                                halt.cancel();
                                return;
                            }
                        }
                    });
                }
                read(SourceFeed { feeds, alive, halt, paused, cancel, acks, names }).await;
            })));
        } else {
            let tx = senders[i - 1].take();
            runs.push(Box::pin(writer.pipeline.execute_with(cancel.clone(), part, move |feed| async move {
                if let Some(tx) = tx {
                    let _ = tx.send(feed);
                }
            })));
        }
    }
    futures::future::join_all(runs).await
}
