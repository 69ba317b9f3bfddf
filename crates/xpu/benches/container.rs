//! `cargo bench -p xpu --bench container`: what the container path costs, with the release
//! binaries and Debian's runc. Prints, in one run:
//! - in process, on the 8×A100 fixture: the full discovery against the shim's narrow one
//!   (`discover_nodes`), NVIDIA's driver files for every capability against the default
//!   `utility,compute`, and CDI generation;
//! - process start: `/bin/true`, the lean `xpu-container-runtime` binary and the full `xpu`
//!   binary (called `xpu-container-runtime` through a symlink), each passing a `state` command
//!   through to `runtime = "/bin/true"`; then the shim's whole work for a request
//!   (`NVIDIA_VISIBLE_DEVICES=1,3`, `create`, then exec of `/bin/true`);
//! - `xpu cdi generate` on the 8×A100 fixture, process wall time (target: under 5 ms);
//! - `runc run` of a busybox container through the shim against plain `runc run`, interleaved,
//!   as ratios of medians (target: at most 1.05×):
//!   - nothing requested (the shim only passes through);
//!   - `NVIDIA_VISIBLE_DEVICES=1,3` against plain runc on the bundle the shim produced (the
//!     shim's own cost: discovery, driver files, checks, the spec rewrite, the exec), through
//!     the lean binary and through the full one;
//!   - and the same request against plain runc on the untouched bundle (what the user sees,
//!     including runc creating the extra nodes and mounts).
//!
//! Before each run that the shim edits, `config.json` is written afresh (removed, then
//! created), as an engine creates a bundle. Overwriting the existing file instead would make
//! ext4 allocate and start writing its blocks on close (`auto_da_alloc`), and the shim, which
//! swaps in its edited spec and removes the old file, would pay for freeing them.
//!
//! The benchmark runs at the highest scheduling priority when it may (it is root for runc), so
//! that other work on the machine disturbs the figures less; it prints the load average.
//! `XPU_BENCH_RUNS` sets the number of `runc run`s per case (default 100).
//!
//! Needs root and runc for the container part; prints why and skips it otherwise.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpu_core::DeviceKind;
use xpu_core::accel::VENDOR_NVIDIA;
use xpu_core::driver::Capabilities;
use xpu_testkit::bundle::{self, Bundle, RUNC, TestHost};
use xpu_testkit::hosts;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");
/// The lean shim binary (`src/bin/xpu-container-runtime.rs`).
const LEAN: &str = env!("CARGO_BIN_EXE_xpu-container-runtime");

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn timed(cmd: &mut Command) -> Duration {
    let t = Instant::now();
    let out =
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).output().unwrap();
    let d = t.elapsed();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    d
}

