//! The Redis-side checks of a run and their repairs: the events stream against the outbox
//! (missing events, republished through the relay; also run alone after Redis lost its data)
//! and the replay streams against the DLQ (lost replay work, orphan entries), each a paged
//! scan whose memory is bounded by the page.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::checks::{Check, Finding};
use super::sql::{self, WorkAudit};
use super::{ReconcileError, Reconciler};
use crate::relay::sql as outbox;
use crate::streams::{REPLAY_GROUP, RedisConn};

/// Events created before this instant may have outlived their dedup record (it lives
/// `dedup_ttl` from the last write to its hash, at or after the event's publish), with an
/// hour of margin for a relay that published late. A TTL too large for the clock means no
/// record has expired yet, never that all have.
fn records_expire_before(now: DateTime<Utc>, dedup_ttl: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(dedup_ttl.saturating_sub(Duration::from_secs(3600)))
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// What [`Reconciler::events_missing_from_stream`] found on a page.
#[derive(Default)]
struct StreamLookup<'r> {
    missing: Vec<&'r outbox::PublishedEvent>,
    trimmed: u64,
    expired: u64,
}

/// The stream findings of a run, and where the events check's next window starts.
pub(super) struct StreamFindings {
    pub(super) findings: Vec<Finding>,
    /// Whether the events check ran (it needs Redis).
    pub(super) events_checked: bool,
    /// Where the next run's events check resumes: the outbox transactions its walk could not
    /// see yet, and those of the missing events it left unrepaired (a snapshot, text form).
    pub(super) events_window: Option<String>,
}

/// A replay stream entry still to be replayed: its id, and the `(DLQ row, generation)` of
/// each work item it carries (`None`: unreadable).
type OutstandingEntry = (String, Option<Vec<(i64, i64)>>);

/// Records the page's `outstanding` work items (entry id, and the DLQ rows and generations
/// it carries, if readable) in `audit`; returns the entries all of whose rows are gone or
/// have moved on to another generation, and the unreadable ones.
async fn orphans_among(
    audit: &mut WorkAudit,
    outstanding: Vec<OutstandingEntry>,
) -> Result<Vec<String>, ReconcileError> {
    let (ids, gens): (Vec<i64>, Vec<i64>) =
        outstanding.iter().filter_map(|(_, w)| w.as_ref()).flatten().copied().unzip();
    audit.record_outstanding(&ids, &gens).await?;
    let live: HashMap<i64, i64> = audit.live_generations(&ids).await?;
    Ok(outstanding
        .into_iter()
        .filter(|(_, w)| match w {
            // An entry of several items is an orphan only once none of them is live.
            Some(items) => items.iter().all(|(dlq_id, generation)| live.get(dlq_id) != Some(generation)),
            None => true,
        })
        .map(|(id, _)| id)
        .collect())
}

impl Reconciler {
    /// The three stream checks, or (without Redis) three findings saying they were skipped.
    /// `events_window`: the events check looks at the events of the outbox transactions not
    /// visible in this snapshot (`None`: every retained event).
    pub(super) async fn stream_findings(
        &self,
        repair: bool,
        events_window: Option<String>,
    ) -> Result<StreamFindings, ReconcileError> {
        let Some(mut redis) = self.redis.clone() else {
            let skipped =
                [Check::MissingEvents, Check::LostReplayWork, Check::OrphanStreamEntries].map(|check| {
                    Finding {
                        check,
                        found: 0,
                        examples: vec![],
                        repaired: 0,
                        note: Some("skipped: no Redis configured".into()),
                    }
                });
            return Ok(StreamFindings {
                findings: skipped.into(),
                events_checked: false,
                events_window: None,
            });
        };
        // The prefix was checked when the run started (`run_sweep`).
        crate::streams::check_shards(&mut redis, &self.keys).await?;
        let (missing, next_window) = self.missing_events_check(&mut redis, repair, events_window).await?;
        let [lost, orphans] = self.replay_stream_checks(&mut redis, repair).await?;
        Ok(StreamFindings {
            findings: vec![missing, lost, orphans],
            events_checked: true,
            events_window: next_window,
        })
    }

