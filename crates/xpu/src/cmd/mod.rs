//! One module per subcommand: clap arguments and a `run` that calls the library and prints.

pub mod discover;
pub mod server;
