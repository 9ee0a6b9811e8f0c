//! JSONL lines as records: the line reader (bounded memory: a line over the cap is skipped
//! through, never held; line numbers; bytes consumed; a leading UTF-8 BOM dropped) and the
//! parse of a line ([`parse_line`]: the shortcut for a plain line, the general path with its
//! JSON walks for repeated keys and metadata sizes, the precise word on a broken line).
//!
//! Each line is one record: `{"doc_id": str, "chunk_index": int, "text": str, "metadata"?: obj}`,
//! or a delete: `{"doc_id": str, "op": "delete"}` (the whole document) or
//! `{"doc_id": str, "chunk_index": int, "op": "delete"}` (one chunk). `"op": "upsert"` is the
//! default and may be spelled out.

use serde_json::{Map, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

use super::{
    RawMetadata, Record, TREE_ENTRY_BYTES, TREE_NODE_BYTES, chunk_index_in_range, doc_id_problem,
    fields_problem, invalid_payload,
};
use crate::model::Chunk;
use crate::telemetry::Escaped;

impl RawMetadata {
    /// `raw` if it is metadata a tree would be accepted as (an object without a key twice,
    /// parsing within serde_json's limits, no NUL: text that may hold one is refused, the
    /// general path then decides); `None` otherwise.
    fn checked(raw: &serde_json::value::RawValue) -> Option<RawMetadata> {
        let text = raw.get();
        if !text.starts_with('{') || text.contains("\\u0000") {
            return None;
        }
        let tree_bytes = unique_keys_tree_bytes(text)?;
        Some(RawMetadata { text: raw.to_owned(), tree_bytes })
    }
}

/// What a record asks for: its `op` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Upsert,
    Delete,
}

/// The record's `op` (absent: an upsert), or why it is not one.
fn op_of(obj: &Map<String, Value>) -> Result<Op, String> {
    match obj.get("op") {
        None => Ok(Op::Upsert),
        Some(Value::String(s)) if s == "upsert" => Ok(Op::Upsert),
        Some(Value::String(s)) if s == "delete" => Ok(Op::Delete),
        Some(other) => Err(format!(
            "op {} is not \"upsert\" or \"delete\"",
            Escaped(&other.to_string().chars().take(64).collect::<String>())
        )),
    }
}

/// Reads lines of at most `max_line_bytes`, tracking line numbers and bytes consumed.
pub(crate) struct LineReader<R> {
    inner: R,
    max_line_bytes: usize,
    line: u64,
    /// Bytes consumed so far (for progress).
    pub bytes_read: u64,
}

/// One raw line.
#[derive(Debug)]
pub(crate) struct RawLine {
    pub number: u64,
    /// The line without its terminator; empty when `oversized`.
    pub bytes: Vec<u8>,
    /// Length of the whole line, when it exceeded the cap and was skipped.
    pub oversized: Option<u64>,
}

impl<R: AsyncBufRead + Unpin> LineReader<R> {
    pub fn new(inner: R, max_line_bytes: usize) -> Self {
        LineReader { inner, max_line_bytes, line: 0, bytes_read: 0 }
    }

    /// The next line, or `None` at end of input.
    pub(crate) async fn next_line(&mut self) -> std::io::Result<Option<RawLine>> {
        let mut buf = Vec::new();
        let mut total: u64 = 0;
        let mut oversized = false;
        loop {
            let available = self.inner.fill_buf().await?;
            if available.is_empty() {
                if total == 0 {
                    return Ok(None);
                }
                break;
            }
            let (take, done) = match memchr::memchr(b'\n', available) {
                Some(pos) => (pos + 1, true),
                None => (available.len(), false),
            };
            total += take as u64;
            if !oversized {
                if buf.len() + take > self.max_line_bytes + 2 {
                    oversized = true;
                    buf = Vec::new();
                } else {
                    buf.extend_from_slice(&available[..take]);
                }
            }
            self.inner.consume(take);
            if done {
                break;
            }
        }
        self.bytes_read += total;
        self.line += 1;
        if self.line == 1 && buf.starts_with(UTF8_BOM) {
            buf.drain(..UTF8_BOM.len());
        }
        while matches!(buf.last(), Some(b'\n' | b'\r')) {
            buf.pop();
        }
        Ok(Some(RawLine { number: self.line, bytes: buf, oversized: oversized.then_some(total) }))
    }
}

/// Editors on some platforms start a UTF-8 file with this mark; it is not part of the data.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// Parses one raw line; `None` for a blank line (allowed, skipped, not counted as a record).
///
/// JSON decoding and its failures are this function's; the checks every record passes
/// whatever its source (identity, NULs, metadata shape) are shared with
/// [`Record::from_chunk`].
pub(crate) fn parse_line(raw: &RawLine) -> Option<Record> {
    let line = raw.number;
    if let Some(len) = raw.oversized {
        return Some(Record::Rejected {
            line,
            problem: format!("line of {len} bytes exceeds the line size limit"),
        });
    }
    if raw.bytes.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    plain_record(line, &raw.bytes).or_else(|| general_record(raw))
}

