//! Rendering of the outcomes shared by several commands: the ingest summary (ingest, demo)
//! and the reconcile report (reconcile, demo), as human lines or one JSON object.

use std::io::Write;

use embed_dlq::ingest::IngestSummary;
use embed_dlq::reconcile::{Mode, Report, Sweep};

/// `n` and the noun that goes with it: "1 row", "0 rows", "2 rows".
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A reconcile mode in words, as the flags name it.
pub fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Check => "check",
        Mode::DryRun => "dry run",
        Mode::Repair => "repair",
    }
}

/// Prints a summary: human lines, or one JSON object.
pub fn print_summary(s: &IngestSummary, json: bool) {
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string(s).expect("summary serializes"));
        return;
    }
    let _ = write_human_summary(&mut out, s);
}

/// The summary's deletions: the input's deletes and the cleanup (a dry run lists every chunk
/// up to its bound).
fn write_deletions(out: &mut dyn Write, s: &IngestSummary) -> std::io::Result<()> {
    let would = if s.dry_run { "would delete" } else { "deleted" };
    if s.delete_requests > 0 {
        writeln!(
            out,
            "deletes in input    {:>10}  ({would} {})",
            s.delete_requests,
            count(s.chunks_deleted, "chunk", "chunks")
        )?;
    }
    if let Some(c) = &s.cleanup {
        match &c.skipped {
            Some(why) if c.deleted == 0 => {
                writeln!(out, "cleanup ({:<11})  not done: {why}", c.mode.as_str())?;
            }
            _ => {
                writeln!(
                    out,
                    "cleanup ({:<11}){:>8}  ({would}; of {})",
                    c.mode.as_str(),
                    c.deleted,
                    count(c.documents, "document", "documents")
                )?;
                if let Some(why) = &c.skipped {
                    writeln!(out, "  not finished: {why}")?;
                }
            }
        }
        if let Some(note) = &c.note {
            writeln!(out, "  {note}")?;
        }
    }
    if !s.deleted_examples.is_empty() {
        let total = s.chunks_deleted + s.cleanup.as_ref().map_or(0, |c| c.deleted);
        let more = if (s.deleted_examples.len() as u64) < total { ", ..." } else { "" };
        if s.dry_run {
            for key in &s.deleted_examples {
                writeln!(out, "  would delete {key}")?;
            }
            if !more.is_empty() {
                writeln!(out, "  ... and {} more", total - s.deleted_examples.len() as u64)?;
            }
        } else {
            writeln!(out, "  deleted: {}{more}", s.deleted_examples.join(", "))?;
        }
    }
    Ok(())
}

