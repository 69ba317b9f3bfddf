//! The cluster `scripts/local-cluster up` starts, for a person to try xpu on one machine without
//! accelerators: a control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)
//! and seven real nodes (kubelet v1.37.2, containerd, runc) whose devices come from fixture hosts,
//! with xpu installed as an admin installs it (its image imported into every node, the Helm chart
//! applied: the scheduler Deployment, the node agent, DRA driver and exporter DaemonSets as pods).
//!
//!   local_cluster --repo DIR --binaries DIR --state DIR
//!
//! Writes `STATE/kubeconfig` (the admin's) and `STATE/ready` (what runs where) once everything
//! runs, then runs until SIGTERM or SIGINT, when it stops every node and the plane and removes
//! what they made. Needs root, like the test nodes.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};
use xpu_testkit::kubelet::{Node, NodeOptions};
use xpu_testkit::{BuildOptions, Fixture, HostSpec, cluster, hosts};

/// Labels a node gets besides its discovery labels.
type Labels = &'static [(&'static str, &'static str)];

/// The nodes: name, fixture host, the node group the chart's values select, extra labels.
fn layout() -> Vec<(&'static str, HostSpec, &'static str, Labels)> {
    const TPU: Labels = &[
        ("cloud.google.com/gke-tpu-accelerator", "tpu-v5p-slice"),
        ("cloud.google.com/gke-tpu-topology", "2x2x2"),
        ("cloud.google.com/gke-nodepool", "tpu-pool"),
    ];
    vec![
        ("127.0.0.2", hosts::a100_4x(), "device-plugin", &[]),
        ("127.0.0.3", hosts::a100_4x(), "device-plugin", &[]),
        ("127.0.0.4", hosts::tpu_v5p(), "device-plugin", TPU),
        ("127.0.0.5", hosts::tpu_v5p(), "device-plugin", TPU),
        ("127.0.0.6", hosts::a100_4x(), "dra", &[]),
        ("127.0.0.7", cpu_host(), "none", &[]),
        ("127.0.0.8", hosts::a100_4x(), "share", &[("xpu.dev/gpu-share", "true")]),
    ]
}

/// A host with no accelerator (the A100 host's CPUs, memory and driver, no PCI devices).
fn cpu_host() -> HostSpec {
    let mut h = hosts::a100_4x();
    h.name = "cpu".into();
    h.devices.clear();
    h
}

struct Args {
    repo: PathBuf,
    binaries: PathBuf,
    state: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut repo, mut binaries, mut state) = (None, None, None);
    while let Some(a) = it.next() {
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--repo" => repo = Some(PathBuf::from(v)),
            "--binaries" => binaries = Some(PathBuf::from(v)),
            "--state" => state = Some(PathBuf::from(v)),
            _ => return Err(format!("unknown argument {a}; use --repo, --binaries, --state")),
        }
    }
    Ok(Args {
        repo: repo.ok_or("--repo DIR is required")?,
        binaries: binaries.ok_or("--binaries DIR is required")?,
        state: state.ok_or("--state DIR is required")?,
    })
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("local_cluster: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("local_cluster: {e}");
            ExitCode::FAILURE
        }
    }
}

fn say(started: Instant, what: &str) {
    println!("[{:6.1}s] {what}", started.elapsed().as_secs_f64());
}

