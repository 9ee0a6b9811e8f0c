//! A replayer, one member of the `replayers` group: reads an entry (`XREADGROUP`, or takes
//! over an idle one with `XAUTOCLAIM`), loads and charges the rows' leases, re-embeds them
//! grouped by target table and model, commits under the fence, then `XACK` + `XDEL`; while a
//! batch is in flight it keeps its claim on the entries it still owns.

use super::outcome::{exhaust, next_state};
use super::*;

/// Entries one read (`XREADGROUP`) or claim (`XAUTOCLAIM`) takes, and so one batch: the
/// scheduler writes one entry per replay batch of a shard's rows ([`Scheduler`]). An entry
/// of one item, as releases before batched entries wrote them (and the relay still
/// publishes from their outbox rows), is then a batch of one: slower, and only while such
/// entries drain after an upgrade.
const ENTRIES_PER_READ: usize = 1;

/// How a group of rows is embedded and where it goes: (canonical target table, model the
/// rows record, `dimensions` request parameter).
type EmbedTarget = (String, Option<String>, Option<i32>);

/// One provider request of a group: how many of its items it covered, their outcomes, and
/// why the run stopped if it did (then only the embedded outcomes count; `None`: not sent,
/// the provider had already refused the run).
type Sent = (usize, Option<(Vec<ItemOutcome>, Option<Stop>)>);

/// One entry of a replay stream shard.
#[derive(Debug, Clone)]
struct Entry {
    /// The shard whose stream holds the entry.
    shard: u16,
    id: String,
    /// Its work items (a batch, or one from an earlier release); `None`: unreadable.
    items: Option<Vec<WorkItem>>,
}

impl Entry {
    fn of(shard: u16, e: redis::streams::StreamId) -> Entry {
        Entry { shard, items: crate::streams::work::from_entry(&e.map), id: e.id }
    }

    /// Work items in it (an unreadable entry counts as one: it is settled as one skip).
    fn weight(&self) -> usize {
        self.items.as_ref().map_or(1, Vec::len)
    }
}

/// One work item of a batch, with the entry that carries it.
#[derive(Debug, Clone)]
struct Item {
    shard: u16,
    /// The id of its entry: acknowledged once every item of the entry is settled.
    entry: String,
    work: WorkItem,
}

/// One member of the `replayers` group.
pub struct Replayer {
    /// Consumer name in the group; unique per replayer (a reused name inherits its pending
    /// entries).
    pub name: String,
    /// Where rows are loaded and their outcomes committed.
    pub store: Store,
    /// The provider side, shared (gate included) with the other replayers of the process.
    pub embedder: Embedder,
    /// Opens the dedicated connection for blocking `XREADGROUP` (a `BLOCK` would stall the shared
    /// connection).
    pub client: crate::streams::RedisClient,
    /// Shared connection for acknowledgements and claims.
    pub redis: RedisConn,
    /// The replay stream and its group.
    pub keys: StreamKeys,
    /// Batching, idle and delivery limits.
    pub config: ReplayConfig,
    /// Set after the provider refused the run: no new work is taken before then.
    pub paused_until: Option<Instant>,
}

/// Entry ids by shard.
fn by_shard<'e>(entries: impl IntoIterator<Item = (u16, &'e String)>) -> BTreeMap<u16, Vec<&'e String>> {
    let mut out: BTreeMap<u16, Vec<&String>> = BTreeMap::new();
    for (shard, id) in entries {
        out.entry(shard).or_default().push(id);
    }
    out
}

impl Replayer {
    /// The shards this replayer reads ([`ReplayConfig::shards`], else all of its keys').
    pub fn shards(&self) -> Vec<u16> {
        let all = self.keys.shards();
        let own: Vec<u16> = self.config.shards.iter().copied().filter(|&s| s < all).collect();
        if own.is_empty() { self.keys.shard_ids().collect() } else { own }
    }

    /// Reads and processes one batch of new entries, committed before it returns, starting
    /// at its first shard: with several shards, one read of each that does not block first
    /// (the first with entries wins), and a blocking read only when all are empty. (`run`
    /// overlaps consecutive batches instead: [`Replayer::step`].)
    pub async fn read_once(
        &mut self,
        conn: &mut crate::streams::RedisConn,
        cancel: &CancellationToken,
    ) -> Result<ReplayCounts, ReplayError> {
        let shards = self.shards();
        let entries = self.read_next(conn, &shards, &mut 0).await?;
        if entries.is_empty() {
            return Ok(ReplayCounts::default());
        }
        self.process(entries, cancel).await
    }

