//! OCI bundles for end-to-end tests with a real runc: `runc spec`'s default `config.json` and a
//! rootfs holding the static `busybox` from Debian's `busybox-static` with a link per applet.
//! Also the pieces the container tests share: a runc state directory that deletes its containers
//! when dropped, malicious rootfs builders (symlinks planted where a runtime would mount or
//! create nodes), and a snapshot of a directory tree to prove nothing outside a rootfs changed.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

/// Debian's runc.
pub const RUNC: &str = "/usr/sbin/runc";
/// Debian's busybox-static.
pub const BUSYBOX: &str = "/bin/busybox";

/// Why the container tests cannot run here (not root), or `None` when they can. A missing
/// runc or static busybox is not a reason to skip: the test fails, naming the install command.
pub fn container_tests_unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not running as root (runc needs it)".to_owned());
    }
    assert!(
        Path::new(RUNC).is_file(),
        "{RUNC} is not installed; run scripts/install-test-deps (apt-get install runc)"
    );
    let busybox_ok = Command::new(BUSYBOX).arg("true").status().is_ok_and(|s| s.success());
    assert!(
        busybox_ok,
        "{BUSYBOX} is not installed; run scripts/install-test-deps (apt-get install busybox-static)"
    );
    None
}

/// A bundle directory: `config.json` and `rootfs/`.
#[derive(Debug)]
pub struct Bundle {
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Bundle {
    /// A busybox bundle in a new temporary directory running `sh -c script`.
    pub fn busybox(script: &str) -> Bundle {
        let tmp = tempfile::Builder::new().prefix("xpu-bundle-").tempdir().unwrap();
        let b = Bundle::busybox_in(tmp.path(), script);
        Bundle { dir: b.dir, _tmp: Some(tmp) }
    }

    /// A busybox bundle in `dir` (created if missing), kept after the value is dropped.
    pub fn busybox_in(dir: &Path, script: &str) -> Bundle {
        let rootfs = dir.join("rootfs");
        let bin = rootfs.join("bin");
        fs::create_dir_all(&bin).unwrap();
        fs::copy(BUSYBOX, bin.join("busybox")).unwrap();
        let list = Command::new(BUSYBOX).arg("--list").output().unwrap();
        for applet in String::from_utf8_lossy(&list.stdout).lines() {
            if applet != "busybox" && !applet.is_empty() {
                let _ = symlink("busybox", bin.join(applet));
            }
        }
        for d in ["proc", "dev", "sys", "tmp", "etc"] {
            fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        let _ = fs::remove_file(dir.join("config.json"));
        let out = Command::new(RUNC).args(["spec", "--bundle"]).arg(dir).output().unwrap();
        assert!(out.status.success(), "runc spec: {}", String::from_utf8_lossy(&out.stderr));
        let b = Bundle { dir: dir.to_path_buf(), _tmp: None };
        let mut c = b.config();
        c["process"]["terminal"] = json!(false);
        c["process"]["args"] = json!(["sh", "-c", script]);
        b.set_config(&c);
        b
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    pub fn config(&self) -> Value {
        serde_json::from_slice(&fs::read(self.config_path()).unwrap()).unwrap()
    }

    pub fn set_config(&self, c: &Value) {
        fs::write(self.config_path(), serde_json::to_vec_pretty(c).unwrap()).unwrap();
    }

    /// Adds `KEY=value` entries to `process.env`.
    pub fn add_env(&self, vars: &[&str]) {
        let mut c = self.config();
        let env = c["process"]["env"].as_array_mut().unwrap();
        env.extend(vars.iter().map(|v| json!(v)));
        self.set_config(&c);
    }

    /// Adds a hook (`prestart`, `createRuntime`...) running `path args...` with `env`.
    pub fn add_hook(&self, stage: &str, path: &Path, args: &[&str], env: &[String]) {
        let mut c = self.config();
        let hook = json!({ "path": path, "args": args, "env": env });
        let hooks = c.as_object_mut().unwrap().entry("hooks").or_insert_with(|| json!({}));
        let list = hooks.as_object_mut().unwrap().entry(stage).or_insert_with(|| json!([]));
        list.as_array_mut().unwrap().push(hook);
        self.set_config(&c);
    }

    /// Replaces `path` inside the rootfs (and anything there) by a symlink to `target`: the
    /// malicious image of CVE-2024-0132's kind.
    pub fn plant_symlink(&self, path: &str, target: &str) {
        let at = self.rootfs().join(path.trim_start_matches('/'));
        if let Some(parent) = at.parent() {
            fs::create_dir_all(parent).unwrap();
        }
        if at.is_dir() && !at.is_symlink() {
            fs::remove_dir_all(&at).unwrap();
        } else {
            let _ = fs::remove_file(&at);
        }
        symlink(target, at).unwrap();
    }
}

/// A runc state directory (`runc --root`) of its own; containers left in it are deleted (`runc
/// delete -f`) when it is dropped.
#[derive(Debug)]
pub struct RuncState {
    dir: tempfile::TempDir,
}

impl Default for RuncState {
    fn default() -> Self {
        Self::new()
    }
}

impl RuncState {
    pub fn new() -> Self {
        Self { dir: tempfile::Builder::new().prefix("xpu-runc-state-").tempdir().unwrap() }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `program [prefix...] --root STATE run --bundle B ID` with `env` added, output captured.
    /// `program` is `runc` itself or a shim standing in for it.
    pub fn run(
        &self,
        program: &Path,
        prefix: &[&str],
        bundle: &Bundle,
        id: &str,
        env: &[(&str, &str)],
    ) -> Output {
        let mut cmd = Command::new(program);
        cmd.args(prefix)
            .arg("--root")
            .arg(self.path())
            .args(["run", "--bundle"])
            .arg(bundle.dir())
            .arg(id)
            .stdin(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    /// Container ids runc knows in this state directory.
    pub fn containers(&self) -> Vec<String> {
        fs::read_dir(self.path())
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }
}

impl Drop for RuncState {
    fn drop(&mut self) {
        for id in self.containers() {
            let _ = Command::new(RUNC)
                .arg("--root")
                .arg(self.path())
                .args(["delete", "-f", &id])
                .output();
        }
    }
}

/// One entry of a [`snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir { mode: u32 },
    File { mode: u32, content: Vec<u8> },
    Symlink(PathBuf),
    Other { mode: u32, rdev: u64 },
}

/// Every path under `dir` with its type, mode and (file) content, symlinks not followed.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Node> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Node>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = fs::symlink_metadata(&path) else { continue };
            let rel = path.strip_prefix(base).unwrap().to_path_buf();
            let ft = meta.file_type();
            let mode = meta.mode() & 0o7777;
            let node = if ft.is_symlink() {
                Node::Symlink(fs::read_link(&path).unwrap_or_default())
            } else if ft.is_dir() {
                walk(base, &path, out);
                Node::Dir { mode }
            } else if ft.is_file() {
                Node::File { mode, content: fs::read(&path).unwrap_or_default() }
            } else {
                let _ = ft.is_char_device();
                Node::Other { mode, rdev: meta.rdev() }
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A container script that prints what the container sees: device nodes under `/dev` and
/// `/dev/vfio` (`ls -ln`) and the environment; parse its output with [`ContainerView::parse`].
/// `extra` runs after it (its output follows `== extra`).
pub fn probe_script(extra: &str) -> String {
    format!(
        "echo '== /dev'; ls -ln /dev; echo '== /dev/vfio'; ls -ln /dev/vfio 2>/dev/null; echo '== /dev/nvidia-caps'; ls -ln /dev/nvidia-caps 2>/dev/null; echo '== /dev/dri'; ls -ln /dev/dri 2>/dev/null; echo '== env'; env; echo '== extra'; {extra}"
    )
}

/// What [`probe_script`] printed.
#[derive(Debug, Clone, Default)]
pub struct ContainerView {
    /// Device nodes by path: (`c` or `b`, major, minor).
    pub nodes: BTreeMap<String, (char, u32, u32)>,
    pub env: BTreeMap<String, String>,
    /// Output of the extra commands.
    pub extra: String,
}

impl ContainerView {
    /// What a container run printed; fails the test, showing its output, when it failed.
    pub fn of(out: &Output) -> ContainerView {
        assert!(
            out.status.success(),
            "container failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        ContainerView::parse(&String::from_utf8_lossy(&out.stdout))
    }

    pub fn parse(stdout: &str) -> ContainerView {
        let mut v = ContainerView::default();
        let mut section = String::new();
        for line in stdout.lines() {
            if let Some(s) = line.strip_prefix("== ") {
                section = s.to_owned();
                continue;
            }
            match section.as_str() {
                "/dev" | "/dev/vfio" | "/dev/nvidia-caps" | "/dev/dri" => {
                    // crw-rw-rw-    1 0        0         195,   1 Nov 22 08:16 nvidia1
                    let f: Vec<&str> = line.split_whitespace().collect();
                    let kind = line.chars().next().unwrap_or(' ');
                    if (kind == 'c' || kind == 'b') && f.len() >= 7 {
                        let major = f[4].trim_end_matches(',').parse().unwrap_or(u32::MAX);
                        let minor = f[5].parse().unwrap_or(u32::MAX);
                        let name = f[f.len() - 1];
                        v.nodes.insert(format!("{section}/{name}"), (kind, major, minor));
                    }
                }
                "env" => {
                    if let Some((k, val)) = line.split_once('=') {
                        v.env.insert(k.to_owned(), val.to_owned());
                    }
                }
                "extra" => {
                    v.extra.push_str(line);
                    v.extra.push('\n');
                }
                _ => {}
            }
        }
        v
    }

    /// The accelerator nodes, leaving out the ones runc always creates (`null`, `tty`...).
    pub fn accel_nodes(&self) -> BTreeMap<String, (char, u32, u32)> {
        const STANDARD: [&str; 7] = [
            "/dev/null",
            "/dev/zero",
            "/dev/full",
            "/dev/random",
            "/dev/urandom",
            "/dev/tty",
            "/dev/console",
        ];
        self.nodes
            .iter()
            .filter(|(p, _)| !STANDARD.contains(&p.as_str()))
            .map(|(p, n)| (p.clone(), *n))
            .collect()
    }
}

/// Writes `runtime.toml` for the shim and the hook into `dir`: discovery under fixture `root`,
/// Debian's runc, a log file `dir/xpu.log`, CUDA 12.2 for `NVIDIA_REQUIRE_*`, and the host
/// snapshot looked for in `dir/cdi` only (never the machine's own `/etc/cdi`). Returns its path
/// (pass it as `XPU_RUNTIME_CONFIG`).
pub fn runtime_config(dir: &Path, root: &Path) -> PathBuf {
    let path = dir.join("runtime.toml");
    fs::write(
        &path,
        format!(
            "root = \"{}\"\nruntime = \"{RUNC}\"\nlog_file = \"{}\"\ncuda_version = \"12.2\"\ncdi_dirs = [\"{}\"]\n",
            root.display(),
            dir.join("xpu.log").display(),
            dir.join("cdi").display()
        ),
    )
    .unwrap();
    path
}

/// A fixture host with real character device nodes (`mknod`, needs root), optionally NVIDIA's
/// driver files, and a `runtime.toml` pointing the shim and the hook at it.
#[derive(Debug)]
pub struct TestHost {
    pub fixture: crate::Fixture,
    pub driver: Option<crate::driver::NvidiaDriver>,
    pub dir: tempfile::TempDir,
    /// `runtime.toml`: pass as `XPU_RUNTIME_CONFIG`.
    pub config: PathBuf,
}

impl TestHost {
    pub fn new(spec: &crate::HostSpec) -> TestHost {
        let fixture =
            spec.build_with(&crate::BuildOptions { char_devices: true, ..Default::default() });
        let driver =
            spec.nvidia_driver.as_deref().map(|v| crate::driver::install_nvidia(fixture.root(), v));
        let dir = tempfile::Builder::new().prefix("xpu-runtime-").tempdir().unwrap();
        let config = runtime_config(dir.path(), fixture.root());
        TestHost { fixture, driver, dir, config }
    }

    /// The shim's log.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("xpu.log")).unwrap_or_default()
    }
}

/// Character device nodes as [`ContainerView::nodes`] lists them: (path, major, minor).
pub fn char_nodes(list: &[(&str, u32, u32)]) -> BTreeMap<String, (char, u32, u32)> {
    list.iter().map(|(p, ma, mi)| ((*p).to_owned(), ('c', *ma, *mi))).collect()
}

/// What a container given GPUs 1 and 3 of the 8xA100 fixture (`NVIDIA_VISIBLE_DEVICES=1,3`)
/// finds in its `/dev`: those two and NVIDIA's control nodes, nothing else.
pub fn a100_gpus_1_and_3_nodes() -> BTreeMap<String, (char, u32, u32)> {
    use crate::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};
    char_nodes(&[
        ("/dev/nvidia1", MAJOR_NVIDIA, 1),
        ("/dev/nvidia3", MAJOR_NVIDIA, 3),
        ("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        ("/dev/nvidia-uvm", MAJOR_NVIDIA_UVM, 0),
        ("/dev/nvidia-uvm-tools", MAJOR_NVIDIA_UVM, 1),
    ])
}

/// True (after saying why on stderr) when this machine cannot run the container tests.
#[allow(clippy::print_stderr)]
pub fn skip_container_tests() -> bool {
    match container_tests_unavailable() {
        Some(why) => {
            eprintln!("skipping: {why}");
            true
        }
        None => false,
    }
}

/// Puts this process (and the children it starts after) at the highest scheduling priority
/// (nice -20), so that other work on the machine disturbs a benchmark less. Needs root; returns
/// whether it worked.
pub fn raise_priority() -> bool {
    rustix::process::setpriority_process(None, -20).is_ok()
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`), for benchmark output.
pub fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// A container id unique on this machine (runc's cgroups are named after it).
pub fn container_id(test: &str) -> String {
    format!("xpu-{test}-{}", std::process::id())
}