async fn run(a: Args) -> Result<(), String> {
    let started = Instant::now();
    std::fs::create_dir_all(&a.state).map_err(|e| format!("{}: {e}", a.state.display()))?;
    let archive = a.state.join("xpu-image.tar");
    say(started, &cluster::build_image(&a.repo, &a.binaries, &archive)?);

    let controllers = cluster::chart_controllers(&[
        "resourceclaim-controller",
        "garbage-collector-controller",
        "node-lifecycle-controller",
        "taint-eviction-controller",
    ]);
    let cp = ControlPlane::start(
        ControlPlaneOptions::default()
            .with_scheduler()
            .with_controller_manager()
            .controllers(controllers),
    )
    .await
    .map_err(|e| format!("the control plane: {e}"))?;
    say(started, &format!("control plane at {}", cp.server_url()));
    let admin = cp.admin_client();
    let xpu = a.binaries.join("xpu");

    let mut nodes: Vec<(Node, Fixture)> = Vec::new();
    for (name, spec, group, extra) in layout() {
        let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
        let options = NodeOptions::default()
            .named(name)
            .devices_of(fx.root())
            .host_root(fx.root())
            .image(&archive);
        let node = Node::start(&cp, options).await.map_err(|e| format!("node {name}: {e}"))?;
        // The host set-up an admin does on a device-plugin node: the CDI spec.
        if group == "device-plugin" || group == "share" {
            let vendor = if spec.name.starts_with("tpu") { "google" } else { "nvidia" };
            run_xpu(
                &xpu,
                &["cdi", "generate", "--vendor", vendor, "--root"],
                fx.root(),
                Some(&node.cdi_dir()),
            )?;
        }
        // The labels NFD would write from xpu's feature file, GKE's pool labels, the group.
        let mut labels: BTreeMap<String, String> =
            run_xpu(&xpu, &["k8s", "nfd-features", "--output", "-", "--root"], fx.root(), None)?
                .lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        labels.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        labels.insert("xpu.dev/agent".into(), group.into());
        let api: Api<NodeObject> = Api::all(admin.clone());
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": labels } })),
        )
        .await
        .map_err(|e| format!("labelling node {name}: {e}"))?;
        say(started, &format!("node {name} ({}, {group}) Ready", spec.name));
        nodes.push((node, fx));
    }

    let api_port: u16 = cp
        .server_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or("the API server's URL has no port")?;
    let docs = cluster::render_chart(
        &a.repo,
        &[
            "--set",
            "nodeAgent.nodeSelector.xpu\\.dev/agent=device-plugin",
            "--set",
            "dra.nodeSelector.xpu\\.dev/agent=dra",
            "--set-json",
            r#"scheduler.extraArgs=["--share-key=/etc/xpu/share/key"]"#,
        ],
    )?;
    let (mut ordered, mut rest): (Vec<_>, Vec<_>) =
        docs.into_iter().partition(|d| d["kind"] == "Namespace");
    // The GPU-share key the scheduler signs its choices with and the share plugin checks, made
    // as the chart's notes tell an admin to (32 random bytes).
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .map_err(|e| format!("reading /dev/urandom: {e}"))?;
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("xpu-gpu-share-key".into()),
            namespace: Some("xpu-system".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("key".to_owned(), ByteString(key.to_vec()))])),
        ..Default::default()
    };
    // k8s-openapi writes `data` base64-encoded, as the API wants it.
    let mut secret = serde_json::to_value(secret).map_err(|e| format!("the key Secret: {e}"))?;
    secret["apiVersion"] = json!("v1");
    secret["kind"] = json!("Secret");
    ordered.push(secret);
    ordered.append(&mut rest);
    for mut doc in ordered {
        cluster::for_fixture_nodes(&mut doc, api_port);
        cluster::create(&admin, &doc, false)
            .await
            .map_err(|e| format!("{} {}: {e}", doc["kind"], doc["metadata"]["name"]))?;
    }
    say(started, "the chart applied; waiting for xpu's pods");
    let system: Api<Pod> = Api::namespaced(admin.clone(), "xpu-system");
    let deadline = Instant::now() + Duration::from_secs(180);
    let summary = loop {
        let pods = system.list(&ListParams::default()).await.map_err(|e| e.to_string())?.items;
        let running: Vec<String> = pods
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .map(|p| {
                let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
                format!("{} on {node}", p.metadata.name.clone().unwrap_or_default())
            })
            .collect();
        // The node agent on four nodes, the share plugin and DRA on one each, the exporter on
        // seven, two schedulers.
        if running.len() == 15 {
            break running;
        }
        if Instant::now() > deadline {
            return Err(format!("xpu's pods not all running after 180 s: {running:?}"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    std::fs::copy(cp.admin_kubeconfig(), a.state.join("kubeconfig"))
        .map_err(|e| format!("writing the kubeconfig: {e}"))?;
    std::fs::write(a.state.join("ready"), summary.join("\n") + "\n")
        .map_err(|e| format!("writing {}: {e}", a.state.join("ready").display()))?;
    say(started, &format!("ready: {}", summary.join(", ")));

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    say(started, "stopping the nodes and the control plane");
    for f in ["ready", "kubeconfig"] {
        // Written at start-up; gone already (removed by hand) is what we want too.
        if let Err(e) = std::fs::remove_file(a.state.join(f))
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("local_cluster: removing {}: {e}", a.state.join(f).display());
        }
    }
    drop(nodes);
    drop(cp);
    say(started, "stopped");
    Ok(())
}

/// `xpu ARGS... ROOT [--output OUT]`; its standard output.
fn run_xpu(
    xpu: &Path,
    args: &[&str],
    root: &Path,
    output: Option<&Path>,
) -> Result<String, String> {
    let mut c = Command::new(xpu);
    c.args(args).arg(root);
    if let Some(o) = output {
        c.arg("--output").arg(o);
    }
    let out = c.output().map_err(|e| format!("running {}: {e}", xpu.display()))?;
    if !out.status.success() {
        return Err(format!("xpu {args:?}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
