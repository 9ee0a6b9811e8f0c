//! The vocabulary shared by every stage: a chunk, its identity, its manifest state and the
//! error classes a failure can be parked under. The string forms here are mirrored by the
//! `CHECK` constraints in `migrations/0001_core.sql`; change both together.

mod reason;

pub use reason::Reason;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One unit of work: a piece of a document to embed, as read from the corpus.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Chunk {
    /// The document's id in the source corpus; with `chunk_index` the chunk's identity in the
    /// manifest, the vector table and the DLQ.
    pub doc_id: String,
    /// Position of the chunk within its document.
    pub chunk_index: i32,
    /// The input sent to the provider; part of the content hash, so a changed text is new work.
    pub text: String,
    /// Free-form metadata carried along untouched so a DLQ row can be replayed on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
}

/// Where a chunk lives, as recorded in `ingest_manifest.status`.
///
/// Moved in by ingest (stored/parked) and, later, by replay (parked -> stored, parked ->
/// exhausted). A chunk with no manifest row has simply not finished an ingest yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkStatus {
    /// A vector with this content hash is in the target table.
    Stored,
    /// A DLQ row holds the chunk; replay or an operator may still store it.
    Parked,
    /// A DLQ row holds the chunk and automatic replay has given up on it.
    Exhausted,
    /// The reconciler found the vector missing or drifted; the next ingest of the corpus
    /// embeds the chunk again.
    Reingest,
}

impl ChunkStatus {
    /// The SQL spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ChunkStatus::Stored => "stored",
            ChunkStatus::Parked => "parked",
            ChunkStatus::Exhausted => "exhausted",
            ChunkStatus::Reingest => "reingest",
        }
    }

    /// Parses the SQL spelling; `None` for anything the schema would reject.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "stored" => Some(ChunkStatus::Stored),
            "parked" => Some(ChunkStatus::Parked),
            "exhausted" => Some(ChunkStatus::Exhausted),
            "reingest" => Some(ChunkStatus::Reingest),
            _ => None,
        }
    }
}

/// Why a chunk was parked. A small fixed set, so it is safe as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Timeouts, connection errors, 408/425/429/5xx that outlived the in-process retries.
    /// The only class replayed automatically.
    Transient,
    /// The provider (400/413/422) or our own pre-flight check (empty, too long) rejected
    /// the input. Replaying it unchanged would fail again.
    PermanentInput,
    /// The corpus line itself is broken (missing text, invalid UTF-8, wrong types) but its
    /// identity could be read, so it is parked instead of dropped.
    InvalidRecord,
    /// The provider returned a vector whose length differs from the target column.
    DimensionMismatch,
    /// NaN/Inf, empty vectors, or a response whose vectors do not match its inputs.
    InvalidVector,
}

impl ErrorClass {
    /// Every class, for metrics and reports that must show zeros too.
    pub const ALL: [ErrorClass; 5] = [
        ErrorClass::Transient,
        ErrorClass::PermanentInput,
        ErrorClass::InvalidRecord,
        ErrorClass::DimensionMismatch,
        ErrorClass::InvalidVector,
    ];

    /// The SQL and label spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::PermanentInput => "permanent_input",
            ErrorClass::InvalidRecord => "invalid_record",
            ErrorClass::DimensionMismatch => "dimension_mismatch",
            ErrorClass::InvalidVector => "invalid_vector",
        }
    }

    /// Parses the SQL and label spelling: the one place a class is read back from text (a
    /// DLQ row, a filter flag). `None` for anything the schema would reject.
    pub fn parse(s: &str) -> Option<Self> {
        ErrorClass::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether parked rows of this class are scheduled for automatic replay.
    pub fn is_replayable(self) -> bool {
        matches!(self, ErrorClass::Transient)
    }
}

impl std::fmt::Display for ErrorClass {
    /// The SQL spelling, honouring width and alignment (`{:<20}` in tables).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// A class spelling that is not one of [`ErrorClass::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error class {0:?}; one of: {list}", list = ErrorClass::ALL.map(|k| k.as_str()).join(", "))]
pub struct UnknownErrorClass(pub String);

impl std::str::FromStr for ErrorClass {
    type Err = UnknownErrorClass;

    /// [`ErrorClass::parse`], with an error that lists the valid spellings (what `--class`
    /// shows for a typo, which would otherwise match nothing, silently).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ErrorClass::parse(s).ok_or_else(|| UnknownErrorClass(s.to_string()))
    }
}

/// Hash that decides whether a chunk must be (re-)embedded: it covers the text and the
/// embedding space (model and dimensions), so a model change re-embeds while a rerun of the
/// same corpus makes no provider call.
pub fn content_hash(model: &str, dimensions: usize, text: &str) -> String {
    HexHash::of_content(model, dimensions, text).as_str().to_owned()
}

