//! `cargo bench -p xpu --bench container`: what the container path costs, with the release
//! binaries and Debian's runc. Prints, in one run:
//! - in process, on the 8×A100 fixture: the full discovery against the shim's narrow one
//!   (`discover_nodes`), NVIDIA's driver files for every capability against the default
//!   `utility,compute`, and CDI generation;
//! - process start: `/bin/true`, the shim `xpu-container-runtime` as `scripts/build-shim` builds
//!   it (linked statically with musl; when that build is newer than its sources), and the full
//!   `xpu` binary (called `xpu-container-runtime` through a symlink; dynamically linked glibc),
//!   each passing a `state` command through to `runtime = "/bin/true"`; then the shim's whole
//!   work for a request (`NVIDIA_VISIBLE_DEVICES=1,3`, `create`, then exec of `/bin/true`);
//!   The shim reads the host snapshot `xpu cdi generate` wrote (its CDI mode) unless the line
//!   says discovery; the in-process line gives what the snapshot path costs (the host key and
//!   reading the file);
//! - `xpu cdi generate` on the 8×A100 fixture, process wall time (target: under 5 ms);
//! - `runc run` of a busybox container through the shim against plain `runc run`, interleaved,
//!   each comparison as the Hodges–Lehmann ratio (the median ratio over every pair of runs) with
//!   its 95 % distribution-free interval, then the ratio of medians with its 95 % bootstrap
//!   interval (target: at most 1.05×); plain runc also runs as a second case of its own, and how
//!   far it lands from the first says what resolution the run has:
//!   - nothing requested (the shim only passes through);
//!   - `NVIDIA_VISIBLE_DEVICES=1,3` against plain runc on the same bundle holding the spec the
//!     shim produced (the shim's own cost: the snapshot or discovery, driver files, checks, the
//!     spec rewrite, the exec), through each of those binaries;
//!   - and the same request against plain runc on the untouched bundle (what the user sees,
//!     including runc creating the extra nodes and mounts);
//! - and the shim's own time from the process-start loops over those `runc run` medians: a
//!   `runc run` here takes anywhere from 20 to 40 ms, so 200 runs a case pin a ratio down to
//!   about ±3 % (±5 % for a ratio of medians), while the shim's own time is known to a few µs.
//!
//! Every command is timed without the `LD_LIBRARY_PATH` cargo sets for a benchmark (see
//! [`timed`]).
//!
//! The shim alone is measured twice: by itself (each round `/bin/true`, then the shim's create;
//! the figure the target is judged on) and among the other binaries and modes, one after the
//! other in each round; and by itself once more on the same request in a spec as containerd
//! writes one, compact and holding a seccomp profile of Docker's default size (runc's own
//! `runc spec`, which the bundles here start from, has none). Before either, the benchmark waits for the fixture, the bundle and the
//! binaries it has just written to reach the disk (`sync`): while the kernel writes them back,
//! creating a file can wait for that I/O, which on this project's VMs added 0.3 ms to the shim's
//! start for the first ten to thirty seconds.
//!
//! Before each run that the shim edits, `config.json` is written afresh (removed, then
//! created), as an engine creates a bundle. Overwriting the existing file instead would make
//! ext4 allocate and start writing its blocks on close (`auto_da_alloc`), work an engine that
//! creates its bundle does not cause.
//!
//! The `runc run` cases are interleaved in a shuffled order each round: a container's teardown
//! slows whatever starts next, so a fixed order favours some cases. Every container gets a name
//! of its own, as an engine names them.
//!
//! They run in two regimes, one after the other: spaced, each run starting 20 ms after the last
//! one ended, as container starts on a node are; then back to back, each starting as the last
//! one ends. Back to back, whatever delays runc's start is charged about twice: a program that
//! spins 2 ms and then execs runc added 4.2 ms to `runc run` back to back and 2.3 ms with 20 ms
//! between runs (a C harness, 300 interleaved rounds, medians, less the same program without
//! the wait). The likely cause is the kernel releasing the last container's
//! namespaces and cgroup after runc has exited: a run that starts later overlaps more of it.
//! So back to back charges a shim more than its own time, and spaced what it costs; both are
//! printed. `XPU_BENCH_GAP_MS` runs one regime with that gap.
//!
//! The benchmark runs at the highest scheduling priority when it may (it is root for runc), so
//! that other work on the machine disturbs the figures less; it prints the load average.
//! `XPU_BENCH_RUNS` sets the number of `runc run`s per case (default 200). Targets (issue 21):
//! with devices requested at most 1.05× the same edits without the shim, nothing requested at
//! most 1.02× plain runc, the shim alone under 0.5 ms above `/bin/true`.
//!
//! Needs root and runc for the container part; prints why and skips it otherwise.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpu_core::DeviceKind;
use xpu_core::accel::VENDOR_NVIDIA;
use xpu_core::driver::Capabilities;
use xpu_testkit::bundle::{self, Bundle, RUNC, TestHost};
use xpu_testkit::hosts;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// xorshift64: a deterministic shuffle and resampling without a dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The 95 % interval of `median(x) / median(y)`, by bootstrap: each case's runs resampled with
/// replacement, 2000 times. A `runc run` on these machines takes anywhere from 20 to 40 ms, so
/// with 200 runs a case the ratio of two identical cases lands anywhere in about 0.95–1.05×;
/// the interval says how far a printed ratio can be trusted.
fn ratio_interval(x: &[Duration], y: &[Duration]) -> (f64, f64) {
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let mut resampled_median = |v: &[Duration]| {
        median((0..v.len()).map(|_| v[rng.below(v.len())]).collect()).as_secs_f64()
    };
    let mut q: Vec<f64> = (0..2000).map(|_| resampled_median(x) / resampled_median(y)).collect();
    q.sort_by(f64::total_cmp);
    (q[q.len() / 40], q[q.len() - 1 - q.len() / 40])
}

