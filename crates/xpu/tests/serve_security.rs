//! Attacks on `xpu serve` from a local user and from a tenant writing manifests, each against
//! the real daemon as a process: who may submit on which listener and as whom jobs run (a real
//! unprivileged user, made with `setpriv`), manifests and bundles that tried to write outside
//! the data dir, take devices, exhaust memory or block the API, and log followers that held
//! every connection. The daemon must answer `/v1/status` throughout, and start again cleanly.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serve_support::{Daemon, xpu_bin};

const NOBODY: u32 = 65534;

/// A data dir under a directory other users may enter (a test's temporary directory is 0700).
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// `xpu ARGS` as uid `nobody` with group `gid` and no other group.
fn xpu_as_nobody(gid: u32, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new("setpriv")
        .args([&format!("--reuid={NOBODY}"), &format!("--regid={gid}"), "--clear-groups", "--"])
        .arg(xpu_bin())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `/v1/status` answers within a second.
fn status_answers(d: &Daemon) {
    let t0 = Instant::now();
    let r = d.anonymous().request("GET", "/v1/status", None, &[]).unwrap();
    assert_eq!(r.status, 200);
    assert!(t0.elapsed() < Duration::from_secs(1), "status took {:?}", t0.elapsed());
}

#[test]
fn a_local_user_gets_no_root_job_and_runs_jobs_as_itself() {
    if !xpu_testkit::is_root() {
        eprintln!("skipped: needs root to run the daemon and become another user");
        return;
    }
    let dir = open_tempdir();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "nvidia-a100:1"]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    let job = dir.path().join("job.yaml");
    std::fs::write(
        &job,
        format!("name: who\ncommand: [sh, -c, 'id -u > {}/uid; id -u']\n", out.display()),
    )
    .unwrap();
    std::fs::set_permissions(&job, std::fs::Permissions::from_mode(0o644)).unwrap();
    let job = job.to_str().unwrap();

    // Loopback TCP without a token: the overview is readable, nothing can be changed or read.
    let tcp = d.url();
    let r = xpu_as_nobody(NOBODY, &["submit", "--server", &tcp, job], &[]);
    assert!(!r.status.success(), "nobody submitted over loopback TCP without a token");
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(stderr.contains("Bearer") || stderr.contains("token"), "{stderr}");
    for (method, path) in
        [("POST", "/v1/jobs"), ("POST", "/v1/jobs/1/cancel"), ("GET", "/v1/jobs/1/logs")]
    {
        let r = d
            .anonymous()
            .request(
                method,
                path,
                Some(b"command: [id]\n"),
                &[("Content-Type", "application/yaml")],
            )
            .unwrap();
        assert_eq!(r.status, 401, "{method} {path} without a token: {}", r.error_message());
    }
    for path in ["/v1/status", "/v1/jobs", "/v1/queue", "/v1/devices", "/metrics", "/"] {
        let r = d.anonymous().request("GET", path, None, &[]).unwrap();
        assert_eq!(r.status, 200, "{path} is the overview, readable on loopback");
    }

    // The Unix socket refuses a user outside the daemon's group (mode 0660).
    let socket = d.socket();
    let r = xpu_as_nobody(NOBODY, &["submit", "--server", &socket, job], &[]);
    assert!(!r.status.success(), "nobody outside the group reached the socket");

    // In the daemon's group (here gid 0), a user submits over the socket, and the job runs as
    // that user, not as the daemon's root.
    let r = xpu_as_nobody(0, &["submit", "--server", &socket, "--format", "json", job], &[]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let id =
        serde_json::from_slice::<serde_json::Value>(&r.stdout).unwrap()["id"].as_i64().unwrap();
    let done = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", d.log());
    assert_eq!(done["owner"]["uid"], NOBODY, "{done}");
    let uid = std::fs::read_to_string(out.join("uid")).unwrap();
    assert_eq!(uid.trim(), NOBODY.to_string(), "the job ran as uid {uid}");

    // Its owner reads its output; root's job is not its to read or cancel.
    let r = xpu_as_nobody(0, &["logs", "--server", &socket, &id.to_string()], &[]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), NOBODY.to_string());
    let roots = d.submit("name: roots\ncommand: [sleep, '300']\n");
    let r = xpu_as_nobody(0, &["logs", "--server", &socket, &roots.to_string()], &[]);
    assert!(!r.status.success(), "nobody read root's job's output");
    let r = xpu_as_nobody(0, &["cancel", "--server", &socket, &roots.to_string()], &[]);
    assert!(!r.status.success(), "nobody cancelled root's job");
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("belongs to"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    // The daemon's token acts as the daemon's user over TCP.
    let r = d.client().request("POST", &format!("/v1/jobs/{roots}/cancel"), None, &[]).unwrap();
    assert_eq!(r.status, 202, "{}", r.error_message());
    status_answers(&d);
}

#[test]
fn a_bundle_brings_no_device_and_a_named_file_never_blocks_or_floods_the_daemon() {
    let dir = open_tempdir();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "nvidia-a100:1"]);
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
    let submit = |cfg: &serde_json::Value| {
        std::fs::write(bundle.join("config.json"), cfg.to_string()).unwrap();
        let m = format!("name: b\nbundle: {}\ncommand: [\"true\"]\n", bundle.display());
        d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &[]).unwrap()
    };
    let base = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["true"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
        "root": {"path": "rootfs"},
        "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]}},
    });
    let mut devices = base.clone();
    devices["linux"]["devices"] =
        serde_json::json!([{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]);
    let mut allow = base.clone();
    allow["linux"]["resources"]["devices"] = serde_json::json!([
        {"allow": false, "access": "rwm"},
        {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"}
    ]);
    let mut bind = base.clone();
    bind["mounts"] = serde_json::json!([
        {"destination": "/dev/nvidia0", "type": "none", "source": "/dev/nvidia0", "options": ["rbind"]}
    ]);
    let mut bind_dev_dir = base.clone();
    bind_dev_dir["mounts"] = serde_json::json!([
        {"destination": "/hostdev", "type": "bind", "source": "/dev/../dev", "options": ["ro"]}
    ]);
    for (cfg, field) in [
        (&devices, "linux.devices"),
        (&allow, "linux.resources.devices[1]"),
        (&bind, "mounts[0].source"),
        (&bind_dev_dir, "mounts[0].source"),
    ] {
        let r = submit(cfg);
        assert_eq!(r.status, 400, "a bundle with {field} was accepted");
        assert!(r.error_message().contains(field), "{field}: {}", r.error_message());
    }
    assert_eq!(submit(&base).status, 201);

    // A FIFO for config.json is refused at once, and never stalls the API.
    std::fs::remove_file(bundle.join("config.json")).unwrap();
    let fifo = Command::new("mkfifo").arg(bundle.join("config.json")).status().unwrap();
    assert!(fifo.success());
    for _ in 0..4 {
        let m = format!("name: b\nbundle: {}\ncommand: [\"true\"]\n", bundle.display());
        let t0 = Instant::now();
        let r = d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &[]).unwrap();
        assert_eq!(r.status, 400);
        assert!(r.error_message().contains("FIFO"), "{}", r.error_message());
        assert!(t0.elapsed() < Duration::from_secs(5));
        status_answers(&d);
    }

    // Swapped after submit for a file far over the cap (sparse: no disk): the start fails,
    // naming the file, and the daemon's memory stays small.
    std::fs::remove_file(bundle.join("config.json")).unwrap();
    std::fs::write(bundle.join("config.json"), base.to_string()).unwrap();
    let blocker = d.submit("name: hold\ngpus: 1\ncommand: [sleep, '300']\n");
    d.wait_pid(blocker);
    let m = format!("name: b\nbundle: {}\ngpus: 1\ncommand: [\"true\"]\n", bundle.display());
    let r = d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 201, "{}", r.error_message());
    let id = r.json().unwrap()["id"].as_i64().unwrap();
    let big = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(bundle.join("config.json"))
        .unwrap();
    big.set_len(3_500_000_000).unwrap();
    let r = d.client().request("POST", &format!("/v1/jobs/{blocker}/cancel"), None, &[]).unwrap();
    assert_eq!(r.status, 202);
    let done = d.wait_state(id, &["failed", "succeeded"]);
    assert_eq!(done["state"], "failed", "{done}");
    assert!(done.to_string().contains("larger than"), "{done}");
    status_answers(&d);
    assert!(rss_kib(&d) < MAX_RSS_KIB, "daemon at {} KiB", rss_kib(&d));
    // A restart with the FIFO and the huge file still there starts cleanly.
    let mut d = d;
    d.restart();
    status_answers(&d);
}

