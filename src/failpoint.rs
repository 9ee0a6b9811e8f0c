//! Fault injection for the crash and supervision tests, compiled in only with the cargo
//! feature `failpoints` (the test command enables it; a default build has none of it), and
//! armed by one environment variable:
//!
//! ```text
//! EMBED_DLQ_FAILPOINT=<name>[=abort|panic][@<n>]
//! ```
//!
//! The `n`-th time (default: the first) the process reaches the point `name`, it either
//! aborts (the default: no destructors, no graceful anything — like `kill -9`) or panics in
//! the task that reached it (to prove that a dying task is seen, never silently gone). A
//! point fires once.
//!
//! Call sites use `hit!`: without the feature it expands to nothing, so neither the hooks
//! nor the point names nor the variable's name are in the binary.
//!
//! Points: `relay_after_publish` (stream entries added, outbox rows not yet marked),
//! `schedule_after_publish` (work items appended to the replay stream, their leases not yet
//! committed),
//! `replay_before_embed` (rows loaded and charged, nothing sent), `replay_before_commit` (re-embedded, nothing committed), `replay_after_commit` (committed,
//! stream entries not yet acknowledged), `ingest_worker` (a worker took a job, no provider
//! call yet), `ingest_writer` (a writer is about to write gathered outcomes),
//! `ingest_claim` (an intake window's claim statement is about to be sent),
//! `source_before_ack` (a stream source's outcomes committed, their entries not yet
//! acknowledged).

#[cfg(feature = "failpoints")]
use std::sync::OnceLock;
#[cfg(feature = "failpoints")]
use std::sync::atomic::{AtomicU64, Ordering};

/// Marks the failpoint `$name` here: fires it when armed (see the module doc). Expands to
/// nothing without the `failpoints` feature.
#[cfg(feature = "failpoints")]
macro_rules! hit {
    ($name:literal) => {
        $crate::failpoint::fire($name)
    };
}

/// Marks the failpoint `$name` here; without the `failpoints` feature, nothing.
#[cfg(not(feature = "failpoints"))]
macro_rules! hit {
    ($name:literal) => {};
}

pub(crate) use hit;

/// What an armed point does when it fires.
#[cfg(feature = "failpoints")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// `std::process::abort()`: a crash.
    Abort,
    /// `panic!` in the calling task.
    Panic,
}

/// A parsed `EMBED_DLQ_FAILPOINT` value.
#[cfg(feature = "failpoints")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Armed {
    /// The point that fires.
    pub name: String,
    /// What it does when it fires.
    pub action: Action,
    /// Fires on this hit, counting from 1.
    pub at: u64,
}

#[cfg(feature = "failpoints")]
impl Armed {
    /// Parses `<name>[=abort|panic][@<n>]`; `None` for an empty or malformed value (a typo
    /// must not fire a different point, so nothing fires).
    pub fn parse(spec: &str) -> Option<Armed> {
        let spec = spec.trim();
        let (rest, at) = match spec.rsplit_once('@') {
            Some((rest, n)) => (rest, n.parse::<u64>().ok().filter(|n| *n >= 1)?),
            None => (spec, 1),
        };
        let (name, action) = match rest.split_once('=') {
            Some((name, "abort")) => (name, Action::Abort),
            Some((name, "panic")) => (name, Action::Panic),
            Some(_) => return None,
            None => (rest, Action::Abort),
        };
        (!name.is_empty()).then(|| Armed { name: name.to_string(), action, at })
    }
}

/// Fires the armed action if `EMBED_DLQ_FAILPOINT` names this point and this is its `n`-th
/// hit. Called through `hit!`.
#[cfg(feature = "failpoints")]
pub(crate) fn fire(name: &str) {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let armed =
        ARMED.get_or_init(|| std::env::var("EMBED_DLQ_FAILPOINT").ok().and_then(|s| Armed::parse(&s)));
    let Some(armed) = armed else { return };
    if armed.name != name || HITS.fetch_add(1, Ordering::SeqCst) + 1 != armed.at {
        return;
    }
    match armed.action {
        Action::Abort => {
            eprintln!("embed-dlq: failpoint {name} reached, aborting");
            std::process::abort();
        }
        Action::Panic => panic!("failpoint {name} reached"),
    }
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let a = |name: &str, action, at| Some(Armed { name: name.into(), action, at });
        assert_eq!(Armed::parse("replay_after_commit"), a("replay_after_commit", Action::Abort, 1));
        assert_eq!(Armed::parse("ingest_worker=panic"), a("ingest_worker", Action::Panic, 1));
        assert_eq!(Armed::parse("ingest_writer=panic@3"), a("ingest_writer", Action::Panic, 3));
        assert_eq!(Armed::parse("x=abort@2"), a("x", Action::Abort, 2));
        assert_eq!(Armed::parse("x=explode"), None);
        assert_eq!(Armed::parse("x@0"), None);
        assert_eq!(Armed::parse("x@many"), None);
        assert_eq!(Armed::parse(""), None);
    }
}
