//! Turns SIGINT/SIGTERM into a cancellation token. The first signal asks for a graceful stop
//! (stop intake, finish or park in-flight work); a second one exits at once.

use tokio_util::sync::CancellationToken;

/// Returns a token cancelled on the first SIGINT or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::warn!("shutdown requested: finishing in-flight work (signal again to exit now)");
        t.cancel();
        wait_for_signal().await;
        eprintln!("embed-dlq: second signal, exiting immediately");
        std::process::exit(crate::cli::exit::INTERRUPTED);
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
