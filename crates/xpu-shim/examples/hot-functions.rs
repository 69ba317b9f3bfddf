//! `cargo run -p xpu-shim --example hot-functions` (root, gdb, busybox): writes
//! `crates/xpu-shim/hot-functions.txt`, the functions a container start runs in the order it
//! first runs them, which `scripts/build-shim` lays out first in the binary.
//!
//! It builds the shim with `scripts/build-shim` and runs it on the 8×A100 fixture host with the
//! host snapshot, as a container start does: `create` with `NVIDIA_VISIBLE_DEVICES=1,3`, `create`
//! asking for nothing, and `state` (every other subcommand passes through the same way). Each run
//! is under gdb with a breakpoint on every function, each breakpoint disabled at its first hit,
//! until the shim execs the runtime. The runtime is `/bin/true`; nothing after the exec is the
//! shim's. The functions are written by name without the hash rustc puts in a symbol (see
//! `scripts/build-shim --symbols`), so that the list stays good across rebuilds; run this again
//! when the shim's code changes much (the build then reports fewer names found).

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use xpu_testkit::bundle::{Bundle, RUNC};

#[path = "../tests/shim_support/mod.rs"]
mod shim_support;

fn main() {
    let shim = shim_support::build_shim();

    let host = shim_support::a100_host_with_snapshot();
    let config = host.dir.path().join("to-true.toml");
    let text = std::fs::read_to_string(&host.config).unwrap();
    std::fs::write(&config, text.replace(RUNC, "/bin/true")).unwrap();

    let requested = Bundle::busybox("true");
    requested.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let plain = Bundle::busybox("true");
    let script = gdb_script(&shim);
    let mut order: Vec<String> = Vec::new();
    for (what, bundle, args) in [
        ("create, GPUs 1 and 3", Some(&requested), vec!["create", "--bundle", "B", "hot"]),
        ("create, nothing asked for", Some(&plain), vec!["create", "--bundle", "B", "hot"]),
        ("state", None, vec!["state", "hot"]),
    ] {
        let bundle_dir = bundle.map(|b| b.dir().to_str().unwrap().to_owned());
        let args: Vec<&str> = args
            .iter()
            .map(|a| if *a == "B" { bundle_dir.as_deref().unwrap() } else { a })
            .collect();
        let out = Command::new("gdb")
            .args(["-q", "-batch", "-x"])
            .arg(&script)
            .arg("--args")
            .arg(&shim)
            .args(&args)
            .env("XPU_RUNTIME_CONFIG", &config)
            .output()
            .unwrap_or_else(|e| panic!("gdb: {e} (apt-get install gdb)"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let ran: Vec<&str> = stdout.lines().filter_map(|l| l.strip_prefix("xpu-hot: ")).collect();
        assert!(ran.len() > 20, "{what}: gdb saw {} functions:\n{stdout}", ran.len());
        println!("{what}: {} functions", ran.len());
        order.extend(ran.iter().map(|s| (*s).to_owned()));
    }

    // Symbols to names without the hash, as `scripts/build-shim` matches them.
    let symbols = shim_support::symbol_names(&shim);
    let names: BTreeMap<&str, &str> =
        symbols.iter().map(|(s, n)| (s.as_str(), n.as_str())).collect();
    let mut seen = HashSet::new();
    let mut list = String::from(
        "# The functions a container start runs, in the order it first runs them, by name without\n\
         # the hash in their symbols: scripts/build-shim lays them out first in the shim.\n\
         # Written by `cargo run -p xpu-shim --example hot-functions`; do not edit.\n",
    );
    for symbol in &order {
        let name = names.get(symbol.as_str()).copied().unwrap_or(symbol);
        if seen.insert(name) {
            writeln!(list, "{name}").unwrap();
        }
    }
    let path = shim_support::repo().join("crates/xpu-shim/hot-functions.txt");
    std::fs::write(&path, list).unwrap();
    println!("wrote {}: {} functions", path.display(), seen.len());
}

/// A gdb script that stops the shim at its first instruction, puts a breakpoint on every
/// function symbol that prints the symbol's name and disables itself, and ends at the shim's
/// `execve`. The binary is position-independent: addresses are taken from where its entry
/// point was loaded.
fn gdb_script(shim: &Path) -> PathBuf {
    let image = std::fs::read(shim).unwrap();
    // ELF64 `e_entry`, little-endian, at offset 24.
    let entry = u64::from_le_bytes(image[24..32].try_into().unwrap());
    let mut at = HashSet::new();
    let functions: Vec<(u64, String)> = shim_support::functions(shim, "-p")
        .into_iter()
        .filter(|(addr, _)| at.insert(*addr))
        .collect();
    let mut script = String::from("set pagination off\nset confirm off\nstarti\n");
    writeln!(script, "set $base = $pc - {entry:#x}").unwrap();
    for (addr, symbol) in functions {
        if addr == entry {
            // Where the program stands now: run first, and no breakpoint needed.
            writeln!(script, "echo xpu-hot: {symbol}\\n").unwrap();
            continue;
        }
        write!(
            script,
            "break *($base + {addr:#x})\ncommands\nsilent\necho xpu-hot: {symbol}\\n\n\
             disable $_hit_bpnum\ncontinue\nend\n"
        )
        .unwrap();
    }
    script.push_str("catch syscall execve\ncontinue\nkill\nquit\n");
    let path = std::env::temp_dir().join(format!("xpu-hot-functions-{}.gdb", std::process::id()));
    std::fs::write(&path, script).unwrap();
    path
}