    /// Republishes the events Redis lost (a `FLUSHALL`, a restart without persistence, a
    /// cluster master restarted empty): the missing-events check with repair, alone, under
    /// the reconcile lock (so it never races a reconcile run's own republish), recording no
    /// run. `serve` calls it when a replayer finds a stream's consumer group gone, so lost
    /// events come back within seconds instead of at the next `reconcile --repair`. Returns
    /// the events marked for the relay to publish again (`None` without Redis).
    pub async fn republish_lost_events(&self) -> Result<Option<u64>, ReconcileError> {
        let Some(mut redis) = self.redis.clone() else { return Ok(None) };
        // Held until it is dropped at the end: rolled back, so nothing is recorded.
        let _lock = sql::RunLock::begin(self.store.pool()).await?;
        crate::streams::check_shards(&mut redis, &self.keys).await?;
        let (missing, _) = self.missing_events_check(&mut redis, true, None).await?;
        Ok(Some(missing.repaired))
    }

    /// Published events must be on the events stream: pages through the published `events`
    /// rows of the outbox ([`ReconcileConfig::page`] at a time), reads the entry id each one
    /// became from its dedup record (the relay writes it when it publishes, see
    /// `redis/publish.lua`) and looks the entries up (per shard and page, one `XRANGE` over
    /// the page's entry ids: [`entries_present`]).
    ///
    /// With a `window` (an incremental run), only the rows of the outbox transactions not
    /// visible in that snapshot (what the relay published since the previous run's walk
    /// began, and the previous run's unrepaired findings), and the page
    /// of events just before it: the witnesses that what the previous runs checked is still
    /// there. A stream only ever loses its newest entries together with the older ones (a
    /// `FLUSHALL`, a restart without persistence or from an older snapshot, a failover to a
    /// replica that lagged), so a witness missing sends the check through every retained
    /// event; an entry deleted by hand from the middle of a stream is found by the next full
    /// sweep. Without a window, every retained event. Either walk ends at the outbox's
    /// position when it began: what a relay publishes meanwhile goes to the stream as it is
    /// now, and the next run's window covers it.
    ///
    /// An event whose record is gone was lost with the data of Redis, unless the record may
    /// have expired ([`ReconcileConfig::dedup_ttl`]): those are counted in the note. An entry
    /// older than the stream's first one, while the stream is at its length cap, was trimmed
    /// by policy and is not a finding. Repair deletes the event's dedup record (or the relay
    /// would take the republish for a duplicate) and hands the row back to the relay, which
    /// publishes it again with the same `event_id`. Rows an older relay published (before
    /// migration 0022) are not walked; rows past the outbox retention are gone. Returns the
    /// finding and where the next incremental walk starts.
    ///
    /// [`ReconcileConfig::page`]: super::ReconcileConfig::page
    /// [`ReconcileConfig::dedup_ttl`]: super::ReconcileConfig::dedup_ttl
    async fn missing_events_check(
        &self,
        redis: &mut RedisConn,
        repair: bool,
        window: Option<String>,
    ) -> Result<(Finding, Option<String>), ReconcileError> {
        use outbox::EventsPage;
        let pool = self.store.pool();
        let page = self.config.page();
        let mut out =
            Finding { check: Check::MissingEvents, found: 0, examples: vec![], repaired: 0, note: None };
        let at = outbox::position(pool).await?;
        // What this walk cannot see yet, plus its unrepaired findings: the next window.
        let mut next_window = outbox::Window::parse(at.lower());
        // A window ahead of the position was taken in another cluster (a logical restore:
        // the relay started its position again) and says nothing about this one's
        // transactions: every retained event is walked.
        let window = window.filter(|w| match (outbox::Window::parse(w), &next_window) {
            (Some(w), Some(now)) => !w.is_ahead_of(now),
            _ => true,
        });
        let mut since = None;
        let mut lost_before_window = false;
        if let Some(window) = window {
            let witnesses =
                outbox::published_events(pool, &EventsPage::PublishedBefore(window.clone()), page).await?;
            let missing = self.events_missing_from_stream(redis, &witnesses).await?;
            lost_before_window = !missing.missing.is_empty();
            if !lost_before_window {
                since = Some(window);
            }
        }
        let mut cursor = EventsPage::Published { since, after: (0, 0), at };
        let (mut trimmed, mut expired) = (0u64, 0u64);
        loop {
            let rows = outbox::published_events(pool, &cursor, page).await?;
            let Some(last) = rows.last() else { break };
            if let EventsPage::Published { after, .. } = &mut cursor {
                *after = (last.txid, last.id);
            }
            let found = self.events_missing_from_stream(redis, &rows).await?;
            trimmed += found.trimmed;
            expired += found.expired;
            let missing = found.missing;
            out.found += missing.len() as u64;
            out.add_examples(missing.iter().map(|r| r.key.clone()), self.config.examples);
            if repair && !missing.is_empty() {
                out.repaired += self.republish_events(redis, &missing).await?;
            } else if let Some(w) = next_window.as_mut() {
                w.hold(missing.iter().map(|r| r.txid));
            }
            if rows.len() < page {
                break;
            }
        }
        let mut notes = Vec::new();
        if lost_before_window {
            notes.push("events published before the previous run are gone from the stream: checked every retained event".to_string());
        }
        if trimmed > 0 {
            notes.push(format!("{trimmed} trimmed by the stream's length cap"));
        }
        if expired > 0 {
            notes.push(format!(
                "{expired} not checked: their dedup records may have expired (relay_marker_ttl_secs)"
            ));
        }
        out.note = (!notes.is_empty()).then(|| notes.join("; "));
        Ok((out, next_window.map(|w| w.to_string())))
    }