/// `[lo–hi]`: [`ratio_interval`] for printing.
fn interval(x: &[Duration], y: &[Duration]) -> String {
    let (lo, hi) = ratio_interval(x, y);
    format!("[95 % {lo:.3}–{hi:.3}]")
}

/// How many times longer the runs in `x` take than those in `y`, by Hodges and Lehmann: the
/// median of the ratios of every run in `x` to every run in `y` (the shift between the two
/// cases' logarithms), with its 95 % distribution-free interval, the order statistics of those
/// ratios that the Mann–Whitney test bounds (normal approximation; Hollander and Wolfe).
/// Returns `(estimate, lo, hi)`.
///
/// A ratio of medians looks at the middle runs only. `runc run` times here have two humps (a
/// run either meets a slow path in the kernel or not), and the median falls on the slope
/// between them, where it moves most from one sample to the next; every pair of runs enters
/// this estimate, so at the same number of runs its interval is a third to a half narrower.
fn hodges_lehmann(x: &[Duration], y: &[Duration]) -> (f64, f64, f64) {
    let ln = |d: &Duration| d.as_secs_f64().ln();
    let ly: Vec<f64> = y.iter().map(ln).collect();
    let mut q: Vec<f64> = x.iter().flat_map(|a| ly.iter().map(move |b| ln(a) - b)).collect();
    q.sort_by(f64::total_cmp);
    let (m, n, len) = (x.len() as f64, y.len() as f64, q.len());
    let mid = if len % 2 == 0 { (q[len / 2 - 1] + q[len / 2]) / 2.0 } else { q[len / 2] };
    // The k-th smallest and k-th largest ratios bound the 95 % interval.
    let k = (m * n / 2.0 - 1.96 * (m * n * (m + n + 1.0) / 12.0).sqrt()).floor().max(0.0) as usize;
    (mid.exp(), q[k].exp(), q[len - 1 - k].exp())
}