    /// The next batch of new entries of its `shards`, starting at `shards[*next]`. With one
    /// shard: one read blocking up to `block`. With several: first one read of each that
    /// does not block, and the first with entries wins; only when every shard is empty does
    /// it block, on `shards[*next]`, for its share of `block`. (Blocking on each shard in
    /// turn stalled a replayer whose shards were partly empty: it waited out every empty
    /// shard's share before reaching the busy one.) `*next` moves past the shard read, so
    /// busy shards take turns.
    async fn read_next(
        &self,
        conn: &mut crate::streams::RedisConn,
        shards: &[u16],
        next: &mut usize,
    ) -> Result<Vec<Entry>, redis::RedisError> {
        let n = shards.len().max(1);
        if shards.len() > 1 {
            let entries = self.read_now(conn, shards, next).await?;
            if !entries.is_empty() {
                return Ok(entries);
            }
        }
        let shard = shards.get(*next % n).copied().unwrap_or(0);
        *next = (*next + 1) % n;
        self.read_shard(conn, shard, Some(self.block_per_read(n))).await
    }

    /// The next batch of new entries of its `shards` without blocking: one read of each,
    /// starting at `shards[*next]`, and the first with entries wins (`*next` moves past it);
    /// empty when none has any.
    async fn read_now(
        &self,
        conn: &mut crate::streams::RedisConn,
        shards: &[u16],
        next: &mut usize,
    ) -> Result<Vec<Entry>, redis::RedisError> {
        let n = shards.len().max(1);
        for k in 0..n {
            let i = (*next + k) % n;
            let entries = self.read_shard(conn, shards.get(i).copied().unwrap_or(0), None).await?;
            if !entries.is_empty() {
                *next = (i + 1) % n;
                return Ok(entries);
            }
        }
        Ok(Vec::new())
    }

    /// Takes over entries idle longer than `min_idle` on each of its shards and processes
    /// them; also removes dead consumers.
    pub async fn reclaim_once(&mut self, cancel: &CancellationToken) -> Result<ReplayCounts, ReplayError> {
        let mut total = ReplayCounts::default();
        for shard in self.shards() {
            if cancel.is_cancelled() {
                break;
            }
            total.add(self.reclaim_shard(shard, cancel).await?);
        }
        Ok(total)
    }

    /// [`Replayer::reclaim_once`] on one shard (`XAUTOCLAIM` reads one stream).
    async fn reclaim_shard(
        &mut self,
        shard: u16,
        cancel: &CancellationToken,
    ) -> Result<ReplayCounts, ReplayError> {
        let stream = self.keys.replay_of(shard);
        let mut total = ReplayCounts::default();
        let mut cursor = "0-0".to_string();
        loop {
            let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                .arg(&stream)
                .arg(REPLAY_GROUP)
                .arg(&self.name)
                .arg(self.config.min_idle.as_millis() as u64)
                .arg(&cursor)
                .arg("COUNT")
                .arg(ENTRIES_PER_READ)
                .query_async(&mut self.redis)
                .await?;
            if !reply.deleted_ids.is_empty() {
                // Trimmed away while pending: nothing to do but forget them.
                let mut ack = redis::cmd("XACK");
                ack.arg(&stream).arg(REPLAY_GROUP);
                for id in &reply.deleted_ids {
                    ack.arg(id);
                }
                let _: i64 = ack.query_async(&mut self.redis).await?;
            }
            if !reply.claimed.is_empty() {
                let entries: Vec<Entry> = reply.claimed.into_iter().map(|e| Entry::of(shard, e)).collect();
                let items: usize = entries.iter().map(Entry::weight).sum();
                total.reclaimed += items as u64;
                tracing::info!(consumer = %self.name, shard, entries = entries.len(), items, "reclaimed idle replay entries");
                total.add(self.process(entries, cancel).await?);
            }
            if reply.next_stream_id == "0-0" || cancel.is_cancelled() {
                break;
            }
            cursor = reply.next_stream_id;
        }
        self.remove_dead_consumers(&stream).await?;
        Ok(total)
    }

