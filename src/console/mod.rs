//! The operator console: server-rendered HTML over the DLQ, the outbox, the streams and the
//! reconciler, for the on-call engineer who would rather click than write SQL at 3 a.m.
//!
//! Pages (every one rendered on the server with `maud`, which escapes every interpolated
//! value; the only script is a few lines of the crate's own for the live tail):
//!
//! | route | what |
//! | --- | --- |
//! | `GET /` | overview: depth by class and reason, ready / backing off / exhausted, park and replay rates (inline SVG), oldest row, outbox backlog, streams per shard, last reconcile, breaker state |
//! | `GET /dlq` | the list: filters, sortable columns, keyset pages, the count that matches |
//! | `GET /dlq/{id}` | one row: payload (its first 64 Ki characters), metadata, error timeline, next retry, its events, actions |
//! | `GET /dlq/{id}/text` | the row's whole text, streamed from Postgres piece by piece |
//! | `GET /actions/{requeue,purge}` | a bulk action's dry run (count and sample) and confirmation form |
//! | `POST /actions/{requeue,purge}` | the confirmed action, run in the background; redirects to its audit entry |
//! | `GET /audit`, `GET /audit/{id}` | the audit trail; an action's result page |
//! | `GET /events`, `GET /events/stream` | the live tail of the events stream (Server-Sent Events) |
//! | `GET /reconcile`, `POST /reconcile` | the last runs; run the checks, a repair dry run, a repair |
//! | `GET /login`, `POST /login`, `POST /logout` | the token login that gives a session cookie |
//!
//! # Security
//!
//! - It listens on `127.0.0.1:8088` by default, and answers only requests whose `Host` is an
//!   IP address, `localhost` or a name given with `--allow-host` (a DNS-rebinding page on
//!   another site cannot read it through the victim's browser).
//! - Beyond loopback every page needs a session (the login form answers 401 instead), since
//!   rows hold customer text; `public_read` (`--public-read`) lifts that. Listening beyond
//!   loopback without a token and without `public_read` is a usage error: nobody could read.
//!   On loopback the pages need no login (actions still do).
//! - Every mutating route needs a session from the login with `EMBED_DLQ_CONSOLE_TOKEN`
//!   (an `HttpOnly`, `SameSite=Strict` cookie) and the session's CSRF token in the form. No
//!   token configured: no action at all. `read_only`: no action forms, every action refused.
//! - A strict Content-Security-Policy (no inline script, no foreign origin), `nosniff`, no
//!   framing, no referrer, no caching.
//! - Nothing secret is rendered: the token, the database and Redis URLs and the provider
//!   key never reach a page; metrics URLs are shown without credentials or query.
//! - Every action (login, logout, requeue, purge, reconcile run) is written to
//!   `console_audit`: who, when, the filter, the count.
//!
//! # Bounds
//!
//! Every setting of [`ConsoleConfig`] has a documented range ([`ConsoleConfig::check`]);
//! every request value is bounded before use (filter strings, page sizes, cursors); sessions,
//! live-tail clients and background actions are capped; every page has a time limit. A
//! row's page reads a bounded excerpt of its payload, its whole text streams in pieces, and
//! both together are capped (`max_row_views`; beyond it 503 with `Retry-After`).

mod actions;
mod auth;
mod charts;
mod events;
mod filter;
mod overview;
mod pages;
mod reply;
mod routes;
mod state;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::embed::gate::ProviderGate;
use crate::store::Store;
use crate::streams::StreamKeys;

pub use auth::ConsoleToken;

/// Default listen address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8088";
/// Default rows a second a console requeue publishes (the same default as `dlq requeue`).
pub const DEFAULT_REQUEUE_RATE: u32 = 500;
/// Highest requeue rate accepted (the same bound as `dlq requeue --rate`).
pub const MAX_REQUEUE_RATE: u32 = 100_000;
/// Default live-tail clients served at once.
pub const DEFAULT_EVENT_CLIENTS: usize = 8;
/// Most live-tail clients accepted as a setting: each holds a Redis connection blocked in
/// `XREAD`.
pub const MAX_EVENT_CLIENTS: usize = 64;
/// Default newest events scanned for a row's detail page.
pub const DEFAULT_EVENTS_SCAN: usize = 2000;
/// Bounds of the events scanned for a row's detail page (each is one short read of a page of
/// 500 entries).
pub const EVENTS_SCAN_RANGE: std::ops::RangeInclusive<usize> = 100..=100_000;
/// Most metrics endpoints the overview reads the breaker state from.
pub const MAX_METRICS_URLS: usize = 8;
/// Most extra host names the console answers to.
pub const MAX_ALLOWED_HOSTS: usize = 16;
/// Bulk actions running at once; another one is refused until one ends.
pub const MAX_RUNNING_ACTIONS: usize = 4;
/// Default detail pages and text downloads served at once.
pub const DEFAULT_ROW_VIEWS: usize = 8;
/// Most detail pages and text downloads served at once, as a setting: each reads up to
/// 65,536 characters (`store::console::DETAIL_TEXT_CHARS`) of three payload parts (a page) or holds one
/// piece of a text (a download) and a database connection while it reads.
pub const MAX_ROW_VIEWS: usize = 64;
/// What a client told to come back (a view beyond the cap) is asked to wait, in seconds.
pub const BUSY_RETRY_AFTER_SECS: u64 = 2;
/// Default time limit of every page (a slow query shows an error instead of hanging the
/// browser).
pub const DEFAULT_PAGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounds of the page time limit, in seconds: a second to ten minutes.
pub const PAGE_TIMEOUT_SECS: std::ops::RangeInclusive<u64> = 1..=600;

