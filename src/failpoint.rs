//! Crash injection for the crash tests: `EMBED_DLQ_FAILPOINT=<name>` makes the process abort
//! (no destructors, no graceful anything — like `kill -9`) the first time it reaches the
//! point of that name. Unset in production, where `hit` is one cached string comparison.
//!
//! Points: `relay_after_publish` (stream entries added, outbox rows not yet marked),
//! `replay_before_commit` (re-embedded, nothing committed), `replay_after_commit` (committed,
//! stream entries not yet acknowledged).

use std::sync::OnceLock;

/// Aborts the process if `EMBED_DLQ_FAILPOINT` names this point.
pub fn hit(name: &str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("EMBED_DLQ_FAILPOINT").ok().filter(|s| !s.is_empty()));
    if armed.as_deref() == Some(name) {
        eprintln!("embed-dlq: failpoint {name} reached, aborting");
        std::process::abort();
    }
}
