//! The consumer group on the source streams, as Redis answers for it: created if missing
//! ([`ensure_groups`]), its pending count and lag ([`group_info`], also the console's), the
//! oldest position it may still hand on ([`group_floor`]), and the replies of `XREADGROUP`,
//! `XAUTOCLAIM` and `XPENDING` read into entries (fields in order, repeated ones kept) and
//! counts (clamped to what a stream can hold).

use std::collections::HashMap;

use redis::Value;

use super::SourceOptions;
use crate::streams::RedisConn;

/// One entry as read: id and fields in order (`None`: deleted while pending).
pub(super) type RawEntry = (String, Option<Vec<(Vec<u8>, Vec<u8>)>>);

/// The pending count and lag (`None` when Redis cannot tell) of `group` on `stream`, from
/// `XINFO GROUPS`; clamped to what a stream can hold. `None` without the group.
pub(crate) async fn group_info(
    redis: &mut RedisConn,
    stream: &str,
    group: &str,
) -> redis::RedisResult<Option<(u64, Option<u64>)>> {
    let reply: Value = redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
    let groups = match reply {
        Value::Array(a) => a,
        _ => return Ok(None),
    };
    for g in groups {
        let fields = pairs(g);
        let name = fields.iter().find(|(k, _)| k == "name").and_then(|(_, v)| text(v));
        if name.as_deref() != Some(group) {
            continue;
        }
        let num = |key: &str| fields.iter().find(|(k, _)| k == key).and_then(|(_, v)| clamp_count(v));
        return Ok(Some((num("pending").unwrap_or(0), num("lag"))));
    }
    Ok(None)
}

/// The position of the oldest entry of `stream` that `group` may still hand to a consumer:
/// its oldest pending entry (`XPENDING`) or, with none pending, its last delivered one
/// (`XINFO GROUPS`). 0 when the group does not exist yet (everything is still to come).
pub(super) async fn group_floor(redis: &mut RedisConn, stream: &str, group: &str) -> redis::RedisResult<i64> {
    use crate::store::position::entry_position;
    let reply: Value = redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
    let Value::Array(groups) = reply else { return Ok(0) };
    let mut delivered = None;
    for g in groups {
        let fields = pairs(g);
        let field = |key: &str| fields.iter().find(|(k, _)| k == key).and_then(|(_, v)| text(v));
        if field("name").as_deref() == Some(group) {
            delivered = Some(field("last-delivered-id").unwrap_or_default());
        }
    }
    let Some(delivered) = delivered else { return Ok(0) };
    let summary: Value = redis::cmd("XPENDING").arg(stream).arg(group).query_async(redis).await?;
    let oldest_pending = match summary {
        Value::Array(parts) => parts.get(1).and_then(text),
        _ => None,
    };
    let floor = entry_position(&delivered, 0);
    Ok(oldest_pending.map_or(floor, |id| floor.min(entry_position(&id, 0))))
}

/// Largest count taken from a server reply: what a stream can hold in practice.
const MAX_COUNT: u64 = 1 << 48;

/// A non-negative count from a reply, clamped to [`MAX_COUNT`]; `None` for nil or garbage.
fn clamp_count(v: &Value) -> Option<u64> {
    let n = match v {
        Value::Int(i) => *i,
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok()?,
        _ => return None,
    };
    Some(n.clamp(0, MAX_COUNT as i64) as u64)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn bytes(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(i) => i.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

/// The key/value pairs of a flat array or a map reply.
fn pairs(v: Value) -> Vec<(String, Value)> {
    match v {
        Value::Map(m) => m.into_iter().filter_map(|(k, v)| Some((text(&k)?, v))).collect(),
        Value::Array(a) => {
            let mut out = Vec::new();
            let mut it = a.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                if let Some(k) = text(&k) {
                    out.push((k, v));
                }
            }
            out
        }
        _ => Vec::new(),
    }
}

/// An entry `[id, [field, value, ...]]` (fields `None` when the entry was deleted).
fn entry_of(v: Value) -> Option<RawEntry> {
    let Value::Array(parts) = v else { return None };
    let mut parts = parts.into_iter();
    let id = text(&parts.next()?)?;
    let fields = match parts.next() {
        Some(Value::Array(kv)) => {
            let mut out = Vec::with_capacity(kv.len() / 2);
            let mut it = kv.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((bytes(k), bytes(v)));
            }
            Some(out)
        }
        Some(Value::Map(m)) => Some(m.into_iter().map(|(k, v)| (bytes(k), bytes(v))).collect()),
        _ => None,
    };
    Some((id, fields))
}