/// Whether the session cookie carries `Secure` (sent back over HTTPS only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CookieSecure {
    /// `Secure` when the console listens beyond loopback, where it belongs behind TLS; not on
    /// loopback, where browsers are reached over plain HTTP.
    #[default]
    Auto,
    /// Always `Secure` (e.g. a loopback console behind a TLS reverse proxy).
    Always,
    /// Never `Secure`: beyond loopback over plain HTTP (the token and the session then travel
    /// in clear).
    Never,
}

/// How the console runs; every field has a documented bound ([`ConsoleConfig::check`]).
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Where to listen. Loopback by default; any other address should sit behind TLS.
    pub listen: SocketAddr,
    /// Hide and refuse every action.
    pub read_only: bool,
    /// The login token (`EMBED_DLQ_CONSOLE_TOKEN`); without one no action is possible.
    pub token: Option<ConsoleToken>,
    /// Rows a second a requeue publishes, 1..=[`MAX_REQUEUE_RATE`].
    pub requeue_rate: u32,
    /// Live-tail clients served at once, 1..=[`MAX_EVENT_CLIENTS`].
    pub max_event_clients: usize,
    /// Newest events scanned for a row's events on its detail page, within
    /// [`EVENTS_SCAN_RANGE`].
    pub events_scan: usize,
    /// Prometheus endpoints of `ingest`/`serve` processes whose breaker state the overview
    /// shows (at most [`MAX_METRICS_URLS`]; `http(s)://` only).
    pub metrics_urls: Vec<String>,
    /// Host names besides IP addresses and `localhost` that requests may name (at most
    /// [`MAX_ALLOWED_HOSTS`]), e.g. the name of a reverse proxy in front of it.
    pub allowed_hosts: Vec<String>,
    /// Serve the pages without a login even beyond loopback (`--public-read`). Without it a
    /// console that listens beyond loopback shows nothing but its login: every row's text
    /// and metadata is customer data. On loopback the pages need no login either way.
    pub public_read: bool,
    /// Row detail pages and text downloads served at once, 1..=[`MAX_ROW_VIEWS`]; one more
    /// is answered 503 with `Retry-After` rather than queued (one 8 MB row asked for 200 times
    /// at once must not hold 200 copies of it).
    pub max_row_views: usize,
    /// Whether the session cookie is `Secure` (`--cookie-secure`).
    pub cookie_secure: CookieSecure,
    /// Time limit of every page but the live tail and a reconcile run, within
    /// [`PAGE_TIMEOUT_SECS`]: past it the page is a 503.
    pub page_timeout: Duration,
    /// The stream source's streams and consumer group (`[source]`), shown on the overview
    /// with their length, pending count and lag.
    pub source: Option<(Vec<String>, String)>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            read_only: false,
            token: None,
            requeue_rate: DEFAULT_REQUEUE_RATE,
            max_event_clients: DEFAULT_EVENT_CLIENTS,
            events_scan: DEFAULT_EVENTS_SCAN,
            metrics_urls: Vec::new(),
            allowed_hosts: Vec::new(),
            public_read: false,
            max_row_views: DEFAULT_ROW_VIEWS,
            cookie_secure: CookieSecure::Auto,
            page_timeout: DEFAULT_PAGE_TIMEOUT,
            source: None,
        }
    }
}

