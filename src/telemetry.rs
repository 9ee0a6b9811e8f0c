//! Logging setup. Log lines carry ids, classes and reasons — never payload text or secrets.

use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

/// How log lines are written on stderr: text for people, JSON for log collectors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object per event.
    Json,
}

/// What is logged when `RUST_LOG` is unset: warnings from the libraries, our own progress.
const DEFAULT_FILTER: &str = "warn,embed_dlq=info";

/// Installs the stderr logger; `RUST_LOG` overrides the default (`warn,embed_dlq=info`) with
/// comma-separated `level` and `target=level` directives (`debug`,
/// `warn,embed_dlq::replay=trace`). A value that does not parse is ignored with a warning.
/// Targets rather than `EnvFilter`: its span and field filters need a regex engine in every
/// build, and nobody filters this tool's logs by span.
pub fn init_logging(format: LogFormat) {
    let default = || DEFAULT_FILTER.parse::<Targets>().expect("the default filter parses");
    let (filter, refused) = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => match v.parse::<Targets>() {
            Ok(t) => (t, None),
            Err(e) => (default(), Some(e.to_string())),
        },
        _ => (default(), None),
    };
    use std::io::IsTerminal;
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => tracing_subscriber::registry().with(layer.with_filter(filter)).try_init(),
        LogFormat::Json => tracing_subscriber::registry().with(layer.json().with_filter(filter)).try_init(),
    };
    if let (Ok(()), Some(e)) = (installed, refused) {
        tracing::warn!(error = %e, default = DEFAULT_FILTER, "RUST_LOG does not parse; logging with the default");
    }
}

/// Displays a user-controlled string (a doc id, a problem quoting the input) safely inside a
/// text log line: control characters (newlines, ANSI escape sequences, C1 controls) and
/// bidirectional overrides are written as `\u{..}` escapes and a backslash as `\\`, so a
/// corpus line can neither forge log lines nor recolour or rewrite the operator's terminal.
/// Strings longer than [`Escaped::MAX_CHARS`] are cut with a `…` so one line stays readable.
pub(crate) struct Escaped<'a>(pub &'a str);

impl Escaped<'_> {
    /// Characters shown before the cut (doc ids are at most 1024 bytes anyway).
    pub(crate) const MAX_CHARS: usize = 1024;
}

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        for (n, c) in self.0.chars().enumerate() {
            if n == Self::MAX_CHARS {
                return f.write_char('…');
            }
            let bidi =
                matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}');
            if c == '\\' {
                f.write_str("\\\\")?;
            } else if c.is_control() || bidi {
                write!(f, "\\u{{{:x}}}", c as u32)?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::Escaped;

    #[test]
    fn escaped_strings_cannot_break_or_colour_a_log_line() {
        let hostile = "doc\n2026-11-29T00:00:00Z ERROR forged\r\x1b[31mred\x1b[0m\t\u{202E}txt\u{85}\\end";
        let out = Escaped(hostile).to_string();
        assert!(!out.chars().any(|c| c.is_control()), "{out:?}");
        assert!(!out.contains('\u{202E}'));
        assert_eq!(
            out,
            "doc\\u{a}2026-11-29T00:00:00Z ERROR forged\\u{d}\\u{1b}[31mred\\u{1b}[0m\\u{9}\\u{202e}txt\\u{85}\\\\end"
        );
        // Ordinary ids, non-ASCII included, are shown as they are.
        assert_eq!(Escaped("café/ドキュメント-1").to_string(), "café/ドキュメント-1");
        // A literal "\u{a}" in the input cannot pass for an escaped newline.
        assert_eq!(Escaped("a\\u{a}").to_string(), "a\\\\u{a}");
        let long = "x".repeat(Escaped::MAX_CHARS + 10);
        assert_eq!(Escaped(&long).to_string().chars().count(), Escaped::MAX_CHARS + 1);
    }
}
