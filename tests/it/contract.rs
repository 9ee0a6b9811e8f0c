//! The events contract (`docs/events.schema.json`, `docs/events.md`): the schema is sound and
//! can fail, it knows every event kind the outbox allows, and a consumer in another language
//! (`examples/events_consumer.py`, redis-py) consumes the relay's streams with a consumer group,
//! across a crash. Which events conform is checked where they are published: `relay_all` checks
//! every entry it adds, and `streams::every_kind_of_event_is_published_as_the_contract_says`
//! makes each kind. Real Postgres, real Redis (single node and cluster).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Parks `n` chunks of `doc` as transient (the provider is down).
async fn park(db: &TestDb, doc: &str, n: i32) {
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(db, &mock);
    s.retry.max_attempts = 1;
    let corpus: String = (0..n).map(|i| line(doc, i, &format!("{doc} {i}"))).collect();
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), n as u64);
}

/// The kinds the outbox's CHECK constraint allows (every statement that records an event must
/// pass it), as a migrated database has it.
pub(crate) async fn kinds_the_outbox_allows(db: &TestDb) -> BTreeSet<String> {
    let def: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
          WHERE conrelid = 'dlq_outbox'::regclass AND conname = 'dlq_outbox_event_check'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    def.split('\'').skip(1).step_by(2).map(str::to_string).collect()
}

