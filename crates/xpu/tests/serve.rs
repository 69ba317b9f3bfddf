//! `xpu serve` end to end, the same suite against a real SQLite file and a real PostgreSQL
//! server: submit → schedule → run → finish with the seeds' Job manifests, restart policies and
//! backoff limits, the Indexed job's environment, queueing with the scheduler's reasons, shared
//! GPUs, priority and fair share, cancel, deadlines, logs, bad manifests, the CLI's JSON
//! shapes, and every path the OpenAPI document lists.
//!
//! Nothing here sleeps a fixed time to let the daemon act: each step waits for the state it
//! needs (up to `serve_support::WAIT`), so the suite holds on a loaded two-core machine.

#![allow(clippy::unwrap_used)]

mod serve_support;

use serde_json::Value;
use serve_support::{Daemon, Postgres, kill_tasks};

/// A shell loop that waits until `gate` exists (the test opens it).
fn wait_gate(gate: &std::path::Path) -> String {
    format!("while [ ! -e {} ]; do sleep 0.05; done", gate.display())
}

/// The GKE seed's single-host Job with its placeholders filled for a v6e host with 8 chips.
const SEED_SINGLE: &str = r#"
apiVersion: batch/v1
kind: Job
metadata:
  name: job-1
spec:
  template:
    spec:
      nodeSelector:
        cloud.google.com/gke-flex-start: "true"
        cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
        cloud.google.com/gke-tpu-topology: 2x4
      containers:
      - name: container-1
        image: gcr.io/k8s-staging-perf-tests/sleep:latest
        args: ["0.2s"] # the seed sleeps 3600s
        resources:
          requests:
              google.com/tpu: 8
          limits:
              google.com/tpu: 8
      restartPolicy: OnFailure
"#;

/// The seed's multi-host Indexed Job (with its headless Service), two workers of 4 chips,
/// whose container writes its environment to a file.
fn seed_multi(out_dir: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata:
  name: headless-svc
spec:
  clusterIP: None
  selector:
    job-name: job-1
---
apiVersion: batch/v1
kind: Job
metadata:
  name: job-1
spec:
  backoffLimit: 0
  completions: 2
  parallelism: 2
  completionMode: Indexed
  template:
    spec:
      subdomain: headless-svc
      restartPolicy: Never
      nodeSelector:
          cloud.google.com/gke-flex-start: "true"
          cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
          cloud.google.com/gke-tpu-topology: 2x4
      containers:
      - name: tpu-job
        image: us-docker.pkg.dev/cloud-tpu-images/jax-ai-image/tpu:latest
        ports:
        - containerPort: 8471
        securityContext:
          privileged: true
        command:
        - bash
        - -c
        - |
          env | grep -E '^(JOB_COMPLETION_INDEX|TPU_WORKER_ID|TPU_WORKER_HOSTNAMES|TPU_VISIBLE_CHIPS)=' | sort > {out_dir}/env-$JOB_COMPLETION_INDEX
        resources:
          requests:
            google.com/tpu: 4
          limits:
            google.com/tpu: 4
"#
    )
}

fn short(cmd: &str, extra: &str) -> String {
    format!("command: [sh, -c, {}]\n{extra}", serde_json::to_string(cmd).unwrap())
}

fn start(dir: &std::path::Path, db: Option<&str>) -> Daemon {
    Daemon::start(
        dir,
        db,
        &[
            "--devices",
            "tpu-v6e:8",
            "--devices",
            "nvidia-a100:2",
            "--label",
            "cloud.google.com/gke-flex-start=true",
            "--node-name",
            "node-a",
        ],
    )
}

fn suite(d: &Daemon, scratch: &std::path::Path) {
    submit_schedule_run_finish(d);
    restart_policies(d, scratch);
    indexed_job_env(d, scratch);
    gpu_env_and_queueing(d, scratch);
    shared_gpus(d, scratch);
    priority_and_fair_share(d, scratch);
    completions_beyond_parallelism(d, scratch);
    cancel(d);
    deadline(d);
    bad_manifests(d);
    idempotent_submit(d);
    several_workloads_in_one_file(d, scratch);
    pod_restarts_by_default(d, scratch);
    cli_shapes(d);
    openapi_paths_answer(d);
}

