//! Every error the CLI prints for a set of bad inputs: a message never repeats its source, so
//! the chain `error: outer: inner: root` says each thing once (../shared/STYLE.md). The CLI
//! prints each link on its own line under `XPU_ERROR_CHAIN=lines`; a link that contains a later
//! one, or the same text twice, fails the test naming the command.
#![allow(clippy::unwrap_used)]

use std::process::Command;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

/// The chain's links as the CLI printed them.
fn chain(args: &[&str]) -> (Option<i32>, Vec<String>, String) {
    let out = Command::new(XPU)
        .args(args)
        .env("XPU_ERROR_CHAIN", "lines")
        .env_remove("XPU_SERVER")
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let links =
        err.lines().filter_map(|l| l.strip_prefix("  cause: ")).map(str::to_owned).collect();
    (out.status.code(), links, err)
}

/// Where a link repeats a later one (its source, or its source's source).
fn repeated(links: &[String]) -> Option<(usize, usize)> {
    for (i, outer) in links.iter().enumerate() {
        for (j, inner) in links.iter().enumerate().skip(i + 1) {
            // Short roots ("not found") may well appear in an outer message by chance.
            if inner.len() >= 12 && outer.contains(inner.as_str()) {
                return Some((i, j));
            }
        }
    }
    None
}

#[test]
fn no_error_the_cli_prints_repeats_its_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let bad_yaml = tmp.path().join("bad.yaml");
    std::fs::write(&bad_yaml, "apiVersion: batch/v1\nkind: Job\nspec: [\n").unwrap();
    let not_a_job = tmp.path().join("cm.yaml");
    std::fs::write(&not_a_job, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n").unwrap();
    let short_key = tmp.path().join("key");
    std::fs::write(&short_key, "short").unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("sub");
    let p = |x: &std::path::Path| x.to_str().unwrap().to_owned();
    let (bad_yaml, not_a_job, short_key, under_file) =
        (p(&bad_yaml), p(&not_a_job), p(&short_key), p(&under_file));
    let closed = "http://127.0.0.1:1";
    let cases: Vec<Vec<&str>> = vec![
        vec!["submit", "--server", closed, "/nonexistent/job.yaml"],
        vec!["submit", "--server", closed, &bad_yaml],
        vec!["submit", "--server", closed, &not_a_job],
        vec!["submit", "--server", closed, "--gpus", "1", "--", "true"],
        vec!["submit", "--server", "unix:///nonexistent/xpu.sock", "--gpus", "1", "--", "true"],
        vec!["jobs", "--server", closed],
        vec!["job", "--server", closed, "1"],
        vec!["cancel", "--server", closed, "1"],
        vec!["devices", "--server", closed],
        vec!["discover", "--root", "/nonexistent"],
        vec!["discover", "--pci-ids", "/nonexistent/pci.ids"],
        vec!["doctor", "--root", "/nonexistent", "--profile", "vfio-host"],
        vec!["cdi", "generate", "--root", "/nonexistent"],
        vec!["cdi", "generate", "--output", &under_file],
        vec!["vfio", "bind", "--root", "/nonexistent", "0000:00:00.0"],
        vec!["host", "render", "--profile", "vfio-host", "--devices", "zz:zz"],
        vec!["exporter", "--root", "/nonexistent", "--once"],
        vec![
            "sim",
            "openb",
            "--nodes",
            "/nonexistent/nodes.csv",
            "--pods",
            "/nonexistent/pods.csv",
        ],
        vec!["k8s", "scheduler", "--kubeconfig", "/nonexistent/kubeconfig"],
        vec!["k8s", "scheduler", "--share-key", &short_key, "--kubeconfig", "/nonexistent"],
        vec!["k8s", "scheduler", "--share-key", "/nonexistent/key"],
        vec!["k8s", "device-plugin", "--root", "/nonexistent", "--plugin-dir", &under_file],
        vec!["k8s", "nfd-features", "--root", "/nonexistent"],
        vec!["serve", "--data-dir", &under_file, "--no-tcp"],
        vec!["serve", "--db", "postgres://nobody@127.0.0.1:1/xpu", "--no-tcp"],
        vec!["serve", "--listen", "256.0.0.1:80"],
    ];
    let mut failures = Vec::new();
    let mut checked = 0;
    for args in &cases {
        let (code, links, err) = chain(args);
        if code == Some(0) {
            continue;
        }
        if links.is_empty() {
            // clap's usage errors are not chains.
            assert!(code == Some(2), "{args:?}: no chain and exit {code:?}: {err}");
            continue;
        }
        checked += 1;
        if let Some((i, j)) = repeated(&links) {
            failures.push(format!(
                "xpu {}: link {i} repeats link {j}:\n  {}",
                args.join(" "),
                links.join("\n  ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} chains repeat a cause:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        checked >= 15,
        "only {checked} of {} bad inputs reached the CLI's error path",
        cases.len()
    );
}
