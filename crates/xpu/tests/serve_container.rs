//! `xpu serve` running jobs that name a rootfs or a bundle as real runc containers through the
//! `xpu runtime` shim, on a fixture 8×A100 host whose device nodes are real character devices
//! (`mknod`): the container sees exactly the GPUs the scheduler gave its task, output reaches
//! the task's log, exit statuses and `restartPolicy` count as for process tasks, cancel sends
//! SIGTERM through runc to the container, `activeDeadlineSeconds` ends one that ignores it with
//! `runc kill`, and a bundle runs its own command. Needs root and runc (installed by
//! scripts/install-test-deps); skips, saying so, only where they are truly absent.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serve_support::{Daemon, kill_tasks};
use xpu_testkit::bundle::{self, Bundle, ContainerView, RUNC, TestHost, probe_script};
use xpu_testkit::hosts;
use xpu_testkit::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};

/// Deletes whatever containers are left in the daemon's runc state directory.
struct Cleanup {
    data: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_tasks(&self.data);
        for id in containers(&self.data) {
            let _ = Command::new(RUNC)
                .arg("--root")
                .arg(self.data.join("runc"))
                .args(["delete", "-f", &id])
                .output();
        }
    }
}

/// Container ids runc knows in the daemon's state directory.
fn containers(data: &Path) -> Vec<String> {
    std::fs::read_dir(data.join("runc"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

fn logs(d: &Daemon, id: i64) -> String {
    let r = d.client().request("GET", &format!("/v1/jobs/{id}/logs"), None, &[]).unwrap();
    String::from_utf8(r.body).unwrap()
}

/// A short-form job running `script` with `sh -c` in `rootfs`.
fn job(script: &str, rootfs: &Path, extra: &str) -> String {
    format!(
        "command: [sh, -c, {}]\nrootfs: {}\n{extra}",
        serde_json::to_string(script).unwrap(),
        rootfs.display()
    )
}

/// The device nodes GPUs `gpus` (host indices) of the fixture bring into a container.
fn gpu_nodes(gpus: &[u32]) -> BTreeMap<String, (char, u32, u32)> {
    let mut m: BTreeMap<String, (char, u32, u32)> =
        gpus.iter().map(|&g| (format!("/dev/nvidia{g}"), ('c', MAJOR_NVIDIA, g))).collect();
    m.insert("/dev/nvidiactl".into(), ('c', MAJOR_NVIDIA, 255));
    m.insert("/dev/nvidia-uvm".into(), ('c', MAJOR_NVIDIA_UVM, 0));
    m.insert("/dev/nvidia-uvm-tools".into(), ('c', MAJOR_NVIDIA_UVM, 1));
    m
}

/// A daemon on the 8×A100 fixture with real device nodes, its shim pointed at the fixture, and
/// a busybox root filesystem for its jobs.
struct Setup {
    host: TestHost,
    tmp: tempfile::TempDir,
    image: Bundle,
    rootfs: PathBuf,
    data: PathBuf,
    _cleanup: Cleanup,
    d: Daemon,
}

impl Setup {
    fn new() -> Setup {
        Setup::with_runtime(None, &[])
    }

    /// With `runtime` in place of runc in the shim's settings, and `extra` daemon flags.
    fn with_runtime(runtime: Option<&Path>, extra: &[&str]) -> Setup {
        let host = TestHost::new(&hosts::a100_8x());
        if let Some(r) = runtime {
            let text = std::fs::read_to_string(&host.config).unwrap();
            std::fs::write(&host.config, text.replace(RUNC, r.to_str().unwrap())).unwrap();
        }
        let tmp = tempfile::tempdir().unwrap();
        let image = Bundle::busybox_in(&tmp.path().join("image"), "true");
        let rootfs = image.rootfs();
        let data = tmp.path().join("data");
        let cleanup = Cleanup { data: data.clone() };
        let cfg = host.config.to_str().unwrap().to_owned();
        let mut args = vec!["--root", host.fixture.root().to_str().unwrap()];
        args.extend_from_slice(extra);
        let d = Daemon::start_with_env(&data, None, &args, &[("XPU_RUNTIME_CONFIG", &cfg)]);
        Setup { host, tmp, image, rootfs, data, _cleanup: cleanup, d }
    }
}

#[test]
fn rootfs_and_bundle_jobs_run_as_runc_containers_needs_root_and_runc() {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    // Bound in this order so the daemon goes first, then its containers, then the files.
    let Setup { host, tmp, image: _image, rootfs, data, _cleanup, d } = Setup::new();
    let devs = d.get("/v1/devices");
    assert_eq!(devs["devices"].as_array().unwrap().len(), 8, "{devs}");

    // Two GPU containers at once: each sees exactly the two GPUs its task holds.
    let gate = rootfs.join("tmp/gate");
    let probe = format!("{}; while [ ! -e /tmp/gate ]; do sleep 0.05; done", probe_script("true"));
    let a = d.submit(&job(&probe, &rootfs, "gpus: 2\nenv: {MY_VAR: from-manifest}\n"));
    let b = d.submit(&job(&probe, &rootfs, "gpus: 2\n"));
    for id in [a, b] {
        d.wait_state(id, &["running"]);
        d.wait_log(id, "== extra");
    }
    std::fs::write(&gate, "").unwrap();
    let mut held = Vec::new();
    for id in [a, b] {
        let j = d.wait_state(id, &["succeeded", "failed"]);
        assert_eq!(j["state"], "succeeded", "{j}\n{}", logs(&d, id));
        let gpus: Vec<u32> = j["tasks"][0]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(gpus.len(), 2);
        let v = ContainerView::parse(&logs(&d, id));
        assert_eq!(v.accel_nodes(), gpu_nodes(&gpus), "job {id} sees exactly its GPUs");
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        assert_eq!(v.env["NVIDIA_VISIBLE_DEVICES"], list.join(","));
        assert_eq!(v.env["XPU_JOB_ID"], id.to_string());
        assert!(!v.env.contains_key("CUDA_VISIBLE_DEVICES"), "no host indices inside");
        held.extend(gpus);
    }
    held.sort_unstable();
    held.dedup();
    assert_eq!(held.len(), 4, "the two containers held different GPUs");
    let first = ContainerView::parse(&logs(&d, a));
    assert_eq!(first.env["MY_VAR"], "from-manifest");
    assert!(host.log().contains("nvidia.com/gpu="), "the shim injected them: {}", host.log());

    // Exit status and restartPolicy: Never, backoffLimit 1 → two attempts, then failed.
    let id =
        d.submit(&job("echo failing; exit 3", &rootfs, "restartPolicy: Never\nbackoffLimit: 1\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "failed", "{j}");
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t["exit_code"] == 3), "{j}");
    assert!(j["message"].as_str().unwrap().contains("BackoffLimitExceeded"));
    assert_eq!(logs(&d, id), "failing\n");

    // Cancel: SIGTERM reaches the container's init through runc; it exits on its own.
    let id = d.submit(&job(
        "trap 'echo got TERM; exit 143' TERM; echo ready; while :; do sleep 1 & wait $!; done",
        &rootfs,
        "gpus: 1\n",
    ));
    d.wait_log(id, "ready");
    let out = d.cli(&["cancel", &id.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t = d.wait_for("the cancelled container's end", || {
        let j = d.get(&format!("/v1/jobs/{id}"));
        (j["tasks"][0]["state"] == "cancelled").then(|| j["tasks"][0].clone())
    });
    assert_eq!(t["exit_code"], 143, "{t}");
    assert_eq!(logs(&d, id), "ready\ngot TERM\n");

    // Deadline: the container's init ignores SIGTERM (PID 1 without a handler), so after the
    // grace period `runc kill` ends it.
    let id = d.submit(&job("echo sleeping; sleep 300", &rootfs, "activeDeadlineSeconds: 1\n"));
    let j = d.wait_state(id, &["failed"]);
    assert!(j["message"].as_str().unwrap().contains("DeadlineExceeded"), "{j}");
    let t = d.wait_for("the killed container's end", || {
        let j = d.get(&format!("/v1/jobs/{id}"));
        (j["tasks"][0]["state"] == "failed").then(|| j["tasks"][0].clone())
    });
    assert_eq!(t["exit_code"], 137, "{t}");

    // A bundle brings its own command.
    let own =
        Bundle::busybox_in(&tmp.path().join("bundle"), "echo from the bundle $XPU_TASK_INDEX");
    let id = d.submit(&format!("bundle: {}\n", own.dir().display()));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(logs(&d, id), "from the bundle 0\n");

    // Nothing is left in runc's state: every container was deleted when it ended.
    d.wait_for("runc's state to be empty", || containers(&data).is_empty().then_some(()));

    // A rootfs that is not there is refused at submit, naming the field.
    let r = d
        .client()
        .request(
            "POST",
            "/v1/jobs",
            Some(b"command: [\"true\"]\nrootfs: /nonexistent/rootfs\n"),
            &[],
        )
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json().unwrap()["error"],
        "rootfs: /nonexistent/rootfs is not a directory on the daemon's host"
    );
}

/// Kubernetes' Indexed Job example (an init container writes the index's input into an
/// `emptyDir`, the worker reads it), with a sidecar and a `medium: Memory` volume added, run as
/// runc containers: every container of a task sees the same volumes, the init container ran
/// first, the sidecar ran beside the worker and was stopped after it, and nothing is left.
#[test]
fn an_indexed_job_with_an_init_container_and_empty_dirs_runs_as_runc_containers_needs_root_and_runc()
 {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let Setup { host: _host, tmp: _tmp, image: _image, rootfs, data, _cleanup, d } = Setup::new();
    let manifest = format!(
        r#"apiVersion: batch/v1
kind: Job
metadata:
  name: indexed-job
  annotations: {{xpu.dev/rootfs: {rootfs}}}
spec:
  completions: 3
  parallelism: 3
  completionMode: Indexed
  template:
    spec:
      restartPolicy: Never
      initContainers:
      - name: input
        image: docker.io/library/bash
        command:
        - sh
        - -c
        - |
          set -- foo bar baz
          shift $JOB_COMPLETION_INDEX
          echo $1 > /input/data.txt
          echo from-init > /scratch/init
        volumeMounts:
        - {{name: input, mountPath: /input}}
        - {{name: scratch, mountPath: /scratch}}
      - name: heartbeat
        image: busybox
        restartPolicy: Always
        command: [sh, -c, 'while :; do date +%s > /scratch/beat; sleep 0.05; done']
        volumeMounts: [{{name: scratch, mountPath: /scratch}}]
      containers:
      - name: worker
        image: docker.io/library/busybox
        command:
        - sh
        - -c
        - |
          while [ ! -e /scratch/beat ]; do sleep 0.05; done
          echo "data=$(cat /input/data.txt) init=$(cat /scratch/init) sidecar=up index=$(cat /meta/index)"
          grep -q ' /scratch tmpfs ' /proc/mounts && echo scratch=tmpfs
          {{ echo nope > /input/x; }} 2>/dev/null || echo input=read-only
        volumeMounts:
        - {{name: input, mountPath: /input, readOnly: true}}
        - {{name: scratch, mountPath: /scratch}}
        - {{name: meta, mountPath: /meta}}
      volumes:
      - name: meta
        downwardAPI:
          items:
          - path: index
            fieldRef: {{fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
      - name: input
        emptyDir: {{}}
      - name: scratch
        emptyDir: {{medium: Memory, sizeLimit: 16Mi}}
"#,
        rootfs = rootfs.display()
    );
    let id = d.submit(&manifest);
    let j = d.wait_state(id, &["succeeded", "failed"]);
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(j["state"], "succeeded", "{j}\n{}", logs(&d, id));
    assert_eq!(tasks.len(), 3, "{j}");
    for (i, word) in ["foo", "bar", "baz"].into_iter().enumerate() {
        let r =
            d.client().request("GET", &format!("/v1/jobs/{id}/logs?task={i}"), None, &[]).unwrap();
        let log = String::from_utf8(r.body).unwrap();
        assert_eq!(
            log,
            format!(
                "data={word} init=from-init sidecar=up index={i}\nscratch=tmpfs\ninput=read-only\n"
            ),
            "task {i}"
        );
    }
    // Every container (three per task) was deleted; no tmpfs is left mounted.
    d.wait_for("runc's state to be empty", || containers(&data).is_empty().then_some(()));
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(!mounts.contains(&data.display().to_string()), "{mounts}");
}

/// Issue 15: a runtime call that fails is a warning in the daemon's log with the runtime's
/// stderr, not dropped (here `runc delete` is refused by a wrapper in front of runc).
#[test]
fn a_failing_runtime_call_is_logged_with_its_stderr_needs_root_and_runc() {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("runc-refusing-delete");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = delete ] && {{ echo 'delete refused by the test wrapper' >&2; exit 1; }}; done\nexec {RUNC} \"$@\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    let Setup { host: _host, tmp: _tmp, image: _image, rootfs, data: _data, _cleanup, d } =
        Setup::with_runtime(Some(&wrapper), &["--log-level", "debug"]);
    let id = d.submit(&job("echo hi", &rootfs, ""));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    d.wait_for("the runtime's stderr in the daemon's log", || {
        let log = d.log();
        (log.contains("runtime call failed") && log.contains("delete refused by the test wrapper"))
            .then_some(())
    });
    // At debug, every runtime command is logged with its arguments.
    let log = d.log();
    let calls: Vec<&str> =
        log.lines().filter(|l| l.contains("runtime call") && !l.contains("failed")).collect();
    assert!(
        calls.iter().any(|l| l.contains(" runtime --root ") && l.contains(" delete -f xpu-")),
        "no debug line for the delete with its arguments: {calls:?}"
    );
}

/// A subPath that an earlier container turned into a symlink out of the volume is refused
/// before runc would bind the host directory it points to.
#[test]
fn a_sub_path_replaced_by_a_symlink_is_refused_needs_root_and_runc() {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let Setup { host: _host, tmp: _tmp, image: _image, rootfs, data: _data, _cleanup, d } =
        Setup::new();
    let pod = format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: escape, annotations: {{xpu.dev/rootfs: {rootfs}}}}}
spec:
  restartPolicy: Never
  initContainers:
  - name: plant
    command: [sh, -c, 'rmdir /data/sub; ln -s /etc /data/sub']
    volumeMounts: [{{name: data, mountPath: /data}}]
  containers:
  - name: main
    command: [cat, /x/hostname]
    volumeMounts: [{{name: data, mountPath: /x, subPath: sub}}]
  volumes:
  - {{name: data, emptyDir: {{}}}}
"#,
        rootfs = rootfs.display()
    );
    let id = d.submit(&pod);
    let j = d.wait_state(id, &["failed", "succeeded"]);
    assert_eq!(j["state"], "failed", "{j}");
    let log = logs(&d, id);
    assert!(log.contains("subPath \"sub\" of volume \"data\" leads out of the volume"), "{log}");
}
