//! Source stream entries as records ([`parse_entry`]): the entry format and its checks, a
//! malformed entry parked (never rejected: an entry is acknowledged only once its outcome is
//! written) under its identity or `source:<stream>/<entry id>`, a poison entry parked
//! ([`poison_entry`]), and the raw fields and hash a broken entry is parked with.

use serde_json::{Map, Value};

use super::{Record, chunk_index_in_range, doc_id_problem, fields_problem};
use crate::model::Chunk;
use crate::telemetry::Escaped;

/// Where a source stream entry came from: its stream key and entry id.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EntryOrigin<'a> {
    pub stream: &'a str,
    pub id: &'a str,
}

/// The `doc_id` under which an entry without a usable identity is parked
/// (`source:<stream>/<entry id>`, chunk index 0): the raw entry is kept in its payload, and
/// the name says where it came from. Stream keys are at most [`MAX_SOURCE_KEY_BYTES`], so
/// the name stays within [`MAX_DOC_ID_BYTES`](super::MAX_DOC_ID_BYTES).
pub(crate) fn unidentified_doc_id(origin: EntryOrigin<'_>) -> String {
    format!("source:{}/{}", origin.stream, origin.id)
}

/// Longest source stream key accepted, in bytes.
pub(crate) const MAX_SOURCE_KEY_BYTES: usize = 512;

/// The `op` values an entry may carry; absent means `upsert`.
pub(crate) const ENTRY_OPS: &[&str] = &["upsert", "delete"];

/// Parses one source stream entry (`fields` as Redis holds them: bytes) into a record, with
/// the checks every record passes ([`Record::from_chunk`], [`parse_line`](super::parse_line)). The entry format:
/// `doc_id` (UTF-8), `chunk_index` (decimal integer in 0..=2147483647), `text` (UTF-8),
/// optional `metadata` (a JSON object, as text) and optional `op` (one of [`ENTRY_OPS`]);
/// other fields are ignored. `position` stands in for the line number.
///
/// Never [`Record::Rejected`]: a stream entry is acknowledged only once its outcome is
/// written, so an entry without a usable identity (or larger than `max_bytes`) is parked as
/// an invalid record under [`unidentified_doc_id`], its raw fields in the payload.
pub(crate) fn parse_entry(
    position: u64,
    origin: EntryOrigin<'_>,
    fields: &[(Vec<u8>, Vec<u8>)],
    max_bytes: usize,
) -> Record {
    let size: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
    let raw_hash = entry_hash(fields);
    let unidentified = |problem: String| Record::Invalid {
        line: position,
        doc_id: unidentified_doc_id(origin),
        chunk_index: 0,
        payload: entry_payload(None, position, origin, fields, max_bytes),
        problem,
        raw_hash: raw_hash.clone(),
    };
    if size > max_bytes {
        return unidentified(format!("entry of {size} bytes exceeds the entry size limit of {max_bytes}"));
    }
    let field = |name: &str| -> Result<Option<&[u8]>, String> {
        let mut found = fields.iter().filter(|(k, _)| k == name.as_bytes());
        let first = found.next();
        if found.next().is_some() {
            return Err(format!("duplicate field {name:?}"));
        }
        Ok(first.map(|(_, v)| v.as_slice()))
    };
    let deletes = matches!(field("op"), Ok(Some(b)) if b == b"delete");
    let identity = (|| {
        let doc_id = match field("doc_id")? {
            None => return Err("missing field doc_id".to_string()),
            Some(b) => match std::str::from_utf8(b) {
                Ok(s) => s,
                Err(e) => return Err(format!("doc_id is not valid UTF-8 (at byte {})", e.valid_up_to())),
            },
        };
        if let Some(problem) = doc_id_problem(doc_id) {
            return Err(problem);
        }
        let chunk_index = match field("chunk_index")? {
            // A delete without one deletes the whole document.
            None if deletes => None,
            None => return Err("missing field chunk_index".to_string()),
            Some(b) => {
                // ASCII digits only: a sign, spaces or other digits would be another spelling
                // of the same key. At most 19 digits, so the number fits before the range check.
                let s = String::from_utf8_lossy(b);
                let digits = !b.is_empty() && b.len() <= 19 && b.iter().all(u8::is_ascii_digit);
                let n = digits.then(|| s.parse::<i64>().ok()).flatten().ok_or_else(|| {
                    format!("chunk_index {:?} is not a decimal integer in 0..=2147483647", Escaped(&s))
                })?;
                Some(chunk_index_in_range(&n.into())?)
            }
        };
        Ok((doc_id.to_string(), chunk_index))
    })();
    let (doc_id, chunk_index) = match identity {
        Ok((doc_id, Some(chunk_index))) if !deletes => (doc_id, chunk_index),
        Ok((doc_id, chunk_index)) => {
            if matches!(field("text"), Ok(Some(_))) {
                return Record::Invalid {
                    line: position,
                    payload: entry_payload(
                        Some((&doc_id, chunk_index.unwrap_or(0))),
                        position,
                        origin,
                        fields,
                        max_bytes,
                    ),
                    doc_id,
                    chunk_index: chunk_index.unwrap_or(0),
                    problem: "a delete carries no text".into(),
                    raw_hash,
                };
            }
            return Record::delete(position, doc_id, chunk_index);
        }
        Err(problem) => return unidentified(problem),
    };
    let fields_read = (|| {
        let text = match field("text")? {
            None => return Err("missing field text".to_string()),
            Some(b) => std::str::from_utf8(b)
                .map_err(|e| format!("text is not valid UTF-8 (at byte {})", e.valid_up_to()))?
                .to_string(),
        };
        let metadata = match field("metadata")? {
            None => None,
            Some(b) => match serde_json::from_slice::<Value>(b) {
                Ok(Value::Null) => None,
                Ok(v) => Some(v),
                Err(e) => return Err(format!("metadata is not JSON: {}", Escaped(&e.to_string()))),
            },
        };
        if let Some(b) = field("op")? {
            let op = String::from_utf8_lossy(b);
            if !ENTRY_OPS.contains(&op.as_ref()) {
                return Err(format!("unknown op {:?} (known: {})", Escaped(&op), ENTRY_OPS.join(", ")));
            }
        }
        if let Some(problem) = fields_problem(&text, metadata.as_ref()) {
            return Err(problem);
        }
        Ok((text, metadata))
    })();
    match fields_read {
        Ok((text, metadata)) => Record::Chunk {
            line: position,
            chunk: Chunk { doc_id, chunk_index, text, metadata },
            metadata: None,
        },
        Err(problem) => Record::Invalid {
            line: position,
            payload: entry_payload(Some((&doc_id, chunk_index)), position, origin, fields, max_bytes),
            doc_id,
            chunk_index,
            problem,
            raw_hash,
        },
    }
}

