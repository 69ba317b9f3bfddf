//! What the Debian package installs: the systemd units under `packaging/systemd` (structure,
//! `systemd-analyze verify` and the exposure scores), the default `/etc/xpu/runtime.toml`,
//! `xpu --version` and `xpu-container-runtime --version`, and the completions (loaded by bash,
//! parsed by zsh and fish) and man pages the binary generates for `scripts/build-deb`. The package
//! itself is built from the binaries cargo built for these tests and installed into a throw-away
//! root by `deb_package_installs_into_a_throwaway_root`.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use xpu_container::config::RuntimeConfig;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

/// The shim's binary `xpu-container-runtime` (the xpu-shim package), built into the same
/// directory as `xpu`. It belongs to another package, whose binaries cargo does not build for
/// these tests, so this runs `cargo build` for it, unless `XPU_TEST_SHIM` names the one
/// `cargo test --workspace` built (scripts/test does: a build of xpu-shim alone unifies features
/// differently and recompiles its dependencies, some 20 s).
fn shim() -> PathBuf {
    // scripts/test names the shim `cargo test --workspace` built, which is current.
    if let Some(built) = std::env::var_os("XPU_TEST_SHIM") {
        let built = PathBuf::from(built);
        assert!(built.is_file(), "XPU_TEST_SHIM={} is not a file", built.display());
        return built;
    }
    let shim = Path::new(XPU).with_file_name("xpu-container-runtime");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build.args(["build", "--locked", "-p", "xpu-shim", "--bin", "xpu-container-runtime"]);
    if shim.parent().and_then(Path::file_name).is_some_and(|p| p == "release") {
        build.arg("--release");
    }
    let o = build.current_dir(repo()).output().unwrap();
    assert!(o.status.success(), "cargo build (shim): {}", String::from_utf8_lossy(&o.stderr));
    assert!(shim.is_file(), "cargo build did not leave {}", shim.display());
    shim
}
/// The script `xpu-tpu-env.service` runs; `xpu host apply --profile tpu-vm` writes it.
const TPU_ENV_SCRIPT: &str = "/var/scripts/xpu-tpu-env.sh";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn xpu(args: &[&str]) -> Output {
    Command::new(XPU).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// man's output as plain text: bold comes out as overstrike (`N\bNA\bA...`) when man writes to
/// a pipe.
fn without_overstrike(s: &str) -> String {
    let mut text = String::new();
    for c in s.chars() {
        if c == '\u{8}' {
            text.pop();
        } else {
            text.push(c);
        }
    }
    text
}

/// Whether `program` can be run at all (`--version` exits, whatever its status).
fn have(program: &str) -> bool {
    Command::new(program).arg("--version").output().is_ok()
}

/// A unit file as section -> key -> values (a key may repeat).
type Unit = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn parse_unit(text: &str) -> Unit {
    let mut unit = Unit::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            unit.entry(section.clone()).or_default();
            continue;
        }
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("not key=value: {line}"));
        assert!(!section.is_empty(), "{line} is outside a section");
        unit.get_mut(&section)
            .unwrap()
            .entry(k.trim().to_owned())
            .or_default()
            .push(v.trim().to_owned());
    }
    unit
}

fn units() -> BTreeMap<String, (String, Unit)> {
    let dir = repo().join("packaging/systemd");
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        out.insert(name, (text.clone(), parse_unit(&text)));
    }
    out
}

fn one<'a>(unit: &'a Unit, section: &str, key: &str) -> &'a str {
    let values = unit.get(section).and_then(|s| s.get(key));
    values.and_then(|v| v.last()).map_or("", String::as_str)
}