/// The human form of a summary, written to any writer.
pub fn write_human_summary(out: &mut dyn Write, s: &IngestSummary) -> std::io::Result<()> {
    let rate = if s.elapsed_secs > 0.0 { s.records as f64 / s.elapsed_secs } else { 0.0 };
    writeln!(
        out,
        "records read        {:>10}  ({} lines, {:.1}s, {:.0} records/s)",
        s.records, s.lines_read, s.elapsed_secs, rate
    )?;
    writeln!(
        out,
        "stored              {:>10}  ({} written)",
        s.stored,
        count(s.vectors_written, "vector row", "vector rows")
    )?;
    writeln!(out, "skipped unchanged   {:>10}", s.unchanged)?;
    writeln!(out, "skipped, in DLQ     {:>10}", s.already_parked)?;
    writeln!(out, "parked              {:>10}", s.parked_total())?;
    for (class, n) in &s.parked {
        writeln!(out, "  {:<18}{:>10}", class.as_str(), n)?;
    }
    if s.superseded > 0 {
        writeln!(
            out,
            "superseded          {:>10}  (a later line or run of the same chunk won)",
            s.superseded
        )?;
    }
    if s.leased_elsewhere > 0 {
        writeln!(
            out,
            "leased elsewhere    {:>10}  (a concurrent run holds their lease; not finished by this run)",
            s.leased_elsewhere
        )?;
    }
    if s.differs_from_active > 0 {
        let more = if (s.differs_examples.len() as u64) < s.differs_from_active { ", ..." } else { "" };
        writeln!(
            out,
            "differs from active {:>10}  (left out: the active revision holds other text for them, or nothing; changed or deleted since the corpus was written){}",
            s.differs_from_active,
            if s.differs_examples.is_empty() {
                String::new()
            } else {
                format!(": {}{more}", s.differs_examples.join(", "))
            }
        )?;
    }
    if s.dlq_resolved > 0 {
        writeln!(out, "DLQ rows resolved   {:>10}", s.dlq_resolved)?;
    }
    if s.vectors_withdrawn > 0 {
        writeln!(
            out,
            "vectors withdrawn   {:>10}  (their chunk's new text is parked; on_newer_parked = withdraw)",
            s.vectors_withdrawn
        )?;
    }
    write_deletions(out, s)?;
    let retries: u64 = s.retries.values().sum();
    writeln!(out, "retries             {:>10}", retries)?;
    for (reason, n) in &s.retries {
        writeln!(out, "  {:<18}{:>10}", reason, n)?;
    }
    writeln!(
        out,
        "provider calls      {:>10}  ({}, {})",
        s.provider_calls,
        count(s.provider_inputs, "input", "inputs"),
        count(s.batch_splits, "batch split", "batch splits")
    )?;
    writeln!(out, "tokens (reported)   {:>10}", s.reported_tokens)?;
    let tokens = s.tokens_stored + s.tokens_wasted;
    let share = if tokens > 0 { 100.0 * s.tokens_wasted as f64 / tokens as f64 } else { 0.0 };
    writeln!(
        out,
        "tokens stored       {:>10}  ({} wasted, {share:.1}% of {tokens} sent; ~{} chars/token unless usage is plausible)",
        s.tokens_stored,
        s.tokens_wasted,
        embed_dlq::embed::limit::CHARS_PER_TOKEN
    )?;
    if let (Some(cost), Some(waste)) = (s.estimated_cost, s.wasted_cost) {
        writeln!(out, "estimated cost      {cost:>10.4}  ({waste:.4} of it on waste)")?;
    }
    if s.breaker_opened > 0 {
        writeln!(out, "breaker opened      {:>10}", s.breaker_opened)?;
    }
    if s.rejected_lines > 0 {
        writeln!(
            out,
            "rejected lines      {:>10}  (no usable doc_id/chunk_index; not stored anywhere)",
            s.rejected_lines
        )?;
        for r in &s.rejected_examples {
            writeln!(out, "  line {}: {}", r.line, r.problem)?;
        }
    }
    if s.unfinished() > 0 {
        let examples = if s.unfinished_examples.is_empty() {
            String::new()
        } else {
            let more = if (s.unfinished_examples.len() as u64) < s.unfinished() { ", ..." } else { "" };
            format!(": {}{more}", s.unfinished_examples.join(", "))
        };
        writeln!(
            out,
            "not finished        {:>10}  ({} not attempted, {} leased to another run; no manifest row: rerun the same corpus to finish them){examples}",
            s.unfinished(),
            s.not_attempted,
            s.leased_elsewhere
        )?;
    }
    if let Some(why) = &s.stopped {
        writeln!(out, "stopped early: {why}")?;
    }
    Ok(())
}

/// Prints a reconcile report on stdout: the table, or one JSON object.
pub fn print_report(report: &Report, json: bool) {
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string(report).expect("report serializes"));
    } else {
        let _ = write_report(&mut out, report);
    }
}

/// The report as a table, written to any writer.
pub fn write_report(out: &mut dyn std::io::Write, r: &Report) -> std::io::Result<()> {
    writeln!(out, "{:<24}{:>10}{:>10}  notes", "check", "found", "repaired")?;
    for f in &r.findings {
        let repaired = match (r.mode, f.check.repair_action()) {
            (_, None) => "-".to_string(),
            (Mode::Repair, Some(_)) => f.repaired.to_string(),
            (Mode::DryRun, Some(a)) if f.found > 0 => format!("would: {a}"),
            _ => "-".to_string(),
        };
        let mut notes = f.note.clone().unwrap_or_default();
        if !f.examples.is_empty() {
            if !notes.is_empty() {
                notes.push_str("; ");
            }
            notes.push_str(&format!("e.g. {}", f.examples.join(", ")));
        }
        writeln!(out, "{:<24}{:>10}{:>10}  {notes}", f.check.name(), f.found, repaired)?;
    }
    writeln!(
        out,
        "total findings: {} ({:.2}s, mode {})",
        r.total_found(),
        r.duration_secs,
        mode_name(r.mode)
    )?;
    let scope = match (r.sweep, r.since) {
        (Sweep::Incremental, Some(t)) => format!("incremental: chunks changed since {}", t.to_rfc3339()),
        (Sweep::Incremental, None) => "incremental: every chunk (no earlier run to resume from)".into(),
        (Sweep::Full, _) => "full: every chunk; vectors' contents of changed chunks only".into(),
        (Sweep::Deep, _) => "deep: every chunk and every vector".into(),
    };
    writeln!(out, "sweep {scope}")?;
    if let Some(note) = &r.window_note {
        writeln!(out, "note: {note}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_in_english() {
        let one =
            IngestSummary { provider_calls: 1, provider_inputs: 1, batch_splits: 1, ..Default::default() };
        let mut out = Vec::new();
        write_human_summary(&mut out, &one).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("(1 input, 1 batch split)"), "{text}");
        assert!(text.contains("(0 vector rows written)"), "{text}");
    }
}
