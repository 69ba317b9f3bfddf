//! The front's decisions, and that each one it takes itself is the full shim's: for every
//! command line, runtime config and spec below, when the front hands the command to the real
//! runtime, `xpu_container::shim::handle` passes the same command through to the same runtime
//! without reading the host. Everything else the front hands to the full shim, which then does
//! what it always did. Needs no root.

#![allow(clippy::unwrap_used)]

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use xpu_container::config::RuntimeConfig;
use xpu_container::nvml::FakeNvml;
use xpu_container::request::Wanted;
use xpu_container::shim::{self, Host, Outcome};
use xpu_core::Inventory;
use xpu_core::driver::{Capabilities, DriverFiles};
use xpu_shim_front::{Action, Why, decide};

/// A host the full shim must not read on a pass-through.
struct Untouchable;

impl Host for Untouchable {
    fn inventory(&self, _: Option<&[Wanted]>) -> Result<Inventory, String> {
        panic!("the host was read for a container the front passed through")
    }
    fn driver_files(&self, _: &Inventory, _: Capabilities) -> DriverFiles {
        panic!("driver files were read for a container the front passed through")
    }
}

struct Case {
    dir: tempfile::TempDir,
}

impl Case {
    fn new() -> Case {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        Case { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// An executable file at `p`.
    fn program(&self, p: &str) -> PathBuf {
        let path = self.path(p);
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(&path, mode).unwrap();
        path
    }

    fn config(&self, text: &str) -> PathBuf {
        let p = self.path("runtime.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    fn spec(&self, v: &Value) -> PathBuf {
        let b = self.path("bundle");
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("config.json"), v.to_string()).unwrap();
        b
    }
}

fn env(config: &Path, path: &str) -> Vec<Vec<u8>> {
    vec![
        [b"XPU_RUNTIME_CONFIG=".as_slice(), config.as_os_str().as_bytes()].concat(),
        format!("PATH={path}").into_bytes(),
    ]
}

fn args(a: &[&str]) -> Vec<Vec<u8>> {
    a.iter().map(|s| s.as_bytes().to_vec()).collect()
}

/// The front's decision, checked against the full shim's when the front takes it itself.
fn check(config: &Path, path_var: &str, a: &[&str], exe: &Path) -> Action {
    let e = env(config, path_var);
    let action = decide(&args(a), &e, exe.as_os_str().as_bytes(), b"/nonexistent/xpu-shim-std");
    if let Action::Runtime(runtime) = &action {
        // The full shim reads $PATH from its own environment.
        assert_eq!(path_var, std::env::var("PATH").unwrap_or_default());
        let cfg = RuntimeConfig::parse(&std::fs::read_to_string(config).unwrap(), config)
            .expect("the front accepted a config the full shim refuses");
        let os: Vec<OsString> = a.iter().map(OsString::from).collect();
        let (rt, outcome) = shim::handle(&os, &cfg, &Untouchable, &FakeNvml::default())
            .expect("the front passed through a command the full shim refuses");
        assert!(matches!(outcome, Outcome::PassThrough), "{a:?}");
        assert_eq!(rt.as_os_str().as_bytes(), runtime.as_bytes(), "{a:?}");
    }
    action
}

#[test]
fn hands_runc_only_what_the_full_shim_would_pass_through() {
    let c = Case::new();
    let runc = c.program("bin/runc");
    let path_var = std::env::var("PATH").unwrap_or_default();
    let me = c.program("front");
    let cfg = c.config(&format!(
        "runtime = \"{}\"\nroot = \"/\"\ncuda_version = \"12.2\"\ncdi_dirs = []\n",
        runc.display()
    ));
    let runtime = |a: &[&str]| check(&cfg, &path_var, a, &me);
    let as_runc = Action::Runtime(std::ffi::CString::new(runc.as_os_str().as_bytes()).unwrap());

    // Commands other than create and run go to runc untouched.
    for a in [&["state", "x"][..], &["--root", "/r", "delete", "--force", "x"], &["start", "x"]] {
        assert_eq!(runtime(a), as_runc, "{a:?}");
    }
    assert_eq!(runtime(&["--version"]), Action::Full(Why::Version));
    assert_eq!(runtime(&["-v"]), Action::Full(Why::Version));

    // Specs: the front hands on those that ask for nothing.
    let specs: [(Value, Option<bool>); 11] = [
        (json!({"process": {"env": ["PATH=/bin"]}}), Some(false)),
        (json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}), Some(false)),
        (json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES="]}}), Some(false)),
        (
            json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=void"]}}),
            Some(false),
        ),
        (json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1,3"]}}), Some(true)),
        (json!({"process": {"env": ["XPU_VISIBLE_DEVICES=google.com/tpu=0"]}}), Some(true)),
        (json!({"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}), Some(true)),
        (
            json!({"annotations": {"io.kubernetes.cri.sandbox-id": "abc"}, "process": "odd"}),
            Some(false),
        ),
        (json!({"process": {"env": "A=1"}}), None),
        (json!({"process": {"env": [1]}}), None),
        (json!({"annotations": {"a": 1}}), None),
    ];
    for (spec, asks) in specs {
        let b = c.spec(&spec);
        for a in [
            vec!["create", "--bundle", b.to_str().unwrap(), "id"],
            vec!["--log", "/l", "run", &format!("-b={}", b.display()), "id"],
        ] {
            let want = match asks {
                Some(false) => as_runc.clone(),
                Some(true) => Action::Full(Why::Request),
                None => Action::Full(Why::Spec),
            };
            assert_eq!(runtime(&a), want, "{spec} {a:?}");
        }
    }
    std::fs::write(c.path("bundle/config.json"), "{").unwrap();
    let bundle = c.path("bundle");
    assert_eq!(runtime(&["create", "-b", bundle.to_str().unwrap(), "id"]), Action::Full(Why::Spec));
    let missing = c.path("nothing-here");
    assert_eq!(
        runtime(&["create", "-b", missing.to_str().unwrap(), "id"]),
        Action::Full(Why::Spec)
    );
}

#[test]
fn hands_the_full_shim_every_config_and_runtime_it_does_not_take_as_is() {
    let c = Case::new();
    let runc = c.program("bin/runc");
    let me = c.program("front");
    let path_var = std::env::var("PATH").unwrap_or_default();
    let with = |text: &str| {
        let cfg = c.config(text);
        check(&cfg, &path_var, &["state", "x"], &me)
    };
    let runtime = format!("runtime = \"{}\"\n", runc.display());
    for bad in [
        "runtim = \"x\"",
        "root = \"rel\"",
        "cdi_dirs = [\"cdi\"]",
        "cuda_version = \"x\"",
        "[",
        "root = 1",
    ] {
        assert_eq!(with(&format!("{runtime}{bad}\n")), Action::Full(Why::Config), "{bad}");
        assert!(RuntimeConfig::parse(&format!("{runtime}{bad}\n"), Path::new("r.toml")).is_err());
    }
    // Valid, but the capability names are the full shim's to check.
    assert_eq!(
        with(&format!("{runtime}default_capabilities = \"all\"\n")),
        Action::Full(Why::Config)
    );
    // A config named but missing, and one that is not UTF-8.
    let e = env(&c.path("missing.toml"), &path_var);
    assert_eq!(decide(&args(&["state", "x"]), &e, b"", b""), Action::Full(Why::Config));
    std::fs::write(c.path("runtime.toml"), b"runtime = \"\xff\"").unwrap();
    let e = env(&c.path("runtime.toml"), &path_var);
    assert_eq!(decide(&args(&["state", "x"]), &e, b"", b""), Action::Full(Why::Config));

    // Runtimes: missing, a directory, the front itself, the full shim.
    assert_eq!(with("runtime = \"/nonexistent/runc\""), Action::Full(Why::Runtime));
    assert_eq!(
        with(&format!("runtime = \"{}\"", c.path("bin").display())),
        Action::Full(Why::Runtime)
    );
    assert_eq!(with(&format!("runtime = \"{}\"", me.display())), Action::Full(Why::Runtime));
    let full = c.program("xpu-shim-std");
    let cfg = c.config(&format!("runtime = \"{}\"", full.display()));
    let e = env(&cfg, &path_var);
    let full_bytes = full.as_os_str().as_bytes();
    assert_eq!(
        decide(&args(&["state", "x"]), &e, me.as_os_str().as_bytes(), full_bytes),
        Action::Full(Why::Runtime)
    );

    // A bare name is looked up in $PATH, an empty entry being the current directory, then in
    // the sbin directories, as the full shim does.
    let cfg = c.config("runtime = \"runc\"");
    let bin = c.path("bin");
    let e = env(&cfg, &format!("/nonexistent:{}", bin.display()));
    assert_eq!(
        decide(&args(&["state", "x"]), &e, b"", b""),
        Action::Runtime(std::ffi::CString::new(runc.as_os_str().as_bytes()).unwrap())
    );
}
