//! The router, the request guards (host check, login for reads; the security headers and the
//! time limit are tower-http layers) and the read-only pages' handlers. The shared state is in
//! `state`, the shared responses in `reply`, the actions' handlers in `actions`, the live
//! tail's in `events`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Form, Path, Query, Request, State as AxumState};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::timeout::TimeoutLayer;

use super::auth;
use super::filter::RawQuery;
use super::pages;
use super::reply::{authorize, cross_site, db_error, html};
use super::state::{Ctx, Page, State, here};
use super::{actions, events, overview};
use crate::store::StoreError;
use crate::store::console as sql;

/// Every route of the console. Every page but the live tail and a reconcile run gets the
/// configured time limit (a 503 when the database is too slow to answer); every response, refusals
/// included, carries the security headers.
pub fn router(state: State) -> Router {
    let page_timeout = state.console.config.page_timeout;
    let pages = Router::new()
        .route("/", get(overview_page))
        .route("/dlq", get(list_page))
        .route("/dlq/{id}", get(detail_page))
        .route("/dlq/{id}/text", get(text_download))
        .route("/actions/{kind}", get(actions::preview).post(actions::confirm))
        .route("/audit", get(audit_list))
        .route("/audit/{id}", get(audit_entry))
        .route("/events", get(events_page))
        .route("/reconcile", get(actions::reconcile_page))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/static/console.css", get(css))
        .route("/static/console.js", get(js))
        .fallback(not_found)
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, page_timeout));
    let unlimited = Router::new()
        .route("/events/stream", get(events::stream))
        .route("/reconcile", post(actions::reconcile_run));
    pages
        .merge(unlimited)
        .layer(middleware::from_fn_with_state(state.clone(), read_gate))
        .layer(middleware::from_fn_with_state(state.clone(), host_check))
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .layer(SetResponseHeaderLayer::overriding(header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .layer(SetResponseHeaderLayer::overriding(header::X_CONTENT_TYPE_OPTIONS, NOSNIFF))
        .layer(SetResponseHeaderLayer::overriding(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")))
        .layer(SetResponseHeaderLayer::overriding(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ))
        .layer(SetResponseHeaderLayer::if_not_present(
            header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        ))
        .with_state(state)
}

/// Scripts, styles, images and connections from the console itself only; no framing, no
/// form posts elsewhere.
const CONTENT_SECURITY_POLICY: HeaderValue = HeaderValue::from_static(
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
);

/// `X-Content-Type-Options`: a download is never sniffed into a page.
const NOSNIFF: HeaderValue = HeaderValue::from_static("nosniff");

/// Whether a `Host` header names this console: an IP address, `localhost`, or a name given
/// with `--allow-host` (with any port). A page on another site that rebinds its name to
/// 127.0.0.1 sends its own name and is turned away.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, _)) => return ip.parse::<std::net::Ipv6Addr>().is_ok(),
            None => return false,
        }
    } else {
        host.rsplit_once(':')
            .map(|(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { host })
            .unwrap_or(host)
    };
    name.parse::<std::net::IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

/// Refuses a request for a host name that is not this console's (DNS rebinding).
async fn host_check(AxumState(state): AxumState<State>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
    if !host_allowed(host, &state.console.config.allowed_hosts) {
        tracing::warn!("console: refused a request for another host name (DNS rebinding?); see --allow-host");
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "unknown host name: start the console with --allow-host NAME",
        )
            .into_response();
    }
    next.run(req).await
}

/// Where a request needs no session even when reads do: the login itself and its style.
fn open_without_login(path: &str) -> bool {
    matches!(path, "/login" | "/static/console.css" | "/static/console.js")
}

/// When reads need a login ([`State::reads_need_login`]), a request without a live session
/// gets the login form (401), whatever it asked for; it never reaches a handler, so nothing
/// is read from Postgres or Redis for it.
async fn read_gate(AxumState(state): AxumState<State>, req: Request, next: Next) -> Response {
    if !state.reads_need_login
        || open_without_login(req.uri().path())
        || state.session(req.headers()).is_some()
    {
        return next.run(req).await;
    }
    let ctx = state.ctx(req.headers(), here(req.uri()));
    let back = local_next(Some(&ctx.here));
    html(
        StatusCode::UNAUTHORIZED,
        pages::login(&ctx, &back, Some("Log in to read: this console listens beyond loopback.")),
    )
}

async fn overview_page(Page { state, ctx }: Page) -> Response {
    match overview::gather(&state).await {
        Ok(o) => html(StatusCode::OK, pages::overview(&ctx, &o)),
        Err(e) => db_error(&ctx, e),
    }
}

async fn list_page(Page { state, ctx }: Page, Query(raw): Query<RawQuery>) -> Response {
    let q = match raw.list() {
        Ok(q) => q,
        Err(e) => return html(StatusCode::BAD_REQUEST, pages::message(&ctx, "Bad filter", &e)),
    };
    let pool = state.console.store.pool();
    let rows = q.filter.rows(None);
    let page = match sql::page(pool, &rows, q.sort, q.desc, q.after.as_ref(), q.limit).await {
        Ok(p) => p,
        Err(StoreError::Db(e)) if q.after.is_some() && e.as_database_error().is_some() => {
            return html(
                StatusCode::BAD_REQUEST,
                pages::message(&ctx, "Bad page cursor", "start again from the first page"),
            );
        }
        Err(e) => return db_error(&ctx, e),
    };
    let lists = async {
        let count = crate::store::dlq::count(pool, &rows).await?;
        Ok::<_, StoreError>((count, sql::tables(pool).await?, sql::reasons(pool).await?))
    };
    match lists.await {
        Ok((count, tables, reasons)) => {
            html(StatusCode::OK, pages::list(&ctx, &q, count, &page, &tables, &reasons))
        }
        Err(e) => db_error(&ctx, e),
    }
}

/// A row view beyond [`super::ConsoleConfig::max_row_views`]: 503, come back shortly.
fn busy(ctx: &Ctx) -> Response {
    let mut resp = html(
        StatusCode::SERVICE_UNAVAILABLE,
        pages::message(ctx, "Busy", "Too many row pages and downloads at once: try again in a moment."),
    );
    resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(super::BUSY_RETRY_AFTER_SECS));
    resp
}

