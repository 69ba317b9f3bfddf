//! Builds a named fixture host into a directory, for trying commands by hand:
//! `cargo run -p xpu-testkit --example build_fixture -- a100-8x /tmp/a100 [--char-devices]
//! [--driver]`; `--driver` also installs the fixture's NVIDIA driver files, as the container
//! tests' `TestHost` does.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use xpu_testkit::{BuildOptions, hosts};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(name), Some(dir)) = (args.first(), args.get(1)) else {
        eprintln!("usage: build_fixture NAME DIR [--char-devices] [--driver]; names: {}", names());
        std::process::exit(2);
    };
    let Some(spec) = hosts::all().into_iter().find(|h| &h.name == name) else {
        eprintln!("unknown fixture {name:?}; names: {}", names());
        std::process::exit(2);
    };
    let opts = BuildOptions {
        char_devices: args.iter().any(|a| a == "--char-devices"),
        dir: Some(dir.into()),
    };
    let f = spec.build_with(&opts);
    if args.iter().any(|a| a == "--driver")
        && let Some(v) = spec.nvidia_driver.as_deref()
    {
        xpu_testkit::driver::install_nvidia(f.root(), v);
    }
    println!("{}", f.root().display());
}

fn names() -> String {
    hosts::all().iter().map(|h| h.name.clone()).collect::<Vec<_>>().join(", ")
}