    /// Which of `rows` are not on their shard's events stream, how many more were trimmed by
    /// its length cap (missing, older than its first entry, while the stream is at the cap),
    /// and how many could not be checked (their record may have expired).
    async fn events_missing_from_stream<'r>(
        &self,
        redis: &mut RedisConn,
        rows: &'r [outbox::PublishedEvent],
    ) -> Result<StreamLookup<'r>, ReconcileError> {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<&'r outbox::PublishedEvent>> =
            Default::default();
        for r in rows {
            by_shard.entry(r.identity.shard(&self.keys)).or_default().push(r);
        }
        let mut out = StreamLookup::default();
        let expiry = records_expire_before(chrono::Utc::now(), self.config.dedup_ttl);
        for (shard, rows) in by_shard {
            let records = self.records(redis, shard, &rows).await?;
            let mut recorded = Vec::with_capacity(rows.len());
            for (r, record) in rows.into_iter().zip(records) {
                match record {
                    Some(entry) => recorded.push((r, entry)),
                    None if r.created_at < expiry => out.expired += 1,
                    None => out.missing.push(r),
                }
            }
            let (m, t) = self.missing_from_shard(redis, shard, recorded).await?;
            out.missing.extend(m);
            out.trimmed += t;
        }
        out.missing.sort_by_key(|r| r.id);
        Ok(out)
    }

    /// The entry id each of `rows` (all of shard `shard`) became, from its dedup record
    /// (`None`: no record), in one pipeline: an `HMGET` per dedup hash, then a `GET` of the
    /// old-format marker of rows created before the hashes that had no field.
    async fn records(
        &self,
        redis: &mut RedisConn,
        shard: u16,
        rows: &[&outbox::PublishedEvent],
    ) -> Result<Vec<Option<String>>, ReconcileError> {
        let mut hours: Vec<&str> = rows.iter().map(|r| r.dedup_hour.as_str()).collect();
        hours.sort_unstable();
        hours.dedup();
        let mut pipe = redis::pipe();
        for hour in &hours {
            let fields: Vec<&str> =
                rows.iter().filter(|r| r.dedup_hour == *hour).map(|r| r.event_id.as_str()).collect();
            pipe.cmd("HMGET").arg(self.keys.dedup_hash(shard, hour)).arg(fields);
        }
        let per_hour: Vec<Vec<Option<String>>> = pipe.query_async(redis).await?;
        let mut found: HashMap<&str, String> = HashMap::new();
        for (hour, values) in hours.iter().zip(per_hour) {
            let of_hour = rows.iter().filter(|r| r.dedup_hour == *hour);
            for (r, v) in of_hour.zip(values) {
                if let Some(v) = v {
                    found.insert(r.event_id.as_str(), v);
                }
            }
        }
        let legacy: Vec<&&outbox::PublishedEvent> =
            rows.iter().filter(|r| r.legacy_marker && !found.contains_key(r.event_id.as_str())).collect();
        if !legacy.is_empty() {
            let mut pipe = redis::pipe();
            for r in &legacy {
                pipe.get(self.keys.legacy_marker(shard, &r.event_id));
            }
            let values: Vec<Option<String>> = pipe.query_async(redis).await?;
            for (r, v) in legacy.iter().zip(values) {
                if let Some(v) = v {
                    found.insert(r.event_id.as_str(), v);
                }
            }
        }
        Ok(rows.iter().map(|r| found.get(r.event_id.as_str()).cloned()).collect())
    }

    /// Which of `rows` (of shard `shard`, each with the entry id its record names) are not on
    /// the shard's events stream, and how many of those were trimmed by its length cap. One
    /// pipeline: one slot.
    async fn missing_from_shard<'r>(
        &self,
        redis: &mut RedisConn,
        shard: u16,
        rows: Vec<(&'r outbox::PublishedEvent, String)>,
    ) -> Result<(Vec<&'r outbox::PublishedEvent>, u64), ReconcileError> {
        if rows.is_empty() {
            return Ok((vec![], 0));
        }
        let stream = self.keys.events_of(shard);
        let mut wanted: Vec<(u64, u64)> =
            rows.iter().map(|(_, entry)| crate::streams::parse_entry_id(entry)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let present = entries_present(redis, &stream, &wanted).await?;
        // The stream's head after the lookups: trimming only moves it forward, so an entry
        // missing above is either below this head (trimmed) or deleted.
        let (len, head): (usize, redis::streams::StreamRangeReply) = redis::pipe()
            .cmd("XLEN")
            .arg(&stream)
            .cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(redis)
            .await?;
        let capped = self.config.events_maxlen > 0 && len >= self.config.events_maxlen;
        let head = head.ids.first().map(|e| crate::streams::parse_entry_id(&e.id));
        let mut missing = Vec::new();
        let mut trimmed = 0u64;
        for (r, entry) in rows {
            let entry = crate::streams::parse_entry_id(&entry);
            if present.contains(&entry) {
                continue;
            }
            if capped && head.is_some_and(|h| entry < h) {
                trimmed += 1;
            } else {
                missing.push(r);
            }
        }
        Ok((missing, trimmed))
    }

    /// Has the relay publish `missing` events again: deletes their dedup records, and the
    /// markers an older relay may have written (or the relay would take the republish for a
    /// duplicate), then hands their rows back to the relay.
    async fn republish_events(
        &self,
        redis: &mut RedisConn,
        missing: &[&outbox::PublishedEvent],
    ) -> Result<u64, ReconcileError> {
        // One pipeline per shard: a cluster pipeline must stay in one slot.
        let mut by_shard: std::collections::BTreeMap<u16, redis::Pipeline> = Default::default();
        for r in missing {
            let shard = r.identity.shard(&self.keys);
            let forget = by_shard.entry(shard).or_insert_with(redis::pipe);
            forget.hdel(self.keys.dedup_hash(shard, &r.dedup_hour), &r.event_id).ignore();
            forget.del(self.keys.legacy_marker(shard, &r.event_id)).ignore();
        }
        for forget in by_shard.values() {
            let _: () = forget.query_async(redis).await?;
        }
        let ids: Vec<i64> = missing.iter().map(|r| r.id).collect();
        Ok(outbox::mark_unpublished(self.store.pool(), &ids).await?)
    }

    /// The replay stream against the DLQ, in one paged scan, for two checks:
    ///
    /// - lost replay work: rows handed out as work (leased) with no outstanding work item —
    ///   neither an unpublished outbox row nor a stream entry still to be processed (pending
    ///   in the group, or not yet delivered). Repair publishes them again.
    /// - orphan entries: entries still to be processed whose row is gone or has moved on to
    ///   another generation. Repair acknowledges and deletes them, page by page.
    ///
    /// Memory is bounded by the page: outstanding work items go into a temporary table and
    /// the lost rows are found set-based in Postgres. Order matters: the outbox snapshot is
    /// taken first (a row the relay publishes meanwhile is seen there, or on the stream), the
    /// stream is scanned next, and the DLQ rows are read last (a work item consumed meanwhile
    /// has already moved its row on). Candidates were enqueued before the transaction began
    /// (`now()` is its start), minus the grace period.
    async fn replay_stream_checks(
        &self,
        redis: &mut RedisConn,
        repair: bool,
    ) -> Result<[Finding; 2], ReconcileError> {
        let mut audit = WorkAudit::begin(self.store.pool()).await?;
        let orphans = self.orphan_entries_check(redis, &mut audit, repair).await?;
        audit.analyze().await?;
        let lost = self.lost_work_check(&mut audit, repair).await?;
        audit.finish().await?;
        Ok([lost, orphans])
    }

    /// Scans every shard's replay stream page by page: records every outstanding work item
    /// in `audit` and finds (and, with `repair`, acknowledges and deletes) the orphan entries.
    async fn orphan_entries_check(
        &self,
        redis: &mut RedisConn,
        audit: &mut WorkAudit,
        repair: bool,
    ) -> Result<Finding, ReconcileError> {
        let mut orphans = Finding {
            check: Check::OrphanStreamEntries,
            found: 0,
            examples: vec![],
            repaired: 0,
            note: None,
        };
        for shard in self.keys.shard_ids() {
            self.orphans_of_shard(redis, &self.keys.replay_of(shard), audit, repair, &mut orphans).await?;
        }
        Ok(orphans)
    }

    /// [`Reconciler::orphan_entries_check`] for one shard's replay stream.
    async fn orphans_of_shard(
        &self,
        redis: &mut RedisConn,
        stream: &str,
        audit: &mut WorkAudit,
        repair: bool,
        orphans: &mut Finding,
    ) -> Result<(), ReconcileError> {
        let page = self.config.page();
        let exists: bool = redis::cmd("EXISTS").arg(stream).query_async(redis).await?;
        if !exists {
            return Ok(());
        }
        // Where the group stands: entries after its last delivered id are still to be read.
        let groups: redis::streams::StreamInfoGroupsReply =
            redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
        let group = groups.groups.into_iter().find(|g| g.name == REPLAY_GROUP);
        let last_delivered =
            group.as_ref().map(|g| crate::streams::parse_entry_id(&g.last_delivered_id)).unwrap_or((0, 0));
        let mut start = "-".to_string();
        loop {
            let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(stream)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(page)
                .query_async(redis)
                .await?;
            let (Some(first), Some(last)) = (entries.ids.first(), entries.ids.last()) else { break };
            let pending = match &group {
                Some(g) if g.pending > 0 => pending_between(redis, stream, &first.id, &last.id, page).await?,
                _ => HashSet::new(),
            };
            let outstanding: Vec<OutstandingEntry> = entries
                .ids
                .iter()
                .filter(|e| pending.contains(&e.id) || crate::streams::parse_entry_id(&e.id) > last_delivered)
                .map(|e| {
                    let items = crate::streams::work::from_entry(&e.map)
                        .map(|items| items.iter().map(|w| (w.dlq_id, w.generation)).collect());
                    (e.id.clone(), items)
                })
                .collect();
            let page_orphans = orphans_among(audit, outstanding).await?;
            orphans.found += page_orphans.len() as u64;
            orphans.add_examples(page_orphans.iter().cloned(), self.config.examples);
            if repair && !page_orphans.is_empty() {
                let mut pipe = redis::pipe();
                pipe.cmd("XACK").arg(stream).arg(REPLAY_GROUP).arg(&page_orphans).ignore();
                pipe.cmd("XDEL").arg(stream).arg(&page_orphans);
                let (deleted,): (u64,) = pipe.query_async(redis).await?;
                orphans.repaired += deleted;
            }
            if entries.ids.len() < page {
                break;
            }
            start = format!("({}", last.id);
        }
        Ok(())
    }

    /// Leased rows with no outstanding work item (found in `audit` after the stream scan);
    /// with `repair`, their leases are released so the scheduler issues them again.
    async fn lost_work_check(&self, audit: &mut WorkAudit, repair: bool) -> Result<Finding, ReconcileError> {
        let page = self.config.page();
        let mut lost =
            Finding { check: Check::LostReplayWork, found: 0, examples: vec![], repaired: 0, note: None };
        let mut after = 0i64;
        loop {
            let rows = audit.lost_work(self.config.lost_work_grace, after, page).await?;
            let Some(last) = rows.last() else { break };
            after = last.0;
            lost.found += rows.len() as u64;
            lost.add_examples(rows.iter().map(|(_, key)| key.clone()), self.config.examples);
            if repair {
                // Released, not issued here: the scheduler issues them again within the
                // outstanding cap at its next pass.
                let ids: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
                lost.repaired += self.store.release_leases(&ids).await?;
            }
            if rows.len() < page {
                break;
            }
        }
        Ok(lost)
    }
}

