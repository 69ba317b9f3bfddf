//! How `xpu serve` starts and runs tasks whatever the job puts in it: a job's `PATH` does not
//! break the task supervisor (an exit status is recorded even while the daemon is down), a task
//! that cannot start says why, a root filesystem runc would refuse is refused at submit, and a
//! daemon that cannot start prints its cause once, no banner, and leaves no socket behind; an
//! Indexed Job's downward-API variables and `$(VAR)` references resolve as the kubelet's would.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::process::Command;

use serve_support::{Daemon, xpu_bin};

/// Whether a process is alive: present and not a zombie.
fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

#[test]
fn a_jobs_path_keeps_its_exit_status_across_a_daemon_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let gate = tmp.path().join("gate");
    let mut d = Daemon::start(&data, None, &[]);
    // The job's PATH has none of the usual commands; it names its own programs by path.
    let script =
        format!("while [ ! -e {} ]; do /bin/sleep 0.05; done; echo path=$PATH", gate.display());
    let id = d.submit(&format!(
        "command: [/bin/sh, -c, {}]\nenv: {{PATH: /opt/conda/bin}}\n",
        serde_json::to_string(&script).unwrap()
    ));
    let pid = d.wait_pid(id);
    // The daemon goes down; the task ends with status 0 while nobody waits for it.
    d.kill9();
    std::fs::write(&gate, "").unwrap();
    d.wait_for("the task to end", || (!alive(pid)).then_some(()));
    d.restart();
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["tasks"][0]["exit_code"], 0, "{j}");
    d.wait_log(id, "path=/opt/conda/bin");
}

