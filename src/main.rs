//! The `embed-dlq` binary: everything in it is the app layer (`app/`) over the library.

mod app;

fn main() {
    std::process::exit(app::main());
}
