//! The console's shared state and a request's page context: what every handler starts from
//! ([`Page`]), and what every page renders with ([`Ctx`]). The lowest file of the console:
//! it uses none of the pages, actions or handlers.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::auth::{self, Session, Sessions};
use super::{Console, MAX_RUNNING_ACTIONS};
use crate::streams::RedisConn;

/// Shared by every request.
#[derive(Clone)]
pub struct State {
    pub console: Arc<Console>,
    pub sessions: Arc<Sessions>,
    /// For reading metrics endpoints (short timeouts, no redirects).
    pub http: reqwest::Client,
    /// The console's stop: ends live tails and bulk actions (between pages).
    pub cancel: CancellationToken,
    /// Live tails and bulk actions: the console waits for them when it stops.
    pub tasks: TaskTracker,
    pub event_slots: Arc<Semaphore>,
    /// Detail pages and text downloads being served ([`super::ConsoleConfig::max_row_views`]).
    pub row_slots: Arc<Semaphore>,
    pub action_slots: Arc<Semaphore>,
    /// One reconcile run at a time per console.
    pub reconcile_lock: Arc<tokio::sync::Mutex<()>>,
    /// Every page but the login needs a session: the console listens beyond loopback and
    /// `--public-read` was not given (chunk text and metadata are customer data).
    pub reads_need_login: bool,
    /// The session cookie carries `Secure` ([`super::CookieSecure`] for this listener).
    pub secure_cookie: bool,
    redis: Arc<tokio::sync::Mutex<Option<RedisConn>>>,
}

impl State {
    /// The state of a console that stops on `cancel` and tracks its tasks in `tasks`.
    ///
    /// `exposed`: the listener is reachable from beyond loopback.
    pub fn new(console: Console, cancel: CancellationToken, tasks: TaskTracker, exposed: bool) -> State {
        let http = crate::http::client_builder()
            .timeout(Duration::from_secs(3))
            .connect_timeout(Duration::from_secs(2))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client without TLS settings builds");
        State {
            reads_need_login: exposed && !console.config.public_read,
            secure_cookie: match console.config.cookie_secure {
                super::CookieSecure::Auto => exposed,
                super::CookieSecure::Always => true,
                super::CookieSecure::Never => false,
            },
            event_slots: Arc::new(Semaphore::new(console.config.max_event_clients)),
            row_slots: Arc::new(Semaphore::new(console.config.max_row_views)),
            action_slots: Arc::new(Semaphore::new(MAX_RUNNING_ACTIONS)),
            console: Arc::new(console),
            sessions: Arc::default(),
            http,
            cancel,
            tasks,
            reconcile_lock: Arc::default(),
            redis: Arc::default(),
        }
    }

    /// A Redis connection for short commands, made on first use (so the console starts and
    /// shows the database's pages while Redis is down) and reused after.
    pub async fn redis(&self) -> Result<RedisConn, String> {
        let Some(client) = &self.console.redis else { return Err("Redis is not configured".into()) };
        let mut slot = self.redis.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let conn = tokio::time::timeout(Duration::from_secs(5), crate::streams::managed(client))
            .await
            .map_err(|_| "Redis did not answer within 5 s".to_string())?
            .map_err(|e| format!("cannot connect to Redis: {e}"))?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// The logged-in session of a request, if any (its id and contents).
    pub fn session(&self, headers: &HeaderMap) -> Option<(String, Session)> {
        let id = auth::session_cookie(headers)?;
        let s = self.sessions.get(&id)?;
        Some((id, s))
    }

    /// The page context of a request.
    pub fn ctx(&self, headers: &HeaderMap, here: String) -> Ctx {
        let read_only = self.console.config.read_only;
        Ctx {
            session: if read_only { None } else { self.session(headers).map(|(_, s)| (s.actor, s.csrf)) },
            read_only,
            token_set: self.console.config.token.is_some(),
            here,
            login_for_reads: self.reads_need_login,
        }
    }
}

/// What a page handler starts from: the shared state and the request's page context (the
/// session, the read-only flag, and the page's own path for a login to return to). Handlers
/// that check a form's CSRF token take the headers themselves.
pub struct Page {
    /// The console's shared state.
    pub state: State,
    /// The page context of this request.
    pub ctx: Ctx,
}

impl axum::extract::FromRequestParts<State> for Page {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &State,
    ) -> Result<Self, Self::Rejection> {
        Ok(Page { ctx: state.ctx(&parts.headers, here(&parts.uri)), state: state.clone() })
    }
}

/// What every page needs to know about the request.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The logged-in operator's name and CSRF token.
    pub session: Option<(String, String)>,
    /// `--read-only`.
    pub read_only: bool,
    /// A token is configured (so a login is possible).
    pub token_set: bool,
    /// The request's path and query (where a login returns to).
    pub here: String,
    /// Reading needs a login here (the console listens beyond loopback without
    /// `--public-read`): the login form is offered even when actions are disabled.
    pub login_for_reads: bool,
}

impl Ctx {
    /// Actions are possible at all (a token is set and the console is not read-only).
    pub fn actions_enabled(&self) -> bool {
        self.token_set && !self.read_only
    }

    /// The login form is offered: for actions, or for reading where reading needs it.
    pub fn login_offered(&self) -> bool {
        self.token_set && (!self.read_only || self.login_for_reads)
    }

    pub(super) fn csrf(&self) -> Option<&str> {
        self.session.as_ref().map(|(_, c)| c.as_str())
    }
}

/// The path and query of a request (where a login returns to).
pub fn here(uri: &axum::http::Uri) -> String {
    uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into())
}
