//! Logging setup. Log lines carry ids, classes and reasons — never payload text or secrets.

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Installs the stderr logger; `RUST_LOG` overrides the default `embed_dlq=info`.
pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn,embed_dlq=info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