fn in_process(n: usize, mut f: impl FnMut()) -> Duration {
    median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

/// Writes `config.json` afresh, as an engine does (see the module documentation).
fn fresh_config(b: &Bundle, bytes: &[u8]) {
    let _ = std::fs::remove_file(b.config_path());
    std::fs::write(b.config_path(), bytes).unwrap();
}

fn main() {
    let reniced = bundle::raise_priority();
    let load = bundle::load_average();
    if let Some(why) = bundle::container_tests_unavailable() {
        println!("skipping: {why}");
        return;
    }
    println!("load average at start: {load}{}", if reniced { "; running at nice -20" } else { "" });
    let host = TestHost::new(&hosts::a100_8x());
    let root = host.fixture.root().to_str().unwrap().to_owned();

    // In process: where the time of a request goes.
    let root_h = xpu_host::Root::new(host.fixture.root()).unwrap();
    let opts = xpu_host::DiscoverOptions {
        scope: xpu_host::Scope::Accelerators,
        pci_ids: None,
        skip_names: true,
    };
    let inv = xpu_host::discover(&root_h, &opts).unwrap();
    let version = inv.host.nvidia_driver_version.as_deref();
    let nvidia = [(Some(VENDOR_NVIDIA), DeviceKind::Gpu)];
    let caps = Capabilities::parse("utility,compute").unwrap();
    let t_disc = in_process(300, || {
        xpu_host::discover(&root_h, &opts).unwrap();
    });
    let t_nodes = in_process(300, || {
        xpu_host::discover_nodes(&root_h, Some(&nvidia)).unwrap();
    });
    let t_files = in_process(300, || {
        xpu_host::driver_files::find(&root_h, version);
    });
    let t_files_uc = in_process(300, || {
        xpu_host::driver_files::find_for(&root_h, version, caps);
    });
    let files = xpu_host::driver_files::find(&root_h, version);
    let gen_opts = xpu_container::cdi::GenerateOptions {
        kinds: vec![xpu_container::cdi::CdiKind::NvidiaGpu],
        strict: true,
        host_root: host.fixture.root().to_path_buf(),
    };
    let t_gen = in_process(300, || {
        let g = xpu_container::cdi::generate(&inv, &files, &gen_opts).unwrap();
        let _ = xpu_container::cdi::to_json(&g.specs[0]);
    });
    println!(
        "in process: discover {} (the shim's narrow read of NVIDIA GPUs: {}), driver files {} (utility,compute: {}), generate+serialize {}",
        ms(t_disc),
        ms(t_nodes),
        ms(t_files),
        ms(t_files_uc),
        ms(t_gen)
    );

    let gen_args =
        ["cdi", "generate", "--root", root.as_str(), "--vendor", "nvidia", "--format", "json"];
    let runs: Vec<Duration> = (0..200).map(|_| timed(Command::new(XPU).args(gen_args))).collect();
    println!(
        "xpu cdi generate, 8xA100 fixture:             median {} (target < 5 ms)",
        ms(median(runs))
    );

    // The shim as engines install it: the lean binary, and the full one through a symlink.
    let full = host.dir.path().join("xpu-container-runtime");
    std::os::unix::fs::symlink(XPU, &full).unwrap();
    let lean = Path::new(LEAN);

    // Process start and the shim's own work, with no runtime after it: `runtime = "/bin/true"`.
    let alone = host.dir.path().join("alone.toml");
    let cfg = std::fs::read_to_string(&host.config).unwrap();
    std::fs::write(&alone, cfg.replace(RUNC, "/bin/true")).unwrap();
    let wants = Bundle::busybox("true");
    wants.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let pristine = std::fs::read(wants.config_path()).unwrap();
    let n_start = 300;
    let (mut t_true, mut t_pass_lean, mut t_pass_full) = (Vec::new(), Vec::new(), Vec::new());
    let (mut t_alone_lean, mut t_alone_full) = (Vec::new(), Vec::new());
    let alone_create = |program: &Path| {
        let mut c = Command::new(program);
        c.args(["create", "--bundle"]).arg(wants.dir()).arg("xpu-bench-e");
        c.env("XPU_RUNTIME_CONFIG", &alone);
        c
    };
    for _ in 0..n_start {
        t_true.push(timed(&mut Command::new("/bin/true")));
        for (program, into) in [(lean, &mut t_pass_lean), (full.as_path(), &mut t_pass_full)] {
            into.push(timed(
                Command::new(program).args(["state", "x"]).env("XPU_RUNTIME_CONFIG", &alone),
            ));
        }
        fresh_config(&wants, &pristine);
        t_alone_lean.push(timed(&mut alone_create(lean)));
        fresh_config(&wants, &pristine);
        t_alone_full.push(timed(&mut alone_create(&full)));
    }
    let t_true = median(t_true);
    println!(
        "process start (a pass-through to /bin/true): /bin/true {}; lean xpu-container-runtime {}; xpu as xpu-container-runtime {}",
        ms(t_true),
        ms(median(t_pass_lean)),
        ms(median(t_pass_full))
    );
    println!(
        "shim alone (create, NVIDIA_VISIBLE_DEVICES=1,3, then exec /bin/true): lean {}, xpu {}; /bin/true {}",
        ms(median(t_alone_lean)),
        ms(median(t_alone_full)),
        ms(t_true)
    );

    let state = bundle::RuncState::new();
    let plain = Bundle::busybox("true");
    // The bundle as the shim leaves it, for plain runc.
    let edited = Bundle::busybox("true");
    let run = |program: &Path, b: &Bundle, id: &str| {
        let mut c = Command::new(program);
        c.arg("--root").arg(state.path()).args(["run", "--bundle"]).arg(b.dir()).arg(id);
        c.env("XPU_RUNTIME_CONFIG", &host.config);
        timed(&mut c)
    };
    fresh_config(&wants, &pristine);
    run(lean, &wants, "xpu-bench-warm");
    std::fs::copy(wants.config_path(), edited.config_path()).unwrap();

    let (mut a, mut b, mut c, mut c_full, mut d) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let n: usize = std::env::var("XPU_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    for _ in 0..n {
        a.push(run(Path::new(RUNC), &plain, "xpu-bench-a"));
        b.push(run(lean, &plain, "xpu-bench-b"));
        fresh_config(&wants, &pristine);
        c.push(run(lean, &wants, "xpu-bench-c"));
        d.push(run(Path::new(RUNC), &edited, "xpu-bench-d"));
        fresh_config(&wants, &pristine);
        c_full.push(run(&full, &wants, "xpu-bench-f"));
    }

    let (a, b, c, c_full, d) = (median(a), median(b), median(c), median(c_full), median(d));
    let r = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
    println!(
        "runc run, plain (busybox true):               median {} ({n} runs each, interleaved)",
        ms(a)
    );
    println!(
        "runc run via shim, nothing requested:         median {} = {:.3}x plain (target <= 1.05x)",
        ms(b),
        r(b, a)
    );
    println!("plain runc run on the shim-edited bundle:     median {}", ms(d));
    println!(
        "runc run via shim, NVIDIA_VISIBLE_DEVICES=1,3: median {} = {:.3}x the same edits without the shim (target <= 1.05x)",
        ms(c),
        r(c, d)
    );
    println!(
        "  (= {:.3}x plain runc on the unedited bundle, runc's extra nodes and mounts included)",
        r(c, a)
    );
    println!(
        "  the same through the full xpu binary:       median {} = {:.3}x",
        ms(c_full),
        r(c_full, d)
    );
    println!("load average at the end: {}", bundle::load_average());
}
