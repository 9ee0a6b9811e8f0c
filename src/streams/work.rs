//! The replay work item: what the replay stream carries for one DLQ row, in one place.
//!
//! Written by Postgres (the scheduler's single statement builds the outbox body with
//! `WorkItem::sql_body`) and read by the replayers and the reconciler with
//! [`WorkItem::parse`]. A work item names the row (`dlq_id`), the row's `generation` and
//! `content_hash` when it was scheduled, and the target table: a replay result for it commits
//! only while the row still has that generation and that content (`crate::store::replay`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::field;

/// One due DLQ row, as published on the replay stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkItem {
    /// The `embedding_dlq` row to replay.
    pub dlq_id: i64,
    /// The row's generation when it was scheduled (`embedding_dlq.generation`).
    pub generation: i64,
    /// The content the work is for (`embedding_dlq.content_hash`).
    pub content_hash: String,
    /// Canonical target table name (`embedding_dlq.target_table`).
    pub target_table: String,
}

/// Longest content hash / table name accepted from a stream entry (a hash is 64 hex
/// characters; Postgres names are at most 63 bytes per part, quoted and qualified).
const MAX_FIELD: usize = 512;

impl WorkItem {
    /// The SQL expression (over columns `id`, `generation`, `content_hash`, `target_table`,
    /// `doc_id`, `chunk_index`, `attempts` of `alias`) that builds the outbox body of a work
    /// item. `doc_id`, `chunk_index` and `attempts` are informational for stream readers.
    pub(crate) fn sql_body(alias: &str) -> String {
        format!(
            "jsonb_build_object('dlq_id', {a}.id, 'generation', {a}.generation, \
             'content_hash', {a}.content_hash, 'table', {a}.target_table, 'doc_id', {a}.doc_id, \
             'chunk_index', {a}.chunk_index, 'attempts', {a}.attempts)",
            a = alias
        )
    }

    /// Reads a work item from a stream entry's `body` field. `None` for anything else
    /// (including items written before generations existed: their rows are scheduled again
    /// when their lease runs out).
    pub fn parse(map: &HashMap<String, redis::Value>) -> Option<WorkItem> {
        Self::parse_body(&field(map, "body")?)
    }

    /// Reads a work item from its JSON body.
    pub(crate) fn parse_body(body: &str) -> Option<WorkItem> {
        let v: serde_json::Value = serde_json::from_str(body).ok()?;
        let content_hash = v["content_hash"].as_str().filter(|s| s.len() <= MAX_FIELD)?;
        let target_table = v["table"].as_str().filter(|s| !s.is_empty() && s.len() <= MAX_FIELD)?;
        Some(WorkItem {
            dlq_id: v["dlq_id"].as_i64()?,
            generation: v["generation"].as_i64()?,
            content_hash: content_hash.to_string(),
            target_table: target_table.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_current_items_and_refuses_legacy_or_broken_ones() {
        let w = WorkItem::parse_body(
            r#"{"dlq_id":7,"generation":42,"content_hash":"ab","table":"public.t","doc_id":"d","chunk_index":0}"#,
        )
        .unwrap();
        assert_eq!(
            w,
            WorkItem {
                dlq_id: 7,
                generation: 42,
                content_hash: "ab".into(),
                target_table: "public.t".into()
            }
        );
        assert_eq!(WorkItem::parse_body(r#"{"dlq_id":7,"replays":0}"#), None, "pre-generation item");
        assert_eq!(WorkItem::parse_body("not json"), None);
        let long =
            format!(r#"{{"dlq_id":7,"generation":1,"content_hash":"{}","table":"t"}}"#, "a".repeat(600));
        assert_eq!(WorkItem::parse_body(&long), None);
    }

    #[test]
    fn sql_body_names_every_field_parse_reads() {
        let sql = WorkItem::sql_body("u");
        for f in [
            "'dlq_id', u.id",
            "'generation', u.generation",
            "'content_hash', u.content_hash",
            "'table', u.target_table",
        ] {
            assert!(sql.contains(f), "{sql} lacks {f}");
        }
    }
}
