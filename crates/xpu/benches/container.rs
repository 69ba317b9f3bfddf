//! `cargo bench -p xpu --bench container`: what the container path costs, with the release
//! `xpu` binary and Debian's runc. Prints, in one run:
//! - `xpu cdi generate` on the 8×A100 fixture, process wall time (target: under 5 ms);
//! - `runc run` of a busybox container through `xpu-container-runtime` against plain `runc run`
//!   on the same bundle, interleaved, as ratios of medians (target: at most 1.05×):
//!   - nothing requested (the shim only passes through);
//!   - `NVIDIA_VISIBLE_DEVICES=1,3` against plain runc on the bundle the shim produced (the
//!     shim's own cost: discovery, driver files, checks, the spec rewrite, the exec);
//!   - and the same request against plain runc on the untouched bundle (what the user sees,
//!     including runc creating the extra nodes and mounts).
//!
//! Needs root and runc for the container part; prints why and skips it otherwise.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpu_testkit::bundle::{self, Bundle, RUNC, TestHost};
use xpu_testkit::hosts;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

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

fn main() {
    if let Some(why) = bundle::container_tests_unavailable() {
        println!("skipping: {why}");
        return;
    }
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
    let t_disc = median(
        (0..300)
            .map(|_| {
                let t = Instant::now();
                let _ = xpu_host::discover(&root_h, &opts).unwrap();
                t.elapsed()
            })
            .collect(),
    );
    let t_files = median(
        (0..300)
            .map(|_| {
                let t = Instant::now();
                let _ = xpu_host::driver_files::find(
                    &root_h,
                    inv.host.nvidia_driver_version.as_deref(),
                );
                t.elapsed()
            })
            .collect(),
    );
    let files = xpu_host::driver_files::find(&root_h, inv.host.nvidia_driver_version.as_deref());
    let gen_opts = xpu_container::cdi::GenerateOptions {
        kinds: vec![xpu_container::cdi::CdiKind::NvidiaGpu],
        strict: true,
        host_root: host.fixture.root().to_path_buf(),
    };
    let t_gen = median(
        (0..300)
            .map(|_| {
                let t = Instant::now();
                let g = xpu_container::cdi::generate(&inv, &files, &gen_opts).unwrap();
                let _ = xpu_container::cdi::to_json(&g.specs[0]);
                t.elapsed()
            })
            .collect(),
    );
    println!(
        "in process: discover {}, driver files {}, generate+serialize {}",
        ms(t_disc),
        ms(t_files),
        ms(t_gen)
    );
    println!(
        "xpu --version (process start of the release binary): median {}",
        ms(median((0..100).map(|_| timed(Command::new(XPU).arg("--version"))).collect()))
    );

    let gen_args =
        ["cdi", "generate", "--root", root.as_str(), "--vendor", "nvidia", "--format", "json"];
    let runs: Vec<Duration> = (0..200).map(|_| timed(Command::new(XPU).args(gen_args))).collect();
    println!(
        "xpu cdi generate, 8xA100 fixture:             median {} (target < 5 ms)",
        ms(median(runs))
    );

    // The shim as engines install it.
    let shim = host.dir.path().join("xpu-container-runtime");
    std::os::unix::fs::symlink(XPU, &shim).unwrap();
    let state = bundle::RuncState::new();
    let plain = Bundle::busybox("true");
    let wants = Bundle::busybox("true");
    wants.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let pristine = std::fs::read(wants.config_path()).unwrap();
    // The bundle as the shim leaves it, for plain runc.
    let edited = Bundle::busybox("true");
    let run = |program: &Path, b: &Bundle, id: &str| {
        let mut c = Command::new(program);
        c.arg("--root").arg(state.path()).args(["run", "--bundle"]).arg(b.dir()).arg(id);
        c.env("XPU_RUNTIME_CONFIG", &host.config);
        timed(&mut c)
    };
    run(&shim, &wants, "xpu-bench-warm");
    std::fs::copy(wants.config_path(), edited.config_path()).unwrap();

    let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let n: usize = std::env::var("XPU_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    for _ in 0..n {
        a.push(run(Path::new(RUNC), &plain, "xpu-bench-a"));
        b.push(run(&shim, &plain, "xpu-bench-b"));
        std::fs::write(wants.config_path(), &pristine).unwrap();
        c.push(run(&shim, &wants, "xpu-bench-c"));
        d.push(run(Path::new(RUNC), &edited, "xpu-bench-d"));
    }
    // The shim's own work, with no runtime after it: `runtime = "/bin/true"`.
    let alone = host.dir.path().join("alone.toml");
    let cfg = std::fs::read_to_string(&host.config).unwrap();
    std::fs::write(&alone, cfg.replace(RUNC, "/bin/true")).unwrap();
    let (mut e, mut f) = (Vec::new(), Vec::new());
    for _ in 0..n {
        std::fs::write(wants.config_path(), &pristine).unwrap();
        e.push(timed(
            Command::new(&shim)
                .args(["create", "--bundle"])
                .arg(wants.dir())
                .arg("xpu-bench-e")
                .env("XPU_RUNTIME_CONFIG", &alone),
        ));
        f.push(timed(&mut Command::new("/bin/true")));
    }
    let (e, f) = (median(e), median(f));
    println!(
        "shim alone (create, NVIDIA_VISIBLE_DEVICES=1,3, then exec /bin/true): median {}; /bin/true {}",
        ms(e),
        ms(f)
    );

    let (a, b, c, d) = (median(a), median(b), median(c), median(d));
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
}