/// The memory the daemon stays under through every attack here (it idles near 11 MiB).
const MAX_RSS_KIB: u64 = 200 * 1024;

/// The daemon's resident memory.
fn rss_kib(d: &Daemon) -> u64 {
    let pid = d.pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn log_followers_leave_room_for_everyone_else() {
    let dir = open_tempdir();
    let d = Daemon::start(&dir.path().join("data"), None, &[]);
    let silent = d.submit("name: silent\ncommand: [sleep, '300']\n");
    d.wait_pid(silent);
    // 300 followers of a silent job, over the socket and over TCP with the token, as one user.
    let token = d.token();
    let mut held: Vec<Box<dyn std::io::Read>> = Vec::new();
    let mut refused = 0;
    for i in 0..300 {
        let head = format!(
            "GET /v1/jobs/{silent}/logs?follow=true HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {token}\r\n\r\n",
            d.port
        );
        let (status, stream): (u16, Box<dyn std::io::Read>) = if i % 2 == 0 {
            let mut s =
                std::os::unix::net::UnixStream::connect(d.data_dir.join("xpu.sock")).unwrap();
            std::io::Write::write_all(&mut s, head.as_bytes()).unwrap();
            (read_status(&mut s), Box::new(s))
        } else {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
            std::io::Write::write_all(&mut s, head.as_bytes()).unwrap();
            (read_status(&mut s), Box::new(s))
        };
        match status {
            200 => held.push(stream),
            429 => refused += 1,
            other => panic!("follower {i}: status {other}"),
        }
    }
    assert!(held.len() <= 64, "{} followers held", held.len());
    assert!(refused >= 236, "{refused} refused");
    for _ in 0..20 {
        status_answers(&d);
    }
    let r = d.anonymous().request("GET", "/v1/jobs", None, &[]).unwrap();
    assert_eq!(r.status, 200);
    drop(held);
    // Their places come back when they go.
    d.wait_for("a follower's place to come back", || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        let head = format!(
            "GET /v1/jobs/{silent}/logs?follow=true HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {token}\r\n\r\n",
            d.port
        );
        std::io::Write::write_all(&mut s, head.as_bytes()).unwrap();
        (read_status(&mut s) == 200).then_some(())
    });
    assert!(rss_kib(&d) < MAX_RSS_KIB, "daemon at {} KiB", rss_kib(&d));
    let mut d = d;
    d.restart();
    status_answers(&d);
}

