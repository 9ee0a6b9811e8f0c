//! The `embed-dlq` binary: parse, set up logging, hand over to the library.

use clap::Parser;

fn main() {
    let cli = embed_dlq::cli::Cli::parse();
    embed_dlq::telemetry::init_logging(cli.log_format);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("build tokio runtime");
    let code = runtime.block_on(embed_dlq::cli::run(cli));
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}
