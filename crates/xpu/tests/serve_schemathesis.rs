//! Schemathesis (<https://schemathesis.readthedocs.io>, from PyPI) against a live `xpu serve`:
//! it reads the daemon's own `/openapi.json`, generates requests from it (the document's
//! examples, boundary and malformed values of every parameter and body, then random ones and
//! chains through the document's links) and fails on any server error and on any answer the
//! document does not describe: an undeclared status, another content type, a body or header
//! that does not match its schema.
//!
//! The binary comes from `scripts/install-schemathesis` (a pinned version in a virtual
//! environment under `~/.cache/xpu`); without it this test fails with that command. The run is
//! bounded (examples per operation, a seed, a request timeout) so that it takes well under a
//! minute on two cores.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::path::PathBuf;
use std::process::Command;

use serve_support::{Daemon, kill_tasks};

/// Where `scripts/install-schemathesis` puts the binary (`$XPU_SCHEMATHESIS` overrides).
fn schemathesis() -> PathBuf {
    if let Some(p) = std::env::var_os("XPU_SCHEMATHESIS") {
        return PathBuf::from(p);
    }
    let venv = match std::env::var_os("XPU_SCHEMATHESIS_VENV") {
        Some(v) => PathBuf::from(v),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap()
            .join("xpu/schemathesis"),
    };
    venv.join("bin/schemathesis")
}

/// The checks: server errors, and conformance of every answer's status, content type, headers
/// and body to the document. (`positive_data_acceptance` is left out: a manifest the schema
/// allows, any YAML string, is mostly not a job; `ignored_auth` too: loopback needs no token by
/// design, which the document's optional security says.)
const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
response_headers_conformance,response_schema_conformance,negative_data_rejection,\
missing_required_header,unsupported_method,use_after_free,ensure_resource_availability";

#[test]
fn schemathesis_finds_no_server_error_and_no_answer_outside_the_document() {
    let bin = schemathesis();
    assert!(
        bin.exists(),
        "{} is missing: run scripts/install-schemathesis (scripts/test does) to install it from PyPI",
        bin.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        &dir.path().join("data"),
        None,
        &["--devices", "nvidia-a100:2", "--node-name", "node-a"],
    );
    // Jobs in every ended state, with output, so that lists, logs and events have something
    // to show; none left queued or running, so that a followed log ends at once.
    let ok = d.submit("name: hello\ncommand: [sh, -c, 'echo hello from $XPU_JOB_ID']\ngpus: 1\n");
    let failed = d.submit("name: fails\ncommand: [sh, -c, 'echo bye; exit 3']\n");
    let cancelled = d.submit("name: sleeper\ncommand: [sleep, \"300\"]\n");
    d.wait_pid(cancelled);
    let r = d.client().request("POST", &format!("/v1/jobs/{cancelled}/cancel"), None, &[]).unwrap();
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    for (id, state) in [(ok, "succeeded"), (failed, "failed"), (cancelled, "cancelled")] {
        d.wait_state(id, &[state]);
    }

    let started = std::time::Instant::now();
    let out = Command::new(&bin)
        .arg("run")
        .arg(format!("{}/openapi.json", d.url()))
        .args(["--checks", CHECKS])
        .args(["--max-examples", "25", "--seed", "15", "--workers", "1"])
        .args(["--request-timeout", "20", "--max-failures", "20"])
        .args(["--generation-database", "none", "--no-color"])
        // As the daemon's own user, so that submits, cancels and logs are reached too.
        .args(["--header", &format!("Authorization: Bearer {}", d.token())])
        .current_dir(dir.path())
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("schemathesis ran {:.1} s:\n{text}", started.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "schemathesis found failures (exit {:?}); its report is above\n{}",
        out.status.code(),
        d.log()
    );
    kill_tasks(&d.data_dir);
}