/// Hash of a chunk's text alone, with no model or dimension in it (the manifest's
/// `text_hash`, migration 0026): two revisions of a target embed one text with different
/// models, so their content hashes differ, and this is how a revision is shown to hold the
/// same text of every chunk as another. The first 16 bytes of SHA-256.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TextHash(pub [u8; 16]);

impl TextHash {
    /// The hash of `text`.
    pub fn of(text: &str) -> TextHash {
        let mut h = Sha256::new();
        h.update(b"text\0");
        h.update(text.as_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize()[..16]);
        TextHash(out)
    }

    /// The bytes, as the manifest stores them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for TextHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

/// A [`content_hash`] held inline, its 64 hex digits in the value: the batcher keeps one for
/// every record of its windows, and a `String` each was an allocation (and a free on another
/// thread) per record of an unchanged rerun.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct HexHash([u8; 64]);

impl HexHash {
    /// [`content_hash`] of `text` embedded by `model` at `dimensions`.
    pub(crate) fn of_content(model: &str, dimensions: usize, text: &str) -> HexHash {
        let mut h = Sha256::new();
        h.update(model.as_bytes());
        h.update([0]);
        h.update(dimensions.to_string().as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
        let mut digits = [0u8; 64];
        hex_into(&h.finalize(), &mut digits);
        HexHash(digits)
    }

    /// The hash as text, as the manifest and the DLQ store it.
    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl std::fmt::Debug for HexHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Hash for a record that could not be parsed: it covers the raw line, so rerunning the same
/// broken corpus does not re-park (and re-announce) the same line.
pub fn raw_record_hash(raw: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"invalid-record\0");
    h.update(raw);
    hex(&h.finalize())
}

/// Lowercase hex, two digits a byte (by table: `write!` per byte was a tenth of the CPU time
/// of an unchanged rerun, which hashes every record).
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut digits = vec![0u8; bytes.len() * 2];
    hex_into(bytes, &mut digits);
    String::from_utf8(digits).expect("hex digits are ASCII")
}

/// [`hex`] into `out` (twice as long as `bytes`): the one hex encoder of the crate, also for
/// [`HexHash`], which keeps its digits inline.
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX_DIGITS[usize::from(b >> 4)];
        pair[1] = HEX_DIGITS[usize::from(b & 0xf)];
    }
}

/// One due DLQ row, as the replay stream carries it: the row (`dlq_id`), the row's
/// `generation` and `content_hash` when it was scheduled, and its target table. A replay
/// result for it commits only while the row still has that generation and that content
/// (`crate::replay::sql`). Written by the scheduler's statement (`crate::replay::sql`),
/// read from stream entries by [`crate::streams::work::from_entry`]; [`WorkItem::parse_body`]
/// is the one parser of its JSON body.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkItem {
    /// The DLQ row (`embedding_dlq.id`).
    pub dlq_id: i64,
    /// The row's generation when it was scheduled (`embedding_dlq.generation`).
    pub generation: i64,
    /// The content the work is for (`embedding_dlq.content_hash`).
    pub content_hash: String,
    /// Canonical target table name (`embedding_dlq.target_table`).
    pub target_table: String,
    /// The replay lease the item was issued under (`replay_lease.lease_no`): of two items of
    /// the same row only the one of its current lease is replayed. `None` for items issued
    /// before leases were numbered (replayed if their generation is current).
    #[serde(default)]
    pub lease: Option<i64>,
}

/// Longest content hash / table name accepted from a work item (a hash is 64 hex
/// characters; Postgres names are at most 63 bytes per part, quoted and qualified).
const WORK_ITEM_MAX_FIELD: usize = 512;

/// Most work items one replay stream entry carries: the largest replay batch
/// (`crate::config::bounds::REPLAY_BATCH`), since the scheduler writes one entry per batch of
/// a shard. An entry that claims more is unreadable (acknowledged and skipped; its rows'
/// leases run out and they are issued again).
pub const MAX_ITEMS_PER_ENTRY: usize = 2048;

/// One work item's JSON as it is read: the fields replay needs, borrowed from the body.
#[derive(Deserialize)]
struct ItemBody<'a> {
    dlq_id: i64,
    generation: i64,
    #[serde(borrow)]
    content_hash: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    table: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    lease: Option<&'a serde_json::value::RawValue>,
}

impl ItemBody<'_> {
    /// The item, or `None` when a field is out of bounds. A `lease` that is not an integer
    /// reads as none, as an item from before leases were numbered.
    fn into_item(self) -> Option<WorkItem> {
        if self.content_hash.len() > WORK_ITEM_MAX_FIELD
            || self.table.is_empty()
            || self.table.len() > WORK_ITEM_MAX_FIELD
        {
            return None;
        }
        Some(WorkItem {
            dlq_id: self.dlq_id,
            generation: self.generation,
            content_hash: self.content_hash.into_owned(),
            target_table: self.table.into_owned(),
            lease: self.lease.and_then(|l| l.get().parse::<i64>().ok()),
        })
    }
}