#[test]
fn a_task_that_cannot_start_fails_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(&tmp.path().join("data"), None, &[]);
    // One argument over Linux's 128 KiB limit: exec fails with E2BIG.
    let huge = "x".repeat(140_000);
    let id = d.submit(&format!("command: [/bin/echo, {huge}]\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "failed");
    let message = j["message"].as_str().unwrap();
    assert!(message.contains("could not start"), "{message}");
    assert!(message.contains("too large to start"), "{message}");
    assert!(!message.contains("lost"), "{message}");
    assert_eq!(j["tasks"][0]["exit_code"], serde_json::Value::Null, "{j}");
}

#[test]
fn a_root_runc_would_refuse_is_refused_at_submit() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(&tmp.path().join("data"), None, &[]);
    let real = tmp.path().join("real");
    std::fs::create_dir_all(real.join("rootfs")).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let refused = |manifest: String| -> String {
        let r = d.client().request("POST", "/v1/jobs", Some(manifest.as_bytes()), &[]).unwrap();
        assert_eq!(r.status, 400, "{manifest}: {}", String::from_utf8_lossy(&r.body));
        r.json().unwrap()["error"].as_str().unwrap().to_owned()
    };
    let job = |field: &str, path: &str| format!("command: [\"true\"]\n{field}: {path}\n");
    // A symlink, or a symlink above it: runc compares the root with its resolved path.
    let e = refused(job("rootfs", &link.join("rootfs").display().to_string()));
    assert_eq!(
        e,
        format!(
            "rootfs: {} has a symlink in it (it resolves to {}), which runc refuses as a root; give {1}",
            link.join("rootfs").display(),
            real.join("rootfs").display()
        )
    );
    let e = refused(job("rootfs", &link.display().to_string()));
    assert!(e.contains("has a symlink in it"), "{e}");
    // Relative to what the daemon's working directory happens to be: refused.
    let e = refused(job("rootfs", "real/rootfs"));
    assert!(e.starts_with("rootfs: ") && e.contains("absolute"), "{e}");
    let e = refused(job("rootfs", &tmp.path().join("missing").display().to_string()));
    assert!(e.ends_with("is not a directory on the daemon's host"), "{e}");
    // A bundle whose config.json names a root that is not there.
    std::fs::write(real.join("config.json"), r#"{"root": {"path": "nope"}, "process": {}}"#)
        .unwrap();
    let e = refused(job("bundle", &real.display().to_string()));
    assert_eq!(
        e,
        format!(
            "bundle: root.path of {}: {} is not a directory on the daemon's host",
            real.join("config.json").display(),
            real.join("nope").display()
        )
    );
    // The same bundle reached through a symlink.
    std::fs::write(real.join("config.json"), r#"{"root": {"path": "rootfs"}, "process": {}}"#)
        .unwrap();
    let e = refused(job("bundle", &link.display().to_string()));
    assert!(e.contains("has a symlink in it"), "{e}");
    // Kubernetes' form names the annotation.
    let k8s = format!(
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: j\n  annotations:\n    xpu.dev/rootfs: {}\nspec:\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        command: [\"true\"]\n",
        link.display()
    );
    assert!(refused(k8s).starts_with("metadata.annotations.xpu.dev/rootfs: "));
}

#[test]
fn a_daemon_that_cannot_listen_says_why_once_without_banner_or_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(xpu_bin())
        .args(["serve", "--data-dir", data.to_str().unwrap(), "--listen", &addr])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        !stderr.contains("xpu serve: socket"),
        "no banner for a daemon that never served: {stderr}"
    );
    assert_eq!(stderr.matches("Address already in use").count(), 1, "{stderr}");
    assert!(stderr.contains(&format!("listening on {addr}")), "{stderr}");
    assert!(!data.join("xpu.sock").exists(), "the socket is left behind: {stderr}");

    // A daemon that starts prints its banner once it serves.
    let d = Daemon::start(&data, None, &[]);
    d.wait_for("the banner", || d.log().contains("xpu serve: socket").then_some(()));
}

/// The standard multi-host pattern: an Indexed Job whose env takes the completion index through
/// the downward API and whose args use `$(VAR)` references, as the kubelet expands them.
#[test]
fn an_indexed_job_gets_its_rank_from_the_downward_api_and_var_references() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(&tmp.path().join("data"), None, &[]);
    let manifest = r#"
apiVersion: batch/v1
kind: Job
metadata:
  name: ddp
  namespace: ml
spec:
  completions: 1
  completionMode: Indexed
  template:
    metadata:
      labels:
        app: trainer
    spec:
      restartPolicy: Never
      serviceAccountName: trainer
      containers:
      - name: main
        image: busybox
        command: ["/bin/echo"]
        args: ["rank=$(JOB_COMPLETION_INDEX)", "node_rank=$(RANK)", "master=$(MASTER)",
               "ns=$(NS)", "app=$(APP)", "sa=$(SA)", "pod=$(POD)", "escaped=$$(RANK)",
               "unknown=$(NOPE)", "cpus=$(CPUS)", "early=$(LATE)", "late_ref=$(LATE_REF)"]
        env:
        - name: RANK
          valueFrom:
            fieldRef:
              fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        - name: JOB
          valueFrom:
            fieldRef:
              fieldPath: "metadata.labels['job-name']"
        - name: MASTER
          value: "$(JOB)-0.ddp-svc"
        - name: LATE_REF
          value: "$(LATE)"
        - name: LATE
          value: "set-after"
        - {name: NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
        - {name: APP, valueFrom: {fieldRef: {fieldPath: "metadata.labels['app']"}}}
        - {name: SA, valueFrom: {fieldRef: {fieldPath: spec.serviceAccountName}}}
        - {name: POD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
        - name: CPUS
          valueFrom:
            resourceFieldRef: {resource: requests.cpu, divisor: 1m}
        resources:
          requests:
            cpu: 500m
"#;
    let id = d.submit(manifest);
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    d.wait_log(
        id,
        &format!(
            "rank=0 node_rank=0 master=ddp-0.ddp-svc ns=ml app=trainer sa=trainer pod=ddp-{id}-0 \
             escaped=$(RANK) unknown=$(NOPE) cpus=500 early=set-after late_ref=$(LATE)"
        ),
    );
}

/// References that double a value each time stand for a huge string in a small manifest: it is
/// refused at submit naming the variable, and the daemon never builds the string. The fan-out
/// that keeps each value under its bound (`A` of 64 KiB, `B=$(A)$(A)`, then thousands of
/// `B=$(B)`) is refused the same way, and the daemon answers throughout.
#[test]
fn a_doubling_chain_of_references_is_refused_at_submit_instead_of_growing() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(&tmp.path().join("data"), None, &[]);
    let mut env = format!("        - {{name: V0, value: \"{}\"}}\n", "x".repeat(1000));
    for i in 1..40 {
        env.push_str(&format!("        - {{name: V{i}, value: \"$(V{p})$(V{p})\"}}\n", p = i - 1));
    }
    let job = |env: &str| {
        format!(
            "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: bomb}}\nspec:\n  backoffLimit: 0\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        command: [\"/bin/true\"]\n        env:\n{env}"
        )
    };
    let r = d.client().request("POST", "/v1/jobs", Some(job(&env).as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    assert!(r.error_message().contains("env[8]"), "{}", r.error_message());
    let mut fan = format!("        - {{name: A, value: \"{}\"}}\n", "a".repeat(64 * 1024));
    fan.push_str("        - {name: B, value: \"$(A)$(A)\"}\n");
    for _ in 0..3000 {
        fan.push_str("        - {name: B, value: \"$(B)\"}\n");
    }
    let t0 = std::time::Instant::now();
    let r = d.client().request("POST", "/v1/jobs", Some(job(&fan).as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    let r = d.client().request("GET", "/v1/status", None, &[]).unwrap();
    assert_eq!(r.status, 200);
}