#[test]
fn the_contract_is_a_versioned_2020_12_schema() {
    let c = events_contract();
    assert_eq!(c.schema["$schema"], "https://json-schema.org/draft/2020-12/schema");
    assert_eq!(c.schema_problems(), Vec::<String>::new(), "the schema is valid against its meta-schema");
    let id = c.schema["$id"].as_str().unwrap();
    let version = c.schema["version"].as_str().expect("a version");
    let major = version.split('.').next().unwrap();
    assert_eq!(version.split('.').filter(|p| p.parse::<u32>().is_ok()).count(), 3, "semver: {version}");
    assert!(id.ends_with(&format!(":v{major}")), "the $id names the major version: {id} for {version}");
    // The document explains the same version.
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/events.md")).unwrap();
    assert!(doc.contains(version) && doc.contains(id), "docs/events.md names version {version} and {id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_kind_the_outbox_allows_is_in_the_contract() {
    let db = TestDb::new().await;
    let allowed = kinds_the_outbox_allows(&db).await;
    assert!(allowed.contains("parked") && allowed.contains("withdrawn"), "{allowed:?}");
    // `replay` is the work item of the replay stream (read by the replayers only), not an event.
    let events: BTreeSet<String> = allowed.into_iter().filter(|k| k != "replay").collect();
    let described = events_contract().kinds();
    let missing: Vec<&String> = events.difference(&described).collect();
    assert!(
        missing.is_empty(),
        "event kinds the code can record but docs/events.schema.json lacks: {missing:?}"
    );
    // A kind the contract describes and nothing records: only one announced ahead of its
    // release (marked PROVISIONAL in the schema).
    for extra in described.difference(&events) {
        let def =
            events_contract().schema["$defs"][extra.as_str()]["description"].as_str().unwrap_or_default();
        assert!(def.contains("PROVISIONAL"), "{extra} is in the contract, but nothing records it");
    }
    // Every error class the code knows, and no other.
    let classes: BTreeSet<String> = events_contract().schema["$defs"]["error_class"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    let known: BTreeSet<String> =
        embed_dlq::model::ErrorClass::ALL.iter().map(|c| c.as_str().to_string()).collect();
    assert_eq!(classes, known);
}

/// The check can fail: a real body conforms, and each way of breaking it is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_rejects_a_malformed_event() {
    let db = TestDb::new().await;
    park(&db, "bad", 1).await;
    let (outbox_id, event_id, body): (i64, String, serde_json::Value) =
        sqlx::query_as("SELECT id, event_id::text, body FROM dlq_outbox WHERE event = 'parked'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let c = events_contract();
    assert_eq!(c.body_problems(&body), Vec::<String>::new(), "a real parked body conforms: {body}");
    let entry = |body: &serde_json::Value| -> BTreeMap<String, String> {
        BTreeMap::from([
            ("outbox_id".into(), outbox_id.to_string()),
            ("event_id".into(), event_id.clone()),
            ("event".into(), "parked".into()),
            ("body".into(), body.to_string()),
        ])
    };
    assert_eq!(c.entry_problems(&entry(&body)), Vec::<String>::new());

    let broken = |change: &dyn Fn(&mut serde_json::Value)| {
        let mut b = body.clone();
        change(&mut b);
        b
    };
    let bodies = [
        ("no dlq_id", broken(&|b| drop(b.as_object_mut().unwrap().remove("dlq_id")))),
        ("no seq", broken(&|b| drop(b.as_object_mut().unwrap().remove("seq")))),
        ("chunk_index as text", broken(&|b| b["chunk_index"] = "0".into())),
        ("negative chunk_index", broken(&|b| b["chunk_index"] = (-1).into())),
        ("unknown kind", broken(&|b| b["event"] = "teleported".into())),
        ("unknown class", broken(&|b| b["error_class"] = "cosmic_ray".into())),
        ("a field parked does not have", broken(&|b| b["payload"] = "the chunk's text".into())),
        ("a timestamp that is not one", broken(&|b| b["last_failed_at"] = "yesterday".into())),
        ("a kind with another kind's fields", broken(&|b| b["event"] = "withdrawn".into())),
        ("not an object", serde_json::json!(["parked"])),
    ];
    for (what, b) in &bodies {
        assert!(!c.body_problems(b).is_empty(), "{what}: accepted {b}");
        assert!(!c.entry_problems(&entry(b)).is_empty(), "{what}: the entry was accepted");
    }
    let entries = [
        ("no event_id", {
            let mut e = entry(&body);
            e.remove("event_id");
            e
        }),
        ("event_id not a uuid", {
            let mut e = entry(&body);
            e.insert("event_id".into(), "42".into());
            e
        }),
        ("outbox_id not a number", {
            let mut e = entry(&body);
            e.insert("outbox_id".into(), "x".into());
            e
        }),
        ("event differs from the body's", {
            let mut e = entry(&body);
            e.insert("event".into(), "purged".into());
            e
        }),
        ("an extra field", {
            let mut e = entry(&body);
            e.insert("payload".into(), "text".into());
            e
        }),
        ("body not JSON", {
            let mut e = entry(&body);
            e.insert("body".into(), "{parked".into());
            e
        }),
    ];
    for (what, e) in &entries {
        assert!(!c.entry_problems(e).is_empty(), "{what}: accepted {e:?}");
    }
}

/// Whether `python3` can import redis-py (what `scripts/test.sh` installs), from a directory
/// with no `redis/` folder in it (the repository's would shadow the package).
fn python_redis_problem() -> Option<String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import redis, redis.cluster; print(redis.__version__)"])
        .current_dir(std::env::temp_dir())
        .output();
    match out {
        Err(e) => Some(format!("python3 cannot be run ({e})")),
        Ok(o) if !o.status.success() => Some(format!(
            "python3 cannot import redis-py: {}",
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or_default()
        )),
        Ok(_) => None,
    }
}

const PY_CONSUMER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/events_consumer.py");

/// `examples/events_consumer.py` for the streams of `keys`, printing JSON lines, as consumer
/// `py-1` of group `py-group`.
fn python_consumer(keys: &StreamKeys, extra: &[&str]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("python3");
    c.arg(PY_CONSUMER)
        .args(["--redis-url", &redis_url(), "--stream-prefix", keys.prefix()])
        .args(["--group", "py-group", "--consumer", "py-1", "--start", "0", "--json", "--block-ms", "300"])
        .args(extra)
        .env_remove("EMBED_DLQ_STREAM_SHARDS")
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

/// One line the Python consumer printed: (stream, entry id, event_id, body).
fn handled(line: &str) -> (String, String, String, serde_json::Value) {
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
    let s = |k: &str| v[k].as_str().unwrap_or_else(|| panic!("{k} missing: {line}")).to_string();
    (s("stream"), s("stream_id"), s("event_id"), v["body"].clone())
}

/// The next event the consumer printed (within 60 s).
async fn next_handled(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) -> (String, String, String, serde_json::Value) {
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await;
    handled(&line.expect("the consumer went quiet for 60 s").unwrap().expect("the consumer exited"))
}

/// Entries delivered to group `py-group` and not acknowledged, per stream: (stream, id).
async fn pending_entries(keys: &StreamKeys) -> BTreeSet<(String, String)> {
    let mut r = redis().await;
    let mut out = BTreeSet::new();
    for shard in keys.shard_ids() {
        let stream = keys.events_of(shard);
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("py-group")
            .arg("-")
            .arg("+")
            .arg(1000)
            .query_async(&mut r)
            .await
            .unwrap();
        out.extend(reply.ids.into_iter().map(|p| (stream.clone(), p.id)));
    }
    out
}

on_single_and_cluster! {
/// The Python example as a user runs it: a consumer group over every shard's events stream
/// (the count read from `{prefix}:meta`), each event handled, then acknowledged. Killed after
/// handling an event and before acknowledging its batch, then restarted: it takes its pending
/// entries first (the handled-but-unacknowledged ones are handled again: at least once,
/// deduplicated by `event_id`), then the events published while it was down, then new ones.
async fn the_python_consumer_handles_every_event_at_least_once_across_a_crash() {
    if let Some(problem) = python_redis_problem() {
        panic!("{problem}: the Python consumer test needs python3 and redis-py (scripts/test.sh installs it: pip install redis)");
    }
    let db = TestDb::new().await;
    let fresh = fresh_keys();
    let keys = StreamKeys::with_shards(fresh.prefix(), 3);
    // What the first serve/tail/reconcile records, and the consumer reads.
    embed_dlq::streams::check_shards(&mut redis().await, &keys).await.unwrap();
    park(&db, "py", 24).await;
    assert_eq!(relay_all(&db, &keys).await, 24);

    // Run 1 dies (exit 3) after handling its 10th event, before acknowledging that batch.
    let out = python_consumer(&keys, &["--count", "4", "--die-after", "10"]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "run 1: {stderr}");
    assert!(stderr.contains("consuming 3 shard(s)"), "the shard count comes from the meta hash: {stderr}");
    let run1: Vec<_> = String::from_utf8_lossy(&out.stdout).lines().map(handled).collect();
    assert_eq!(run1.len(), 10, "{run1:?}");
    let pending = pending_entries(&keys).await;
    let unacked: BTreeSet<(String, String)> =
        run1.iter().map(|(s, id, _, _)| (s.clone(), id.clone())).filter(|k| pending.contains(k)).collect();
    assert!(!unacked.is_empty() && pending.len() <= 4, "one batch of at most 4 left pending: {pending:?}");
    assert!(unacked.contains(&(run1[9].0.clone(), run1[9].1.clone())), "the last handled event was not acknowledged");

    // Published while it is down.
    park(&db, "py-down", 6).await;
    assert_eq!(relay_all(&db, &keys).await, 6);

    // Run 2: resumes, then follows.
    let mut child = python_consumer(&keys, &["--count", "4"]).spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // What run 1 never handled, and what it handled without acknowledging.
    let mut run2 = Vec::new();
    for _ in 0..30 - 10 + unacked.len() {
        run2.push(next_handled(&mut lines).await);
    }
    // Published while it runs.
    park(&db, "py-live", 3).await;
    assert_eq!(relay_all(&db, &keys).await, 3);
    for _ in 0..3 {
        run2.push(next_handled(&mut lines).await);
    }
    // SIGTERM: it stops after its current batch, acknowledged.
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(0), "run 2 stops cleanly on SIGTERM");
    assert!(lines.next_line().await.unwrap().is_none(), "nothing handled beyond the 33 events");

    // Its pending entries came first.
    let first: BTreeSet<(String, String)> =
        run2.iter().take(pending.len()).map(|(s, id, _, _)| (s.clone(), id.clone())).collect();
    assert_eq!(first, pending, "run 2 resumed with the entries left pending");
    // Every event on the streams was handled, the unacknowledged ones twice, nothing else twice.
    let on_streams = assert_events_conform(&keys).await;
    assert_eq!(on_streams.len(), 33);
    let mut times: BTreeMap<String, usize> = BTreeMap::new();
    for (_, _, event_id, body) in run1.iter().chain(&run2) {
        *times.entry(event_id.clone()).or_default() += 1;
        assert!(events_contract().body_problems(body).is_empty(), "the consumer passed the body on as published");
    }
    let expected: BTreeSet<String> = on_streams.iter().map(|e| e.fields["event_id"].clone()).collect();
    assert_eq!(times.keys().cloned().collect::<BTreeSet<_>>(), expected, "every event handled");
    let twice: BTreeSet<String> = times.iter().filter(|(_, n)| **n > 1).map(|(id, _)| id.clone()).collect();
    let unacked_ids: BTreeSet<String> = run1
        .iter()
        .filter(|(s, id, _, _)| unacked.contains(&(s.clone(), id.clone())))
        .map(|(_, _, e, _)| e.clone())
        .collect();
    assert_eq!(twice, unacked_ids, "only what was handled and not acknowledged came again");
    assert!(times.values().all(|n| *n <= 2));
    assert_eq!(pending_entries(&keys).await, BTreeSet::new(), "everything handled was acknowledged");
}
}