/// A console setting outside its documented bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting} {problem}")]
pub struct InvalidConsoleSetting {
    /// The setting's flag name.
    pub setting: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl ConsoleConfig {
    /// Checks every bound; the first setting outside its range is the error.
    pub fn check(&self) -> Result<(), InvalidConsoleSetting> {
        let bad = |setting, problem: String| Err(InvalidConsoleSetting { setting, problem });
        if !(1..=MAX_REQUEUE_RATE).contains(&self.requeue_rate) {
            return bad(
                "--requeue-rate",
                format!("{} is out of range: allowed 1..={MAX_REQUEUE_RATE}", self.requeue_rate),
            );
        }
        if !(1..=MAX_EVENT_CLIENTS).contains(&self.max_event_clients) {
            return bad(
                "--max-event-clients",
                format!("{} is out of range: allowed 1..={MAX_EVENT_CLIENTS}", self.max_event_clients),
            );
        }
        let page_secs = self.page_timeout.as_secs_f64();
        if !(*PAGE_TIMEOUT_SECS.start() as f64..=*PAGE_TIMEOUT_SECS.end() as f64).contains(&page_secs) {
            return bad(
                "--page-timeout-secs",
                format!(
                    "{page_secs} s is out of range: allowed {}..={} s",
                    PAGE_TIMEOUT_SECS.start(),
                    PAGE_TIMEOUT_SECS.end()
                ),
            );
        }
        if !(1..=MAX_ROW_VIEWS).contains(&self.max_row_views) {
            return bad(
                "--max-row-views",
                format!("{} is out of range: allowed 1..={MAX_ROW_VIEWS}", self.max_row_views),
            );
        }
        if !EVENTS_SCAN_RANGE.contains(&self.events_scan) {
            return bad(
                "--events-scan",
                format!(
                    "{} is out of range: allowed {}..={}",
                    self.events_scan,
                    EVENTS_SCAN_RANGE.start(),
                    EVENTS_SCAN_RANGE.end()
                ),
            );
        }
        if self.metrics_urls.len() > MAX_METRICS_URLS {
            return bad(
                "--metrics-url",
                format!("is given {} times: at most {MAX_METRICS_URLS}", self.metrics_urls.len()),
            );
        }
        for u in &self.metrics_urls {
            match reqwest::Url::parse(u) {
                Ok(url)
                    if matches!(url.scheme(), "http" | "https")
                        && url.host().is_some()
                        && u.len() <= 2048 => {}
                _ => {
                    return bad(
                        "--metrics-url",
                        format!("{:?} is not an http(s) URL", overview::redact_url(u)),
                    );
                }
            }
        }
        if !self.listen.ip().is_loopback() && self.token.is_none() && !self.public_read {
            return bad(
                "--listen",
                format!(
                    "{} is beyond loopback, where reading needs a login: set EMBED_DLQ_CONSOLE_TOKEN, \
                     or pass --public-read (serve: --console-public-read) to show every row to \
                     anyone who reaches it",
                    self.listen
                ),
            );
        }
        if self.allowed_hosts.len() > MAX_ALLOWED_HOSTS {
            return bad(
                "--allow-host",
                format!("is given {} times: at most {MAX_ALLOWED_HOSTS}", self.allowed_hosts.len()),
            );
        }
        for h in &self.allowed_hosts {
            let ok = !h.is_empty()
                && h.len() <= 253
                && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
            if !ok {
                return bad("--allow-host", format!("{h:?} is not a host name"));
            }
        }
        Ok(())
    }
}

/// Why the console stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// The listen address could not be bound.
    #[error("console: cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("console: {0}")]
    Serve(#[source] std::io::Error),
}

/// What the console reads and acts on.
pub struct Console {
    /// The database (DLQ, outbox, manifest, audit).
    pub store: Store,
    /// Redis (a node or a cluster), for the streams' numbers, a row's events and the live
    /// tail (`None`: those sections say so). Never rendered.
    pub redis: Option<crate::streams::RedisClient>,
    /// The stream keys (prefix) of the deployment.
    pub keys: StreamKeys,
    /// The provider gate of this process, when the console runs inside `serve`: its breaker
    /// state is shown as this process's.
    pub gate: Option<Arc<ProviderGate>>,
    /// Settings.
    pub config: ConsoleConfig,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The Redis URL may hold a password: never printed.
        f.debug_struct("Console")
            .field("keys", &self.keys)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The console as `serve --console-addr` mounts it: its settings and the Redis URL of the
/// service (never printed).
#[derive(Clone)]
pub struct MountedConsole {
    /// Settings (`listen` is `--console-addr`).
    pub config: ConsoleConfig,
    /// The Redis the service uses.
    pub redis: crate::streams::RedisClient,
}

impl std::fmt::Debug for MountedConsole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountedConsole").field("config", &self.config).finish_non_exhaustive()
    }
}

/// Binds `console.config.listen` and serves until `cancel`; then stops taking requests,
/// ends the live tails and waits for running bulk actions to finish their current page
/// (they stop between pages).
pub async fn serve(console: Console, cancel: CancellationToken) -> Result<(), ConsoleError> {
    let addr = console.config.listen;
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|source| ConsoleError::Bind { addr, source })?;
    serve_on(listener, console, cancel).await
}

/// [`serve`] on a listener the caller bound (tests bind port 0 and read the address).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    console: Console,
    cancel: CancellationToken,
) -> Result<(), ConsoleError> {
    // The address actually bound decides (a caller may bind another than `listen`).
    let bound = listener.local_addr().map(|a| a.ip()).unwrap_or(console.config.listen.ip());
    let exposed = !bound.is_loopback();
    if exposed && console.config.public_read {
        tracing::warn!(listen = %console.config.listen,
            "the console listens beyond loopback with --public-read: anyone who reaches it reads every row");
    } else if exposed {
        tracing::info!(listen = %console.config.listen,
            "the console listens beyond loopback: every page needs a login (put it behind TLS)");
    }
    let tasks = TaskTracker::new();
    let state = state::State::new(console, cancel.clone(), tasks.clone(), exposed);
    let app = routes::router(state).into_make_service_with_connect_info::<SocketAddr>();
    let stop = cancel.clone();
    let served =
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
    tasks.close();
    tasks.wait().await;
    served.map_err(ConsoleError::Serve)
}