/// [`parse_line`] for any line that is not blank: the JSON tree of the whole line, then each
/// check in turn, so that a broken line gets the most precise word on what is wrong with it.
fn general_record(raw: &RawLine) -> Option<Record> {
    let line = raw.number;
    let decoded = DecodedLine::new(&raw.bytes);
    let obj = match decoded.json_object().and_then(|obj| Ok((op_of(&obj)?, obj))) {
        Err(problem) => return Some(Record::Rejected { line, problem }),
        Ok((Op::Delete, obj)) => return Some(decoded.delete(line, obj)),
        Ok((Op::Upsert, obj)) => obj,
    };
    let mut obj = obj;
    let identified = decoded.identity(&mut obj).map(|identity| (identity, obj));
    let ((doc_id, chunk_index), mut obj) = match identified {
        Ok(found) => found,
        Err(problem) => return Some(Record::Rejected { line, problem }),
    };
    // serde_json keeps the last of a repeated key without a word: which one the source meant
    // is unknown, so a repeated identity key rejects the line, any other parks it as invalid.
    let repeated = duplicate_key(&decoded.text);
    if let Some((true, key)) = &repeated {
        return Some(Record::Rejected { line, problem: format!("duplicate key {key:?}") });
    }
    let fields = match (&decoded.utf8_problem, repeated) {
        (Some(p), _) => Err(p.clone()),
        (None, Some((_, key))) => Err(format!("duplicate key {key:?}")),
        (None, None) => fields_of(&mut obj),
    };
    Some(match fields {
        Ok((text, metadata)) => {
            Record::Chunk { line, chunk: Chunk { doc_id, chunk_index, text, metadata }, metadata: None }
        }
        Err(problem) => Record::Invalid {
            line,
            payload: invalid_payload(&doc_id, chunk_index, line, &decoded.text, decoded.marker),
            doc_id,
            chunk_index,
            problem,
            raw_hash: crate::model::raw_record_hash(&raw.bytes),
        },
    })
}

/// The usual line, read straight into its fields: `doc_id`, `chunk_index`, `text` and an
/// optional `metadata`, no other key, no key twice (serde's derive refuses a repeated
/// field). Every other line, and any line this one finds a problem in, goes the general way
/// ([`parse_line`]), which then words the problem: this is only a shortcut past building a
/// JSON tree of the whole line and walking it again for repeated keys, the most expensive part
/// of reading an unchanged corpus.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlainLine<'a> {
    #[serde(borrow)]
    doc_id: std::borrow::Cow<'a, str>,
    chunk_index: serde_json::Number,
    #[serde(borrow)]
    text: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    metadata: Option<&'a serde_json::value::RawValue>,
}

/// The record of a plain line ([`PlainLine`]) if nothing in it needs the general path: exactly
/// what [`parse_line`] makes of the same line, or `None`.
fn plain_record(line: u64, bytes: &[u8]) -> Option<Record> {
    let plain: PlainLine<'_> = serde_json::from_slice(bytes).ok()?;
    if doc_id_problem(&plain.doc_id).is_some() {
        return None;
    }
    let chunk_index = chunk_index_in_range(&plain.chunk_index).ok()?;
    // The checks `fields_problem` makes of a tree, made of the text: an object (or null), no
    // NUL (which JSON can only hold as the escape `\u0000`; any such text goes the general
    // way, which decides), no key twice (the walk also proves that the text parses).
    let metadata = match plain.metadata {
        None => None,
        Some(raw) if raw.get() == "null" => None,
        Some(raw) => Some(RawMetadata::checked(raw)?),
    };
    let text = plain.text.into_owned();
    if fields_problem(&text, None).is_some() {
        return None;
    }
    Some(Record::Chunk {
        line,
        chunk: Chunk { doc_id: plain.doc_id.into_owned(), chunk_index, text, metadata: None },
        metadata,
    })
}

/// A line decoded as UTF-8. Invalid sequences are replaced by a marker character that does
/// not occur in the line, so a field that was broken can be told from one that merely holds
/// U+FFFD.
struct DecodedLine<'a> {
    text: std::borrow::Cow<'a, str>,
    utf8_problem: Option<String>,
    marker: Option<char>,
}

