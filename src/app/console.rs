//! `console`: resolves the database, Redis and stream settings, reads the login token from
//! `EMBED_DLQ_CONSOLE_TOKEN` (never a flag: it would show in `ps`), checks every console
//! setting's bound and serves the console until a signal.

use embed_dlq::config::{FileConfig, IngestArgs, ServeArgs};
use embed_dlq::console::{Console, ConsoleConfig, ConsoleToken};
use tokio_util::sync::CancellationToken;

use super::args::ConsoleCommand;
use super::{Resolver, exit};

/// The environment variable holding the console's login token.
pub const TOKEN_ENV: &str = "EMBED_DLQ_CONSOLE_TOKEN";

/// The login token from the environment: `None` if unset or empty, an error if it is outside
/// its bounds.
pub fn token_from_env() -> Result<Option<ConsoleToken>, String> {
    match std::env::var(TOKEN_ENV) {
        Ok(t) if t.is_empty() => Ok(None),
        Ok(t) => ConsoleToken::new(t).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{TOKEN_ENV} is not valid UTF-8")),
    }
}

/// Runs `console`; returns the exit code.
pub async fn command(resolver: &Resolver, args: ConsoleCommand, cancel: CancellationToken) -> i32 {
    let ConsoleCommand {
        listen,
        read_only,
        public_read,
        cookie_secure,
        requeue_rate,
        max_event_clients,
        max_row_views,
        page_timeout_secs,
        events_scan,
        metrics_urls,
        allowed_hosts,
        table,
        stream_prefix,
    } = args;
    let flags = FileConfig {
        ingest: IngestArgs { table, ..Default::default() },
        serve: ServeArgs { stream_prefix, ..Default::default() },
        ..Default::default()
    };
    let (settings, url) = match resolver.with_database(flags) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let token = match token_from_env() {
        Ok(t) => t,
        Err(e) => return exit::fail(exit::USAGE, &e),
    };
    let config = ConsoleConfig {
        listen,
        read_only,
        token,
        requeue_rate,
        max_event_clients: max_event_clients as usize,
        events_scan: events_scan as usize,
        metrics_urls,
        allowed_hosts,
        public_read,
        max_row_views: max_row_views as usize,
        cookie_secure,
        page_timeout: std::time::Duration::from_secs(page_timeout_secs),
        // The config file's `[source]`, if any: its streams on the overview.
        source: settings.source.as_ref().map(|s| (s.streams.clone(), s.group.clone())),
    };
    if let Err(e) = config.check() {
        return exit::fail(exit::USAGE, &e.to_string());
    }
    if config.token.is_none() && !config.read_only {
        tracing::warn!("{TOKEN_ENV} is not set: the console shows everything but takes no action");
    }
    // Its reconcile action judges superseded vectors by the configured policy.
    let store = match super::open_store(&url, 8, &settings.table).await {
        Ok(s) => s.with_on_newer_parked(settings.options.on_newer_parked),
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    if let Err(code) = super::refuse_other_prefix(store.pool(), &settings.stream_prefix).await {
        return code;
    }
    let redis = match settings.redis_url.is_some().then(|| settings.redis_client()).transpose() {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let console = Console { store, redis, keys: settings.stream_keys(), gate: None, config };
    // Actions need the token: without one the console is read-only whatever the flag says.
    let actions = !console.config.read_only && console.config.token.is_some();
    tracing::info!(listen = %listen, actions, "console: serving");
    match embed_dlq::console::serve(console, cancel).await {
        Ok(()) => exit::OK,
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}