fn submit_schedule_run_finish(d: &Daemon) {
    let id = d.submit(SEED_SINGLE);
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["spec"]["container"]["argv"], serde_json::json!(["sleep", "0.2s"]));
    let t = &j["tasks"][0];
    assert_eq!(t["state"], "succeeded");
    assert_eq!(t["exit_code"], 0);
    assert_eq!(t["devices"], serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7]));
    assert!(j["started_at_ms"].as_i64() <= j["finished_at_ms"].as_i64());
}

fn restart_policies(d: &Daemon, scratch: &std::path::Path) {
    // OnFailure: restarted in place, same devices, until it succeeds on the third attempt.
    let counter = scratch.join("count");
    let cmd = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; echo attempt $n $CUDA_VISIBLE_DEVICES; [ $n -ge 3 ]",
        c = counter.display()
    );
    let id = d.submit(&short(&cmd, "gpus: 1\nrestartPolicy: OnFailure\nbackoffLimit: 2\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["failures"], 2);
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3);
    assert_eq!(tasks[0]["state"], "failed");
    assert_eq!(tasks[0]["exit_code"], 1);
    assert_eq!(tasks[0]["devices"], tasks[2]["devices"], "OnFailure keeps the devices");

    // Never with backoffLimit 1: two failures fail the job (BackoffLimitExceeded).
    let id = d.submit(&short("exit 7", "restartPolicy: Never\nbackoffLimit: 1\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(j["failures"], 2);
    assert_eq!(j["tasks"].as_array().unwrap().len(), 2);
    assert!(j["message"].as_str().unwrap().contains("BackoffLimitExceeded"), "{j}");
    assert_eq!(j["tasks"][1]["exit_code"], 7);

    // The Kubernetes default backoffLimit (6) applies to manifests.
    let k8s = SEED_SINGLE
        .replace("image: gcr.io/k8s-staging-perf-tests/sleep:latest\n        args: [\"0.2s\"] # the seed sleeps 3600s", "command: [\"false\"]");
    let id = d.submit(&k8s);
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "failed");
    assert_eq!(j["failures"], 7, "{j}");
}

fn indexed_job_env(d: &Daemon, scratch: &std::path::Path) {
    let out = scratch.join("indexed");
    std::fs::create_dir_all(&out).unwrap();
    let id = d.submit(&seed_multi(&out.display().to_string()));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    let host = d.get("/v1/status")["hostname"].as_str().unwrap().to_owned();
    let mut chips = Vec::new();
    for i in 0..2 {
        let env = std::fs::read_to_string(out.join(format!("env-{i}"))).unwrap();
        assert!(env.contains(&format!("JOB_COMPLETION_INDEX={i}\n")), "{env}");
        assert!(env.contains(&format!("TPU_WORKER_ID={i}\n")), "{env}");
        assert!(env.contains(&format!("TPU_WORKER_HOSTNAMES={host},{host}\n")), "{env}");
        let visible = env.lines().find_map(|l| l.strip_prefix("TPU_VISIBLE_CHIPS=")).unwrap();
        chips.extend(visible.split(',').map(|c| c.parse::<u32>().unwrap()));
    }
    chips.sort_unstable();
    assert_eq!(chips, (0..8).collect::<Vec<_>>(), "the gang's two workers got disjoint chips");
}

fn gpu_env_and_queueing(d: &Daemon, scratch: &std::path::Path) {
    // Two GPU jobs fill the node; a third waits in the queue with a reason, then runs.
    let gate = scratch.join("gate");
    let hold = format!("{}; echo $CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES", wait_gate(&gate));
    let a = d.submit(&short(&hold, "gpus: 1\n"));
    let b = d.submit(&short(&hold, "gpus: 1\n"));
    let c = d.submit(&short("echo third $CUDA_VISIBLE_DEVICES", "gpus: 1\n"));
    d.wait_state(a, &["running"]);
    d.wait_state(b, &["running"]);
    // The third waits, and the scheduler says why, kube-scheduler style.
    let q = d.wait_for("job c queued with a reason", || {
        let q = d.get("/v1/queue");
        (q["queued"][0]["id"] == c && q["queued"][0]["reason"].is_string()).then_some(q)
    });
    assert_eq!(q["queued"].as_array().unwrap().len(), 1, "{q}");
    assert_eq!(q["queued"][0]["reason"], "0/1 nodes are available: 1 Insufficient gpu", "{q}");
    let shown = d.cli(&["job", &c.to_string()]);
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains("Insufficient gpu"),
        "xpu job shows the reason: {}",
        String::from_utf8_lossy(&shown.stdout)
    );
    let devs = d.get("/v1/devices");
    let held: Vec<&Value> =
        devs["devices"].as_array().unwrap().iter().filter(|x| x["kind"] == "gpu").collect();
    assert!(held.iter().all(|x| x["holder"].is_object()), "{devs}");
    std::fs::write(&gate, "").unwrap();
    for id in [a, b, c] {
        assert_eq!(d.wait_state(id, &["succeeded", "failed"])["state"], "succeeded");
    }
    let logs: Vec<String> = [a, b]
        .iter()
        .map(|id| {
            let r = d.client().request("GET", &format!("/v1/jobs/{id}/logs"), None, &[]).unwrap();
            String::from_utf8(r.body).unwrap()
        })
        .collect();
    let mut got = logs.clone();
    got.sort();
    assert_eq!(got, vec!["0 0\n".to_owned(), "1 1\n".to_owned()], "each job saw only its own GPU");
}