/// The status of an HTTP/1.1 response, read from its status line (the rest is left unread).
fn read_status(s: &mut impl std::io::Read) -> u16 {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        if s.read(&mut b).unwrap() == 0 {
            break;
        }
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line);
    line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[test]
fn a_gang_larger_than_the_host_is_refused_and_never_stops_a_restart() {
    let dir = open_tempdir();
    let mut d = Daemon::start(&dir.path().join("data"), None, &["--devices", "tpu-v6e:8"]);
    for n in [30_000u32, 40_000, 1_025] {
        let m = format!(
            "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: g}}\nspec:\n  completionMode: Indexed\n  completions: {n}\n  parallelism: {n}\n  template:\n    spec:\n      restartPolicy: Never\n      containers: [{{name: c, image: x, command: [\"true\"]}}]\n"
        );
        let t0 = Instant::now();
        let r = d.client().request("POST", "/v1/jobs", Some(m.as_bytes()), &[]).unwrap();
        assert_eq!(r.status, 400, "a gang of {n}: {}", r.error_message());
        assert!(r.error_message().contains("spec.completions"), "{}", r.error_message());
        assert!(t0.elapsed() < Duration::from_secs(5));
        status_answers(&d);
    }
    // The largest a host takes runs, and its tasks share one list of host names.
    let m = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: g}\nspec:\n  completionMode: Indexed\n  completions: 64\n  parallelism: 64\n  template:\n    spec:\n      restartPolicy: Never\n      containers: [{name: c, image: x, command: [\"true\"]}]\n";
    let id = d.submit(m);
    assert_eq!(d.wait_state(id, &["succeeded", "failed"])["state"], "succeeded");
    d.restart();
    status_answers(&d);
    assert!(rss_kib(&d) < MAX_RSS_KIB, "daemon at {} KiB", rss_kib(&d));
}

/// Checks that bundle paths a job makes stay in the attempt's directory, however the files
/// there are laid out before it starts: a planted link is never followed.
#[test]
fn a_bundle_is_written_only_where_the_attempt_owns_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    std::fs::create_dir(&root).unwrap();
    let victim = tmp.path().join("victim.json");
    std::fs::write(&victim, "keep").unwrap();
    let dir = tmp.path().join("attempt");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("config.json")).unwrap();
    let c = xpu_server::container::ContainerLaunch {
        runtime: vec!["true".into()],
        state_dir: tmp.path().join("runc"),
        id: "x".into(),
        source: xpu_server::container::Source::Rootfs(root),
        hostname: "h".into(),
        steps: Vec::new(),
    };
    let p = xpu_server::container::Process {
        job: 1,
        argv: &["true".to_owned()],
        env: &[],
        working_dir: None,
        mounts: &[],
        user: None,
    };
    assert!(xpu_server::container::write_bundle(&dir, &c, &p).is_err());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    assert!(Path::new(&victim).exists());
}