impl<'a> DecodedLine<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(s) => DecodedLine { text: s.into(), utf8_problem: None, marker: None },
            Err(e) => {
                let (decoded, marker) = decode_marked(bytes);
                DecodedLine {
                    text: decoded.into(),
                    utf8_problem: Some(format!("invalid UTF-8 at byte {}", e.valid_up_to())),
                    marker,
                }
            }
        }
    }

    /// The line as a JSON object, or why it is none (a rejection: no identity can be read).
    fn json_object(&self) -> Result<Map<String, Value>, String> {
        let value: Value = serde_json::from_str(&self.text).map_err(|e| match &self.utf8_problem {
            Some(p) => format!("{p}; then malformed JSON: {}", Escaped(&e.to_string())),
            None => format!("malformed JSON: {}", Escaped(&e.to_string())),
        })?;
        match value {
            Value::Object(obj) => Ok(obj),
            _ => Err("not a JSON object".into()),
        }
    }

    /// A delete line: its identity (a chunk index is optional), or why it is rejected. A
    /// delete that carries `text` is rejected: it is not clear whether it meant to write.
    fn delete(&self, line: u64, mut obj: Map<String, Value>) -> Record {
        let identity = self.doc_id(&mut obj).and_then(|doc_id| {
            if obj.contains_key("text") {
                return Err("a delete carries no text".to_string());
            }
            if let Some((true, key)) = duplicate_key(&self.text) {
                return Err(format!("duplicate key {key:?}"));
            }
            let chunk_index = match obj.get("chunk_index") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => Some(chunk_index_in_range(n)?),
                Some(_) => return Err("chunk_index is not a number".into()),
            };
            Ok((doc_id, chunk_index))
        });
        match identity {
            Ok((doc_id, chunk_index)) => Record::Delete { line, doc_id, chunk_index },
            Err(problem) => Record::Rejected { line, problem },
        }
    }

    /// `(doc_id, chunk_index)`, moved out of `obj`, or why the record has no usable identity.
    fn identity(&self, obj: &mut Map<String, Value>) -> Result<(String, i32), String> {
        let doc_id = self.doc_id(obj)?;
        let chunk_index = match obj.get("chunk_index") {
            Some(Value::Number(n)) => chunk_index_in_range(n)?,
            Some(_) => return Err("chunk_index is not a number".into()),
            None => return Err("missing key chunk_index".into()),
        };
        Ok((doc_id, chunk_index))
    }

    /// `doc_id`, moved out of `obj`, or why it is no usable identity.
    fn doc_id(&self, obj: &mut Map<String, Value>) -> Result<String, String> {
        let doc_id = match obj.remove("doc_id") {
            // The lossy decode maps every invalid sequence to U+FFFD, so two different broken
            // ids would become one key (and one DLQ row would hold whichever came last): an id
            // that cannot be read exactly is no identity.
            Some(Value::String(s))
                if self.utf8_problem.is_some() && self.marker.is_none_or(|m| s.contains(m)) =>
            {
                let p = self.utf8_problem.as_deref().unwrap_or("invalid UTF-8");
                return Err(format!("doc_id is not valid UTF-8 ({p})"));
            }
            Some(Value::String(s)) => match doc_id_problem(&s) {
                Some(problem) => return Err(problem),
                None => s,
            },
            Some(_) => return Err("doc_id is not a string".into()),
            None => return Err("missing key doc_id".into()),
        };
        Ok(doc_id)
    }
}

/// Longest path of a repeated key that a problem quotes; longer ones are cut.
const MAX_KEY_PATH: usize = 200;

/// What [`value_bytes`](super::value_bytes) would count of the tree of `json` (a value), if it parses and no object
/// of it repeats a key; `None` otherwise. One walk that keeps nothing but each object's keys
/// (borrowed from the text unless escaped): the plain path's check of a line's metadata.
fn unique_keys_tree_bytes(json: &str) -> Option<u64> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::borrow::Cow;
    use std::fmt;

    const NODE: u64 = TREE_NODE_BYTES;
    const ENTRY: u64 = TREE_ENTRY_BYTES;

    /// Adds up one value's tree bytes; an error ends the walk (a repeated key is one).
    struct Count;

    impl<'de> DeserializeSeed<'de> for Count {
        type Value = u64;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
            d.deserialize_any(self)
        }
    }

    /// An object's key, borrowed where the text has no escape in it.
    struct Key<'de>(Cow<'de, str>);

    impl<'de> serde::Deserialize<'de> for Key<'de> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct KeyVisitor;
            impl<'de> Visitor<'de> for KeyVisitor {
                type Value = Key<'de>;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a key")
                }
                fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                    Ok(Key(Cow::Borrowed(s)))
                }
                fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                    Ok(Key(Cow::Owned(s.to_owned())))
                }
            }
            d.deserialize_str(KeyVisitor)
        }
    }

    impl<'de> Visitor<'de> for Count {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<u64, E> {
            Ok(NODE)
        }
        fn visit_i64<E>(self, _: i64) -> Result<u64, E> {
            Ok(NODE)
        }
        fn visit_u64<E>(self, _: u64) -> Result<u64, E> {
            Ok(NODE)
        }
        fn visit_f64<E>(self, _: f64) -> Result<u64, E> {
            Ok(NODE)
        }
        fn visit_str<E>(self, s: &str) -> Result<u64, E> {
            Ok(NODE + s.len() as u64)
        }
        fn visit_unit<E>(self) -> Result<u64, E> {
            Ok(NODE)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
            let mut bytes = NODE;
            while let Some(b) = seq.next_element_seed(Count)? {
                bytes += b;
            }
            Ok(bytes)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
            let mut keys = std::collections::HashSet::new();
            let mut bytes = NODE;
            while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
                bytes += ENTRY + key.len() as u64;
                if !keys.insert(key) {
                    map.next_value::<IgnoredAny>()?;
                    return Err(serde::de::Error::custom("a key twice"));
                }
                bytes += map.next_value_seed(Count)?;
            }
            Ok(bytes)
        }
    }

    let mut de = serde_json::Deserializer::from_str(json);
    let bytes = Count.deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(bytes)
}

