//! The reference pages under `docs/reference/`, rendered from the code so they cannot drift
//! from it: [`configuration`] from the command-line definition of every config-file section
//! (flag, environment variable, help text) with the bound the resolver checks
//! ([`crate::config::help_bounds`]) and the resolved defaults
//! ([`crate::config::help_defaults`]); [`metrics()`] from the metrics' own descriptions
//! (`describe()`) and the label values they are registered with, captured by a local
//! recorder. `embed-dlq reference configuration|metrics` prints them; a test fails when a
//! checked-in page differs from what the code renders.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use clap::Args;

use crate::config::{
    IngestArgs, ProviderArgs, RetryArgs, ServeArgs, ServiceArgs, SourceArgs, help_bounds, help_defaults,
};

/// The command that regenerates `docs/reference/<page>.md`.
pub fn regenerate_command(page: &str) -> String {
    format!("cargo run --quiet -- reference {page} > docs/reference/{page}.md")
}

/// A markdown table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// `docs/reference/configuration.md`: every key of every config-file section.
pub fn configuration() -> String {
    let defaults: HashMap<&str, String> = help_defaults().into_iter().collect();
    let bounds: HashMap<&str, String> = help_bounds().into_iter().collect();
    let sections = [
        ("services", "where Postgres and Redis are", ServiceArgs::augment_args(clap::Command::new("s"))),
        ("provider", "the embeddings endpoint, model, key and request shape", {
            ProviderArgs::augment_args(clap::Command::new("p"))
        }),
        ("ingest", "target table, batching, concurrency and memory bounds", {
            IngestArgs::augment_args(clap::Command::new("i"))
        }),
        ("retry", "in-process retries, the DLQ replay schedule and the circuit breaker", {
            RetryArgs::augment_args(clap::Command::new("r"))
        }),
        ("serve", "replay, relay, streams, metrics and the periodic reconcile", {
            ServeArgs::augment_args(clap::Command::new("v"))
        }),
        ("source", "a Redis Stream as the input of `serve` and `ingest --from-stream` (docs/sources.md)", {
            SourceArgs::augment_args(clap::Command::new("o"))
        }),
    ];
    let mut out = String::new();
    let _ = writeln!(out, "# Configuration reference");
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "<!-- Generated from the code (src/config/); do not edit. Regenerate: {} -->",
        regenerate_command("configuration")
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Every setting resolves the same way in every command: flag > environment variable > config \
         file (`--config FILE` or `EMBED_DLQ_CONFIG`) > default. The file has one TOML section per \
         table below and the keys of the first column; unknown keys are errors. A value outside its \
         bound is a usage error (exit 2) naming the setting and where it came \
         from. How the settings fit together: [the operations guide](../operations.md#configuration)."
    );
    for (name, what, cmd) in sections {
        let _ = writeln!(out);
        let _ = writeln!(out, "## `[{name}]`: {what}");
        let _ = writeln!(out);
        let _ = writeln!(out, "| key | flag | environment | default | bound | meaning |");
        let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- |");
        for arg in cmd.get_arguments() {
            let key = arg.get_id().as_str();
            let flag = arg.get_long().map_or(String::new(), |l| format!("`--{l}`"));
            let env = arg.get_env().map_or(String::new(), |e| format!("`{}`", e.to_string_lossy()));
            let default =
                defaults.get(key).filter(|d| *d != "none").map_or("none".to_string(), |d| format!("`{d}`"));
            let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
            let bound = bounds.get(key).map_or(String::new(), |b| format!("`{b}`"));
            let _ = writeln!(
                out,
                "| `{key}` | {flag} | {env} | {} | {} | {} |",
                cell(&default),
                cell(&bound),
                cell(&help)
            );
        }
    }
    out
}

/// What the capturing recorder saw of one metric.
#[derive(Debug, Default)]
struct Seen {
    kind: &'static str,
    unit: Option<metrics::Unit>,
    description: String,
    /// Label name -> the values it was registered with.
    labels: BTreeMap<String, Vec<String>>,
}

/// A recorder that keeps the descriptions and the registered label values.
#[derive(Default, Clone)]
struct Capture {
    /// In the order described.
    order: Arc<Mutex<Vec<String>>>,
    seen: Arc<Mutex<HashMap<String, Seen>>>,
}

