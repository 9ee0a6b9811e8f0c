//! The responses every handler shares: an HTML page, a database failure as a page, a
//! refused action, and the checks an action passes before it runs ([`authorize`]).

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::Markup;

use super::auth::{self, Session};
use super::pages;
use super::state::{Ctx, State};
use crate::store::StoreError;

/// An HTML response.
pub fn html(status: StatusCode, m: Markup) -> Response {
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], m.into_string()).into_response()
}

/// A database failure as a page (the message names no secret: sqlx errors carry no URL).
pub fn db_error(ctx: &Ctx, e: StoreError) -> Response {
    tracing::warn!(error = %e, "console: a page's query failed");
    html(StatusCode::SERVICE_UNAVAILABLE, pages::message(ctx, "Database error", &e.to_string()))
}

/// Why a mutating request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `--read-only`, or no token configured.
    Disabled,
    /// No (live) session.
    NotLoggedIn,
    /// The form's CSRF token is missing or wrong, or the request came from another site.
    Csrf,
}

impl Refused {
    /// The refusal as a page (401 or 403); nothing was changed.
    pub fn page(self, ctx: &Ctx) -> Response {
        let (status, text) = match self {
            Refused::Disabled => {
                (StatusCode::FORBIDDEN, "Refused: actions are disabled on this console. Nothing was changed.")
            }
            Refused::NotLoggedIn => (
                StatusCode::UNAUTHORIZED,
                "Refused: log in with the console token first. Nothing was changed.",
            ),
            Refused::Csrf => (
                StatusCode::FORBIDDEN,
                "Refused: the form's security token is missing or stale; reload the page. Nothing was changed.",
            ),
        };
        html(status, pages::message(ctx, "Refused", text))
    }
}

/// Whether the browser says the request comes from another site (`Sec-Fetch-Site`).
pub(super) fn cross_site(headers: &HeaderMap) -> bool {
    headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) == Some("cross-site")
}

/// The session of a mutating request, after every check: actions enabled, a live session,
/// the session's CSRF token in the form, not a cross-site request.
pub fn authorize(state: &State, headers: &HeaderMap, csrf: &str) -> Result<(String, Session), Refused> {
    let refused = |r: Refused| {
        tracing::warn!(reason = ?r, "console: refused an action");
        Err(r)
    };
    if state.console.config.read_only || state.console.config.token.is_none() {
        return refused(Refused::Disabled);
    }
    let Some((id, session)) = state.session(headers) else { return refused(Refused::NotLoggedIn) };
    if cross_site(headers) || csrf.is_empty() || !auth::same(csrf, &session.csrf) {
        return refused(Refused::Csrf);
    }
    Ok((id, session))
}