/// Most stream entries one batched lookup of [`entries_present`] reads per entry id it looks
/// for: the events of one page of the outbox lie close together on their shard's stream (the
/// relay publishes in outbox order), so a range over them holds little else.
const LOOKUP_SPAN_FACTOR: usize = 2;

/// Which of `wanted` (sorted, distinct entry ids) are on `stream`, in one `XRANGE` from the
/// first to the last of them, cut at [`LOOKUP_SPAN_FACTOR`] entries per id: every entry in
/// `first..=last` comes back unless the reply is cut, so an id the reply covers and does not
/// hold is not on the stream. Ids past a cut reply (a range that holds many other entries:
/// events of rows published out of order, or of other pages) are looked up one by one, in one
/// pipeline, as before this batching: each reply is bounded by its `COUNT`, and a page costs
/// one round trip where it cost one command per event.
async fn entries_present(
    redis: &mut RedisConn,
    stream: &str,
    wanted: &[(u64, u64)],
) -> Result<HashSet<(u64, u64)>, ReconcileError> {
    let (Some(first), Some(last)) = (wanted.first(), wanted.last()) else {
        return Ok(HashSet::new());
    };
    let id = |(ms, seq): (u64, u64)| format!("{ms}-{seq}");
    let count = wanted.len().saturating_mul(LOOKUP_SPAN_FACTOR);
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg(id(*first))
        .arg(id(*last))
        .arg("COUNT")
        .arg(count)
        .query_async(redis)
        .await?;
    let on_stream: HashSet<(u64, u64)> =
        reply.ids.iter().map(|e| crate::streams::parse_entry_id(&e.id)).collect();
    // Everything up to the last entry returned is covered; with a reply shorter than COUNT,
    // everything is.
    let covered = match reply.ids.last() {
        Some(e) if reply.ids.len() >= count => crate::streams::parse_entry_id(&e.id),
        _ => *last,
    };
    let mut present: HashSet<(u64, u64)> = wanted.iter().copied().filter(|w| on_stream.contains(w)).collect();
    let rest: Vec<(u64, u64)> = wanted.iter().copied().filter(|w| *w > covered).collect();
    if !rest.is_empty() {
        let mut pipe = redis::pipe();
        for w in &rest {
            pipe.cmd("XRANGE").arg(stream).arg(id(*w)).arg(id(*w)).arg("COUNT").arg(1);
        }
        let hits: Vec<Vec<redis::Value>> = pipe.query_async(redis).await?;
        present.extend(rest.iter().zip(&hits).filter(|(_, hit)| !hit.is_empty()).map(|(w, _)| *w));
    }
    Ok(present)
}

