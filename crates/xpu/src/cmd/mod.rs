//! One module per subcommand: clap arguments and a `run` that calls the library and prints.

pub mod cdi;
pub mod discover;
pub mod doctor;
pub mod exporter;
pub mod format;
pub mod generate;
pub mod hook;
pub mod host;
pub mod k8s;
pub mod openstack;
pub mod runtime;
pub mod server;
pub mod sim;
pub mod vfio;