impl Capture {
    fn describe(&self, kind: &'static str, key: metrics::KeyName, unit: Option<metrics::Unit>, text: &str) {
        let name = key.as_str().to_string();
        self.order.lock().unwrap().push(name.clone());
        let mut seen = self.seen.lock().unwrap();
        let s = seen.entry(name).or_default();
        (s.kind, s.unit, s.description) = (kind, unit, text.to_string());
    }

    fn register(&self, key: &metrics::Key) {
        let mut seen = self.seen.lock().unwrap();
        let s = seen.entry(key.name().to_string()).or_default();
        for l in key.labels() {
            let values = s.labels.entry(l.key().to_string()).or_default();
            if !values.iter().any(|v| v == l.value()) {
                values.push(l.value().to_string());
            }
        }
    }
}

impl metrics::Recorder for Capture {
    fn describe_counter(&self, key: metrics::KeyName, unit: Option<metrics::Unit>, d: metrics::SharedString) {
        self.describe("counter", key, unit, &d);
    }
    fn describe_gauge(&self, key: metrics::KeyName, unit: Option<metrics::Unit>, d: metrics::SharedString) {
        self.describe("gauge", key, unit, &d);
    }
    fn describe_histogram(
        &self,
        key: metrics::KeyName,
        unit: Option<metrics::Unit>,
        d: metrics::SharedString,
    ) {
        self.describe("histogram", key, unit, &d);
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        self.register(key);
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        self.register(key);
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        self.register(key);
        metrics::Histogram::noop()
    }
}

/// `docs/reference/metrics.md`: every metric with its type, unit, labels and description.
pub fn metrics() -> String {
    let capture = Capture::default();
    metrics::with_local_recorder(&capture, || {
        crate::metrics::describe();
        crate::metrics::initialise();
    });
    let sampled: HashMap<&str, &str> = crate::metrics::SAMPLED_LABELS.iter().copied().collect();
    let mut out = String::new();
    let _ = writeln!(out, "# Metrics reference");
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "<!-- Generated from the code (src/metrics.rs); do not edit. Regenerate: {} -->",
        regenerate_command("metrics")
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "`serve`, `ingest` and `reconcile` serve these on `/metrics` with `--metrics-addr`. Label \
         values come from small fixed sets only. How the gauges are sampled and what alerts on \
         them: [the operations guide](../operations.md#metrics)."
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "| metric | type | unit | labels | meaning |");
    let _ = writeln!(out, "| --- | --- | --- | --- | --- |");
    let seen = capture.seen.lock().unwrap();
    for name in capture.order.lock().unwrap().iter() {
        let s = &seen[name];
        let unit = s.unit.map_or(String::new(), |u| u.as_str().to_string());
        let labels = match sampled.get(name.as_str()) {
            Some(l) => l.to_string(),
            None => s
                .labels
                .iter()
                .map(|(k, v)| match k.as_str() {
                    "revision" => crate::metrics::REVISION_LABEL.to_string(),
                    _ => format!("`{k}` = {}", v.join(", ")),
                })
                .collect::<Vec<_>>()
                .join("; "),
        };
        let _ = writeln!(
            out,
            "| `{name}` | {} | {unit} | {} | {} |",
            s.kind,
            cell(&labels),
            cell(&s.description)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in page equals what the code renders, or the failure says how to fix it.
    fn assert_current(page: &str, rendered: &str) {
        let path = format!("{}/docs/reference/{page}.md", env!("CARGO_MANIFEST_DIR"));
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == rendered,
            "docs/reference/{page}.md differs from the code; regenerate it: {}",
            regenerate_command(page)
        );
    }

    #[test]
    fn the_configuration_reference_is_current() {
        let page = configuration();
        for key in ["database_url", "base_url", "concurrency", "dlq_cap_secs", "events_maxlen"] {
            assert!(page.contains(&format!("| `{key}` |")), "{key} missing");
        }
        assert!(page.contains("| `concurrency` | `--concurrency` |  | `4` |"), "{page}");
        assert_current("configuration", &page);
    }

    #[test]
    fn the_metrics_reference_is_current() {
        let page = metrics();
        for name in ["embed_dlq_chunks_parked_total", "embed_dlq_dlq_depth", "embed_dlq_stream_lag"] {
            assert!(page.contains(&format!("| `{name}` |")), "{name} missing");
        }
        assert!(page.contains("`outcome` = ok, retry, reject, systemic"), "{page}");
        assert_current("metrics", &page);
    }
}