fn shared_gpus(d: &Daemon, scratch: &std::path::Path) {
    // One job holds a whole GPU; two jobs asking half a GPU each share the other one and run
    // at the same time; a third half-GPU job waits until a share frees up.
    let gate = scratch.join("share-gate");
    let whole = d.submit(&short(&wait_gate(&gate), "gpus: 1\n"));
    d.wait_state(whole, &["running"]);
    let marks = scratch.join("share-marks");
    std::fs::create_dir_all(&marks).unwrap();
    let half = format!(
        "cd {}; echo $CUDA_VISIBLE_DEVICES $XPU_GPU_MILLI > .$XPU_JOB_ID; mv .$XPU_JOB_ID $XPU_JOB_ID; {}",
        marks.display(),
        wait_gate(&gate)
    );
    let s1 = d.submit(&short(&half, "gpuMilli: 500\n"));
    let s2 = d.submit(&short(&half, "gpuMilli: 500\n"));
    let s3 = d.submit(&short(&half, "gpuMilli: 500\n"));
    // Both halves are running at once: each has written its mark while the gate is closed
    // (renamed into place, so a mark that exists is complete).
    for id in [s1, s2] {
        d.wait_for(&format!("job {id} running on its share"), || {
            marks.join(id.to_string()).exists().then_some(())
        });
    }
    let seen = |id: i64| std::fs::read_to_string(marks.join(id.to_string())).unwrap();
    assert_eq!(seen(s1), seen(s2), "the two halves share one GPU");
    assert!(seen(s1).ends_with(" 500\n"), "{}", seen(s1));
    let q = d.wait_for("the third half queued with a reason", || {
        let q = d.get("/v1/queue");
        let mine = q["queued"].as_array()?.iter().find(|x| x["id"] == s3)?.clone();
        mine["reason"].is_string().then_some(mine)
    });
    assert_eq!(q["reason"], "0/1 nodes are available: 1 Insufficient gpu", "{q}");
    assert_eq!(d.get(&format!("/v1/jobs/{s3}"))["state"], "queued");
    let devs = d.get("/v1/devices");
    let shared: Vec<&Value> = devs["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["holders"].as_array().unwrap().len() == 2)
        .collect();
    assert_eq!(shared.len(), 1, "{devs}");
    assert_eq!(shared[0]["allocated_milli"], 1000);
    assert_eq!(shared[0]["holders"][0]["milli"], 500);
    let table = String::from_utf8_lossy(&d.cli(&["devices"]).stdout).into_owned();
    assert!(table.contains(&format!("job {s1} (sh) task 0 500m")), "{table}");
    let metrics =
        String::from_utf8(d.client().request("GET", "/metrics", None, &[]).unwrap().body).unwrap();
    let gpu_lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("xpu_device_allocated{") && l.contains("kind=\"gpu\""))
        .collect();
    assert_eq!(gpu_lines.len(), 2, "{metrics}");
    assert!(gpu_lines.iter().all(|l| l.ends_with(" 1")), "both GPUs fully held: {gpu_lines:?}");
    std::fs::write(&gate, "").unwrap();
    for id in [whole, s1, s2, s3] {
        assert_eq!(d.wait_state(id, &["succeeded", "failed"])["state"], "succeeded");
    }
}