async fn detail_page(Page { state, ctx }: Page, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return html(StatusCode::NOT_FOUND, pages::message(&ctx, "Not found", "no such DLQ row"));
    };
    let Ok(_slot) = state.row_slots.clone().try_acquire_owned() else { return busy(&ctx) };
    let d = match sql::row_view(state.console.store.pool(), id).await {
        Ok(Some(d)) => d,
        Ok(None) => {
            return html(
                StatusCode::NOT_FOUND,
                pages::message(
                    &ctx,
                    "Not found",
                    &format!("no DLQ row {id} (replayed, purged or never parked)"),
                ),
            );
        }
        Err(e) => return db_error(&ctx, e),
    };
    let events = match state.redis().await {
        Ok(mut redis) => {
            let r = &d.detail.row;
            events::of_row(
                &mut redis,
                &state.console.keys,
                (r.id, &r.target_table, &r.doc_id, r.chunk_index),
                state.console.config.events_scan,
            )
            .await
            .map_err(|e| format!("Redis: {e}"))
        }
        Err(e) => Err(e),
    };
    html(StatusCode::OK, pages::detail(&ctx, &d, &events))
}

/// `/dlq/{id}/text`: the row's whole text as a `text/plain` attachment, read from Postgres
/// [`sql::TEXT_PIECE_CHARS`] characters at a time as the client takes them (one piece in
/// memory, whatever the text's size). It holds a row-view slot until its body ends. A row
/// that changes (requeued, parked again) or goes away meanwhile ends the body short of its
/// `Content-Length`, so the client sees a broken download rather than a mix of two texts.
async fn text_download(Page { state, ctx }: Page, Path(id): Path<String>) -> Response {
    let not_found = |ctx: &Ctx| {
        html(StatusCode::NOT_FOUND, pages::message(ctx, "Not found", "no DLQ row with a text by this id"))
    };
    let Ok(id) = id.parse::<i64>() else { return not_found(&ctx) };
    let Ok(slot) = state.row_slots.clone().try_acquire_owned() else { return busy(&ctx) };
    let pool = state.console.store.pool().clone();
    let size = match sql::text_size(&pool, id).await {
        Ok(Some(s)) => s,
        Ok(None) => return not_found(&ctx),
        Err(e) => return db_error(&ctx, e),
    };
    let cancel = state.cancel.clone();
    let broken = |why: String| std::io::Error::other(why);
    let pieces = futures::stream::unfold(Some((0i64, slot)), move |next| {
        let (pool, cancel) = (pool.clone(), cancel.clone());
        async move {
            let (from, slot) = next?;
            if cancel.is_cancelled() {
                return Some((Err(broken("the console is stopping".into())), None));
            }
            match sql::text_piece(&pool, id, size.generation, from).await {
                Ok(Some(piece)) if piece.is_empty() => None,
                Ok(Some(piece)) => {
                    let n = piece.chars().count() as i64;
                    let more = (n == i64::from(sql::TEXT_PIECE_CHARS)).then_some((from + n, slot));
                    Some((Ok(bytes::Bytes::from(piece)), more))
                }
                Ok(None) => Some((Err(broken(format!("DLQ row {id} changed during the download"))), None)),
                Err(e) => Some((Err(broken(e.to_string())), None)),
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8")),
            (header::CONTENT_LENGTH, HeaderValue::from(size.bytes)),
            (
                header::CONTENT_DISPOSITION,
                HeaderValue::from_str(&format!("attachment; filename=\"dlq-{id}.txt\""))
                    .expect("digits and ASCII"),
            ),
        ],
        axum::body::Body::from_stream(pieces),
    )
        .into_response()
}

async fn events_page(Page { state, ctx }: Page) -> Response {
    let recent = match state.redis().await {
        Ok(mut redis) => {
            events::recent(&mut redis, &state.console.keys, 50).await.map_err(|e| format!("Redis: {e}"))
        }
        Err(e) => Err(e),
    };
    html(StatusCode::OK, pages::events(&ctx, &recent))
}

async fn audit_list(Page { state, ctx }: Page) -> Response {
    match sql::audit_recent(state.console.store.pool(), 200).await {
        Ok(entries) => html(StatusCode::OK, pages::audit_list(&ctx, &entries)),
        Err(e) => db_error(&ctx, e),
    }
}

async fn audit_entry(Page { state, ctx }: Page, Path(id): Path<String>) -> Response {
    let entry = match id.parse::<i64>() {
        Ok(id) => sql::audit_get(state.console.store.pool(), id).await,
        Err(_) => Ok(None),
    };
    match entry {
        Ok(Some(e)) => html(StatusCode::OK, pages::audit_entry(&ctx, &e)),
        Ok(None) => html(StatusCode::NOT_FOUND, pages::message(&ctx, "Not found", "no such audit entry")),
        Err(e) => db_error(&ctx, e),
    }
}

/// Longest `next` a login returns to.
const MAX_NEXT: usize = 2048;

/// `next` of the login, where the browser goes once logged in: a path of this console or `/`.
///
/// Only a path made of visible ASCII that starts with exactly one `/` and holds no backslash
/// passes. Browsers strip tabs and line breaks from a `Location` (`/<TAB>/evil.example`
/// becomes `//evil.example`, another site) and read `\` as `/`; a line break or a NUL
/// cannot go in a header at all. A real path of the console never needs any of them: links
/// carry it percent-encoded. Anything else is `/`, decided before the login writes anything.
fn local_next(next: Option<&str>) -> String {
    match next {
        Some(n) if is_local_path(n) => n.to_string(),
        _ => "/".into(),
    }
}

fn is_local_path(n: &str) -> bool {
    n.len() <= MAX_NEXT
        && n.starts_with('/')
        && !n.starts_with("//")
        && n.bytes().all(|b| b.is_ascii_graphic() && b != b'\\')
}

#[derive(Debug, Deserialize)]
struct NextQuery {
    next: Option<String>,
}

async fn login_page(Page { ctx, .. }: Page, Query(q): Query<NextQuery>) -> Response {
    html(StatusCode::OK, pages::login(&ctx, &local_next(q.next.as_deref()), None))
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
    #[serde(default)]
    name: String,
    next: Option<String>,
}

async fn login(
    AxumState(state): AxumState<State>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let ctx = state.ctx(&headers, "/login".into());
    let next = local_next(form.next.as_deref());
    // A read-only console still logs in when reads need a session (for reading only:
    // `authorize` refuses every action there).
    let token = match (&state.console.config.token, state.console.config.read_only) {
        (Some(t), read_only) if !read_only || state.reads_need_login => t,
        _ => {
            return html(
                StatusCode::FORBIDDEN,
                pages::login(&ctx, &next, Some("Actions are disabled on this console.")),
            );
        }
    };
    if cross_site(&headers) || !token.matches(&form.token) {
        tracing::warn!(peer = %peer, "console: a login with a wrong token was refused");
        // Slows guessing down (the token has at least 16 bytes anyway).
        tokio::time::sleep(Duration::from_millis(500)).await;
        return html(StatusCode::UNAUTHORIZED, pages::login(&ctx, &next, Some("Wrong token.")));
    }
    let id = state.sessions.create(&form.name);
    let actor = state.sessions.get(&id).map(|s| s.actor).unwrap_or_default();
    let audit = sql::audit_start(
        state.console.store.pool(),
        &actor,
        Some(&peer.to_string()),
        "login",
        &serde_json::json!({}),
        None,
        Some((0, "logged in")),
    )
    .await;
    if let Err(e) = audit {
        // No audit, no session: an action must never go unrecorded.
        state.sessions.remove(&id);
        return db_error(&ctx, e);
    }
    tracing::info!(actor = %actor, peer = %peer, "console: logged in");
    // `next` is visible ASCII (checked above), so this never falls back.
    let location = HeaderValue::from_str(&next).unwrap_or_else(|_| HeaderValue::from_static("/"));
    let mut resp = (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response();
    resp.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&auth::set_cookie(&id, state.secure_cookie)).expect("hex cookie"),
    );
    resp
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    csrf: String,
}

async fn logout(
    AxumState(state): AxumState<State>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    let ctx = state.ctx(&headers, "/".into());
    let session = match authorize(&state, &headers, &form.csrf) {
        Ok(s) => s,
        Err(refused) => return refused.page(&ctx),
    };
    let (id, s) = session;
    state.sessions.remove(&id);
    let _ = sql::audit_start(
        state.console.store.pool(),
        &s.actor,
        Some(&peer.to_string()),
        "logout",
        &serde_json::json!({}),
        None,
        Some((0, "logged out")),
    )
    .await;
    let mut resp = Redirect::to("/").into_response();
    resp.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&auth::clear_cookie(state.secure_cookie)).expect("static cookie"),
    );
    resp
}