/// The entries of an `XRANGE`-shaped reply (also what `redis/source_read.lua` returns).
pub(super) fn entries_of(v: Value) -> Vec<RawEntry> {
    match v {
        Value::Array(a) => a.into_iter().filter_map(entry_of).collect(),
        _ => Vec::new(),
    }
}

/// The entries of an `XREADGROUP` reply (one stream), fields in order, repeated ones kept.
pub(super) fn read_reply_entries(reply: Value) -> Vec<RawEntry> {
    match reply {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(kv) => kv.into_iter().nth(1).map(entries_of).unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(m) => m.into_iter().flat_map(|(_, v)| entries_of(v)).collect(),
        _ => Vec::new(),
    }
}

/// `XAUTOCLAIM` reply: next cursor, entries claimed, ids deleted meanwhile.
pub(super) fn autoclaim_reply(reply: Value) -> (String, Vec<RawEntry>, Vec<String>) {
    let Value::Array(parts) = reply else { return ("0-0".into(), Vec::new(), Vec::new()) };
    let mut parts = parts.into_iter();
    let next = parts.next().as_ref().and_then(text).unwrap_or_else(|| "0-0".into());
    let entries = parts.next().map(entries_of).unwrap_or_default();
    let deleted = match parts.next() {
        Some(Value::Array(ids)) => ids.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    // An entry whose fields are nil was deleted too (Redis 6.2 reports it that way).
    let (entries, gone): (Vec<RawEntry>, Vec<RawEntry>) = entries.into_iter().partition(|(_, f)| f.is_some());
    let deleted = deleted.into_iter().chain(gone.into_iter().map(|(id, _)| id)).collect();
    (next, entries, deleted)
}

/// Delivery counts from an extended `XPENDING` reply (`[id, consumer, idle, deliveries]`).
pub(super) fn pending_deliveries(reply: Value) -> HashMap<String, u64> {
    let Value::Array(rows) = reply else { return HashMap::new() };
    rows.into_iter()
        .filter_map(|row| {
            let Value::Array(cols) = row else { return None };
            let id = text(cols.first()?)?;
            let n = clamp_count(cols.get(3)?)?;
            Some((id, n))
        })
        .collect()
}

/// Creates the group on every source stream if missing (at `0`, with `MKSTREAM`).
pub(super) async fn ensure_groups(redis: &mut RedisConn, opts: &SourceOptions) -> redis::RedisResult<()> {
    for stream in &opts.streams {
        let r: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(&opts.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(redis)
            .await;
        match r {
            Ok(()) => {
                tracing::info!(stream = %stream, group = %opts.group, "created the source consumer group")
            }
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn replies_keep_fields_in_order_and_clamp_counts() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("src"),
            Value::Array(vec![Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("text"), bulk("a"), bulk("text"), bulk("b")]),
            ])]),
        ])]);
        let entries = read_reply_entries(reply);
        assert_eq!(entries.len(), 1);
        let fields = entries[0].1.as_ref().unwrap();
        assert_eq!(fields.len(), 2, "a repeated field is kept, not merged");
        assert_eq!(clamp_count(&Value::Int(-5)), Some(0));
        assert_eq!(clamp_count(&Value::Int(i64::MAX)), Some(MAX_COUNT));
        assert_eq!(clamp_count(&Value::Nil), None);
        let claim = Value::Array(vec![
            bulk("0-0"),
            Value::Array(vec![Value::Array(vec![bulk("2-0"), Value::Nil])]),
            Value::Array(vec![bulk("3-0")]),
        ]);
        let (next, entries, deleted) = autoclaim_reply(claim);
        assert_eq!((next.as_str(), entries.len()), ("0-0", 0));
        assert_eq!(deleted, vec!["3-0".to_string(), "2-0".to_string()]);
    }
}