fn priority_and_fair_share(d: &Daemon, scratch: &std::path::Path) {
    // Both GPUs held; then queue a gets a low- and a high-priority job, and queue b one job,
    // submitted last. When the GPUs free up, a's high-priority job starts first (priority
    // inside a queue) and b's job next (b holds nothing, a already half the GPUs: fair
    // share), ahead of a's older low-priority job, which waits.
    let hold_gate = scratch.join("fair-hold");
    let gate = scratch.join("fair-gate");
    let hold = d.submit(&short(&wait_gate(&hold_gate), "gpus: 2\nqueue: ops\n"));
    d.wait_state(hold, &["running"]);
    let job = |q: &str, p: i32| {
        d.submit(&short(&wait_gate(&gate), &format!("gpus: 1\nqueue: {q}\npriority: {p}\n")))
    };
    let a_low = job("a", 0);
    let a_high = job("a", 5);
    let b = job("b", 0);
    let q = d.wait_for("three jobs queued", || {
        let q = d.get("/v1/queue");
        (q["queued"].as_array()?.len() == 3).then_some(q)
    });
    let order: Vec<i64> =
        q["queued"].as_array().unwrap().iter().map(|x| x["id"].as_i64().unwrap()).collect();
    assert_eq!(order, vec![a_high, a_low, b], "queue order: priority, then submission");
    std::fs::write(&hold_gate, "").unwrap();
    d.wait_state(a_high, &["running"]);
    d.wait_state(b, &["running"]);
    let q = d.wait_for("a's low-priority job alone in the queue", || {
        let q = d.get("/v1/queue");
        (q["queued"].as_array()?.len() == 1).then_some(q)
    });
    assert_eq!(q["queued"][0]["id"], a_low, "{q}");
    assert_eq!(d.get(&format!("/v1/jobs/{a_low}"))["state"], "queued");
    std::fs::write(&gate, "").unwrap();
    for id in [hold, a_high, b, a_low] {
        assert_eq!(d.wait_state(id, &["succeeded", "failed"])["state"], "succeeded");
    }
}