    /// Deletes the group's consumers that have been idle past `dead_consumer_after` with
    /// nothing pending. A stream gone meanwhile (Redis lost its data) has none to delete: the
    /// next read recreates the group.
    async fn remove_dead_consumers(&mut self, stream: &str) -> Result<(), ReplayError> {
        let info: redis::streams::StreamInfoConsumersReply = match redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(stream)
            .arg(REPLAY_GROUP)
            .query_async(&mut self.redis)
            .await
        {
            Ok(info) => info,
            Err(e) if crate::streams::is_lost_group(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        for c in info.consumers {
            if c.name != self.name
                && c.pending == 0
                && c.idle as u128 > self.config.dead_consumer_after.as_millis()
            {
                let _: i64 = redis::cmd("XGROUP")
                    .arg("DELCONSUMER")
                    .arg(stream)
                    .arg(REPLAY_GROUP)
                    .arg(&c.name)
                    .query_async(&mut self.redis)
                    .await?;
                tracing::info!(consumer = %c.name, "removed dead consumer");
            }
        }
        Ok(())
    }

    /// Handles a batch of entries owned by this consumer: skip, exhaust or replay each, commit,
    /// then acknowledge what was settled. Rows are embedded in groups of (target table, model,
    /// request dimensions), each with the model the row records and checked against its own
    /// table's dimension, and committed into their own table.
    async fn process(
        &mut self,
        entries: Vec<Entry>,
        cancel: &CancellationToken,
    ) -> Result<ReplayCounts, ReplayError> {
        if entries.is_empty() {
            return Ok(ReplayCounts::default());
        }
        let (batch, pause) = self.prepare(entries, cancel).await?;
        if pause.is_some() {
            self.paused_until = pause;
        }
        self.commit_and_ack(batch).await
    }

    /// Everything of a batch but its commit: loads (and charges) its rows, re-embeds them,
    /// and settles each entry; the rows the provider refused are postponed at once. Returns
    /// the settled batch and, when the refusal pauses this replayer, until when. Takes
    /// `&self` so that it can run beside the commit of the batch before it ([`Replayer::step`]).
    async fn prepare(
        &self,
        entries: Vec<Entry>,
        cancel: &CancellationToken,
    ) -> Result<(Settlement, Option<Instant>), ReplayError> {
        let mut batch = Settlement::default();
        let mut pause = None;
        let todo = self.triage(entries, &mut batch).await?;
        let groups = group_by_target(todo);
        if !groups.is_empty() {
            failpoint::hit!("replay_before_embed");
            let entry_ids: Vec<(u16, String)> = groups
                .values()
                .flatten()
                .map(|(item, _)| (item.shard, item.entry.clone()))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let work = self.embed_groups(groups, cancel, &mut batch);
            let keepalive =
                keep_claim(self.redis.clone(), &self.keys, &self.name, &entry_ids, self.config.min_idle);
            let (stopped, postpone) = tokio::select! {
                r = work => r?,
                _ = keepalive => unreachable!("keepalive never ends"),
            };
            if let Some((stop, whole_batch)) = stopped {
                pause = self.postpone_refused(&stop, postpone, whole_batch, &mut batch).await?;
            }
        }
        Ok((batch, pause))
    }

    /// Sorts the batch's work items: unreadable entries, stale or duplicate items are
    /// skipped, and so is an item of an older lease of its row (another item stands for the
    /// row's work); a row begun more than `delivery_cap` times without an outcome is
    /// exhausted; the rest (with their live DLQ row) are returned to be replayed. Every
    /// entry of the batch is acknowledged after the commit unless one of its items is left
    /// pending ([`Settlement::held`]). Loading the rows charges the attempt in Postgres
    /// ([`Store::load_for_replay`]).
    async fn triage(
        &self,
        entries: Vec<Entry>,
        batch: &mut Settlement,
    ) -> Result<Vec<(Item, DlqRow)>, ReplayError> {
        let mut items: Vec<Item> = Vec::with_capacity(entries.iter().map(Entry::weight).sum());
        for e in entries {
            batch.entries.push((e.shard, e.id.clone()));
            match e.items {
                Some(works) => items.extend(works.into_iter().map(|work| Item {
                    shard: e.shard,
                    entry: e.id.clone(),
                    work,
                })),
                None => {
                    tracing::warn!(entry = %e.id, "unreadable replay entry; acknowledging it");
                    batch.counts.skipped += 1;
                }
            }
        }
        let works: Vec<&WorkItem> = items.iter().map(|i| &i.work).collect();
        let mut rows: HashMap<i64, DlqRow> = self
            .store
            .load_for_replay(&works, self.config.lease)
            .await?
            .into_iter()
            .map(|r| (r.id, r))
            .collect();
        let mut todo: Vec<(Item, DlqRow)> = Vec::new();
        for item in items {
            let work = &item.work;
            // Only charged rows were loaded: the item of the row's current lease. The first
            // current item of a row takes it out of the map (moved, not copied), so another
            // item of the same row in the batch finds none and is skipped.
            let live = rows.get(&work.dlq_id).is_some_and(|r| {
                r.is_current(work) && !r.exhausted && r.error_class == ErrorClass::Transient
            });
            match live.then(|| rows.remove(&work.dlq_id)).flatten() {
                Some(row) => {
                    let loads = row.loads;
                    if loads > self.config.delivery_cap as i32 {
                        batch.give_up.push(exhaust(
                            &row,
                            &format!(
                                "replay begun {loads} times without an outcome (delivery cap {})",
                                self.config.delivery_cap
                            ),
                        ));
                    } else {
                        todo.push((item, row));
                    }
                }
                None => batch.counts.skipped += 1,
            }
        }
        Ok(todo)
    }

    /// Embeds each group in turn, in provider requests of at most `request_inputs` inputs and
    /// `request_chars` characters, `requests_in_flight` at a time. A group the provider
    /// refuses has its items not embedded returned untouched, to be postponed (what other
    /// requests in flight embedded meanwhile is kept). The refusal holds back the whole
    /// batch, and pauses this replayer (`Some((stop, true))`), when it is provider-wide
    /// ([`Stop::is_provider_wide`]) or refuses the model and `dimensions` `serve` is
    /// configured with; a refusal of another target (a model retired since its rows were
    /// parked, `dimensions` it cannot give) holds back only that target's rows
    /// (`Some((stop, false))`), so the other rows go on.
    async fn embed_groups(
        &self,
        groups: BTreeMap<EmbedTarget, Vec<(Item, DlqRow)>>,
        cancel: &CancellationToken,
        batch: &mut Settlement,
    ) -> Result<(Option<(Stop, bool)>, Vec<(Item, DlqRow)>), ReplayError> {
        let mut postpone: Vec<(Item, DlqRow)> = Vec::new();
        let mut stopped: Option<(Stop, bool)> = None;
        for (target, items) in groups {
            if stopped.as_ref().is_some_and(|(_, whole_batch)| *whole_batch) {
                postpone.extend(items);
                continue;
            }
            let Some(embedder) = self.embedder_for(&target, &items, batch).await? else { continue };
            // Borrowed from the rows (not copied: a text is up to a chunk's size).
            let text_refs: Vec<&str> = items.iter().map(|(_, r)| r.text.as_str()).collect();
            // A row parked after 500s is normally one that failed alone while its neighbours
            // passed: it is sent alone first, so its batch does not pay for it again.
            for (_, row) in &items {
                if row.error_reason == Reason::Http500.as_str() {
                    embedder.isolation.suspect(&row.text);
                }
            }
            // The group's provider requests, `requests_in_flight` at a time; once the
            // provider has refused the run, requests not yet sent are not sent.
            let refused = std::sync::atomic::AtomicBool::new(false);
            let ranges = request_ranges(&text_refs, self.config.request_inputs, self.config.request_chars);
            let sent: Vec<Sent> = futures::stream::iter(ranges.into_iter().map(|range| {
                let (embedder, text_refs, refused) = (&embedder, &text_refs, &refused);
                async move {
                    if refused.load(std::sync::atomic::Ordering::Relaxed) {
                        return (range.len(), None);
                    }
                    let mut stats = BatchStats::default();
                    let r =
                        embedder.embed_batch_until_stop(&text_refs[range.clone()], cancel, &mut stats).await;
                    if r.1.is_some() {
                        refused.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    (range.len(), Some(r))
                }
            }))
            .buffered(self.config.requests_in_flight.max(1))
            .collect()
            .await;
            let mut items = items.into_iter();
            let mut refused: Option<Stop> = None;
            for (len, result) in sent {
                let part: Vec<(Item, DlqRow)> = items.by_ref().take(len).collect();
                match result {
                    Some((outcomes, None)) => self.settle_outcomes(part, outcomes, batch),
                    Some((outcomes, Some(stop))) => {
                        refused.get_or_insert(stop);
                        // What the provider embedded before refusing was paid for: replayed.
                        let (mut embedded, mut vectors) = (Vec::new(), Vec::new());
                        for (item, outcome) in part.into_iter().zip(outcomes) {
                            match outcome {
                                ItemOutcome::Embedded(_) => {
                                    embedded.push(item);
                                    vectors.push(outcome);
                                }
                                _ => postpone.push(item),
                            }
                        }
                        self.settle_outcomes(embedded, vectors, batch);
                    }
                    None => postpone.extend(part),
                }
            }
            if let Some(stop) = refused {
                let (table, model, request_dimensions) = &target;
                let configured = &self.embedder.client;
                // What `serve` is configured with: new parks would be refused alike.
                let refuses_configured = model.as_deref().is_none_or(|m| {
                    m == configured.model()
                        && request_dimensions.and_then(|d| usize::try_from(d).ok())
                            == configured.request_dimensions()
                });
                let whole_batch = stop.is_provider_wide() || refuses_configured;
                if !whole_batch {
                    tracing::warn!(error = %stop, table = %table, model = model.as_deref().unwrap_or_default(),
                        pause_secs = self.config.systemic_pause.as_secs(),
                        "provider refused this model's replay; postponing its rows, the other models go on");
                }
                if stopped.as_ref().is_none_or(|(_, w)| !w) {
                    stopped = Some((stop, whole_batch));
                }
            }
        }
        Ok((stopped, postpone))
    }

    /// The embedder for one group: the row's model and request dimensions, checked against
    /// its table's dimension. `None` when the table is gone or unusable: retrying cannot help
    /// until an operator fixes it (then `dlq requeue --exhausted`), so its rows are exhausted.
    async fn embedder_for(
        &self,
        (table, model, request_dimensions): &EmbedTarget,
        items: &[(Item, DlqRow)],
        batch: &mut Settlement,
    ) -> Result<Option<Embedder>, ReplayError> {
        let target = match self.store.target_for(table).await {
            Ok(t) => t,
            Err(StoreError::Target { problem, .. }) => {
                tracing::error!(table = %table, %problem, "replay target table unusable; exhausting its rows");
                for (_, row) in items {
                    batch.give_up.push(exhaust(row, &format!("target table {table}: {problem}")));
                }
                return Ok(None);
            }
            Err(e) => return Err(ReplayError::Store(e)),
        };
        Ok(Some(Embedder {
            client: match model {
                Some(m) => self
                    .embedder
                    .client
                    .with_target(m, request_dimensions.and_then(|d| usize::try_from(d).ok())),
                None => self.embedder.client.clone(),
            },
            dimensions: target.dimensions,
            revision: target.revision,
            ..self.embedder.clone()
        }))
    }

    /// Records each item's outcome: embedded rows are to be stored, failed ones re-parked on
    /// the DLQ schedule; an item not attempted keeps its entry pending.
    fn settle_outcomes(
        &self,
        items: Vec<(Item, DlqRow)>,
        outcomes: Vec<ItemOutcome>,
        batch: &mut Settlement,
    ) {
        for ((item, row), outcome) in items.into_iter().zip(outcomes) {
            match outcome {
                ItemOutcome::Embedded(embedding) => batch.replayed.push(Replayed::of(&row, embedding)),
                ItemOutcome::Failed(f) => batch.reparked.push(next_state(&row, &f, &self.config)),
                ItemOutcome::NotAttempted => {
                    batch.counts.left_pending += 1;
                    batch.held.insert((item.shard, item.entry));
                }
            }
        }
    }

    /// The provider refused the run (bad key, no quota, long outage, or one model): not the
    /// items' fault, so nothing is charged. Leaving the entries pending would burn their
    /// delivery count on every reclaim until they were exhausted for a problem they did not
    /// cause, so the rows are postponed (same generation, same attempts) and the entries
    /// acknowledged; with `pause` (a refusal of the whole batch, see
    /// [`Replayer::embed_groups`]) this replayer pauses as long. How long: see
    /// [`Replayer::refusal_wait`].
    async fn postpone_refused(
        &self,
        stop: &Stop,
        postpone: Vec<(Item, DlqRow)>,
        pause: bool,
        batch: &mut Settlement,
    ) -> Result<Option<Instant>, ReplayError> {
        let wait = self.refusal_wait(stop);
        let mut paused_until = None;
        if pause {
            tracing::error!(error = %stop, pause_ms = wait.as_millis() as u64,
                "provider refused replay; postponing the batch and pausing this replayer");
            paused_until = Some(Instant::now() + wait);
        }
        let ids: Vec<i64> = postpone.iter().map(|(_, r)| r.id).collect();
        let gens: Vec<i64> = postpone.iter().map(|(_, r)| r.generation).collect();
        self.store.postpone(&ids, &gens, wait).await?;
        batch.counts.postponed += ids.len() as u64;
        Ok(paused_until)
    }

    /// How long refused rows wait: `systemic_pause` for a refusal (key, quota, model) or a
    /// rate limit that outlasted `max_outage`; for an outage, until the breaker's next probe
    /// (at least [`OUTAGE_POSTPONE_MIN`], at most `systemic_pause`), so that replay resumes
    /// at the probe that finds the provider back, not a fixed minute later.
    fn refusal_wait(&self, stop: &Stop) -> Duration {
        let pause = self.config.systemic_pause;
        match (stop, self.embedder.gate.next_probe_in()) {
            (Stop::Outage(_), Some(probe)) => probe.max(OUTAGE_POSTPONE_MIN).min(pause),
            _ => pause,
        }
    }

    /// Counts the vectors a commit stored, by the revision of each row's target (its table's
    /// lookup is cached: the commit has just resolved it; a lookup that fails counts them
    /// under revision 1 rather than not at all).
    async fn count_stored(&self, replayed: &[Replayed], stored: &[i64]) {
        let stored: HashSet<i64> = stored.iter().copied().collect();
        let mut by_table: BTreeMap<&str, u64> = BTreeMap::new();
        for r in replayed.iter().filter(|r| stored.contains(&r.id)) {
            *by_table.entry(r.target_table.as_str()).or_default() += 1;
        }
        for (table, n) in by_table {
            let revision = self.store.target_for(table).await.map_or(1, |t| t.revision);
            crate::metrics::stored(revision, n);
        }
    }

    /// Commits the batch's results in one transaction (a row that changed meanwhile is
    /// skipped), counts them, and only then acknowledges and deletes the settled entries
    /// (every entry none of whose items is left pending): one `XACK` and `XDEL` per shard (a
    /// batch comes from one shard's read or claim, so normally one).
    async fn commit_and_ack(&self, batch: Settlement) -> Result<ReplayCounts, ReplayError> {
        let Settlement { entries, held, replayed, mut reparked, give_up, mut counts } = batch;
        let ack: Vec<(u16, String)> = entries.into_iter().filter(|e| !held.contains(e)).collect();
        failpoint::hit!("replay_before_commit");
        reparked.extend(give_up);
        let (stored, applied) = self.store.commit_settled(&replayed, &reparked).await?;
        counts.replayed += stored.len() as u64;
        counts.skipped += (replayed.len() - stored.len()) as u64;
        let applied: HashSet<i64> = applied.into_iter().collect();
        for r in &reparked {
            if !applied.contains(&r.id) {
                counts.skipped += 1;
            } else if r.exhausted_reason.is_some() {
                counts.exhausted += 1;
            } else {
                counts.reparked += 1;
            }
        }
        failpoint::hit!("replay_after_commit");
        self.config.settled.add(stored.len() + applied.len(), self.config.outstanding_max);
        record_outcomes(&counts);
        self.count_stored(&replayed, &stored).await;
        let mut redis = self.redis.clone();
        if ack.is_empty() {
            return Ok(counts);
        }
        for (shard, ids) in by_shard(ack.iter().map(|(s, id)| (*s, id))) {
            // Acknowledged and deleted: an entry holds a batch of items, so the stream keeps
            // only the work still outstanding instead of consumed batches until the relay's
            // next trim below the group's needs.
            let stream = self.keys.replay_of(shard);
            let mut pipe = redis::pipe();
            pipe.cmd("XACK").arg(&stream).arg(REPLAY_GROUP).arg(&ids).ignore();
            pipe.cmd("XDEL").arg(&stream).arg(&ids).ignore();
            pipe.query_async::<()>(&mut redis).await?;
        }
        Ok(counts)
    }

    /// Runs until `stop` (stop claiming), finishing the batches in hand (one being prepared,
    /// one waiting for its commit: [`Replayer::step`]); `hard` cuts retry waits short when
    /// the grace period is over. Transient errors are logged and retried with capped
    /// backoff; a permanent one ends the loop.
    ///
    /// Returns `Ok(())` once stopped, `Err` on a permanent error (the caller logs it at ERROR
    /// and stops the process).
    pub async fn run(mut self, stop: CancellationToken, hard: CancellationToken) -> Result<(), ReplayError> {
        let mut conn = None;
        let mut backoff =
            crate::embed::retry::Reconnect::new(Duration::from_millis(100), Duration::from_secs(5));
        // `None`: never done, due at once (`Instant::now() - 1h` panics early after boot on
        // platforms whose monotonic clock starts at zero).
        let mut last_reclaim = Instant::now().checked_sub(Duration::from_secs(3600));
        if let Err(e) = self.ensure_groups().await {
            if !e.is_transient() {
                return Err(e);
            }
            tracing::warn!(error = %e, "cannot create the consumer group yet; will retry");
        }
        let mut flight = InFlight::default();
        while !stop.is_cancelled() {
            if let Some(until) = self.paused_until.take() {
                // The batch embedded before the refusal is committed before the pause.
                match self.finish(&mut flight).await {
                    Err(e) if !e.is_transient() => return Err(e),
                    Err(e) => {
                        tracing::warn!(consumer = %self.name, error = %e, "replay commit failed; its entries stay pending")
                    }
                    Ok(_) => {}
                }
                sleep_or_cancel(until.saturating_duration_since(Instant::now()), &stop).await;
                continue;
            }
            let step: Result<ReplayCounts, ReplayError> = async {
                let mut done = ReplayCounts::default();
                if last_reclaim.is_none_or(|t| t.elapsed() >= self.config.min_idle / 2) {
                    last_reclaim = Some(Instant::now());
                    done.add(self.finish(&mut flight).await?);
                    self.ensure_groups().await?;
                    done.add(self.reclaim_once(&hard).await?);
                }
                if conn.is_none() {
                    conn = Some(crate::streams::blocking(&self.client, self.config.block).await?);
                }
                let c = conn.as_mut().expect("just set");
                done.add(self.step(c, &stop, &hard, &mut flight).await?);
                Ok(done)
            }
            .await;
            match step {
                Ok(c) => {
                    backoff.reset();
                    if c != ReplayCounts::default() {
                        tracing::debug!(consumer = %self.name, ?c, "replay batch");
                    }
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    tracing::warn!(consumer = %self.name, error = %e, "replay step failed; retrying");
                    conn = None;
                    sleep_or_cancel(backoff.next_delay(), &stop).await;
                }
            }
        }
        // Stopped: the batch in hand is committed before the replayer ends.
        match self.finish(&mut flight).await {
            Err(e) if !e.is_transient() => Err(e),
            Err(e) => {
                tracing::warn!(consumer = %self.name, error = %e, "last replay commit failed; its entries stay pending");
                Ok(())
            }
            Ok(_) => Ok(()),
        }
    }

    /// One step of the loop [`Replayer::run`] runs: the next batch is read and prepared
    /// (rows loaded and charged, texts re-embedded) while the batch before it, prepared by
    /// the previous step, is committed and acknowledged. Commits stay in order, one batch
    /// behind, so the database and the provider work at once where one batch after the
    /// other left each idle in turn (BENCHMARKS.md "Replay against ingest"). With a batch in
    /// `flight` the read does not block: when nothing new has come, that batch is committed
    /// alone. Only the blocking read ends early on `stop`; `hard` cuts retry waits short.
    /// Returns what this step's commit settled. The caller ends with
    /// [`Replayer::finish`].
    pub async fn step(
        &mut self,
        conn: &mut crate::streams::RedisConn,
        stop: &CancellationToken,
        hard: &CancellationToken,
        flight: &mut InFlight,
    ) -> Result<ReplayCounts, ReplayError> {
        let shards = self.shards();
        let read = if flight.prepared.is_some() {
            self.read_now(conn, &shards, &mut flight.next).await
        } else {
            tokio::select! {
                _ = stop.cancelled() => return Ok(ReplayCounts::default()),
                r = self.read_next(conn, &shards, &mut flight.next) => r,
            }
        };
        let entries = match read {
            Ok(entries) => entries,
            Err(e) => {
                if crate::streams::is_lost_group(&e) {
                    self.ensure_groups().await?;
                }
                return Err(e.into());
            }
        };
        if entries.is_empty() {
            return self.finish(flight).await;
        }
        let previous = flight.prepared.take();
        let (committed, prepared) = tokio::join!(
            async {
                match previous {
                    Some(batch) => self.commit_and_ack(batch).await,
                    None => Ok(ReplayCounts::default()),
                }
            },
            self.prepare(entries, hard),
        );
        match prepared {
            Ok((batch, pause)) => {
                // Kept even when the commit before it failed: the next step commits it.
                flight.prepared = Some(batch);
                if pause.is_some() {
                    self.paused_until = pause;
                }
            }
            // Its entries stay pending with this replayer and are reclaimed after `min_idle`.
            Err(e) => {
                committed?;
                return Err(e);
            }
        }
        committed
    }

    /// Commits and acknowledges the batch `flight` still holds, if any
    /// ([`Replayer::step`]).
    pub async fn finish(&self, flight: &mut InFlight) -> Result<ReplayCounts, ReplayError> {
        match flight.prepared.take() {
            Some(batch) => self.commit_and_ack(batch).await,
            None => Ok(ReplayCounts::default()),
        }
    }

    /// Creates the consumer group of each of its shards if missing
    /// ([`recover_lost_groups`]).
    async fn ensure_groups(&mut self) -> Result<(), ReplayError> {
        let shards = self.shards();
        recover_lost_groups(
            &self.store,
            &mut self.redis,
            &self.keys,
            &shards,
            self.config.data_lost.as_deref(),
        )
        .await?;
        Ok(())
    }

    /// How long one read blocks: its share of `block` when it reads several shards in turn
    /// (at least 10 ms), so that a busy shard is read again within `block` however many idle
    /// ones it has.
    fn block_per_read(&self, shards: usize) -> Duration {
        (self.config.block / shards.max(1) as u32).max(Duration::from_millis(10))
    }

    /// New entries of one shard (blocking up to `block`; `None`: not at all).
    async fn read_shard(
        &self,
        conn: &mut crate::streams::RedisConn,
        shard: u16,
        block: Option<Duration>,
    ) -> Result<Vec<Entry>, redis::RedisError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(REPLAY_GROUP).arg(&self.name).arg("COUNT").arg(ENTRIES_PER_READ);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(block.as_millis() as u64);
        }
        let reply: StreamReadReply =
            cmd.arg("STREAMS").arg(self.keys.replay_of(shard)).arg(">").query_async(conn).await?;
        Ok(reply.keys.into_iter().flat_map(|k| k.ids).map(|e| Entry::of(shard, e)).collect())
    }
}

/// What [`Replayer::step`] carries from one step to the next: the batch prepared and not yet
/// committed, and which of the replayer's shards to read next. Start with
/// `InFlight::default()`, end with [`Replayer::finish`].
#[derive(Default)]
pub struct InFlight {
    prepared: Option<Settlement>,
    next: usize,
}

/// What one batch has decided so far: its entries, those to keep pending, and the rows to
/// commit.
#[derive(Default)]
struct Settlement {
    /// Every entry of the batch, with its shard: acknowledged after the commit unless held.
    entries: Vec<(u16, String)>,
    /// Entries with an item left pending (not attempted before a shutdown): not
    /// acknowledged, so the entry is taken over and its settled items are skipped then.
    held: HashSet<(u16, String)>,
    replayed: Vec<Replayed>,
    /// Failed passes, re-parked on the DLQ schedule.
    reparked: Vec<Repark>,
    /// Rows exhausted without a pass (delivery cap, unusable target table).
    give_up: Vec<Repark>,
    counts: ReplayCounts,
}

/// The provider requests of a group: consecutive ranges of `texts` of at most `max_inputs`
/// inputs and `max_chars` characters (an input longer than that alone), in order.
fn request_ranges(texts: &[&str], max_inputs: usize, max_chars: usize) -> Vec<Range<usize>> {
    let max_inputs = max_inputs.max(1);
    let mut out = Vec::new();
    let (mut start, mut chars) = (0, 0usize);
    for (i, t) in texts.iter().enumerate() {
        let len = t.chars().count();
        if i > start && (i - start >= max_inputs || chars + len > max_chars) {
            out.push(start..i);
            (start, chars) = (i, 0);
        }
        chars += len;
    }
    if start < texts.len() {
        out.push(start..texts.len());
    }
    out
}

/// One group per (table, model, request dimensions), in a stable order.
fn group_by_target(todo: Vec<(Item, DlqRow)>) -> BTreeMap<EmbedTarget, Vec<(Item, DlqRow)>> {
    let mut groups: BTreeMap<EmbedTarget, Vec<(Item, DlqRow)>> = BTreeMap::new();
    for (e, row) in todo {
        groups
            .entry((row.target_table.clone(), row.model.clone(), row.request_dimensions))
            .or_default()
            .push((e, row));
    }
    groups
}

/// Counts a batch's outcomes in the replay metrics.
fn record_outcomes(counts: &ReplayCounts) {
    for (outcome, n) in [
        ("replayed", counts.replayed),
        ("reparked", counts.reparked),
        ("exhausted", counts.exhausted),
        ("skipped", counts.skipped),
    ] {
        metrics::counter!(crate::metrics::REPLAY_OUTCOMES, "outcome" => outcome).increment(n);
    }
}

/// Refreshes this consumer's claim on `ids` (resets their idle time) every third of
/// `min_idle` until dropped, so nobody reclaims a batch that is still being worked on. Only
/// entries this consumer still owns are refreshed: one that another replayer reclaimed
/// while this one stalled stays with it (taking it back made both embed it).
async fn keep_claim(
    mut redis: RedisConn,
    keys: &StreamKeys,
    me: &str,
    ids: &[(u16, String)],
    min_idle: Duration,
) {
    let every = (min_idle / 3).max(Duration::from_millis(50));
    let shards = by_shard(ids.iter().map(|(s, id)| (*s, id)));
    loop {
        tokio::time::sleep(every).await;
        for (shard, ids) in &shards {
            let stream = keys.replay_of(*shard);
            let mine = match still_owned(&mut redis, &stream, me, ids).await {
                Ok(mine) if mine.is_empty() => continue,
                Ok(mine) => mine,
                Err(e) => {
                    tracing::warn!(error = %e, shard, "could not read the claim on a replay batch");
                    continue;
                }
            };
            let mut cmd = redis::cmd("XCLAIM");
            cmd.arg(&stream).arg(REPLAY_GROUP).arg(me).arg(0);
            for id in mine {
                cmd.arg(id);
            }
            cmd.arg("JUSTID");
            if let Err(e) = cmd.query_async::<redis::Value>(&mut redis).await {
                tracing::warn!(error = %e, shard, "could not refresh the claim on a replay batch");
            }
        }
    }
}

/// Which of `ids` (entries of `stream`) are still pending for consumer `me`.
async fn still_owned<'i>(
    redis: &mut RedisConn,
    stream: &str,
    me: &str,
    ids: &[&'i String],
) -> Result<Vec<&'i String>, redis::RedisError> {
    let (Some(first), Some(last)) = (
        ids.iter().min_by_key(|id| crate::streams::parse_entry_id(id)),
        ids.iter().max_by_key(|id| crate::streams::parse_entry_id(id)),
    ) else {
        return Ok(Vec::new());
    };
    let pending: StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg(REPLAY_GROUP)
        .arg(*first)
        .arg(*last)
        .arg(ids.len() * 2 + 10)
        .arg(me)
        .query_async(redis)
        .await?;
    let owned: HashSet<String> = pending.ids.into_iter().map(|p| p.id).collect();
    Ok(ids.iter().copied().filter(|id| owned.contains(*id)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_requests_obey_the_input_and_character_limits() {
        let texts = ["aa", "bbb", "c", "dddddd", "e", "ff", "g"];
        assert_eq!(request_ranges(&texts, 3, 1000), vec![0..3, 3..6, 6..7]);
        assert_eq!(request_ranges(&texts, 100, 6), vec![0..3, 3..4, 4..7], "a long input goes alone");
        assert_eq!(request_ranges(&texts, 100, 1), (0..7).map(|i| i..i + 1).collect::<Vec<_>>());
        assert_eq!(request_ranges(&texts, 0, 1000), (0..7).map(|i| i..i + 1).collect::<Vec<_>>());
        assert!(request_ranges(&[], 3, 10).is_empty());
        let covered: Vec<usize> = request_ranges(&texts, 2, 4).into_iter().flatten().collect();
        assert_eq!(covered, (0..7).collect::<Vec<_>>(), "every input once, in order");
    }
}