/// The ids of the group's pending entries of `stream` between `first` and `last`
/// (inclusive), read `page` at a time.
async fn pending_between(
    redis: &mut RedisConn,
    stream: &str,
    first: &str,
    last: &str,
    page: usize,
) -> Result<HashSet<String>, ReconcileError> {
    let mut out = HashSet::new();
    let mut start = first.to_string();
    loop {
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(REPLAY_GROUP)
            .arg(&start)
            .arg(last)
            .arg(page)
            .query_async(redis)
            .await?;
        let n = reply.ids.len();
        if let Some(p) = reply.ids.last() {
            start = format!("({}", p.id);
        }
        out.extend(reply.ids.into_iter().map(|p| p.id));
        if n < page {
            return Ok(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dedup_record_expires_after_its_ttl_less_an_hour_and_a_huge_ttl_never() {
        let now = chrono::Utc::now();
        let day = Duration::from_secs(86_400);
        assert_eq!(records_expire_before(now, day), now - chrono::Duration::hours(23));
        assert_eq!(records_expire_before(now, Duration::from_secs(60)), now, "under the margin");
        assert_eq!(records_expire_before(now, Duration::MAX), DateTime::<Utc>::MIN_UTC);
        assert_eq!(records_expire_before(now, Duration::from_secs(u64::MAX / 4)), DateTime::<Utc>::MIN_UTC);
    }
}
