//! A task of `xpu serve` gets exactly the devices the scheduler gave it, whatever its manifest's
//! `env`, or its bundle's `config.json` (`process.env`, `cdi.k8s.io/*` annotations) ask for: on
//! NVIDIA, AMD and TPU fixture hosts, for host processes (the device variables it is told) and
//! for runc containers through the `xpu runtime` shim (the device nodes it sees). One job holds
//! a device the whole time; the others ask for every device in every way the shim or a vendor
//! runtime understands. The container half needs root and runc (scripts/install-test-deps) and
//! skips, saying so, where they are absent.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use serve_support::{Daemon, kill_tasks};
use xpu_server::node::{CDI_ANNOTATION_PREFIX, DEVICE_VARS};
use xpu_testkit::bundle::{self, Bundle, RUNC, TestHost};
use xpu_testkit::hosts;

/// A fixture host and how a job asks for one of its devices.
struct Vendor {
    spec: xpu_testkit::HostSpec,
    /// The short form's field: `gpus` or `tpus`.
    field: &'static str,
    /// The CDI kind the shim injects for it.
    cdi_kind: &'static str,
}

fn vendors() -> Vec<Vendor> {
    vec![
        Vendor { spec: hosts::a100_8x(), field: "gpus", cdi_kind: "nvidia.com/gpu" },
        Vendor { spec: hosts::mi300x(), field: "gpus", cdi_kind: "amd.com/gpu" },
        Vendor { spec: hosts::tpu_v5p(), field: "tpus", cdi_kind: "google.com/tpu" },
    ]
}

/// Every device variable set to ask for everything: all of the vendor's devices to the shim,
/// every index to the vendor runtimes.
fn greedy_env(v: &Vendor) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> =
        DEVICE_VARS.iter().map(|k| ((*k).to_owned(), "0,1,2,3".to_owned())).collect();
    env.insert("XPU_VISIBLE_DEVICES".into(), format!("{}=all", v.cdi_kind));
    env.insert("XPU_DEVICES".into(), format!("{}=all", v.cdi_kind));
    env.insert("CUDA_DEVICE_ORDER".into(), "FASTEST_FIRST".into());
    if v.cdi_kind == "nvidia.com/gpu" {
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), "all".into());
    } else {
        env.remove("NVIDIA_VISIBLE_DEVICES");
    }
    env
}

/// The manifest's `env:` for [`greedy_env`].
fn env_yaml(env: &BTreeMap<String, String>) -> String {
    let m: serde_json::Map<String, Value> =
        env.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    format!("env: {}\n", Value::Object(m))
}

/// `sh -c script` as the short form's command.
fn command(script: &str) -> String {
    format!("command: [sh, -c, {}]\n", serde_json::to_string(script).unwrap())
}

fn logs(d: &Daemon, id: i64) -> String {
    let r = d.client().request("GET", &format!("/v1/jobs/{id}/logs"), None, &[]).unwrap();
    String::from_utf8(r.body).unwrap()
}

