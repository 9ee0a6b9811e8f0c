//! Turns SIGINT/SIGTERM into cancellation tokens. The first signal asks for a graceful stop
//! (stop intake, finish or park in-flight work); a second one asks to exit at once. The
//! library only cancels tokens: what "exit at once" means (the process exit code) is the
//! application's decision.
//!
//! The handlers are installed before this returns, so a failure to install one is logged
//! here (and that signal then keeps its default action) instead of killing a background task
//! unseen. The listening task lives as long as the process, so nothing joins it.

use tokio_util::sync::CancellationToken;

/// The two stages of a requested shutdown.
#[derive(Debug, Clone)]
pub struct ShutdownSignals {
    /// Cancelled on the first SIGINT or SIGTERM: finish or park in-flight work, then stop.
    pub graceful: CancellationToken,
    /// Cancelled on the second signal: the operator does not want to wait for the drain.
    pub immediate: CancellationToken,
}

/// Installs the handlers and returns the tokens they cancel. Must be called inside the
/// tokio runtime.
pub fn on_signal() -> ShutdownSignals {
    let shutdown =
        ShutdownSignals { graceful: CancellationToken::new(), immediate: CancellationToken::new() };
    let tokens = shutdown.clone();
    let mut signals = Signals::install();
    tokio::spawn(async move {
        signals.next().await;
        tracing::info!("shutdown requested: finishing in-flight work (signal again to exit now)");
        tokens.graceful.cancel();
        signals.next().await;
        tokens.immediate.cancel();
    });
    shutdown
}

struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let term = match signal(SignalKind::terminate()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(error = %e, "cannot handle SIGTERM: it will stop the process without draining");
                    None
                }
            };
            Signals { term }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// The next SIGINT or SIGTERM; never, for a signal whose handler could not be installed.
    async fn next(&mut self) {
        let ctrl_c = async {
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::error!(error = %e, "cannot handle SIGINT: it will stop the process without draining");
                std::future::pending::<()>().await;
            }
        };
        #[cfg(unix)]
        {
            let term = async {
                match self.term.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term => {}
            }
        }
        #[cfg(not(unix))]
        ctrl_c.await;
    }
}

/// Sleeps, or returns early on cancellation: the pause of every background loop, so a
/// stop never waits out a backoff.
pub(crate) async fn sleep_or_cancel(d: std::time::Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}
