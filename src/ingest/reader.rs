//! The ingest's input as records, and the checks every record passes whatever its source: the
//! record ([`Record`]; [`RawMetadata`], its metadata kept as text; what it is charged to the
//! byte budget), the identity checks (`doc_id`, `chunk_index`), the content checks (NULs, the
//! metadata's shape) and the payload a broken record is parked with.
//!
//! The sources are its children, `line` (JSONL: the bounded line reader and the parse of a
//! line) and `entry` (a source stream's entries), and [`Record::from_chunk`] here (a chunk
//! handed over by a Rust program). Nothing is dropped silently: an input becomes a
//! [`Record::Chunk`], a [`Record::Delete`], a [`Record::Invalid`] (broken, but its identity is
//! readable, so it is parked with what could be saved) or a [`Record::Rejected`] (no usable
//! identity, or an `op` that is neither: reported with its line number and counted).

mod entry;
mod line;

use serde_json::{Map, Value};

use crate::model::Chunk;
pub(crate) use entry::{EntryOrigin, MAX_SOURCE_KEY_BYTES, parse_entry, poison_entry};
pub(crate) use line::{LineReader, parse_line};

/// Longest `doc_id` accepted, in bytes of UTF-8.
pub(crate) const MAX_DOC_ID_BYTES: usize = 1024;

/// One parsed line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Record {
    Chunk {
        line: u64,
        chunk: Chunk,
        /// The line's metadata as read and checked, not yet a tree (`chunk.metadata` is
        /// `None` then): most chunks of an unchanged rerun are skipped, and building their
        /// metadata trees was half of the client's work there. Only a parked chunk needs the
        /// tree ([`RawMetadata::into_value`]).
        metadata: Option<RawMetadata>,
    },
    /// Broken record with a readable identity; `payload` keeps what could be read.
    Invalid { line: u64, doc_id: String, chunk_index: i32, problem: String, payload: Value, raw_hash: String },
    /// A delete of a whole document (`chunk_index` `None`) or of one chunk, applied at the
    /// record's position: it removes what older records wrote, never what later ones write.
    Delete { line: u64, doc_id: String, chunk_index: Option<i32> },
    /// No identity could be read; only the line number and the reason survive.
    Rejected { line: u64, problem: String },
}

/// A record's metadata as its JSON text, checked as [`parse_line`] checks a metadata tree (an
/// object, no NUL, no key twice), so that building the tree later cannot fail.
/// Charged to the byte budget as the tree it becomes (`tree_bytes`, what [`value_bytes`] counts
/// of that tree), though only a park builds it: the budget bounds the memory of the
/// records in flight whatever becomes of them.
#[derive(Debug, Clone)]
pub(crate) struct RawMetadata {
    text: Box<serde_json::value::RawValue>,
    tree_bytes: u64,
}

impl PartialEq for RawMetadata {
    fn eq(&self, other: &Self) -> bool {
        self.text.get() == other.text.get()
    }
}

impl RawMetadata {
    /// The metadata tree, for a park's payload. The text parsed once already (the same parser,
    /// the same limits), so the error branch is not expected; if it were ever taken, the
    /// metadata is kept as its text rather than lost.
    pub(crate) fn into_value(self) -> Value {
        serde_json::from_str(self.text.get()).unwrap_or_else(|e| {
            tracing::error!(error = %e, "metadata that parsed before did not parse again; kept as text");
            Value::String(self.text.get().to_owned())
        })
    }

    /// `chunk` as a park's payload: its JSON form with this metadata.
    pub(crate) fn payload(chunk: &Chunk, metadata: Option<RawMetadata>) -> Value {
        let mut payload = serde_json::to_value(chunk).expect("chunk serializes");
        if let (Some(m), Value::Object(fields)) = (metadata, &mut payload) {
            fields.insert("metadata".into(), m.into_value());
        }
        payload
    }
}

impl Record {
    /// The record with its metadata as a tree in `chunk.metadata`, as a Rust program hands a
    /// chunk over (for comparisons of the two forms).
    #[cfg(test)]
    pub(crate) fn with_metadata_tree(self) -> Record {
        match self {
            Record::Chunk { line, mut chunk, metadata: Some(m) } => {
                chunk.metadata = Some(m.into_value());
                Record::Chunk { line, chunk, metadata: None }
            }
            r => r,
        }
    }

    /// The record's line (its place in the run's input).
    pub(crate) fn line(&self) -> u64 {
        match self {
            Record::Chunk { line, .. }
            | Record::Invalid { line, .. }
            | Record::Delete { line, .. }
            | Record::Rejected { line, .. } => *line,
        }
    }

    /// Approximate heap bytes the parsed record holds (its strings and metadata tree), which
    /// is what the run's byte budget charges on top of the line. A metadata array of small
    /// numbers takes ~16x its JSON size once parsed, so the line length alone would not do.
    pub(crate) fn approx_bytes(&self) -> u64 {
        match self {
            Record::Chunk { chunk, metadata, .. } => {
                (chunk.doc_id.len() + chunk.text.len()) as u64
                    + chunk.metadata.as_ref().map_or(0, value_bytes)
                    + metadata.as_ref().map_or(0, |m| m.tree_bytes)
            }
            Record::Invalid { doc_id, problem, payload, raw_hash, .. } => {
                (doc_id.len() + problem.len() + raw_hash.len()) as u64 + value_bytes(payload)
            }
            Record::Delete { doc_id, .. } => doc_id.len() as u64,
            Record::Rejected { problem, .. } => problem.len() as u64,
        }
    }