/// The first key that an object of `json` (already known to parse) repeats, as a path
/// (`metadata.tags[2].k`), and whether it is `doc_id` or `chunk_index` of the top object.
fn duplicate_key(json: &str) -> Option<(bool, String)> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    /// Walks a value, noting the first repeated key (a walk that reads nothing into memory
    /// but the keys of the object it is in).
    struct Walk<'p> {
        path: &'p str,
        found: &'p std::cell::RefCell<Option<(bool, String)>>,
    }

    impl<'de> DeserializeSeed<'de> for Walk<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Walk<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let mut i = 0usize;
            loop {
                if self.found.borrow().is_some() {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(());
                }
                let path = format!("{}[{i}]", self.path);
                if seq.next_element_seed(Walk { path: &path, found: self.found })?.is_none() {
                    return Ok(());
                }
                i += 1;
            }
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut keys = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                let path = if self.path.is_empty() { key.clone() } else { format!("{}.{key}", self.path) };
                let repeated = !keys.insert(key);
                if repeated {
                    // A repeated identity key outranks any other found before it: the line
                    // has no identity then.
                    let identity =
                        self.path.is_empty() && matches!(path.as_str(), "doc_id" | "chunk_index" | "op");
                    let mut found = self.found.borrow_mut();
                    if found.is_none() || (identity && found.as_ref().is_some_and(|(i, _)| !i)) {
                        *found = Some((identity, path.chars().take(MAX_KEY_PATH).collect()));
                    }
                }
                if repeated || self.found.borrow().is_some() {
                    map.next_value::<IgnoredAny>()?; // only the top object's keys still matter
                } else {
                    map.next_value_seed(Walk { path: &path, found: self.found })?;
                }
            }
            Ok(())
        }
    }

    let found = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(json);
    Walk { path: "", found: &found }.deserialize(&mut de).ok()?;
    found.into_inner()
}

/// `text` and `metadata` moved out of a record's object (never cloned: a record's metadata may
/// be megabytes), or why the record is broken.
fn fields_of(obj: &mut Map<String, Value>) -> Result<(String, Option<Value>), String> {
    let text = match obj.remove("text") {
        Some(Value::String(s)) => s,
        Some(_) => return Err("text is not a string".into()),
        None => return Err("missing key text".into()),
    };
    let metadata = match obj.remove("metadata") {
        None | Some(Value::Null) => None,
        Some(m) => Some(m),
    };
    match fields_problem(&text, metadata.as_ref()) {
        Some(problem) => Err(problem),
        None => Ok((text, metadata)),
    }
}