/// The record of an entry that never got an outcome (`why`: past the delivery cap, then
/// alone): it kills its consumer, so it is parked as an invalid record (reason
/// `delivery_cap`, raw entry in the payload) under its identity if it has one, instead of
/// being tried again.
pub(crate) fn poison_entry(
    position: u64,
    origin: EntryOrigin<'_>,
    fields: &[(Vec<u8>, Vec<u8>)],
    max_bytes: usize,
    why: String,
) -> Record {
    match parse_entry(position, origin, fields, max_bytes) {
        Record::Chunk { line, chunk, .. } => Record::Invalid {
            line,
            payload: entry_payload(
                Some((&chunk.doc_id, chunk.chunk_index)),
                position,
                origin,
                fields,
                max_bytes,
            ),
            doc_id: chunk.doc_id,
            chunk_index: chunk.chunk_index,
            problem: why,
            raw_hash: entry_hash(fields),
        },
        Record::Invalid { line, doc_id, chunk_index, problem, payload, raw_hash } => Record::Invalid {
            line,
            doc_id,
            chunk_index,
            problem: format!("{why}; {problem}"),
            payload,
            raw_hash,
        },
        // A delete is applied however often it was delivered: parking it would keep what
        // the producer asked to remove.
        other @ (Record::Delete { .. } | Record::Rejected { .. }) => other,
    }
}