async fn not_found(Page { ctx, .. }: Page) -> Response {
    html(StatusCode::NOT_FOUND, pages::message(&ctx, "Not found", "no such page"))
}

async fn css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8"), (header::CACHE_CONTROL, "max-age=300")],
        include_str!("assets/console.css"),
    )
        .into_response()
}

async fn js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8"), (header::CACHE_CONTROL, "max-age=300")],
        include_str!("assets/console.js"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ip_addresses_localhost_and_allowed_names_pass() {
        let allowed = vec!["console.internal".to_string()];
        for ok in [
            "127.0.0.1:8088",
            "localhost:8088",
            "LOCALHOST",
            "[::1]:8088",
            "10.0.0.5",
            "console.internal:443",
        ] {
            assert!(host_allowed(ok, &allowed), "{ok}");
        }
        for bad in ["", "evil.example:8088", "127.0.0.1.nip.io", "[nope]", "localhost.evil.example"] {
            assert!(!host_allowed(bad, &allowed), "{bad}");
        }
    }

    #[test]
    fn a_login_returns_only_to_a_local_path() {
        assert_eq!(local_next(Some("/dlq?class=transient")), "/dlq?class=transient");
        for bad in ["//evil.example/", "https://evil.example/", "/\\evil.example", "dlq"] {
            assert_eq!(local_next(Some(bad)), "/", "{bad}");
        }
        assert_eq!(local_next(None), "/");
    }

    #[test]
    fn a_login_never_returns_off_origin_nor_with_a_header_breaking_byte() {
        for ok in ["/", "/dlq?class=transient&after=3", "/dlq/42", "/%09/still-here", "/a/b%0A"] {
            assert_eq!(local_next(Some(ok)), ok, "{ok:?}");
        }
        let long = format!("/{}", "a".repeat(5000));
        for bad in [
            "",
            "/\t/evil.example",
            "/\n/evil.example",
            "/\r\n/evil.example",
            "/\r\nSet-Cookie: x=1",
            "/\0/evil.example",
            "/ /evil.example",
            "/\u{0b}/evil.example",
            "/\u{0c}/evil.example",
            "/\u{7f}/evil.example",
            "/\u{a0}/evil.example",
            "/\u{2028}/evil.example",
            "/\u{200b}/evil.example",
            "/\u{feff}/evil.example",
            "/é",
            "\t//evil.example",
            " /dlq",
            "//evil.example",
            "///evil.example",
            "/\\evil.example",
            "\\/evil.example",
            "/dlq\\..\\",
            "https://evil.example/",
            "javascript:alert(1)",
            "evil.example",
            "dlq",
            long.as_str(),
        ] {
            assert_eq!(local_next(Some(bad)), "/", "{bad:?}");
        }
    }
}