/// One work item's JSON as the scheduler writes it: what [`ItemBody`] reads, plus the chunk
/// and the provider attempts the row has spent, for people reading the stream.
#[derive(Serialize)]
struct WrittenItem<'a> {
    dlq_id: i64,
    generation: i64,
    content_hash: &'a str,
    table: &'a str,
    doc_id: &'a str,
    chunk_index: i32,
    attempts: i32,
    lease: Option<i64>,
}

impl WorkItem {
    /// Reads one work item from its JSON (the body of an entry of one item, as releases
    /// before batched entries wrote them and the relay still publishes from their outbox
    /// rows). `None` for anything else (including items written before generations existed:
    /// their rows are scheduled again when their lease runs out).
    pub fn parse_body(body: &str) -> Option<WorkItem> {
        // Into the fields it needs, not a whole `serde_json::Value` (a map of every field).
        serde_json::from_str::<ItemBody<'_>>(body).ok()?.into_item()
    }

    /// Reads the work items of a replay stream entry's body: a batch (`{"items": [...]}`,
    /// what the scheduler writes: one entry for up to a replay batch of rows of one shard,
    /// so the stream's append, read, claim and acknowledgement are paid once per batch), or
    /// one item ([`WorkItem::parse_body`]). `None` when the body, or any item in it, is not
    /// readable, or it holds no item or more than [`MAX_ITEMS_PER_ENTRY`].
    pub fn parse_entry_body(body: &str) -> Option<Vec<WorkItem>> {
        #[derive(Deserialize)]
        struct Batch<'a> {
            #[serde(borrow)]
            items: Vec<ItemBody<'a>>,
        }
        match serde_json::from_str::<Batch<'_>>(body) {
            Ok(batch) if (1..=MAX_ITEMS_PER_ENTRY).contains(&batch.items.len()) => {
                batch.items.into_iter().map(ItemBody::into_item).collect()
            }
            Ok(_) => None,
            Err(_) => WorkItem::parse_body(body).map(|item| vec![item]),
        }
    }

    /// The JSON body of one item alone, as [`WorkItem::parse_body`] reads it (what releases
    /// before batched entries wrote): with the chunk (`doc_id`, `chunk_index`) and the
    /// provider `attempts` the row has spent, for people reading the stream.
    #[cfg(test)]
    pub(crate) fn body(&self, doc_id: &str, chunk_index: i32, attempts: i32) -> String {
        serde_json::to_string(&self.written(doc_id, chunk_index, attempts))
            .expect("a struct of strings and numbers serializes")
    }

    /// The JSON body of an entry of several items (`(item, doc_id, chunk_index, attempts)`
    /// each), as [`WorkItem::parse_entry_body`] reads it.
    pub(crate) fn entry_body<'a>(
        items: impl IntoIterator<Item = (&'a WorkItem, &'a str, i32, i32)>,
    ) -> String {
        #[derive(Serialize)]
        struct Batch<'a> {
            items: Vec<WrittenItem<'a>>,
        }
        let items = items.into_iter().map(|(w, doc, idx, attempts)| w.written(doc, idx, attempts)).collect();
        serde_json::to_string(&Batch { items }).expect("a struct of strings and numbers serializes")
    }

    fn written<'a>(&'a self, doc_id: &'a str, chunk_index: i32, attempts: i32) -> WrittenItem<'a> {
        WrittenItem {
            dlq_id: self.dlq_id,
            generation: self.generation,
            content_hash: &self.content_hash,
            table: &self.target_table,
            doc_id,
            chunk_index,
            attempts,
            lease: self.lease,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_model_dimensions_and_text() {
        let base = content_hash("m", 768, "hello");
        // The inline form is the same text as the hex encoder's of the same digest.
        let digest = sha2::Sha256::new().chain_update(b"m\x00768\x00hello").finalize();
        assert_eq!(base, hex(&digest));
        assert_eq!(base, content_hash("m", 768, "hello"));
        assert_ne!(base, content_hash("m2", 768, "hello"));
        assert_ne!(base, content_hash("m", 512, "hello"));
        assert_ne!(base, content_hash("m", 768, "hello!"));
        assert_eq!(base.len(), 64);
        // The manifests of earlier runs hold hashes in this form: SHA-256 of model, NUL,
        // dimensions, NUL, text, in lowercase hex.
        assert_eq!(base, "34dbff87f87ff2cbae27337dda9b5fa32cc19f5bb25738d0020b3987d9627809");
    }

    #[test]
    fn class_and_status_spellings_round_trip() {
        for c in ErrorClass::ALL {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(ErrorClass::parse(c.as_str()), Some(c));
            assert_eq!(c.as_str().parse::<ErrorClass>(), Ok(c));
        }
        assert_eq!(ErrorClass::parse("Transient"), None);
        let typo = "transiant".parse::<ErrorClass>().unwrap_err().to_string();
        assert!(typo.contains("\"transiant\"") && typo.contains("permanent_input"), "{typo}");
        assert_eq!(format!("{:<12}|", ErrorClass::Transient), "transient   |");
        for s in [ChunkStatus::Stored, ChunkStatus::Parked, ChunkStatus::Exhausted, ChunkStatus::Reingest] {
            assert_eq!(ChunkStatus::parse(s.as_str()), Some(s));
        }
        assert!(ErrorClass::Transient.is_replayable());
        assert!(!ErrorClass::PermanentInput.is_replayable());
    }

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
                target_table: "public.t".into(),
                lease: None,
            }
        );
        let leased = WorkItem::parse_body(
            r#"{"dlq_id":7,"generation":42,"content_hash":"ab","table":"public.t","lease":9}"#,
        )
        .unwrap();
        assert_eq!(leased.lease, Some(9));
        for odd in ["null", "\"9\"", "9.5", "{}"] {
            let body =
                format!(r#"{{"dlq_id":7,"generation":42,"content_hash":"ab","table":"t","lease":{odd}}}"#);
            assert_eq!(WorkItem::parse_body(&body).unwrap().lease, None, "lease {odd} reads as none");
        }
        let quoted = WorkItem::parse_body(
            r#"{"dlq_id":7,"generation":42,"content_hash":"ab","table":"public.\"odd\u0020name\""}"#,
        )
        .unwrap();
        assert_eq!(quoted.target_table, r#"public."odd name""#, "escapes are decoded");
        assert_eq!(WorkItem::parse_body(r#"{"dlq_id":7,"replays":0}"#), None, "pre-generation item");
        // What the scheduler writes reads back as the same item.
        let written = quoted.body("doc \"quoted\"", 3, 2);
        assert_eq!(WorkItem::parse_body(&written), Some(quoted.clone()));
        assert_eq!(WorkItem::parse_body(&leased.body("d", 0, 1)), Some(leased.clone()), "with its lease");
        let v: serde_json::Value = serde_json::from_str(&written).unwrap();
        assert_eq!(
            (v["doc_id"].as_str(), v["chunk_index"].as_i64(), v["attempts"].as_i64()),
            (Some("doc \"quoted\""), Some(3), Some(2))
        );
        assert_eq!(WorkItem::parse_body("not json"), None);
        let long =
            format!(r#"{{"dlq_id":7,"generation":1,"content_hash":"{}","table":"t"}}"#, "a".repeat(600));
        assert_eq!(WorkItem::parse_body(&long), None);
    }

    #[test]
    fn an_entry_carries_a_batch_of_items_or_one_legacy_item() {
        let a = WorkItem {
            dlq_id: 1,
            generation: 10,
            content_hash: "aa".into(),
            target_table: "public.t".into(),
            lease: Some(5),
        };
        let b = WorkItem { dlq_id: 2, generation: 11, lease: None, ..a.clone() };
        let body = WorkItem::entry_body([(&a, "d \"1\"", 0, 1), (&b, "d2", 3, 2)]);
        assert_eq!(WorkItem::parse_entry_body(&body), Some(vec![a.clone(), b.clone()]));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["items"][1]["chunk_index"].as_i64(), Some(3), "the chunk is written for readers");
        assert_eq!(v["items"][0]["doc_id"].as_str(), Some("d \"1\""));
        // An entry of one item, as earlier releases wrote it.
        assert_eq!(WorkItem::parse_entry_body(&a.body("d", 0, 1)), Some(vec![a.clone()]));
        // One unreadable item makes the entry unreadable; so do no items, too many, or not JSON.
        let broken = body.replace(r#""generation":11"#, r#""generation":"x""#);
        assert_eq!(WorkItem::parse_entry_body(&broken), None);
        assert_eq!(WorkItem::parse_entry_body(r#"{"items":[]}"#), None);
        let many = WorkItem::entry_body(std::iter::repeat_n((&a, "d", 0, 1), MAX_ITEMS_PER_ENTRY + 1));
        assert_eq!(WorkItem::parse_entry_body(&many), None);
        let most = WorkItem::entry_body(std::iter::repeat_n((&a, "d", 0, 1), MAX_ITEMS_PER_ENTRY));
        assert_eq!(WorkItem::parse_entry_body(&most).map(|v| v.len()), Some(MAX_ITEMS_PER_ENTRY));
        assert_eq!(WorkItem::parse_entry_body("not json"), None);
        assert_eq!(WorkItem::parse_entry_body(r#"{"items":7}"#), None);
    }
}