/// What a broken entry keeps: its identity (when it has one), where it came from and its raw
/// fields in order (lossily decoded, NULs replaced; each value cut at `max_bytes`), so a
/// human can repair and requeue it. A cut entry says so: `raw_entry_cut` holds the bytes its
/// fields had and the bytes kept.
fn entry_payload(
    identity: Option<(&str, i32)>,
    position: u64,
    origin: EntryOrigin<'_>,
    fields: &[(Vec<u8>, Vec<u8>)],
    max_bytes: usize,
) -> Value {
    let text = |b: &[u8]| -> Value {
        let cut = &b[..b.len().min(max_bytes)];
        String::from_utf8_lossy(cut).replace('\0', "\u{FFFD}").into()
    };
    let raw: Vec<Value> = fields.iter().map(|(k, v)| Value::Array(vec![text(k), text(v)])).collect();
    let bytes: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
    let kept: usize = fields.iter().map(|(k, v)| k.len().min(max_bytes) + v.len().min(max_bytes)).sum();
    let mut m = Map::new();
    let (doc_id, chunk_index) =
        identity.map_or_else(|| (unidentified_doc_id(origin), 0), |(d, i)| (d.to_string(), i));
    m.insert("doc_id".into(), doc_id.into());
    m.insert("chunk_index".into(), chunk_index.into());
    m.insert("line".into(), position.into());
    m.insert("source_stream".into(), origin.stream.into());
    m.insert("source_entry_id".into(), origin.id.into());
    m.insert("raw_entry".into(), Value::Array(raw));
    if kept < bytes {
        m.insert("raw_entry_cut".into(), serde_json::json!({"bytes": bytes, "kept": kept}));
    }
    Value::Object(m)
}