/// The device variables in `env` output.
fn device_vars(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| DEVICE_VARS.contains(k))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The job's devices (node device ids).
fn devices_of(j: &Value) -> Vec<u64> {
    j["tasks"][0]["devices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

/// Runs `jobs` (manifests) to success after a holder has taken one device, and returns each
/// job's record and log. The holder runs as long as they do.
fn run_beside_a_holder(
    d: &Daemon,
    v: &Vendor,
    gate: &Path,
    jobs: &[String],
) -> Vec<(Value, String)> {
    let hold = format!(
        "{}{}: 1\n",
        command(&format!("while [ ! -e {} ]; do sleep 0.05; done", gate.display())),
        v.field
    );
    let holder = d.submit(&hold);
    d.wait_pid(holder);
    let held = devices_of(&d.wait_state(holder, &["running"]));
    assert_eq!(held.len(), 1);
    let ids: Vec<i64> = jobs.iter().map(|m| d.submit(m)).collect();
    let mut out = Vec::new();
    for id in ids {
        let j = d.wait_state(id, &["succeeded", "failed"]);
        assert_eq!(j["state"], "succeeded", "{j}\n{}", logs(d, id));
        assert!(!devices_of(&j).contains(&held[0]), "the holder's device went to another job: {j}");
        let log = logs(d, id);
        out.push((j, log));
    }
    std::fs::write(gate, "").unwrap();
    d.wait_state(holder, &["succeeded"]);
    out
}

#[test]
fn the_daemon_owns_every_request_the_shim_honours() {
    for var in [
        xpu_container::request::NVIDIA_VISIBLE_DEVICES,
        xpu_container::request::XPU_VISIBLE_DEVICES,
        xpu_container::shim::XPU_DEVICES,
    ] {
        assert!(DEVICE_VARS.contains(&var), "{var}");
    }
    assert_eq!(CDI_ANNOTATION_PREFIX, xpu_container::request::CDI_ANNOTATION_PREFIX);
}

#[test]
fn a_process_is_told_only_its_devices_whatever_its_env() {
    let mut wrong = Vec::new();
    for v in vendors() {
        let fixture = v.spec.build();
        let tmp = tempfile::tempdir().unwrap();
        let d = Daemon::start(
            &tmp.path().join("data"),
            None,
            &["--root", fixture.root().to_str().unwrap()],
        );
        let greedy = env_yaml(&greedy_env(&v));
        let none = format!("{}{greedy}", command("env"));
        let one = format!("{}{greedy}{}: 1\n", command("env"), v.field);
        let ran = run_beside_a_holder(&d, &v, &tmp.path().join("gate"), &[none, one]);
        let name = &v.spec.name;
        for (j, log) in ran {
            let list: Vec<String> = devices_of(&j).iter().map(u64::to_string).collect();
            let ids = list.join(",");
            // What the daemon says, and only that: nothing of the job's own values.
            let want: BTreeMap<&str, String> = match v.cdi_kind {
                "nvidia.com/gpu" => BTreeMap::from([
                    (
                        "NVIDIA_VISIBLE_DEVICES",
                        if ids.is_empty() { "void".into() } else { ids.clone() },
                    ),
                    ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".into()),
                    ("CUDA_VISIBLE_DEVICES", ids.clone()),
                ]),
                "amd.com/gpu" => BTreeMap::from([
                    ("HIP_VISIBLE_DEVICES", ids.clone()),
                    ("ROCR_VISIBLE_DEVICES", ids.clone()),
                ]),
                _ => BTreeMap::from([("TPU_VISIBLE_CHIPS", ids.clone())]),
            };
            let want: BTreeMap<String, String> =
                want.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let got = device_vars(&log);
            if got != want {
                wrong.push(format!("{name} job {}: {got:?}, not {want:?}", j["id"]));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "processes were told of devices they were not given:\n{}",
        wrong.join("\n")
    );
}

/// Deletes whatever containers are left in the daemon's runc state directory.
struct Cleanup {
    data: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_tasks(&self.data);
        let ids: Vec<String> = std::fs::read_dir(self.data.join("runc"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        for id in ids {
            // Clean-up after the test: a container already gone makes runc fail, harmlessly.
            let _ = Command::new(RUNC)
                .arg("--root")
                .arg(self.data.join("runc"))
                .args(["delete", "-f", &id])
                .output();
        }
    }
}

/// Prints the accelerator device nodes the container has, then its environment.
const PROBE: &str = "echo '== nodes'; find /dev -type c | grep -E '^/dev/(nvidia|kfd|dri/|vfio/|accel)' | sort; echo '== env'; env";

/// What [`PROBE`] printed: the nodes and the device variables.
fn probed(log: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let (nodes, env) = log.split_once("== env\n").unwrap_or((log, ""));
    let nodes = nodes.lines().filter(|l| l.starts_with("/dev/")).map(str::to_owned).collect();
    (nodes, device_vars(env))
}

/// The nodes the shim injects for device `k` (the fixtures number each vendor's devices, their
/// minors and groups, in PCI address order, as the shim does).
fn nodes_for(v: &Vendor, devices: &[u64]) -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    for k in devices {
        match v.cdi_kind {
            "nvidia.com/gpu" => {
                s.insert(format!("/dev/nvidia{k}"));
                s.extend(
                    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
                        .map(str::to_owned),
                );
            }
            "amd.com/gpu" => {
                s.insert(format!("/dev/dri/card{k}"));
                s.insert(format!("/dev/dri/renderD{}", 128 + k));
                s.insert("/dev/kfd".to_owned());
            }
            _ => {
                s.insert(format!("/dev/vfio/{k}"));
                s.insert("/dev/vfio/vfio".to_owned());
            }
        }
    }
    s
}

#[test]
fn a_container_sees_only_its_devices_whatever_its_env_or_bundle_needs_root_and_runc() {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut wrong = Vec::new();
    for v in vendors() {
        let host = TestHost::new(&v.spec);
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let _cleanup = Cleanup { data: data.clone() };
        let d = Daemon::start_with_env(
            &data,
            None,
            &["--root", host.fixture.root().to_str().unwrap()],
            &[("XPU_RUNTIME_CONFIG", host.config.to_str().unwrap())],
        );
        let greedy = greedy_env(&v);
        let image = Bundle::busybox_in(&tmp.path().join("image"), "true");
        let rootfs = format!("rootfs: {}\n", image.rootfs().display());
        // Bundles that ask for everything themselves: in process.env, by CDI annotation, both.
        let entries: Vec<String> = greedy.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let greedy_bundle = |name: &str, env: bool, annotation: bool| {
            let b = Bundle::busybox_in(&tmp.path().join(name), PROBE);
            if env {
                b.add_env(&entries.iter().map(String::as_str).collect::<Vec<_>>());
            }
            if annotation {
                let mut c = b.config();
                c["annotations"] = json!({ "cdi.k8s.io/greedy": format!("{}=all", v.cdi_kind) });
                b.set_config(&c);
            }
            format!("bundle: {}\n", b.dir().display())
        };
        let env = env_yaml(&greedy);
        let jobs = [
            format!("{}{rootfs}{env}", command(PROBE)),
            format!("{}{rootfs}{env}{}: 1\n", command(PROBE), v.field),
            greedy_bundle("env", true, false),
            greedy_bundle("annotation", false, true),
            format!("{}{}: 1\n", greedy_bundle("both", true, true), v.field),
        ];
        let ran = run_beside_a_holder(&d, &v, &tmp.path().join("gate"), &jobs);
        let name = &v.spec.name;
        for (j, log) in ran {
            let devices = devices_of(&j);
            let (nodes, vars) = probed(&log);
            let want_nodes = nodes_for(&v, &devices);
            if nodes != want_nodes {
                wrong.push(format!("{name} job {}: nodes {nodes:?}, not {want_nodes:?}", j["id"]));
            }
            // The shim's request, and what it says it injected, are the daemon's alone.
            let names: Vec<String> =
                devices.iter().map(|k| format!("{}={k}", v.cdi_kind)).collect();
            let mut want = BTreeMap::new();
            if v.cdi_kind == "nvidia.com/gpu" {
                let ids: Vec<String> = devices.iter().map(u64::to_string).collect();
                let nv = if ids.is_empty() { "void".to_owned() } else { ids.join(",") };
                want.insert("NVIDIA_VISIBLE_DEVICES".to_owned(), nv);
            } else if !names.is_empty() {
                want.insert("XPU_VISIBLE_DEVICES".to_owned(), names.join(","));
            }
            if !names.is_empty() {
                want.insert("XPU_DEVICES".to_owned(), names.join(","));
            }
            if vars != want {
                wrong.push(format!("{name} job {}: variables {vars:?}, not {want:?}", j["id"]));
            }
        }
        drop(d);
    }
    assert!(wrong.is_empty(), "containers saw devices they were not given:\n{}", wrong.join("\n"));
}

/// `xpu serve --mps-dir`: a share task is a client of its GPU's MPS daemon, limited to its
/// share whatever `CUDA_MPS_*` its manifest sets; the daemon starts before the GPU's first share
/// task and stops after its last; a whole-GPU task is no client. (A fake control binary; what
/// the real one holds is the GPU run's, docs/scheduler.md.) A daemon restarted under running
/// share tasks counts them again: a share task that starts and ends meanwhile does not stop
/// their MPS daemon.
#[test]
fn share_tasks_are_mps_clients_limited_to_their_share_whatever_their_env() {
    let fixture = hosts::h200_4x().build();
    let tmp = tempfile::tempdir().unwrap();
    let control = xpu_testkit::mps::fake_control(tmp.path());
    let mps = tmp.path().join("mps");
    let mut d = Daemon::start(
        &tmp.path().join("data"),
        None,
        &[
            "--root",
            fixture.root().to_str().unwrap(),
            "--mps-dir",
            mps.to_str().unwrap(),
            "--mps-control",
            control.to_str().unwrap(),
        ],
    );
    let gate = tmp.path().join("gate");
    let script = format!("env; while [ ! -e {} ]; do sleep 0.05; done", gate.display());
    let own = BTreeMap::from([
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), "100".to_owned()),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(), "0=999999M".to_owned()),
        ("CUDA_MPS_PIPE_DIRECTORY".to_owned(), "/tmp/mine".to_owned()),
        ("CUDA_VISIBLE_DEVICES".to_owned(), "0,1,2,3".to_owned()),
    ]);
    // An H200's 141 GiB: a quarter and a half of its threads and memory.
    let shares = [(250, "25", "0=36096M"), (500, "50", "0=72192M")];
    let ids: Vec<i64> = shares
        .iter()
        .enumerate()
        .map(|(i, (milli, _, _))| {
            let env = if i == 1 { env_yaml(&own) } else { String::new() };
            d.submit(&format!("{}{env}gpuMilli: {milli}\n", command(&script)))
        })
        .collect();
    let whole = d.submit(&format!("{}gpus: 1\n", command("env")));
    let mut gpus = BTreeSet::new();
    for (id, (milli, percent, memory)) in ids.iter().zip(shares) {
        let log = d.wait_for(&format!("job {id}'s environment"), || {
            let l = logs(&d, *id);
            l.contains("XPU_JOB_ID=").then_some(l)
        });
        let env: BTreeMap<&str, &str> = log.lines().filter_map(|l| l.split_once('=')).collect();
        let pipe = env.get("CUDA_MPS_PIPE_DIRECTORY").copied().unwrap_or_default();
        let gpu = Path::new(pipe)
            .strip_prefix(&mps)
            .ok()
            .and_then(|p| p.parent())
            .and_then(|p| p.to_str())
            .unwrap_or_else(|| panic!("job {id} ({milli}): pipe {pipe:?} not under {mps:?}\n{log}"))
            .to_owned();
        assert!(gpu.starts_with("GPU-"), "{gpu}");
        for (k, v) in [
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", memory),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("XPU_SHARING", "mps"),
        ] {
            assert_eq!(env.get(k), Some(&v), "job {id} ({milli}): {k}\n{log}");
        }
        gpus.insert(gpu);
    }
    // Both run: each GPU's daemon started once, none stopped.
    let started: String = gpus.iter().map(|g| format!("start {g}\n")).collect();
    let calls = xpu_testkit::mps::calls(tmp.path());
    assert_eq!(calls.lines().filter(|l| l.starts_with("start")).count(), gpus.len(), "{calls}");
    assert!(gpus.iter().all(|g| calls.contains(&format!("start {g}"))), "{calls}");
    assert!(!calls.contains("quit"), "{calls}");
    let j = d.wait_state(whole, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded");
    let log = logs(&d, whole);
    assert!(!log.contains("CUDA_MPS_"), "a whole GPU is no MPS client:\n{log}");

    // The daemon restarts under the running shares; a quarter that comes and goes meanwhile
    // (on one of their GPUs when it fits there) leaves their MPS daemons running.
    d.restart();
    for id in &ids {
        assert_eq!(d.wait_state(*id, &["running"])["state"], "running");
    }
    let brief = d.submit(&format!("{}gpuMilli: 250\n", command("env")));
    assert_eq!(d.wait_state(brief, &["succeeded", "failed"])["state"], "succeeded");
    let log = logs(&d, brief);
    let calls = xpu_testkit::mps::calls(tmp.path());
    let shared: Vec<&String> =
        gpus.iter().filter(|g| log.contains(&format!("/{g}/pipe"))).collect();
    eprintln!("the brief quarter ran on {shared:?} (the shares' GPUs: {gpus:?})");
    for g in shared {
        assert!(!calls.contains(&format!("quit {g}")), "{g} quit under running shares: {calls}");
    }
    std::fs::write(&gate, "").unwrap();
    for id in &ids {
        assert_eq!(d.wait_state(*id, &["succeeded", "failed"])["state"], "succeeded");
    }
    let calls = d.wait_for("each daemon stopped after its GPU's last share", || {
        let c = xpu_testkit::mps::calls(tmp.path());
        gpus.iter().all(|g| c.contains(&format!("quit {g}\n"))).then_some(c)
    });
    // Each of the shares' GPUs: started once for them, stopped once after them.
    for g in &gpus {
        assert!(started.contains(g.as_str()));
        assert_eq!(calls.matches(&format!("start {g}\n")).count(), 1, "{calls}");
        assert_eq!(calls.matches(&format!("quit {g}\n")).count(), 1, "{calls}");
    }
}

/// `xpu serve`'s devices say which use holds each device no job holds, as `xpu vfio status`
/// says it: on a host whose GPUs are on vfio-pci, one listed for Nova is Nova's, the others a
/// VM's bound outside xpu; the table and the API agree.
#[test]
fn devices_say_which_use_outside_the_jobs_holds_them() {
    let fixture = hosts::a100_8x_vfio().build();
    let list = fixture.root().join("etc/xpu/vm-devices");
    std::fs::create_dir_all(list.parent().unwrap()).unwrap();
    std::fs::write(&list, "0000:25:00.0\n").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        &tmp.path().join("data"),
        None,
        &["--root", fixture.root().to_str().unwrap()],
    );
    let devs = d.wait_for("the host read", || {
        let v = d.get("/v1/devices");
        v["devices"].as_array()?.iter().all(|x| x["held_by"].is_string()).then_some(v)
    });
    let by = |addr: &str| {
        devs["devices"].as_array().unwrap().iter().find(|x| x["address"] == addr).unwrap()
            ["held_by"]
            .clone()
    };
    assert_eq!(by("0000:25:00.0"), "nova: listed in /etc/xpu/vm-devices", "{devs}");
    assert_eq!(by("0000:2b:00.0"), "vfio-pci: bound outside xpu", "{devs}");
    let table = String::from_utf8_lossy(&d.cli(&["devices"]).stdout).into_owned();
    assert!(table.contains("nova: listed in /etc/xpu/vm-devices"), "{table}");
    assert!(table.contains("vfio-pci: bound outside xpu"), "{table}");
}
