//! The `embed-dlq` binary: parse, set up logging, hand over to the library.

use embed_dlq::cli::Cli;

fn main() {
    // Parse with the matches kept, so settings errors can say flag or environment variable.
    let matches = Cli::command_with_defaults().get_matches();
    let cli = Cli::from_matches(&matches).unwrap_or_else(|e| e.exit());
    embed_dlq::telemetry::init_logging(cli.log_format);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("build tokio runtime");
    let code = runtime.block_on(embed_dlq::cli::run(cli));
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}