fn completions_beyond_parallelism(d: &Daemon, scratch: &std::path::Path) {
    // Five Indexed completions, two at a time: each slot is placed again for the next index,
    // every index runs once, and never more than two run at once.
    let dir = scratch.join("slots");
    std::fs::create_dir_all(dir.join("running")).unwrap();
    let cmd = format!(
        "cd {}; touch running/$JOB_COMPLETION_INDEX; echo $JOB_COMPLETION_INDEX $(ls running | wc -l) >> seen; sleep 0.2; rm running/$JOB_COMPLETION_INDEX",
        dir.display()
    );
    let id = d.submit(&short(&cmd, "completions: 5\nparallelism: 2\nindexed: true\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    let seen = std::fs::read_to_string(dir.join("seen")).unwrap();
    let mut idx: Vec<u32> =
        seen.lines().map(|l| l.split(' ').next().unwrap().parse().unwrap()).collect();
    idx.sort_unstable();
    assert_eq!(idx, vec![0, 1, 2, 3, 4], "{seen}");
    let most = seen.lines().map(|l| l.split(' ').nth(1).unwrap().parse::<u32>().unwrap()).max();
    assert!(most <= Some(2), "parallelism 2 exceeded: {seen}");
    assert_eq!(j["tasks"].as_array().unwrap().len(), 5);
}

fn cancel(d: &Daemon) {
    let id = d.submit(&short("trap '' TERM; echo started; sleep 300", "gpus: 0\n"));
    d.wait_state(id, &["running"]);
    // Running, with its pid recorded, and past the trap: SIGTERM is now ignored.
    let pid = d.wait_pid(id);
    d.wait_log(id, "started");
    // Follow the log while it runs: the stream ends when the task is stopped.
    let follower = {
        let socket = d.socket();
        std::thread::spawn(move || {
            std::process::Command::new(serve_support::xpu_bin())
                .args(["logs", &id.to_string(), "-f", "--server", &socket])
                .output()
                .unwrap()
        })
    };
    let out = d.cli(&["cancel", &id.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = d.wait_state(id, &["cancelled"]);
    assert_eq!(j["message"], "cancelled by request");
    // The task ignores SIGTERM, so it is gone only after SIGKILL (grace 1 s).
    d.wait_for(&format!("task {pid} to be gone after cancel"), || {
        (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    });
    let followed = follower.join().unwrap();
    assert!(followed.status.success());
    assert_eq!(String::from_utf8_lossy(&followed.stdout), "started\n");
    let again = d.cli(&["cancel", &id.to_string()]);
    assert_eq!(again.status.code(), Some(2), "cancelling an ended job is an input error");
}

fn deadline(d: &Daemon) {
    let id = d.submit(&short("sleep 300", "activeDeadlineSeconds: 1\n"));
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "failed");
    assert!(j["message"].as_str().unwrap().contains("DeadlineExceeded"), "{j}");
}

fn bad_manifests(d: &Daemon) {
    let bad = SEED_SINGLE.replace("google.com/tpu: 8", "nvidia.com/gpu: NUM_CHIPS");
    let r = d.client().request("POST", "/v1/jobs", Some(bad.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 400);
    let v = r.json().unwrap();
    assert_eq!(
        v["error"],
        "spec.template.spec.containers[0].resources.requests.nvidia.com/gpu: must be a positive integer"
    );
    assert_eq!(v["field"], "spec.template.spec.containers[0].resources.requests.nvidia.com/gpu");
    let big = vec![b'a'; 2 << 20];
    let r = d.client().request("POST", "/v1/jobs", Some(&big), &[]).unwrap();
    assert_eq!(r.status, 413);
    // Through the CLI: exit 2 with the field in the message.
    let f = d.data_dir.join("bad.yaml");
    std::fs::write(&f, &bad).unwrap();
    let out = d.cli(&["submit", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("limits.nvidia.com/gpu")
            || String::from_utf8_lossy(&out.stderr).contains("requests.nvidia.com/gpu")
    );
    // A job whose nodeSelector the node cannot satisfy fails with the label named.
    let id = d.submit(&SEED_SINGLE.replace("tpu-v6e-slice", "tpu-v5p-slice"));
    let j = d.wait_state(id, &["failed"]);
    assert!(j["message"].as_str().unwrap().contains("cloud.google.com/gke-tpu-accelerator"), "{j}");
    let r = d.client().request("GET", "/v1/jobs/999999", None, &[]).unwrap();
    assert_eq!(r.status, 404);
}

fn idempotent_submit(d: &Daemon) {
    let m = short("true", "");
    let h = [("Idempotency-Key", "abc-1")];
    let r1 = d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &h).unwrap();
    let r2 = d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &h).unwrap();
    assert_eq!((r1.status, r2.status), (201, 200));
    assert_eq!(r1.json().unwrap()["id"], r2.json().unwrap()["id"]);
}

/// Two Pods sharing one GPU and a headless Service in one file, as `kubectl apply -f` takes it.
fn two_pods(gate: &str) -> String {
    let pod = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  annotations: {{xpu.dev/gpu-milli: \"500\"}}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: c\n    image: busybox\n    command: [sh, -c, 'echo {name} $XPU_GPU_MILLI $CUDA_VISIBLE_DEVICES; {gate}']\n    resources: {{limits: {{nvidia.com/gpu: 1}}}}\n"
        )
    };
    format!(
        "{}---\napiVersion: v1\nkind: Service\nmetadata: {{name: headless}}\nspec: {{clusterIP: None}}\n---\n{}",
        pod("share-a"),
        pod("share-b")
    )
}

fn several_workloads_in_one_file(d: &Daemon, scratch: &std::path::Path) {
    let gate = scratch.join("two-pods-gate");
    let file = two_pods(&wait_gate(&gate));
    let h = [("Idempotency-Key", "two-pods")];
    let r = d.client().request("POST", "/v1/jobs", Some(file.as_bytes()), &h).unwrap();
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json().unwrap();
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2, "{v}");
    assert_eq!(
        (jobs[0]["name"].as_str(), jobs[1]["name"].as_str()),
        (Some("share-a"), Some("share-b"))
    );
    assert_eq!(v["id"], jobs[0]["id"]);
    assert!(v["notes"].to_string().contains("skipped Service headless"), "{v}");
    let ids: Vec<i64> = jobs.iter().map(|j| j["id"].as_i64().unwrap()).collect();
    // Both run at once on halves of one GPU.
    for &id in &ids {
        d.wait_state(id, &["running"]);
        d.wait_log(id, " 500 ");
    }
    std::fs::write(&gate, "").unwrap();
    let mut gpus = Vec::new();
    for &id in &ids {
        let j = d.wait_state(id, &["succeeded", "failed"]);
        assert_eq!(j["state"], "succeeded", "{j}");
        gpus.push(j["tasks"][0]["devices"].clone());
    }
    assert_eq!(gpus[0], gpus[1], "the two Pods shared one GPU");
    // A retry of the file finds both jobs.
    let r = d.client().request("POST", "/v1/jobs", Some(file.as_bytes()), &h).unwrap();
    assert_eq!(r.status, 200);
    let again: Vec<i64> = r.json().unwrap()["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_i64().unwrap())
        .collect();
    assert_eq!(again, ids);

    // One bad document: nothing of the file is submitted, and the error names the document.
    let before = d.get("/v1/jobs?limit=1000")["jobs"].as_array().unwrap().len();
    let third = two_pods("true").split("---").next().unwrap().replace("share-a", "third");
    let bad = format!("{file}---\n{}", third.replace("nvidia.com/gpu: 1", "nvidia.com/gpu: many"));
    let r = d.client().request("POST", "/v1/jobs", Some(bad.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let e = r.json().unwrap();
    assert_eq!(e["field"], "document[3].spec.containers[0].resources.limits.nvidia.com/gpu", "{e}");
    let after = d.get("/v1/jobs?limit=1000")["jobs"].as_array().unwrap().len();
    assert_eq!(before, after, "a file with one bad document submits none");

    // The CLI prints one id per job.
    let f = scratch.join("two-pods.yaml");
    std::fs::write(&f, two_pods("true")).unwrap();
    let out = d.cli(&["submit", f.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: Vec<i64> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(printed.len(), 2, "{printed:?}");
    for id in printed {
        d.wait_state(id, &["succeeded"]);
    }
}

/// A Pod without restartPolicy is restarted whenever it exits, as the kubelet does, until it
/// is cancelled.
fn pod_restarts_by_default(d: &Daemon, scratch: &std::path::Path) {
    let runs = scratch.join("always-runs");
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: always}}\nspec:\n  containers:\n  - name: c\n    command: [sh, -c, 'echo run >> {}; sleep 0.05']\n",
        runs.display()
    );
    let r = d.client().request("POST", "/v1/jobs", Some(pod.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 201);
    let v = r.json().unwrap();
    assert!(v["notes"].to_string().contains("restartPolicy: Always (the Pod default)"), "{v}");
    let id = v["id"].as_i64().unwrap();
    d.wait_for("three runs of the Pod", || {
        let n = std::fs::read_to_string(&runs).unwrap_or_default().lines().count();
        (n >= 3).then_some(())
    });
    let j = d.get(&format!("/v1/jobs/{id}"));
    assert_eq!(j["state"], "running", "a Pod with restartPolicy Always never completes: {j}");
    assert_eq!(j["failures"], 0, "exiting 0 is not a failure: {j}");
    let out = d.cli(&["cancel", &id.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    d.wait_state(id, &["cancelled"]);
    let events = d.get(&format!("/v1/events?job={id}"));
    assert!(events.to_string().contains("restartPolicy Always"), "{events}");
}

fn cli_shapes(d: &Daemon) {
    let out =
        d.cli(&["submit", "--gpus", "0", "--name", "cli-job", "--", "sh", "-c", "echo from-cli"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    d.wait_state(id, &["succeeded"]);
    let logs = d.cli(&["logs", &id.to_string()]);
    assert_eq!(String::from_utf8_lossy(&logs.stdout), "from-cli\n");
    let v = d.cli_json(&["jobs", "--format", "json", "--limit", "3"]);
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 3);
    assert_eq!(jobs[0]["id"], id);
    for j in jobs {
        for k in ["id", "name", "state"] {
            assert!(!j[k].is_null(), "{k} in {j}");
        }
        assert!(
            ["queued", "running", "succeeded", "failed", "cancelled"]
                .contains(&j["state"].as_str().unwrap())
        );
    }
    // Paging: the next page continues below the last id.
    let next = v["next"].as_i64().unwrap();
    let v2 =
        d.cli_json(&["jobs", "--format", "json", "--limit", "3", "--before", &next.to_string()]);
    assert!(v2["jobs"][0]["id"].as_i64().unwrap() < next);
    let one = d.cli_json(&["job", &id.to_string(), "--format", "json"]);
    assert_eq!(one["name"], "cli-job");
    let devs = d.cli_json(&["devices", "--format", "json"]);
    assert_eq!(devs["devices"].as_array().unwrap().len(), 10);
    let table = d.cli(&["jobs"]);
    assert!(String::from_utf8_lossy(&table.stdout).starts_with("ID  "));
}

fn openapi_paths_answer(d: &Daemon) {
    let doc = d.get("/openapi.json");
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 10);
    for (path, ops) in paths {
        let concrete = path.replace("{id}", "1");
        for method in ops.as_object().unwrap().keys() {
            let m = method.to_uppercase();
            let body = (m == "POST").then_some(&b"command: [true]\n"[..]);
            let r = d.client().request(&m, &concrete, body, &[]).unwrap();
            // A route that exists never falls through to the 404 "no such route" answer.
            let text = String::from_utf8_lossy(&r.body);
            assert!(!text.contains("no such route"), "{m} {path} is documented but not served");
            assert!(r.status < 500, "{m} {path}: {} {text}", r.status);
        }
    }
    let metrics =
        String::from_utf8(d.client().request("GET", "/metrics", None, &[]).unwrap().body).unwrap();
    for name in [
        "xpu_jobs{state=\"succeeded\"}",
        "xpu_queue_wait_seconds_bucket",
        "xpu_device_allocated{",
        "xpu_scheduling_latency_seconds_count",
        // The exporter's per-device series (xpu-telemetry), for the daemon's devices.
        "xpu_device_info{",
        "xpu_device_healthy{",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    // The whole text parses with Prometheus' own parser for the text format (0.0.4).
    let out = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(
            "import sys\n\
             from prometheus_client.parser import text_string_to_metric_families as p\n\
             print(sum(len(f.samples) for f in p(sys.stdin.read())))",
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(metrics.as_bytes())?;
            c.wait_with_output()
        })
        .expect("/usr/bin/python3 (run scripts/install-test-deps)");
    assert!(
        out.status.success(),
        "Prometheus' parser refused /metrics (scripts/install-test-deps installs \
         python3-prometheus-client): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sqlite_store_suite() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"), None);
    suite(&d, dir.path());
    // The store is a real SQLite file in WAL mode.
    assert!(dir.path().join("data/xpu.db").is_file());
    assert!(dir.path().join("data/xpu.db-wal").exists());
    kill_tasks(&d.data_dir);
}

#[test]
fn postgres_store_suite() {
    let pg = match Postgres::start() {
        Ok(pg) => pg,
        Err(why) => {
            eprintln!("skipping postgres_store_suite: {why}");
            return;
        }
    };
    let url = pg.database("suite");
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"), Some(&url));
    suite(&d, dir.path());
    assert_eq!(d.get("/v1/status")["leader"], true);
    kill_tasks(&d.data_dir);
}

/// A script that has just started `xpu serve` can submit at once with `--wait-server`: the
/// client waits for the daemon to answer instead of failing on a socket that is not there yet.
#[test]
fn submit_waits_for_a_starting_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let socket = format!("unix://{}/xpu.sock", data.display());
    let early = std::process::Command::new(serve_support::xpu_bin())
        .args(["submit", "--server", &socket, "--wait-server", "60", "--", "true"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let d = start(&data, None);
    let out = early.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    d.wait_state(id, &["succeeded"]);

    // No daemon at all: the wait ends with the connection error, naming the fix.
    let none = format!("unix://{}/none.sock", dir.path().display());
    let out = std::process::Command::new(serve_support::xpu_bin())
        .args(["jobs", "--server", &none, "--wait-server", "0.3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is xpu serve running?") && err.contains("waited 0.3 s"), "{err}");
    kill_tasks(&d.data_dir);
}

/// TCP off loopback asks for the bearer token from `<data-dir>/token` (mode 0600) on every
/// route; the Unix socket (mode 0660) does not.
#[test]
fn token_guards_tcp_off_loopback() {
    use std::os::unix::fs::PermissionsExt;
    use xpu_server::client::{Client, Target};

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = serve_support::free_port();
    let mut child = std::process::Command::new(serve_support::xpu_bin())
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args(["--listen", &format!("0.0.0.0:{port}"), "--devices", "nvidia-a100:1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let socket = Target::Unix(data.join("xpu.sock"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while Client::new(socket.clone(), None).request("GET", "/v1/status", None, &[]).is_err() {
        assert!(std::time::Instant::now() < deadline, "the daemon did not answer on its socket");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mode = |p: &str| std::fs::metadata(data.join(p)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("token"), 0o600);
    assert_eq!(mode("xpu.sock"), 0o660);
    let token = std::fs::read_to_string(data.join("token")).unwrap().trim().to_owned();
    assert_eq!(token.len(), 64, "{token}");

    let tcp = Target::Tcp(format!("127.0.0.1:{port}"));
    for path in ["/v1/status", "/v1/jobs", "/metrics", "/"] {
        let r = Client::new(tcp.clone(), None).request("GET", path, None, &[]).unwrap();
        assert_eq!(r.status, 401, "{path} without a token");
        assert!(r.error_message().contains("bearer token"), "{}", r.error_message());
        let wrong = "0".repeat(64);
        assert_eq!(status_with(&tcp, Some(&wrong), path), 401, "{path} with a wrong token");
        assert_eq!(status_with(&tcp, Some(&token), path), 200, "{path} with the token");
    }
    let r = Client::new(socket, None).request("GET", "/v1/jobs", None, &[]).unwrap();
    assert_eq!(r.status, 200);

    // A browser logs in once with the token and then carries an HttpOnly, SameSite=Strict cookie.
    assert_eq!(status_with(&tcp, None, "/login?token=nope"), 401);
    assert_eq!(status_with(&tcp, None, "/login"), 401);
    let head = raw_get(port, &format!("/login?token={token}"));
    assert!(head.starts_with("HTTP/1.1 303"), "{head}");
    let want = format!("set-cookie: xpu_token={token}; Path=/; HttpOnly; SameSite=Strict");
    assert!(head.to_lowercase().contains(&want.to_lowercase()), "{head}");
    assert!(head.to_lowercase().contains("location: /\r\n"), "{head}");
    for path in ["/", "/v1/jobs", "/metrics"] {
        let cookie = format!("theme=dark; xpu_token={token}");
        let mut c = Client::new(tcp.clone(), None);
        let r = c.request("GET", path, None, &[("Cookie", cookie.as_str())]).unwrap();
        assert_eq!(r.status, 200, "{path} with the cookie");
        let mut c = Client::new(tcp.clone(), None);
        let r = c.request("GET", path, None, &[("Cookie", "xpu_token=0000")]).unwrap();
        assert_eq!(r.status, 401, "{path} with a wrong cookie");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The status line and headers of a GET of `path` on 127.0.0.1:`port`.
fn raw_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split("\r\n\r\n").next().unwrap_or_default().to_owned() + "\r\n"
}

/// The status a GET of `path` gets with `token`.
fn status_with(target: &xpu_server::client::Target, token: Option<&str>, path: &str) -> u16 {
    let mut c = xpu_server::client::Client::new(target.clone(), token.map(str::to_owned));
    c.request("GET", path, None, &[]).unwrap().status
}

/// Issue 15: `--log-format json` prints one parseable JSON object per state change, each job
/// and task event carrying the job's id.
#[test]
fn json_logs_have_one_event_per_state_change_with_the_job_id() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(&dir.path().join("data"), None, &["--log-format", "json"]);
    let id = d.submit(&short("echo logged", ""));
    d.wait_state(id, &["succeeded"]);
    let events: Vec<Value> = d.wait_for("the job's end in the log", || {
        let events: Vec<Value> = d
            .log()
            .lines()
            // Every line, the banner and warnings included, is an event.
            .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        let done = events
            .iter()
            .any(|e| e["fields"]["job_id"] == id && e["fields"]["state"] == "succeeded");
        done.then_some(events)
    });
    let of_job: Vec<&Value> = events.iter().filter(|e| e["fields"]["job_id"] == id).collect();
    let states = |msg: &str| -> Vec<String> {
        of_job
            .iter()
            .filter(|e| e["fields"]["message"] == msg)
            .map(|e| e["fields"]["state"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(states("job state"), ["queued", "running", "succeeded"], "{of_job:#?}");
    assert_eq!(states("task state"), ["starting", "running", "succeeded"], "{of_job:#?}");
    assert!(of_job.iter().all(|e| e["level"] == "INFO" && e["timestamp"].is_string()));
}