/// A tenant's manifest reaches no shell and no path outside the data dir, and what the host
/// cannot honour is refused naming the field, never dropped.
#[test]
fn tenant_manifests_that_escaped_or_were_ignored_are_refused_naming_the_field() {
    let dir = open_tempdir();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "tpu-v6e:8"]);
    let marker = dir.path().join("x");
    let job = |spec: &str| {
        format!(
            "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: t}}\nspec:\n  template:\n    metadata: {{labels: {{app: t}}}}\n    spec:\n      restartPolicy: Never\n{spec}"
        )
    };
    let cases = [
        (
            job(&format!(
                "      initContainers: [{{name: \"setup\\ntouch {}\\n#\", image: x, command: [\"true\"]}}]\n      containers: [{{name: c, image: x, command: [\"true\"]}}]\n",
                marker.display()
            )),
            "initContainers[0].name",
        ),
        (
            job("      initContainers: [{name: \"x/../../../..../tmp/out\", image: x, command: [\"true\"]}]\n      containers: [{name: c, image: x, command: [\"true\"]}]\n"),
            "initContainers[0].name",
        ),
        (
            job("      containers: [{name: c, image: x, command: [\"true\"], workingDir: \"../../../../tmp/w\"}]\n"),
            "workingDir",
        ),
        (
            job("      volumes: [{name: m, emptyDir: {medium: Memory, sizeLimit: \"0\"}}]\n      containers: [{name: c, image: x, command: [\"true\"], volumeMounts: [{name: m, mountPath: /m}]}]\n"),
            "sizeLimit",
        ),
        (
            "apiVersion: batch/v1\nkind: Job\nmetadata: {name: t}\nspec:\n  completionMode: Indexed\n  completions: 2\n  parallelism: 2\n  template:\n    metadata: {labels: {app: t}}\n    spec:\n      restartPolicy: Never\n      affinity:\n        podAntiAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n          - labelSelector: {matchLabels: {app: t}}\n            topologyKey: kubernetes.io/hostname\n      containers: [{name: c, image: x, command: [\"true\"]}]\n".to_owned(),
            "podAntiAffinity",
        ),
    ];
    for (manifest, field) in cases {
        let r = d.client().request("POST", "/v1/jobs", Some(manifest.as_bytes()), &[]).unwrap();
        assert_eq!(r.status, 400, "{field}: {}", r.error_message());
        assert!(r.error_message().contains(field), "{field}: {}", r.error_message());
    }
    assert!(!marker.exists());
    assert!(!Path::new("/tmp/out/config.json").exists());
    status_answers(&d);
    // `$(VAR)` fan-out (item 6): 64 KiB `A`, `B=$(A)$(A)`, then thousands of `B=$(B)`.
    let mut env = format!("        - {{name: A, value: \"{}\"}}\n", "a".repeat(64 * 1024));
    env.push_str("        - {name: B, value: \"$(A)$(A)\"}\n");
    env.push_str(&"        - {name: B, value: \"$(B)\"}\n".repeat(3000));
    let fan = job(&format!(
        "      containers:\n      - name: c\n        image: x\n        command: [\"true\"]\n        env:\n{env}"
    ));
    let r = d.client().request("POST", "/v1/jobs", Some(fan.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    assert!(r.error_message().contains("env["), "{}", r.error_message());
    status_answers(&d);
    assert!(rss_kib(&d) < MAX_RSS_KIB, "daemon at {} KiB", rss_kib(&d));
    let mut d = d;
    d.restart();
    status_answers(&d);
}
