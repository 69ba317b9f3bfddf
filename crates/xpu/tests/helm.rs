//! The Helm chart `deploy/helm/xpu`, with the real `helm` (v3.22.0, `scripts/install-helm`):
//! `helm lint` passes; its rendering with the default values is, file for file, what
//! `deploy/kubernetes` holds (those are generated from it by `scripts/render-manifests`, and the
//! cluster tests apply them); and the values an admin sets (node groups for the device plugin
//! and for DRA, components off, the scheduler's flags and replicas) render what they say.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod k8s_support;

use k8s_support::render;

fn repo() -> std::path::PathBuf {
    k8s_support::repo()
}

fn run(args: &[&str]) -> String {
    k8s_support::helm_run(args)
}

fn find<'a>(
    docs: &'a [serde_json::Value],
    kind: &str,
    name: &str,
) -> Option<&'a serde_json::Value> {
    docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

#[test]
fn the_chart_lints_and_renders_the_plain_manifests() {
    run(&["lint", "--strict", "deploy/helm/xpu"]);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    run(&[
        "template",
        "xpu",
        "deploy/helm/xpu",
        "--namespace",
        "xpu-system",
        "--kube-version",
        "v1.37.2",
        "--output-dir",
        dir,
    ]);
    let rendered = out.path().join("xpu/templates");
    let mut names: Vec<String> = std::fs::read_dir(&rendered)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut plain: Vec<String> = std::fs::read_dir(repo().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    plain.sort();
    assert_eq!(names, plain, "deploy/kubernetes holds one file per template");
    for name in &names {
        let want = std::fs::read_to_string(rendered.join(name)).unwrap();
        let have = std::fs::read_to_string(repo().join("deploy/kubernetes").join(name)).unwrap();
        assert!(
            want == have,
            "deploy/kubernetes/{name} differs from the chart's rendering: run scripts/render-manifests"
        );
    }
}

#[test]
fn values_set_node_groups_components_and_the_schedulers_flags() {
    let docs = render(&[
        "--set-json",
        r#"nodeAgent.nodeSelector={"xpu.dev/devices":"plugin"}"#,
        "--set-json",
        r#"dra.nodeSelector={"xpu.dev/devices":"dra"}"#,
        "--set-json",
        r#"scheduler.extraArgs=["--no-preemption","--bind-concurrency=32"]"#,
        "--set",
        "scheduler.replicas=3,scheduler.name=default-scheduler,image=registry.example/xpu:1.2.3",
        "--set",
        "exporter.enabled=false",
    ]);
    let agent = find(&docs, "DaemonSet", "xpu-node-agent").unwrap();
    assert_eq!(agent["spec"]["template"]["spec"]["nodeSelector"]["xpu.dev/devices"], "plugin");
    let dra = find(&docs, "DaemonSet", "xpu-dra-driver").unwrap();
    assert_eq!(dra["spec"]["template"]["spec"]["nodeSelector"]["xpu.dev/devices"], "dra");
    assert_eq!(
        dra["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.example/xpu:1.2.3"
    );
    let sched = find(&docs, "Deployment", "xpu-scheduler").unwrap();
    assert_eq!(sched["spec"]["replicas"], 3);
    let args: Vec<&str> = sched["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--scheduler-name=default-scheduler"), "{args:?}");
    assert!(args.ends_with(&["--no-preemption", "--bind-concurrency=32"]), "{args:?}");
    assert!(find(&docs, "DaemonSet", "xpu-exporter").is_none(), "exporter.enabled=false");
    // Off by default: no component renders anything.
    let none = render(&[
        "--set",
        "scheduler.enabled=false,nodeAgent.enabled=false,dra.enabled=false,exporter.enabled=false,gpuShare.enabled=false",
    ]);
    let kinds: Vec<&str> = none.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Namespace"], "only the namespace stays");
}
