//! Who may act: the login token, sessions and CSRF tokens.
//!
//! The operator logs in with `EMBED_DLQ_CONSOLE_TOKEN` and a name (recorded in the audit
//! trail). The console answers with a session cookie (`HttpOnly`, `SameSite=Strict`, path
//! `/`, 12 hours) holding a random 256-bit session id; the session holds the name and a
//! random CSRF token that every form carries and every mutating route checks. Sessions live
//! in memory (a restart logs everyone out), at most [`MAX_SESSIONS`] (the oldest goes
//! first). Tokens are compared through their SHA-256 digests, in constant time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Name of the session cookie.
pub const COOKIE: &str = "embed_dlq_console";
/// How long a session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Most sessions kept; a login beyond it ends the oldest.
pub const MAX_SESSIONS: usize = 1024;
/// Shortest and longest token accepted, in bytes.
pub const TOKEN_LEN: std::ops::RangeInclusive<usize> = 16..=1024;
/// Longest operator name; longer names are cut.
pub const MAX_ACTOR: usize = 64;

/// The login token. Its `Debug` never shows it.
#[derive(Clone)]
pub struct ConsoleToken(String);

impl std::fmt::Debug for ConsoleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleToken([redacted])")
    }
}

impl ConsoleToken {
    /// A token of 16..=1024 bytes without control characters or surrounding spaces (a
    /// short token is guessable; a stray newline from `$(cat file)` would never match).
    pub fn new(token: String) -> Result<ConsoleToken, String> {
        if !TOKEN_LEN.contains(&token.len()) {
            return Err(format!(
                "EMBED_DLQ_CONSOLE_TOKEN must be {}..={} bytes long (it is {})",
                TOKEN_LEN.start(),
                TOKEN_LEN.end(),
                token.len()
            ));
        }
        if token.chars().any(char::is_control) || token.trim() != token {
            return Err("EMBED_DLQ_CONSOLE_TOKEN has control characters or surrounding spaces".into());
        }
        Ok(ConsoleToken(token))
    }

    /// Whether `given` is the token (constant time over the digests).
    pub fn matches(&self, given: &str) -> bool {
        same(given, &self.0)
    }
}

/// Constant-time comparison of two secrets (through their digests, so the length leaks
/// nothing either).
pub fn same(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 256 random bits as hex.
fn random_id() -> String {
    let bytes: [u8; 32] = rand::random();
    crate::model::hex(&bytes)
}

/// A logged-in operator.
#[derive(Debug, Clone)]
pub struct Session {
    /// The name given at login (what the audit trail records).
    pub actor: String,
    /// The token every form of this session carries.
    pub csrf: String,
    created: Instant,
}

/// The sessions of this console process.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// Starts a session for `actor`; returns its id (the cookie value).
    pub fn create(&self, actor: &str) -> String {
        let actor: String = actor.trim().chars().filter(|c| !c.is_control()).take(MAX_ACTOR).collect();
        let actor = if actor.is_empty() { "operator".to_string() } else { actor };
        let id = random_id();
        let mut map = self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.retain(|_, s| s.created.elapsed() < SESSION_TTL);
        while map.len() >= MAX_SESSIONS {
            let oldest = map.iter().min_by_key(|(_, s)| s.created).map(|(k, _)| k.clone());
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(id.clone(), Session { actor, csrf: random_id(), created: Instant::now() });
        id
    }

    /// The live session with this id.
    pub fn get(&self, id: &str) -> Option<Session> {
        let map = self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(id).filter(|s| s.created.elapsed() < SESSION_TTL).cloned()
    }

    /// Ends a session.
    pub fn remove(&self, id: &str) {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(id);
    }
}

/// The session id in a `Cookie` header, if any.
pub fn session_cookie(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The `Set-Cookie` value that stores a session id; `secure` adds `Secure` (the browser
/// sends it back over HTTPS only).
pub fn set_cookie(id: &str, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict{secure}; Max-Age={}", SESSION_TTL.as_secs())
}

/// The `Set-Cookie` value that clears the session cookie (with the same attributes).
pub fn clear_cookie(secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict{secure}; Max-Age=0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_bounded_and_redacted() {
        assert!(ConsoleToken::new("short".into()).is_err());
        assert!(ConsoleToken::new("a-long-enough-token\n".into()).is_err());
        let t = ConsoleToken::new("a-long-enough-token".into()).unwrap();
        assert!(t.matches("a-long-enough-token"));
        assert!(!t.matches("a-long-enough-tokem"));
        assert!(!t.matches(""));
        assert!(!format!("{t:?}").contains("long-enough"));
    }

    #[test]
    fn sessions_are_capped_and_named() {
        let s = Sessions::default();
        let first = s.create("  alice\u{1b}[31m  ");
        assert_eq!(s.get(&first).unwrap().actor, "alice[31m");
        assert_eq!(s.get(&s.create("")).unwrap().actor, "operator");
        for _ in 0..MAX_SESSIONS {
            s.create("bob");
        }
        assert!(s.get(&first).is_none(), "the oldest session made room");
        let id = s.create(&"x".repeat(500));
        assert_eq!(s.get(&id).unwrap().actor.len(), MAX_ACTOR);
        s.remove(&id);
        assert!(s.get(&id).is_none());
    }

    #[test]
    fn the_cookie_is_read_back_and_anything_else_ignored() {
        let mut h = axum::http::HeaderMap::new();
        let id = random_id();
        h.insert(axum::http::header::COOKIE, format!("other=1; {COOKIE}={id}").parse().unwrap());
        assert_eq!(session_cookie(&h), Some(id));
        h.insert(axum::http::header::COOKIE, format!("{COOKIE}=<script>").parse().unwrap());
        assert_eq!(session_cookie(&h), None);
        assert!(set_cookie("x", false).contains("HttpOnly; SameSite=Strict"));
        assert!(!set_cookie("x", false).contains("Secure"));
        assert!(set_cookie("x", true).contains("; Secure;") && clear_cookie(true).contains("; Secure;"));
    }
}
