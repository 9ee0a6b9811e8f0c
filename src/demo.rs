//! The synthetic corpus the demo (and the tests and benches) use, and the demo's fault mix.
//! The demo command itself (its passes and its report) is in the binary's app layer.

use std::io::Write;

use crate::mock_provider::{self, MockConfig};

/// Shape of a synthetic corpus.
#[derive(Debug, Clone)]
pub struct CorpusSpec {
    /// Prefix of every doc_id, so runs do not collide.
    pub doc_prefix: String,
    pub chunks: usize,
    pub chunks_per_doc: usize,
    /// One chunk in this many carries a poison marker (0 = none); markers rotate through
    /// 400, NaN, wrong dimension, empty text and too long.
    pub poison_every: usize,
    /// Broken lines appended at the end (malformed JSON, invalid UTF-8, missing text).
    pub broken_lines: bool,
    /// Approximate words per chunk.
    pub words: usize,
}

impl Default for CorpusSpec {
    fn default() -> Self {
        CorpusSpec {
            doc_prefix: "doc".into(),
            chunks: 1000,
            chunks_per_doc: 8,
            poison_every: 0,
            broken_lines: false,
            words: 40,
        }
    }
}

/// What a written corpus contains, for checking outcomes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CorpusFacts {
    pub clean: usize,
    pub poison_400: usize,
    pub poison_nan: usize,
    pub poison_dim: usize,
    pub empty: usize,
    pub too_long: usize,
    /// Broken lines that keep an identity (parked as invalid_record).
    pub invalid_records: usize,
    /// Broken lines without an identity (rejected).
    pub rejected_lines: usize,
}

const WORDS: &[&str] = &[
    "vector",
    "index",
    "recall",
    "chunk",
    "embedding",
    "replay",
    "outbox",
    "stream",
    "backoff",
    "jitter",
    "postgres",
    "redis",
    "manifest",
    "payload",
    "latency",
    "quorum",
    "shard",
    "cosine",
    "token",
    "batch",
];

/// Writes `spec` as JSONL; `too_long_chars` sizes the over-long poison inputs.
pub fn write_corpus(
    out: &mut dyn Write,
    spec: &CorpusSpec,
    too_long_chars: usize,
) -> std::io::Result<CorpusFacts> {
    let mut facts = CorpusFacts::default();
    let per_doc = spec.chunks_per_doc.max(1);
    for n in 0..spec.chunks {
        let (doc, idx) = (n / per_doc, n % per_doc);
        let mut text = String::with_capacity(spec.words * 8);
        for w in 0..spec.words {
            if w > 0 {
                text.push(' ');
            }
            text.push_str(WORDS[(n * 7 + w * 13 + w * w) % WORDS.len()]);
        }
        text.push_str(&format!(" #{n}"));
        if spec.poison_every > 0 && n % spec.poison_every == spec.poison_every / 2 {
            match (n / spec.poison_every) % 5 {
                0 => {
                    text.push_str(mock_provider::POISON_400);
                    facts.poison_400 += 1;
                }
                1 => {
                    text.push_str(mock_provider::POISON_NAN);
                    facts.poison_nan += 1;
                }
                2 => {
                    text.push_str(mock_provider::POISON_DIM);
                    facts.poison_dim += 1;
                }
                3 => {
                    text = "   ".into();
                    facts.empty += 1;
                }
                _ => {
                    text = "x".repeat(too_long_chars + 1);
                    facts.too_long += 1;
                }
            }
        } else {
            facts.clean += 1;
        }
        let line = serde_json::json!({
            "doc_id": format!("{}-{doc}", spec.doc_prefix),
            "chunk_index": idx,
            "text": text,
            "metadata": {"source": "demo", "doc_no": doc},
        });
        writeln!(out, "{line}")?;
    }
    if spec.broken_lines {
        writeln!(out, "{{\"doc_id\": \"{}-broken\", \"chunk_index\": 0, \"text\": ", spec.doc_prefix)?;
        out.write_all(
            format!("{{\"doc_id\":\"{}-broken\",\"chunk_index\":1,\"text\":\"caf", spec.doc_prefix)
                .as_bytes(),
        )?;
        out.write_all(b"\xe9\"}\n")?;
        writeln!(out, "{{\"doc_id\":\"{}-broken\",\"chunk_index\":2}}", spec.doc_prefix)?;
        writeln!(out, "{{\"chunk_index\":3,\"text\":\"orphan without doc_id\"}}")?;
        facts.rejected_lines += 2;
        facts.invalid_records += 2;
    }
    Ok(facts)
}

/// The fault mix the demo runs against.
pub fn demo_faults() -> MockConfig {
    MockConfig {
        dimensions: 768,
        rate_429: 0.05,
        retry_after_ms: 100,
        rate_5xx: 0.08,
        rate_timeout: 0.005,
        timeout_hold_ms: 3_000,
        rate_reset: 0.02,
        ..MockConfig::default()
    }
}