#[test]
fn units_have_the_keys_the_package_relies_on() {
    let units = units();
    let names: Vec<&str> = units.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "xpu-cdi-generate.service",
            "xpu-device-plugin.service",
            "xpu-exporter.service",
            "xpu-nfd-features.service",
            "xpu-nfd-features.timer",
            "xpu-serve.service",
            "xpu-tpu-env.service"
        ]
    );
    for (name, (_, unit)) in &units {
        assert!(!one(unit, "Unit", "Description").is_empty(), "{name}: no Description");
        // xpu-tpu-env.service is `xpu host render`'s unit (tpu_env_unit_is_what_host_render_writes):
        // it runs the rendered script, which writes /etc/environment and /home/tpu-runtime.
        if name.ends_with(".service") && name != "xpu-tpu-env.service" {
            let exec = one(unit, "Service", "ExecStart");
            let argv: Vec<&str> = exec.split_whitespace().collect();
            assert_eq!(argv.first(), Some(&"/usr/bin/xpu"), "{name}: {exec}");
            // The command line parses: the same arguments with --help exit 0.
            let mut args: Vec<&str> = argv[1..].to_vec();
            args.push("--help");
            let o = xpu(&args);
            assert!(o.status.success(), "{name}: `xpu {}` does not parse: {o:?}", args.join(" "));
            for key in ["ProtectSystem", "ProtectHome", "PrivateTmp"] {
                assert!(!one(unit, "Service", key).is_empty(), "{name}: no {key}");
            }
        }
    }
    let serve = &units["xpu-serve.service"].1;
    assert_eq!(one(serve, "Service", "StateDirectory"), "xpu");
    assert_eq!(one(serve, "Service", "Restart"), "on-failure");
    assert_eq!(one(serve, "Service", "ProtectHome"), "yes");
    assert_eq!(one(serve, "Service", "PrivateTmp"), "yes");
    assert_eq!(one(serve, "Service", "Delegate"), "yes");
    assert_eq!(one(serve, "Install", "WantedBy"), "multi-user.target");
    // NoNewPrivileges is left unset on purpose, and the unit says why.
    assert!(units["xpu-serve.service"].0.contains("# NoNewPrivileges is NOT set"));
    assert_eq!(one(&units["xpu-device-plugin.service"].1, "Service", "NoNewPrivileges"), "yes");
    let timer = &units["xpu-nfd-features.timer"].1;
    assert!(!one(timer, "Timer", "OnUnitActiveSec").is_empty());
    assert_eq!(one(timer, "Install", "WantedBy"), "timers.target");
    assert_eq!(one(&units["xpu-nfd-features.service"].1, "Service", "Type"), "oneshot");
    let tpu = &units["xpu-tpu-env.service"].1;
    assert_eq!(one(tpu, "Service", "ExecStart"), TPU_ENV_SCRIPT);
    assert_eq!(one(tpu, "Unit", "ConditionFileIsExecutable"), TPU_ENV_SCRIPT);
}