/// Decodes `bytes`, replacing every invalid sequence with a noncharacter that does not occur
/// in the valid parts (`None` and U+FFFD if all 32 candidates occur: then every field of the
/// line counts as possibly broken).
fn decode_marked(bytes: &[u8]) -> (String, Option<char>) {
    let valid: String = bytes.utf8_chunks().map(|c| c.valid()).collect();
    let marker = ('\u{FDD0}'..='\u{FDEF}').find(|c| !valid.contains(*c));
    let mut out = String::with_capacity(bytes.len() + 8);
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        if !chunk.invalid().is_empty() {
            out.push(marker.unwrap_or('\u{FFFD}'));
        }
    }
    (out, marker)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines(input: &[u8], cap: usize) -> Vec<RawLine> {
        let mut r = LineReader::new(input, cap);
        let mut out = vec![];
        while let Some(l) = r.next_line().await.unwrap() {
            out.push(l);
        }
        out
    }

    #[tokio::test]
    async fn splits_lines_and_skips_oversized_ones() {
        let input = b"{\"a\":1}\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\nlast";
        let ls = lines(input, 10).await;
        assert_eq!(ls.len(), 3);
        assert_eq!(ls[0].bytes, b"{\"a\":1}");
        assert_eq!(ls[1].oversized, Some(41));
        assert!(ls[1].bytes.is_empty());
        assert_eq!(ls[2].bytes, b"last");
        assert_eq!(ls[2].number, 3);
    }

    fn parse(bytes: &[u8]) -> Option<Record> {
        parse_line(&RawLine { number: 7, bytes: bytes.to_vec(), oversized: None })
    }

    #[test]
    fn good_record() {
        let r = parse(br#"{"doc_id":"d","chunk_index":3,"text":"hi","metadata":{"k":1}}"#).unwrap();
        let Record::Chunk { line, chunk, .. } = r.clone().with_metadata_tree() else { panic!("{r:?}") };
        assert_eq!(line, 7);
        assert_eq!(chunk.chunk_index, 3);
        assert_eq!(chunk.metadata, Some(serde_json::json!({"k": 1})));
    }

    #[test]
    fn every_kind_of_bad_line() {
        let rejected = |b: &[u8]| matches!(parse(b), Some(Record::Rejected { line: 7, .. }));
        let invalid = |b: &[u8]| matches!(parse(b), Some(Record::Invalid { line: 7, .. }));
        assert!(rejected(b"{not json"));
        assert!(rejected(b"[1,2]"));
        assert!(rejected(br#"{"chunk_index":1,"text":"x"}"#));
        assert!(rejected(br#"{"doc_id":"d","text":"x"}"#));
        assert!(rejected(br#"{"doc_id":"d","chunk_index":-1,"text":"x"}"#));
        assert!(rejected(br#"{"doc_id":"d","chunk_index":1.5,"text":"x"}"#));
        assert!(rejected(br#"{"doc_id":5,"chunk_index":1,"text":"x"}"#));
        assert!(rejected(b"\xff\xfe{garbage"));
        assert!(invalid(br#"{"doc_id":"d","chunk_index":1}"#));
        assert!(invalid(br#"{"doc_id":"d","chunk_index":1,"text":5}"#));
        assert!(invalid(br#"{"doc_id":"d","chunk_index":1,"text":"a\u0000b"}"#));
        assert!(invalid(br#"{"doc_id":"d","chunk_index":1,"text":"x","metadata":[1]}"#));
        assert!(invalid(b"{\"doc_id\":\"d\",\"chunk_index\":1,\"text\":\"caf\xe9\"}"));
        assert_eq!(parse(b"   "), None);
    }

    #[test]
    fn a_key_given_twice_is_never_resolved_silently() {
        let problem = |b: &[u8]| match parse(b) {
            Some(Record::Rejected { problem, .. }) => ("rejected", problem),
            Some(Record::Invalid { problem, .. }) => ("invalid", problem),
            other => panic!("{}: {other:?}", String::from_utf8_lossy(b)),
        };
        // Two identities in one line: which chunk is it? No identity, so rejected.
        let (kind, p) = problem(br#"{"doc_id":"a","chunk_index":1,"doc_id":"b","text":"x"}"#);
        assert_eq!((kind, p.as_str()), ("rejected", "duplicate key \"doc_id\""));
        let (kind, p) = problem(br#"{"doc_id":"a","chunk_index":1,"text":"x","chunk_index":2}"#);
        assert_eq!((kind, p.as_str()), ("rejected", "duplicate key \"chunk_index\""));
        // The identity is clear, the content is not: parked as an invalid record.
        let (kind, p) = problem(br#"{"doc_id":"a","chunk_index":1,"text":"x","text":"y"}"#);
        assert_eq!((kind, p.as_str()), ("invalid", "duplicate key \"text\""));
        let (kind, p) =
            problem(br#"{"doc_id":"a","chunk_index":1,"text":"x","metadata":{"k":1,"j":[{"k":1,"k":2}]}}"#);
        assert_eq!((kind, p.as_str()), ("invalid", "duplicate key \"metadata.j[0].k\""));
        let (kind, p) = problem(br#"{"doc_id":"a","chunk_index":1,"text":"x","extra":1,"extra":1}"#);
        assert_eq!((kind, p.as_str()), ("invalid", "duplicate key \"extra\""));
        // The same key in different objects is no duplicate.
        let r =
            parse(br#"{"doc_id":"a","chunk_index":1,"text":"x","metadata":{"doc_id":"a","m":{"doc_id":1}}}"#);
        assert!(matches!(r, Some(Record::Chunk { .. })), "{r:?}");
    }

    #[test]
    fn a_delete_names_a_document_or_one_chunk() {
        let del = |b: &[u8]| match parse(b) {
            Some(Record::Delete { line: 7, doc_id, chunk_index }) => Ok((doc_id, chunk_index)),
            Some(Record::Rejected { problem, .. }) => Err(problem),
            other => panic!("{other:?}"),
        };
        assert_eq!(del(br#"{"doc_id":"d","op":"delete"}"#), Ok(("d".into(), None)));
        assert_eq!(del(br#"{"doc_id":"d","chunk_index":3,"op":"delete"}"#), Ok(("d".into(), Some(3))));
        assert_eq!(del(br#"{"doc_id":"d","chunk_index":null,"op":"delete"}"#), Ok(("d".into(), None)));
        assert!(del(br#"{"op":"delete"}"#).unwrap_err().contains("doc_id"));
        assert!(
            del(br#"{"doc_id":"d","chunk_index":-1,"op":"delete"}"#).unwrap_err().contains("chunk_index")
        );
        assert!(del(br#"{"doc_id":"d","op":"delete","text":"x"}"#).unwrap_err().contains("no text"));
        assert_eq!(
            del(br#"{"doc_id":"d","chunk_index":1,"op":"delete","op":"upsert"}"#).unwrap_err(),
            "duplicate key \"op\""
        );
        assert!(
            del(br#"{"doc_id":"d","chunk_index":1,"text":"x","op":"remove"}"#).unwrap_err().contains("op")
        );
        assert!(del(br#"{"doc_id":"d","chunk_index":1,"text":"x","op":1}"#).unwrap_err().contains("op"));
        // An upsert may say so.
        assert!(matches!(
            parse(br#"{"doc_id":"d","chunk_index":1,"text":"x","op":"upsert"}"#),
            Some(Record::Chunk { .. })
        ));
        // The same checks for a delete from another source.
        assert!(matches!(Record::delete(3, "d".into(), Some(2)), Record::Delete { line: 3, .. }));
        assert!(matches!(Record::delete(3, String::new(), None), Record::Rejected { line: 3, .. }));
        assert!(matches!(Record::delete(3, "d".into(), Some(-4)), Record::Rejected { .. }));
    }

    /// The shortcut for plain lines makes exactly what the general path makes of them, and
    /// leaves every other line to it.
    #[test]
    fn a_plain_line_reads_as_the_general_path_reads_it() {
        let raw = |b: &[u8]| RawLine { number: 7, bytes: b.to_vec(), oversized: None };
        let plain: &[&[u8]] = &[
            br#"{"doc_id":"d","chunk_index":3,"text":"hi"}"#,
            br#"  {"text":"h\"i\\n\u00e9\ud83d\ude00","chunk_index":0,"doc_id":"d\/e"}  "#,
            br#"{"doc_id":"d","chunk_index":3,"text":"hi","metadata":null}"#,
            br#"{"doc_id":"d","chunk_index":3,"text":"","metadata":{"k":[1,{"j":"x"}],"n":null}}"#,
            "{\"doc_id\":\"caf\u{e9}\",\"chunk_index\":2147483647,\"text\":\"\u{1F600}\"}".as_bytes(),
        ];
        for line in plain {
            let fast = plain_record(7, line).map(Record::with_metadata_tree);
            assert!(fast.is_some(), "the shortcut reads {}", String::from_utf8_lossy(line));
            assert_eq!(
                fast,
                general_record(&raw(line)).map(Record::with_metadata_tree),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
        let general: &[&[u8]] = &[
            b"{not json",
            b"[1,2]",
            br#"{"doc_id":"d","chunk_index":1,"text":"x","extra":1}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"x","op":"upsert"}"#,
            br#"{"doc_id":"d","chunk_index":1,"op":"delete"}"#,
            br#"{"doc_id":"","chunk_index":1,"text":"x"}"#,
            br#"{"doc_id":"a\u0000","chunk_index":1,"text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":-1,"text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":1.0,"text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":2147483648,"text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":"1","text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":5}"#,
            br#"{"doc_id":"d","chunk_index":1}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"a\u0000b"}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"x","metadata":[1]}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"x","metadata":{"k":"\u0000"}}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"x","metadata":{"k":1,"k":2}}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"x","text":"y"}"#,
            br#"{"doc_id":"a","chunk_index":1,"doc_id":"b","text":"x"}"#,
            br#"{"doc_id":"d","chunk_index":1,"text":"\ud800"}"#,
            b"{\"doc_id\":\"d\",\"chunk_index\":1,\"text\":\"caf\xe9\"}",
        ];
        for line in general {
            assert_eq!(plain_record(7, line), None, "{}", String::from_utf8_lossy(line));
            assert!(parse(line).is_some(), "{}", String::from_utf8_lossy(line));
        }
    }

    proptest::proptest! {
        /// Any object of the record's keys (each maybe twice, maybe missing, values of any
        /// kind): where the shortcut answers, it answers as the general path does.
        #[test]
        fn the_shortcut_never_disagrees_with_the_general_path(
            fields in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["doc_id", "chunk_index", "text", "metadata", "op", "x"]),
                    proptest::sample::select(vec![
                        r#""d""#, r#""""#, r#""\u0000""#, "0", "7", "-1", "1.5", "2147483648", "null",
                        "true", r#"{"k":1}"#, r#"{"k":1,"k":2}"#, "[1]", r#""upsert""#, r#""delete""#,
                    ]),
                ),
                0..6,
            )
        ) {
            let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            let line = format!("{{{}}}", body.join(","));
            let raw = RawLine { number: 7, bytes: line.clone().into_bytes(), oversized: None };
            if let Some(fast) = plain_record(7, line.as_bytes()) {
                proptest::prop_assert_eq!(Some(fast.with_metadata_tree()), general_record(&raw), "{}", line);
            }
        }
    }

    #[test]
    fn invalid_utf8_keeps_identity_and_text() {
        let Some(Record::Invalid { doc_id, chunk_index, payload, problem, .. }) =
            parse(b"{\"doc_id\":\"d\",\"chunk_index\":4,\"text\":\"caf\xe9\"}")
        else {
            panic!()
        };
        assert_eq!((doc_id.as_str(), chunk_index), ("d", 4));
        assert!(problem.contains("UTF-8"), "{problem}");
        assert!(payload["raw_line"].as_str().unwrap().contains("caf\u{FFFD}"));
    }
}

#[cfg(test)]
mod identity_tests {
    use super::super::{MAX_DOC_ID_BYTES, value_bytes};
    use super::*;

    fn parse(bytes: &[u8]) -> Option<Record> {
        parse_line(&RawLine { number: 9, bytes: bytes.to_vec(), oversized: None })
    }

    #[test]
    fn a_doc_id_over_the_limit_is_rejected_with_its_line() {
        let at_limit = "d".repeat(MAX_DOC_ID_BYTES);
        let line = format!(r#"{{"doc_id":"{at_limit}","chunk_index":0,"text":"x"}}"#);
        assert!(matches!(parse(line.as_bytes()), Some(Record::Chunk { .. })));
        let over = "d".repeat(3 * 1024);
        let line = format!(r#"{{"doc_id":"{over}","chunk_index":0,"text":"x"}}"#);
        let Some(Record::Rejected { line, problem }) = parse(line.as_bytes()) else { panic!() };
        assert_eq!(line, 9);
        assert!(problem.contains("3072 bytes") && problem.contains("1024"), "{problem}");
        // Counted in bytes, not characters: 400 three-byte characters are 1200 bytes.
        let wide = "€".repeat(400);
        let line = format!(r#"{{"doc_id":"{wide}","chunk_index":0,"text":"x"}}"#);
        assert!(matches!(parse(line.as_bytes()), Some(Record::Rejected { .. })));
    }

    #[test]
    fn different_invalid_utf8_doc_ids_never_share_an_identity() {
        let a = parse(b"{\"doc_id\":\"doc-\xff\",\"chunk_index\":0,\"text\":\"x\"}");
        let b = parse(b"{\"doc_id\":\"doc-\xfe\",\"chunk_index\":0,\"text\":\"x\"}");
        let identity = |r: &Option<Record>| match r {
            Some(Record::Invalid { doc_id, chunk_index, .. }) => Some((doc_id.clone(), *chunk_index)),
            Some(Record::Chunk { chunk, .. }) => Some((chunk.doc_id.clone(), chunk.chunk_index)),
            _ => None,
        };
        // Neither may be parked under the lossy "doc-\u{FFFD}": that key would hold whichever
        // came last. They are rejected (reported with their line) instead.
        assert_eq!(identity(&a), None, "{a:?}");
        assert_eq!(identity(&b), None, "{b:?}");
        let Some(Record::Rejected { problem, .. }) = a else { panic!() };
        assert!(problem.contains("doc_id") && problem.contains("UTF-8"), "{problem}");
        // Invalid UTF-8 in the text alone still parks under the (valid) doc_id.
        assert!(matches!(
            parse(b"{\"doc_id\":\"doc-\xef\xbf\xbd\",\"chunk_index\":0,\"text\":\"caf\xe9\"}"),
            Some(Record::Invalid { .. })
        ));
    }

    #[test]
    fn metadata_read_as_text_parks_as_the_tree_it_would_have_been() {
        let line =
            br#"{"doc_id":"d","chunk_index":3,"text":"hi","metadata":{"k":[1,{"j":"x\u00e9"}],"n":null}}"#;
        let Some(Record::Chunk { chunk, metadata: Some(raw), .. }) = parse(line) else {
            panic!("the plain path keeps the metadata as text")
        };
        assert_eq!(chunk.metadata, None);
        let tree = serde_json::json!({"k": [1, {"j": "x\u{e9}"}], "n": null});
        let expected = serde_json::to_value(Chunk { metadata: Some(tree.clone()), ..chunk.clone() }).unwrap();
        assert_eq!(RawMetadata::payload(&chunk, Some(raw.clone())), expected);
        // Charged as the tree it becomes.
        assert_eq!(raw.tree_bytes, value_bytes(&tree));
        // A key twice, however deep, or text that may hold a NUL: the general path decides.
        for line in [
            br#"{"doc_id":"d","chunk_index":3,"text":"hi","metadata":{"k":[{"j":1,"j":2}]}}"#.as_slice(),
            br#"{"doc_id":"d","chunk_index":3,"text":"hi","metadata":{"k":"a\u0000"}}"#,
        ] {
            assert_eq!(plain_record(7, line), None, "{}", String::from_utf8_lossy(line));
            assert!(matches!(parse(line), Some(Record::Invalid { .. })), "{}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn the_parsed_size_counts_what_a_record_holds() {
        let numbers = format!(
            r#"{{"doc_id":"d","chunk_index":0,"text":"t","metadata":{{"v":[{}]}}}}"#,
            ["0"; 1000].join(",")
        );
        let r = parse(numbers.as_bytes()).unwrap();
        // 1000 numbers of 2 bytes of JSON each hold a 32-byte node each.
        assert!(r.approx_bytes() >= 32_000, "{}", r.approx_bytes());
        let blob = format!(
            r#"{{"doc_id":"d","chunk_index":0,"text":"t","metadata":{{"b":"{}"}}}}"#,
            "x".repeat(10_000)
        );
        let b = parse(blob.as_bytes()).unwrap().approx_bytes();
        assert!((10_000..11_000).contains(&b), "{b}");
    }

    #[test]
    fn a_chunk_from_rust_gets_the_verdict_of_its_json_line() {
        let chunk = |doc_id: &str, chunk_index: i32, text: &str, metadata: Option<Value>| Chunk {
            doc_id: doc_id.into(),
            chunk_index,
            text: text.into(),
            metadata,
        };
        let kind = |r: &Record| match r {
            Record::Chunk { .. } => "chunk",
            Record::Invalid { .. } => "invalid",
            Record::Rejected { .. } => "rejected",
            Record::Delete { .. } => "delete",
        };
        let cases = [
            chunk("d", 0, "x", None),
            chunk("d", 0, "x", Some(serde_json::json!({"k": [1, "v"]}))),
            chunk("d", 0, "x", Some(Value::Null)),
            chunk("", 0, "x", None),
            chunk("a\0b", 0, "x", None),
            chunk(&"d".repeat(MAX_DOC_ID_BYTES + 1), 0, "x", None),
            chunk("d", -1, "x", None),
            chunk("d", 0, "a\0b", None),
            chunk("d", 0, "x", Some(serde_json::json!([1]))),
            chunk("d", 0, "x", Some(serde_json::json!({"k\0": 1}))),
            chunk("d", 0, "x", Some(serde_json::json!({"k": "a\0"}))),
        ];
        for c in cases {
            let line = serde_json::to_string(&c).unwrap();
            let from_line = parse(line.as_bytes()).unwrap().with_metadata_tree();
            let from_rust = Record::from_chunk(9, c.clone());
            assert_eq!(kind(&from_rust), kind(&from_line), "{c:?}");
            match (&from_rust, &from_line) {
                (Record::Rejected { problem: a, .. }, Record::Rejected { problem: b, .. })
                | (Record::Invalid { problem: a, .. }, Record::Invalid { problem: b, .. }) => {
                    assert_eq!(a, b)
                }
                (Record::Chunk { chunk: a, .. }, Record::Chunk { chunk: b, .. }) => assert_eq!(a, b),
                _ => unreachable!(),
            }
        }
        let Record::Invalid { payload, raw_hash, line, .. } =
            Record::from_chunk(4, chunk("d", 1, "a\0b", None))
        else {
            panic!()
        };
        assert_eq!(line, 4);
        assert_eq!(payload["line"], 4);
        assert!(!payload.to_string().contains('\0'), "Postgres cannot store NUL: {payload}");
        let again = Record::from_chunk(4, chunk("d", 1, "a\0b", None));
        assert!(
            matches!(again, Record::Invalid { raw_hash: h, .. } if h == raw_hash),
            "a rerun finds it parked"
        );
    }

    #[tokio::test]
    async fn a_utf8_bom_at_the_start_is_skipped() {
        let input = b"\xef\xbb\xbf{\"doc_id\":\"d\",\"chunk_index\":0,\"text\":\"x\"}\n\xef\xbb\xbf{\"doc_id\":\"e\"}\n";
        let mut r = LineReader::new(&input[..], 1024);
        let first = r.next_line().await.unwrap().unwrap();
        assert!(matches!(parse_line(&first), Some(Record::Chunk { line: 1, .. })), "{first:?}");
        // Only at the start of the input: a BOM later is part of a (broken) line.
        let second = r.next_line().await.unwrap().unwrap();
        assert!(matches!(parse_line(&second), Some(Record::Rejected { line: 2, .. })));
        assert_eq!(r.bytes_read, input.len() as u64);
    }
}