/// `x` against `y` for printing: the Hodges–Lehmann ratio with its interval, then the ratio of
/// medians with its bootstrap interval.
fn compared(x: &[Duration], y: &[Duration]) -> String {
    let (hl, lo, hi) = hodges_lehmann(x, y);
    let medians = median(x.to_vec()).as_secs_f64() / median(y.to_vec()).as_secs_f64();
    format!("{hl:.3}x [95 % {lo:.3}–{hi:.3}] (ratio of medians {medians:.3}x {})", interval(x, y))
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// Runs `cmd` to its end and returns how long that took. Cargo puts its build directories in
/// `LD_LIBRARY_PATH` for a benchmark; every dynamically linked program timed here (`/bin/true`,
/// runc, `runc init`, sh) would search them all for each library, 0.25 ms an exec on this
/// project's VMs, which an engine's environment does not cost. They are taken out.
fn timed(cmd: &mut Command) -> Duration {
    cmd.env_remove("LD_LIBRARY_PATH");
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

/// Writes back every dirty page and waits for it (`sync`). The fixture host, the bundles and the
/// binaries were written a moment ago; until the kernel has written them back, creating a file
/// (the shim's edited spec) can wait for that I/O, which adds 0.3 ms to the shim's start for the
/// first ten to thirty seconds on this project's VMs. A host's `/dev`, `/sys` and driver
/// libraries have long been settled.
fn settle() {
    let status = Command::new("sync").status();
    assert!(status.is_ok_and(|s| s.success()), "sync failed");
}

/// The median over rounds of the differences `a[i] - b[i]`, in seconds: a round's cases share
/// whatever state the machine was in, so pairing them cancels the drift from one batch of rounds
/// to the next, which the difference of medians does not.
fn paired_difference(a: &[Duration], b: &[Duration]) -> f64 {
    let mut q: Vec<f64> = a.iter().zip(b).map(|(a, b)| a.as_secs_f64() - b.as_secs_f64()).collect();
    q.sort_by(f64::total_cmp);
    q[q.len() / 2]
}

/// A seccomp profile the size of the default one Docker and containerd put in every spec: an
/// allow list of 330 system calls and 25 rules with argument conditions, 11 KiB of compact JSON.
/// The names are made up; the shim passes the profile through without reading it.
fn seccomp_profile() -> serde_json::Value {
    let names: Vec<String> = (0..330).map(|i| format!("syscall_{i:03}")).collect();
    let mut rules = vec![serde_json::json!({ "names": names, "action": "SCMP_ACT_ALLOW" })];
    rules.extend((0..25).map(|i| {
        serde_json::json!({
            "names": [format!("conditional_{i}")],
            "action": "SCMP_ACT_ALLOW",
            "args": [{ "index": 0, "value": 2_080_505_856_u64, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ" }],
            "includes": { "caps": ["CAP_SYS_ADMIN"] },
        })
    }));
    serde_json::json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    })
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
    // The CDI mode: the snapshot beside the specs, where the runtime config looks for it.
    let cdi_dir = host.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi_dir).unwrap();
    timed(
        Command::new(XPU)
            .args(["cdi", "generate", "--root", root.as_str(), "--output"])
            .arg(&cdi_dir),
    );
    let dirs = vec![cdi_dir.clone()];
    let t_snap = in_process(300, || {
        let (_, snap) = xpu_container::snapshot::load(&dirs).unwrap();
        assert_eq!(snap.key, xpu_host::host_key(&root_h));
        snap.inventory_for(Some(&nvidia));
        snap.driver_files_for(caps);
    });
    let t_key = in_process(300, || {
        xpu_host::host_key(&root_h);
    });
    println!(
        "in process: discover {} (the shim's narrow read of NVIDIA GPUs: {}), driver files {} (utility,compute: {}), generate+serialize {}; the snapshot instead: {} (of which the host key {})",
        ms(t_disc),
        ms(t_nodes),
        ms(t_files),
        ms(t_files_uc),
        ms(t_gen),
        ms(t_snap),
        ms(t_key)
    );

    let gen_args =
        ["cdi", "generate", "--root", root.as_str(), "--vendor", "nvidia", "--format", "json"];
    let runs: Vec<Duration> = (0..200).map(|_| timed(Command::new(XPU).args(gen_args))).collect();
    println!(
        "xpu cdi generate, 8xA100 fixture:             median {} (target < 5 ms)",
        ms(median(runs))
    );

    // The shim as the package installs it (`scripts/build-shim`: musl, static-pie), when that
    // build is current, and the full `xpu` binary through a symlink.
    let full = host.dir.path().join("xpu-container-runtime");
    std::os::unix::fs::symlink(XPU, &full).unwrap();
    // The packaged binary first.
    let mut shims: Vec<(&str, PathBuf)> = Vec::new();
    match static_shim() {
        Ok(shim) => shims.push(("packaged", shim)),
        Err(why) => println!("not measuring the packaged shim: {why}"),
    }
    shims.push(("xpu", full));

    // Process start and the shim's own work, with no runtime after it: `runtime = "/bin/true"`.
    let alone = host.dir.path().join("alone.toml");
    let cfg = std::fs::read_to_string(&host.config).unwrap();
    std::fs::write(&alone, cfg.replace(RUNC, "/bin/true")).unwrap();
    // The same without the snapshot: discovery on every create.
    let no_cdi = |text: &str| {
        text.lines()
            .map(|l| if l.starts_with("cdi_dirs") { "cdi_dirs = []" } else { l })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let alone_disc = host.dir.path().join("alone-discover.toml");
    std::fs::write(&alone_disc, no_cdi(&cfg.replace(RUNC, "/bin/true"))).unwrap();
    let discover_cfg = host.dir.path().join("discover.toml");
    std::fs::write(&discover_cfg, no_cdi(&cfg)).unwrap();
    let wants = Bundle::busybox("true");
    wants.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let pristine = std::fs::read(wants.config_path()).unwrap();
    // The same request in a spec as containerd writes one: compact, with a seccomp profile.
    let wants_seccomp = Bundle::busybox("true");
    let mut spec = wants.config();
    spec["linux"]["seccomp"] = seccomp_profile();
    let with_seccomp = serde_json::to_vec(&spec).unwrap();
    settle();
    let n_start = 300;
    // The shim's own time, measured by itself: each round runs `/bin/true` and then the first
    // shim's create, with nothing else in between that would evict its code and data from the
    // caches (the loop below interleaves every binary and both modes, the full `xpu` among them).
    let by_itself = |b: &Bundle, spec: &[u8]| {
        let (mut t, mut a) = (Vec::new(), Vec::new());
        for _ in 0..n_start {
            fresh_config(b, spec);
            t.push(timed(&mut Command::new("/bin/true")));
            let mut c = Command::new(&shims[0].1);
            c.args(["create", "--bundle"]).arg(b.dir()).arg("xpu-bench-e");
            a.push(timed(c.env("XPU_RUNTIME_CONFIG", &alone)));
        }
        let paired = paired_difference(&a, &t);
        (median(t), median(a), paired)
    };
    let (own_true, own_alone, own_paired) = by_itself(&wants, &pristine);
    // The same, on the spec with a seccomp profile.
    let (seccomp_true, seccomp_alone, _) = by_itself(&wants_seccomp, &with_seccomp);
    let mut t_true = Vec::new();
    let mut t_pass = vec![Vec::new(); shims.len()];
    let mut t_alone = vec![Vec::new(); shims.len()];
    let mut t_alone_disc = vec![Vec::new(); shims.len()];
    for _ in 0..n_start {
        t_true.push(timed(&mut Command::new("/bin/true")));
        for (k, (_, program)) in shims.iter().enumerate() {
            t_pass[k].push(timed(
                Command::new(program).args(["state", "x"]).env("XPU_RUNTIME_CONFIG", &alone),
            ));
            fresh_config(&wants, &pristine);
            let mut c = Command::new(program);
            c.args(["create", "--bundle"]).arg(wants.dir()).arg("xpu-bench-e");
            t_alone[k].push(timed(c.env("XPU_RUNTIME_CONFIG", &alone)));
            fresh_config(&wants, &pristine);
            let mut c = Command::new(program);
            c.args(["create", "--bundle"]).arg(wants.dir()).arg("xpu-bench-e");
            t_alone_disc[k].push(timed(c.env("XPU_RUNTIME_CONFIG", &alone_disc)));
        }
    }
    let first_alone = median(t_alone[0].clone());
    let first_pass = median(t_pass[0].clone());
    // Each round times /bin/true and the shims one after the other.
    let paired = paired_difference(&t_alone[0], &t_true);
    let t_true = median(t_true);
    let each = |t: Vec<Vec<Duration>>| {
        shims
            .iter()
            .zip(t)
            .map(|((label, _), t)| format!("{label} {}", ms(median(t))))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "process start (a pass-through to /bin/true): /bin/true {}; {}",
        ms(t_true),
        each(t_pass)
    );
    println!(
        "shim alone (create, NVIDIA_VISIBLE_DEVICES=1,3, then exec /bin/true), host snapshot: {}; /bin/true {}",
        each(t_alone),
        ms(t_true)
    );
    println!(
        "  the {} shim is {} above /bin/true (target < 0.5 ms); the median of per-round differences: {:.3} ms",
        shims[0].0,
        ms(first_alone.saturating_sub(t_true)),
        paired * 1e3
    );
    println!("shim alone, discovering instead: {}", each(t_alone_disc));
    println!(
        "shim alone, the {} shim measured by itself (each round /bin/true, then the shim): {}; /bin/true {}",
        shims[0].0,
        ms(own_alone),
        ms(own_true)
    );
    println!(
        "  {} above /bin/true (target < 0.5 ms); the median of per-round differences: {:.3} ms",
        ms(own_alone.saturating_sub(own_true)),
        own_paired * 1e3
    );
    println!(
        "  the same on a spec as containerd writes one ({} KiB, a seccomp profile of Docker's default size): {} above /bin/true",
        with_seccomp.len() / 1024,
        ms(seccomp_alone.saturating_sub(seccomp_true))
    );

    let state = bundle::RuncState::new();
    let plain = Bundle::busybox("true");
    let run_with = |program: &Path, b: &Bundle, id: &str, config: &Path| {
        let mut c = Command::new(program);
        c.arg("--root").arg(state.path()).args(["run", "--bundle"]).arg(b.dir()).arg(id);
        c.env("XPU_RUNTIME_CONFIG", config);
        timed(&mut c)
    };
    let run = |program: &Path, b: &Bundle, id: &str| run_with(program, b, id, &host.config);
    // The spec as the shim leaves it, which plain runc then runs from the same bundle: the two
    // cases differ only in the shim.
    fresh_config(&wants, &pristine);
    run(&shims[0].1, &wants, "xpu-bench-warm");
    let edited_bytes = std::fs::read(wants.config_path()).unwrap();

    // Interleaved, in a shuffled order each round, so that no case always follows the same
    // one (a container's teardown slows whatever runs next): plain runc on the plain bundle and
    // on the shim's edited spec, and each shim with nothing requested and with the request.
    // Every case writes its `config.json` afresh first, untimed, as an engine does.
    let plain_bytes = std::fs::read(plain.config_path()).unwrap();
    // The floor for any shim in front of runc: a shell script that only execs it.
    let wrapper = host.dir.path().join("exec-runc.sh");
    std::fs::write(&wrapper, format!("#!/bin/sh\nexec {RUNC} \"$@\"\n")).unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    let n: usize = std::env::var("XPU_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    // Two regimes (see the module documentation): runs spaced 20 ms apart, as container starts
    // on a node are, and back to back. `XPU_BENCH_GAP_MS` runs one regime with that gap.
    let regimes: Vec<Duration> = match std::env::var("XPU_BENCH_GAP_MS") {
        Ok(v) => vec![Duration::from_millis(v.parse().expect("XPU_BENCH_GAP_MS: milliseconds"))],
        Err(_) => vec![Duration::from_millis(20), Duration::ZERO],
    };
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut seq = 0_u32;
    for gap in regimes {
        let (mut a, mut d, mut w, mut x) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Plain runc once more, as a case of its own: how far two identical cases land apart in
        // this run is the resolution every other ratio has.
        let mut a_again = Vec::new();
        let mut nothing = vec![Vec::new(); shims.len()];
        let mut request = vec![Vec::new(); shims.len()];
        let mut cases: Vec<(usize, usize)> = vec![(0, 0), (1, 0), (4, 0), (5, 0), (6, 0)];
        cases.extend((0..shims.len()).flat_map(|k| [(2, k), (3, k)]));
        for _ in 0..n {
            // Fisher-Yates.
            for i in (1..cases.len()).rev() {
                cases.swap(i, rng.below(i + 1));
            }
            for &(case, k) in &cases {
                // A fresh name for every container, as engines give them: a reused name would
                // meet the same cgroup directories and state path each time, and whatever that
                // costs would stay with one case for the whole run.
                seq += 1;
                let id = format!("xpu-bench-{seq}");
                // Untimed: the machine idles before the run, so that the last container's
                // teardown in the kernel is over when this one starts.
                std::thread::sleep(gap);
                match case {
                    0 => {
                        fresh_config(&plain, &plain_bytes);
                        a.push(run(Path::new(RUNC), &plain, &id));
                    }
                    1 => {
                        fresh_config(&wants, &edited_bytes);
                        d.push(run(Path::new(RUNC), &wants, &id));
                    }
                    4 => {
                        fresh_config(&plain, &plain_bytes);
                        w.push(run(&wrapper, &plain, &id));
                    }
                    6 => {
                        fresh_config(&plain, &plain_bytes);
                        a_again.push(run(Path::new(RUNC), &plain, &id));
                    }
                    5 => {
                        fresh_config(&wants, &pristine);
                        x.push(run_with(&shims[0].1, &wants, &id, &discover_cfg));
                    }
                    2 => {
                        fresh_config(&plain, &plain_bytes);
                        nothing[k].push(run(&shims[k].1, &plain, &id));
                    }
                    _ => {
                        fresh_config(&wants, &pristine);
                        request[k].push(run(&shims[k].1, &wants, &id));
                    }
                }
            }
        }

        let (a_runs, d_runs) = (a.clone(), d.clone());
        let w_vs = compared(&w, &a_runs);
        let (a, d, w) = (median(a), median(d), median(w));
        if gap.is_zero() {
            println!("back to back, each run starting as the last one ends:");
        } else {
            println!("spaced, each run starting {} after the last one ended:", ms(gap));
        }
        println!(
            "runc run, plain (busybox true):               median {} ({n} runs each, interleaved)",
            ms(a)
        );
        println!(
            "  plain runc against itself, a case of its own: {} (no difference but chance)",
            compared(&a_again, &a_runs)
        );
        println!("plain runc run on the spec the shim edited:   median {}", ms(d));
        println!(
            "runc run through `exec runc \"$@\"` in sh:      median {}: {w_vs} plain (sh's own start, the floor for a shim in a script)",
            ms(w)
        );
        for (k, (label, _)) in shims.iter().enumerate() {
            let (b_runs, c_runs) =
                (std::mem::take(&mut nothing[k]), std::mem::take(&mut request[k]));
            let r = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
            println!("through the {label} shim:");
            println!(
                "  nothing requested:          {} plain (target <= 1.02x); median {}",
                compared(&b_runs, &a_runs),
                ms(median(b_runs.clone()))
            );
            let c = median(c_runs.clone());
            println!(
                "  NVIDIA_VISIBLE_DEVICES=1,3: {} the same edits without the shim (target <= 1.05x); median {}, {:.3}x plain runc on the unedited bundle",
                compared(&c_runs, &d_runs),
                ms(c),
                r(c, a)
            );
            if k == 0 {
                println!(
                    "  the same, discovering instead of the snapshot: {} the same edits without the shim",
                    compared(&x, &d_runs)
                );
            }
        }
        // The shim's cost is what it adds before runc starts, which the process-start loops above
        // measure far more precisely than the spread of `runc run` lets the interleaved runs do.
        let over = |extra: Duration, base: Duration| 1.0 + extra.as_secs_f64() / base.as_secs_f64();
        println!(
            "the {} shim's own time against these medians: a request's {} (measured by itself) = {:.3}x the same edits without the shim; a pass-through's {} = {:.3}x plain",
            shims[0].0,
            ms(own_alone.saturating_sub(own_true)),
            over(own_alone.saturating_sub(own_true), d),
            ms(first_pass.saturating_sub(t_true)),
            over(first_pass.saturating_sub(t_true), a)
        );
    }
    println!("load average at the end: {}", bundle::load_average());
}

/// The shim `scripts/build-shim` leaves in `<target>/shim/`, when it is newer than every source
/// file it is built from.
fn static_shim() -> Result<PathBuf, String> {
    let target = Path::new(XPU).parent().and_then(Path::parent).ok_or("no target directory")?;
    let shim = target.join("shim/xpu-container-runtime");
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sources = ["xpu-core/src", "xpu-host/src", "xpu-container/src", "xpu-shim/src"];
    let mut newest = None;
    for dir in sources {
        newest = newest.max(newest_file(&crates.join(dir)));
    }
    let built = std::fs::metadata(&shim)
        .and_then(|m| m.modified())
        .map_err(|_| format!("{} is not there; scripts/build-shim builds it", shim.display()))?;
    if newest.is_some_and(|t| t > built) {
        return Err(format!(
            "{} is older than its sources; run scripts/build-shim",
            shim.display()
        ));
    }
    Ok(shim)
}

/// The latest modification time of any file under `dir`.
fn newest_file(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_file(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).ok()
        };
        newest = newest.max(t);
    }
    newest
}