    /// A delete from a source other than a JSONL line (a stream entry, a Rust program): the
    /// identity checks of a parsed line. `position` (1-based) stands in for the line number.
    pub(crate) fn delete(position: u64, doc_id: String, chunk_index: Option<i32>) -> Record {
        let line = position;
        let problem = doc_id_problem(&doc_id)
            .or_else(|| chunk_index.and_then(|i| chunk_index_in_range(&i.into()).err()));
        match problem {
            Some(problem) => Record::Rejected { line, problem },
            None => Record::Delete { line, doc_id, chunk_index },
        }
    }
}

/// What one node of a metadata tree takes ([`value_bytes`], `line::unique_keys_tree_bytes`).
const TREE_NODE_BYTES: u64 = std::mem::size_of::<Value>() as u64;
/// What one entry of an object takes beside its key and value.
const TREE_ENTRY_BYTES: u64 = 48;

/// Heap bytes of a parsed JSON value: a node per value, string contents, and a map entry's
/// key and bookkeeping.
fn value_bytes(v: &Value) -> u64 {
    const NODE: u64 = TREE_NODE_BYTES;
    const ENTRY: u64 = TREE_ENTRY_BYTES;
    match v {
        Value::String(s) => NODE + s.len() as u64,
        Value::Array(a) => NODE + a.iter().map(value_bytes).sum::<u64>(),
        Value::Object(o) => {
            NODE + o.iter().map(|(k, v)| ENTRY + k.len() as u64 + value_bytes(v)).sum::<u64>()
        }
        _ => NODE,
    }
}

impl Record {
    /// The record a chunk handed over by a Rust program becomes: the same checks as a parsed
    /// line ([`parse_line`]), so both inputs reject, park or embed the same chunks. `position`
    /// (1-based) stands in for the line number; a broken chunk is parked with its JSON form as
    /// the `raw_line` of its payload.
    pub fn from_chunk(position: u64, mut chunk: Chunk) -> Record {
        let line = position;
        let identity = doc_id_problem(&chunk.doc_id)
            .map_or_else(|| chunk_index_in_range(&chunk.chunk_index.into()).err(), Some);
        if let Some(problem) = identity {
            return Record::Rejected { line, problem };
        }
        if chunk.metadata == Some(Value::Null) {
            chunk.metadata = None;
        }
        let Some(problem) = fields_problem(&chunk.text, chunk.metadata.as_ref()) else {
            return Record::Chunk { line, chunk, metadata: None };
        };
        let json = serde_json::to_string(&chunk).expect("chunk serializes");
        Record::Invalid {
            line,
            payload: invalid_payload(&chunk.doc_id, chunk.chunk_index, line, &json, None),
            raw_hash: crate::model::raw_record_hash(json.as_bytes()),
            doc_id: chunk.doc_id,
            chunk_index: chunk.chunk_index,
            problem,
        }
    }
}

/// Why `doc_id` cannot identify a chunk, whatever the input: Postgres cannot store NUL, and
/// cannot index keys much longer than [`MAX_DOC_ID_BYTES`].
fn doc_id_problem(doc_id: &str) -> Option<String> {
    if doc_id.is_empty() || doc_id.contains('\0') {
        return Some("doc_id is empty or contains NUL".into());
    }
    if doc_id.len() > MAX_DOC_ID_BYTES {
        return Some(format!(
            "doc_id of {} bytes exceeds the limit of {MAX_DOC_ID_BYTES} bytes",
            doc_id.len()
        ));
    }
    None
}

/// The chunk index, if `n` is one: an integer in 0..=2147483647, whatever the input.
fn chunk_index_in_range(n: &serde_json::Number) -> Result<i32, String> {
    n.as_i64()
        .and_then(|i| i32::try_from(i).ok())
        .filter(|i| *i >= 0)
        .ok_or_else(|| format!("chunk_index {n} is not an integer in 0..=2147483647"))
}

/// Why an identified record cannot be embedded and stored, whatever the input (it is parked as
/// `invalid_record`): Postgres cannot store NUL characters, and metadata is an object.
fn fields_problem(text: &str, metadata: Option<&Value>) -> Option<String> {
    if text.contains('\0') {
        return Some("text contains NUL characters (Postgres cannot store them)".into());
    }
    match metadata {
        Some(Value::Object(_)) if metadata.is_some_and(contains_nul) => {
            Some("metadata contains NUL characters (Postgres cannot store them)".into())
        }
        None | Some(Value::Object(_)) => None,
        Some(_) => Some("metadata is not an object".into()),
    }
}

fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(contains_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

/// What a broken record keeps: its identity, line number and the raw line (lossily decoded,
/// NULs replaced) — the most a human needs to repair and requeue it.
fn invalid_payload(doc_id: &str, chunk_index: i32, line: u64, raw: &str, marker: Option<char>) -> Value {
    let mut raw_line = raw.replace('\0', "\u{FFFD}");
    if let Some(m) = marker {
        raw_line = raw_line.replace(m, "\u{FFFD}");
    }
    let mut m = Map::new();
    m.insert("doc_id".into(), doc_id.into());
    m.insert("chunk_index".into(), chunk_index.into());
    m.insert("line".into(), line.into());
    m.insert("raw_line".into(), raw_line.into());
    Value::Object(m)
}
