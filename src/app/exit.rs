//! Exit codes, stable for scripts, and the mapping of outcomes to them.

use embed_dlq::config::ConfigError;
use embed_dlq::ingest::IngestSummary;

/// Finished; every record is stored or parked (or was already).
pub const OK: i32 = 0;
/// Could not run (database unreachable, bad table, I/O error).
pub const FAILURE: i32 = 1;
/// Bad flags, environment or config file (unknown key, value out of its documented bound,
/// a base URL that is not http(s)), a destructive command that needs `--all`/a terminal, or an
/// `ingest --cleanup full` refused (input not read to its end, too many rejected lines, too
/// large a share of the table without `--yes`): the run's writes are done, nothing deleted.
pub const USAGE: i32 = 2;
/// Finished, but some input lines had no usable identity and were only reported.
pub const REJECTED_INPUT: i32 = 3;
/// The provider refused the run (bad key, no quota, unknown model, long outage); nothing
/// was parked for it, rerun once fixed.
pub const PROVIDER_STOP: i32 = 4;
/// `reconcile` found something (repaired or not; a second run tells whether it is clean).
pub const FINDINGS: i32 = 5;
/// `tail --on-gap fail`: events after the resume point were trimmed from the stream before
/// they were read (the count is on stderr); nothing past the gap was printed and the
/// checkpoint was not moved.
pub const TAIL_GAP: i32 = 6;
/// `ingest` finished its input but left chunks unfinished: not attempted, or left to a
/// concurrent run's lease. They have no manifest row, so nothing but a rerun of the same
/// corpus finds them (the summary's "not finished" line names them). Wins over
/// [`REJECTED_INPUT`]: a script must not take such a run for done.
pub const UNFINISHED: i32 = 7;
/// Stopped by SIGINT/SIGTERM after finishing or parking in-flight work; rerun to resume.
pub const INTERRUPTED: i32 = 130;

/// The exit code a finished ingest deserves.
pub fn summary_exit_code(summary: &IngestSummary, interrupted: bool) -> i32 {
    if interrupted {
        INTERRUPTED
    } else if summary.unfinished() > 0 {
        UNFINISHED
    } else if summary.rejected_lines > 0 {
        REJECTED_INPUT
    } else {
        OK
    }
}

/// Reports a settings error; returns [`USAGE`].
pub fn usage(e: &ConfigError) -> i32 {
    fail(USAGE, &e.to_string())
}

/// Reports `msg` on stderr; returns `code`.
pub fn fail(code: i32, msg: &str) -> i32 {
    eprintln!("embed-dlq: error: {msg}");
    code
}

/// The second signal: the operator does not want to wait for the drain.
pub fn immediately() -> ! {
    eprintln!("embed-dlq: second signal, exiting immediately");
    std::process::exit(INTERRUPTED);
}