/// The hash a broken entry is parked under: of its fields (length-prefixed, in order), so the
/// same broken entry published twice is recognised as already parked.
fn entry_hash(fields: &[(Vec<u8>, Vec<u8>)]) -> String {
    let mut raw = Vec::new();
    for (k, v) in fields {
        for part in [k, v] {
            raw.extend_from_slice(&(part.len() as u64).to_le_bytes());
            raw.extend_from_slice(part);
        }
    }
    crate::model::raw_record_hash(&raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(kv: &[(&str, &[u8])]) -> Vec<(Vec<u8>, Vec<u8>)> {
        kv.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec())).collect()
    }

    fn parse(kv: &[(&str, &[u8])]) -> Record {
        parse_entry(5, EntryOrigin { stream: "src", id: "1-2" }, &fields(kv), 1 << 20)
    }

    #[test]
    fn a_good_entry_is_a_chunk_and_op_upsert_is_the_default() {
        let r =
            parse(&[("doc_id", b"d"), ("chunk_index", b"3"), ("text", b"hi"), ("metadata", br#"{"k":1}"#)]);
        let Record::Chunk { line, chunk, .. } = r.clone().with_metadata_tree() else { panic!("{r:?}") };
        assert_eq!((line, chunk.doc_id.as_str(), chunk.chunk_index), (5, "d", 3));
        assert_eq!(chunk.metadata, Some(serde_json::json!({"k": 1})));
        let r = parse(&[
            ("doc_id", b"d"),
            ("chunk_index", b"3"),
            ("text", b"hi"),
            ("op", b"upsert"),
            ("x", b"y"),
        ]);
        assert!(matches!(r, Record::Chunk { .. }), "{r:?}");
    }

    #[test]
    fn every_malformed_entry_is_parked_never_rejected() {
        let unidentified = |r: Record| match r {
            Record::Invalid { doc_id, chunk_index, payload, .. } => {
                assert_eq!((doc_id.as_str(), chunk_index), ("source:src/1-2", 0));
                assert_eq!(payload["source_entry_id"], "1-2");
                payload
            }
            other => panic!("{other:?}"),
        };
        let p = unidentified(parse(&[("chunk_index", b"1"), ("text", b"x")]));
        assert_eq!(p["raw_entry"], serde_json::json!([["chunk_index", "1"], ["text", "x"]]));
        unidentified(parse(&[("doc_id", b"d"), ("chunk_index", b"-1"), ("text", b"x")]));
        unidentified(parse(&[("doc_id", b"d"), ("chunk_index", b"1.5"), ("text", b"x")]));
        unidentified(parse(&[("doc_id", b"d\xff"), ("chunk_index", b"1"), ("text", b"x")]));
        unidentified(parse(&[("doc_id", b"a"), ("doc_id", b"b"), ("chunk_index", b"1"), ("text", b"x")]));
        let big = vec![b'x'; 2 << 20];
        unidentified(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", &big)]));
        let invalid = |r: Record| match r {
            Record::Invalid { doc_id, problem, .. } => {
                assert_eq!(doc_id, "d");
                problem
            }
            other => panic!("{other:?}"),
        };
        assert!(invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1")])).contains("text"));
        assert!(
            invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", b"caf\xe9")]))
                .contains("UTF-8")
        );
        assert!(
            invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", b"x"), ("metadata", b"[1]")]))
                .contains("not an object")
        );
        assert!(
            invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", b"x"), ("metadata", b"{")]))
                .contains("not JSON")
        );
        assert!(
            invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", b"x"), ("op", b"zap")]))
                .contains("unknown op")
        );
        assert!(
            invalid(parse(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", b"a\0b")])).contains("NUL")
        );
    }

    /// `chunk_index` is what the format says, a decimal integer: ASCII digits only. A sign,
    /// spaces or other digits made another spelling of the same key (`+3`, ` 3` were 3).
    #[test]
    fn chunk_index_is_ascii_digits_only() {
        for bad in
            [&b"+3"[..], b" 3", b"3 ", b"\t3", b"", b"3e0", b"0x3", "\u{0663}".as_bytes(), b"99999999999"]
        {
            let r = parse(&[("doc_id", b"d"), ("chunk_index", bad), ("text", b"x")]);
            let Record::Invalid { doc_id, problem, .. } = r else { panic!("{bad:?}: {r:?}") };
            assert_eq!(doc_id, "source:src/1-2", "{bad:?}");
            assert!(problem.contains("chunk_index"), "{bad:?}: {problem}");
        }
        for (good, n) in [(&b"0"[..], 0), (b"003", 3), (b"2147483647", i32::MAX)] {
            let r = parse(&[("doc_id", b"d"), ("chunk_index", good), ("text", b"x")]);
            let Record::Chunk { chunk, .. } = r else { panic!("{good:?}: {r:?}") };
            assert_eq!(chunk.chunk_index, n);
        }
    }

    /// A raw entry kept cut says so: the bytes it had and the bytes kept.
    #[test]
    fn a_cut_raw_entry_says_how_much_it_had() {
        let big = vec![b'x'; 3000];
        let kv = fields(&[("doc_id", b"d"), ("chunk_index", b"1"), ("text", &big)]);
        let Record::Invalid { payload, .. } =
            parse_entry(5, EntryOrigin { stream: "src", id: "1-2" }, &kv, 1000)
        else {
            panic!()
        };
        assert_eq!(payload["raw_entry"][2][1].as_str().map(str::len), Some(1000));
        assert_eq!(payload["raw_entry_cut"], serde_json::json!({"bytes": 3000 + 23, "kept": 1000 + 23}));
        let whole = parse(&[("doc_id", b"d"), ("chunk_index", b"1")]);
        let Record::Invalid { payload, .. } = whole else { panic!() };
        assert!(payload.get("raw_entry_cut").is_none(), "{payload}");
    }

    #[test]
    fn the_same_broken_entry_parks_under_the_same_hash_and_poison_keeps_its_identity() {
        let kv: &[(&str, &[u8])] = &[("doc_id", b"d"), ("chunk_index", b"1")];
        let (Record::Invalid { raw_hash: a, .. }, Record::Invalid { raw_hash: b, .. }) =
            (parse(kv), parse(kv))
        else {
            panic!()
        };
        assert_eq!(a, b);
        let origin = EntryOrigin { stream: "src", id: "9-0" };
        let good = fields(&[("doc_id", b"d"), ("chunk_index", b"2"), ("text", b"ok")]);
        let Record::Invalid { doc_id, chunk_index, problem, payload, .. } =
            poison_entry(1, origin, &good, 1 << 20, "delivered 11 times without an outcome".into())
        else {
            panic!()
        };
        assert_eq!((doc_id.as_str(), chunk_index), ("d", 2));
        assert!(problem.contains("delivered 11 times"), "{problem}");
        assert_eq!(payload["raw_entry"][2], serde_json::json!(["text", "ok"]));
    }
}