#[test]
fn tpu_env_unit_is_what_host_render_writes() {
    let dir = tempfile::tempdir().unwrap();
    let o = xpu(&["host", "render", "--profile", "tpu-vm", "--out", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let rendered =
        std::fs::read_to_string(dir.path().join("etc/systemd/system/xpu-tpu-env.service")).unwrap();
    let packaged =
        std::fs::read_to_string(repo().join("packaging/systemd/xpu-tpu-env.service")).unwrap();
    assert_eq!(packaged, rendered, "packaging/systemd/xpu-tpu-env.service differs from render's");
    let script = dir.path().join(TPU_ENV_SCRIPT.trim_start_matches('/'));
    assert!(std::fs::read_to_string(script).unwrap().contains("xpu host metadata-env"));
}

#[test]
fn units_pass_systemd_analyze_verify() {
    assert!(
        have("systemd-analyze"),
        "systemd-analyze is not installed (Debian package systemd); run scripts/install-test-deps"
    );
    // The units as shipped, with /usr/bin/xpu pointing at the binary under test and the tpu-env
    // script at a stand-in (verify checks that ExecStart= is executable; on a host the script is
    // there once `xpu host apply --profile tpu-vm` wrote it).
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("xpu-tpu-env.sh");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut paths = Vec::new();
    for (name, (text, _)) in units() {
        let path = dir.path().join(&name);
        let text = text.replace("/usr/bin/xpu", XPU);
        std::fs::write(&path, text.replace(TPU_ENV_SCRIPT, script.to_str().unwrap())).unwrap();
        paths.push(path);
    }
    let o = Command::new("systemd-analyze")
        .arg("verify")
        .arg("--man=no")
        .args(&paths)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");

    // The exposure scores, printed for the record (`cargo test -- --nocapture`); the kubelet-side
    // units are locked down. The daemon scores 4.9 (the issue's bar is below 5.0): it runs runc
    // and its tasks inherit the unit, so what is left unset would break them (the unit says why).
    for (name, limit) in [
        ("xpu-serve.service", 5.0),
        ("xpu-device-plugin.service", 3.0),
        ("xpu-exporter.service", 3.0),
        ("xpu-nfd-features.service", 3.0),
        ("xpu-cdi-generate.service", 3.0),
    ] {
        let o = Command::new("systemd-analyze")
            .args(["security", "--offline=yes"])
            .arg(dir.path().join(name))
            .output()
            .unwrap();
        let text = stdout(&o);
        let score = text
            .lines()
            .find_map(|l| {
                l.split_once("Overall exposure level for ")?.1.split_once(": ")?.1.split(' ').next()
            })
            .unwrap_or_else(|| panic!("systemd-analyze security --offline=yes {name}: {o:?}"));
        eprintln!("systemd-analyze security {name}: {score}");
        let score: f64 = score.parse().unwrap();
        assert!(score < limit, "{name}: exposure {score}, was below {limit}");
    }
}

#[test]
fn default_runtime_toml_is_the_built_in_defaults() {
    let path = repo().join("packaging/etc/runtime.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let cfg = RuntimeConfig::parse(&text, &path).unwrap();
    assert_eq!(cfg, RuntimeConfig { source: Some(path.clone()), ..RuntimeConfig::default() });
    // Every documented key, uncommented, is one the shim accepts (unknown keys are errors).
    let uncommented: String = text
        .lines()
        .map(|l| l.strip_prefix('#').filter(|r| r.contains(" = ")).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let cfg = RuntimeConfig::parse(&uncommented, &path).unwrap();
    assert_eq!(cfg.runtime, "runc");
    assert_eq!(cfg.root, Path::new("/"));
    assert_eq!(cfg.log_file.as_deref(), Some(Path::new("/var/log/xpu-runtime.log")));
    assert!(cfg.cuda_version.is_some());
}

#[test]
fn version_names_the_commit() {
    let o = xpu(&["--version"]);
    assert!(o.status.success());
    let out = stdout(&o);
    let rest = out.trim().strip_prefix(concat!("xpu ", env!("CARGO_PKG_VERSION"), " (")).unwrap();
    let commit = rest.strip_suffix(')').unwrap();
    let in_git = Command::new("git")
        .args(["rev-parse", "--git-dir"])
        .current_dir(repo())
        .output()
        .is_ok_and(|o| o.status.success());
    if !in_git {
        assert_eq!(commit, "unknown");
        return;
    }
    assert!(commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit()), "{out}");
    // A commit of this repository (HEAD when the binary was built; others may commit since).
    let known = Command::new("git")
        .args(["cat-file", "-e", &format!("{commit}^{{commit}}")])
        .current_dir(repo())
        .status()
        .unwrap();
    assert!(known.success(), "{commit} is not a commit of this repository");
    // Subcommands say the same.
    assert_eq!(
        stdout(&xpu(&["serve", "--version"])).trim(),
        format!("xpu-serve {}", &out.trim()[4..])
    );
}

/// `xpu-container-runtime --version` (and runc's `-v`, and `xpu runtime --version`) prints the
/// shim's version and commit, then the wrapped runc's lines, which engines (`docker info`) read.
#[test]
fn shim_version_is_its_own_then_runcs() {
    assert!(
        have("runc"),
        "runc is not installed (Debian package runc); run scripts/install-test-deps"
    );
    let version = stdout(&xpu(&["--version"]));
    let commit = version.trim().rsplit_once(" (").unwrap().1.trim_end_matches(')').to_owned();
    let own = [
        concat!("xpu-container-runtime version ", env!("CARGO_PKG_VERSION")).to_owned(),
        format!("commit: {commit}"),
    ];
    let config = repo().join("packaging/etc/runtime.toml");
    let shim = shim();
    let shim = shim.to_str().unwrap();
    for argv in [&[shim, "--version"][..], &[shim, "-v"], &[XPU, "runtime", "--version"]] {
        let o = Command::new(argv[0])
            .args(&argv[1..])
            .env("XPU_RUNTIME_CONFIG", &config)
            .output()
            .unwrap();
        assert!(o.status.success(), "{argv:?}: {o:?}");
        let out = stdout(&o);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[..2], own, "{argv:?}: {out}");
        assert!(lines.get(2).is_some_and(|l| l.starts_with("runc version")), "{argv:?}: {out}");
    }
    // Without the runtime the shim's own lines still come, and stderr says why runc's do not.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("runtime.toml");
    std::fs::write(&missing, "runtime = \"/nonexistent/runc\"\n").unwrap();
    let o =
        Command::new(shim).arg("--version").env("XPU_RUNTIME_CONFIG", &missing).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    assert_eq!(stdout(&o).lines().collect::<Vec<_>>(), own);
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/runc"), "{o:?}");
}

#[test]
fn completions_name_the_subcommands_load_in_bash_and_parse_in_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let o = xpu(&["completions", shell]);
        assert!(o.status.success(), "{shell}: {o:?}");
        let text = stdout(&o);
        for word in ["discover", "serve", "device-plugin", "nfd-features", "data-dir"] {
            assert!(text.contains(word), "{shell} completion does not name {word}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("xpu");
    std::fs::write(&file, xpu(&["completions", "bash"]).stdout).unwrap();
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!("source '{}' && complete -p xpu", file.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("-F _xpu"), "{o:?}");
    for (shell, flag) in [("zsh", "-n"), ("fish", "--no-execute")] {
        assert!(
            have(shell),
            "{shell} is not installed (Debian package {shell}); run scripts/install-test-deps"
        );
        let path = dir.path().join(format!("xpu.{shell}"));
        std::fs::write(&path, xpu(&["completions", shell]).stdout).unwrap();
        let o = Command::new(shell).arg(flag).arg(&path).output().unwrap();
        assert!(o.status.success(), "{shell} {flag}: {o:?}");
    }
    assert_eq!(xpu(&["completions", "tcsh"]).status.code(), Some(2));
}

#[test]
fn man_pages_cover_every_visible_command_and_render() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("man1");
    let o = xpu(&["man", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let mut pages: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    pages.sort();
    assert_eq!(stdout(&o).lines().count(), pages.len());
    for page in [
        "xpu.1",
        "xpu-serve.1",
        "xpu-discover.1",
        "xpu-k8s-device-plugin.1",
        "xpu-k8s-nfd-features.1",
    ] {
        assert!(pages.iter().any(|p| p == page), "no {page} in {pages:?}");
    }
    // The packaging helpers are hidden, and so are their pages.
    assert!(!pages.iter().any(|p| p.starts_with("xpu-completions") || p.starts_with("xpu-man")));
    let top = std::fs::read_to_string(out.join("xpu.1")).unwrap();
    assert!(top.contains("discover"), "{top}");
    assert!(
        have("man"),
        "man is not installed (Debian package man-db); run scripts/install-test-deps"
    );
    for page in &pages {
        let o = Command::new("man")
            .args(["-l", "--warnings"])
            .arg(out.join(page))
            .env("MANWIDTH", "80")
            .env("MAN_KEEP_FORMATTING", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && stderr.trim().is_empty(), "man -l {page}: {stderr}");
        let text = without_overstrike(&stdout(&o));
        assert!(text.contains("NAME"), "man -l {page} rendered nothing: {text}");
    }
}

/// Builds the package with `scripts/build-deb --no-build` from the binaries cargo built for these
/// tests (not the release build and static shim `scripts/build-deb` makes by default, which take
/// minutes), checks its contents and control files and lintian's verdict, installs it with
/// `dpkg --root` into a throw-away root, runs the installed binaries, loads the installed
/// completion and renders the installed man pages, then removes (the conffile stays) and purges
/// it (the conffile goes). dpkg --root needs root.
#[test]
fn deb_package_installs_into_a_throwaway_root() {
    for (program, package) in [("dpkg-deb", "dpkg"), ("lintian", "lintian"), ("man", "man-db")] {
        assert!(
            have(program),
            "{program} is not installed (Debian package {package}); run scripts/install-test-deps"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(repo().join("scripts/build-deb"))
        .arg("--no-build")
        .arg("--out")
        .arg(dir.path())
        .env("XPU_DEB_XPU_BIN", XPU)
        .env("XPU_DEB_SHIM_BIN", shim())
        .env("XPU_DEB_COMPRESSION", "gzip")
        .output()
        .unwrap();
    assert!(o.status.success(), "scripts/build-deb: {}", String::from_utf8_lossy(&o.stderr));
    let deb = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .unwrap();
    let contents = stdout(&Command::new("dpkg-deb").arg("-c").arg(&deb).output().unwrap());
    for path in [
        "./usr/bin/xpu",
        "./usr/bin/xpu-container-runtime",
        "./usr/lib/systemd/system/xpu-serve.service",
        "./usr/lib/systemd/system/xpu-device-plugin.service",
        "./usr/lib/systemd/system/xpu-exporter.service",
        "./usr/lib/systemd/system/xpu-nfd-features.service",
        "./usr/lib/systemd/system/xpu-nfd-features.timer",
        "./usr/lib/systemd/system/xpu-tpu-env.service",
        "./etc/xpu/runtime.toml",
        "./usr/lib/systemd/system/xpu-cdi-generate.service",
        "./usr/lib/udev/rules.d/70-xpu-cdi.rules",
        "./usr/share/bash-completion/completions/xpu",
        "./usr/share/zsh/vendor-completions/_xpu",
        "./usr/share/fish/vendor_completions.d/xpu.fish",
        "./usr/share/man/man1/xpu.1.gz",
        "./usr/share/man/man1/xpu-serve.1.gz",
        "./usr/share/doc/xpu/copyright",
        "./usr/share/doc/xpu/changelog.Debian.gz",
    ] {
        assert!(contents.lines().any(|l| l.ends_with(path)), "{path} missing from\n{contents}");
    }
    assert!(contents.lines().all(|l| l.contains("root/root")), "{contents}");
    let info = stdout(&Command::new("dpkg-deb").arg("-I").arg(&deb).output().unwrap());
    for needle in ["Package: xpu", "Depends: libc6 (>= ", "Recommends: runc", "conffiles"] {
        assert!(info.contains(needle), "{needle} missing from\n{info}");
    }

    // Errors fail; warnings are listed in packaging/debian/lintian-overrides or build-deb.
    let o = Command::new("lintian").arg(&deb).output().unwrap();
    let report = stdout(&o);
    assert!(!report.lines().any(|l| l.starts_with("E:")), "lintian: {report}");
    eprintln!("lintian:\n{report}");

    let root = dir.path().join("root");
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates", "etc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    let dpkg = |args: &[&str]| {
        let o = Command::new("dpkg")
            .arg(format!("--root={}", root.display()))
            .args(["--force-script-chrootless", "--force-depends", "--log=/dev/null"])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "dpkg {args:?}: {o:?}");
    };
    dpkg(&["-i", deb.to_str().unwrap()]);
    let installed = root.join("usr/bin/xpu");
    let o = Command::new(&installed).arg("--version").output().unwrap();
    assert!(stdout(&o).starts_with("xpu "), "{o:?}");
    let o = Command::new(&installed).args(["discover", "--all"]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    // The shim's own version, reading the installed runtime.toml (runc's lines follow when runc
    // is installed: shim_version_is_its_own_then_runcs).
    let o = Command::new(root.join("usr/bin/xpu-container-runtime"))
        .arg("--version")
        .env("XPU_RUNTIME_CONFIG", root.join("etc/xpu/runtime.toml"))
        .output()
        .unwrap();
    let first = concat!("xpu-container-runtime version ", env!("CARGO_PKG_VERSION"));
    assert!(o.status.success() && stdout(&o).starts_with(first), "{o:?}");
    let completion = root.join("usr/share/bash-completion/completions/xpu");
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!("source '{}' && complete -p xpu", completion.display()))
        .output()
        .unwrap();
    assert!(o.status.success() && stdout(&o).contains("-F _xpu"), "{o:?}");
    let man1 = root.join("usr/share/man/man1");
    let mut pages: Vec<PathBuf> =
        std::fs::read_dir(&man1).unwrap().map(|e| e.unwrap().path()).collect();
    pages.sort();
    assert!(pages.len() > 5, "{pages:?}");
    for page in &pages {
        // xpu-container-runtime.1.gz is a symlink to xpu-runtime.1.gz, rendered through it.
        let o = Command::new("man")
            .args(["-l", "--warnings"])
            .arg(page)
            .env("MANWIDTH", "80")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && stderr.trim().is_empty(), "man -l {page:?}: {stderr}");
        let text = without_overstrike(&stdout(&o));
        assert!(text.contains("NAME"), "man -l {page:?} rendered nothing: {text}");
    }
    let conffile = root.join("etc/xpu/runtime.toml");
    dpkg(&["-r", "xpu"]);
    assert!(!installed.exists());
    assert!(conffile.exists(), "dpkg -r removed the conffile");
    dpkg(&["-P", "xpu"]);
    assert!(!conffile.exists(), "dpkg -P left the conffile");
}

#[test]
fn output_piped_into_a_reader_that_stops_ends_quietly() {
    use std::process::Stdio;
    // `xpu discover --all --format json | head -0`: the reader is gone before the first write.
    let mut child = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["discover", "--all", "--format", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    // As a process killed by SIGPIPE reports itself to a shell (128 + 13), or 0 when the whole
    // output fit in the pipe before it closed.
    assert!(matches!(out.status.code(), Some(141 | 0)), "{:?}", out.status);
}
